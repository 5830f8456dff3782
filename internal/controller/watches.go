package controller

import (
	"context"
	"slices"

	corev1 "k8s.io/api/core/v1"

	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlevent "sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// Field indexes on the pools' references, so a change of a policy or prefill pool
// enqueues exactly the pools that reference it.
const (
	indexPolicy      = "spec.transferPolicyRef.name"
	indexPrefillPool = "spec.prefillPoolRef.name"
	// indexNode indexes the cached pods (engines and routers) by node.
	indexNode = "spec.nodeName"
)

func indexPodNodes(ctx context.Context, mgr ctrl.Manager) error {
	return mgr.GetFieldIndexer().IndexField(ctx, &corev1.Pod{}, indexNode, func(o client.Object) []string {
		return []string{o.(*corev1.Pod).Spec.NodeName}
	})
}

// enqueuePoolsOnNode maps a node to the pools of role with engines on it.
func enqueuePoolsOnNode(c client.Client, role kvv1.Role) handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		pods := &corev1.PodList{}
		if err := c.List(ctx, pods, client.MatchingFields{indexNode: o.GetName()}, client.MatchingLabels{kvv1.LabelRole: string(role)}); err != nil {
			return nil
		}
		var reqs []reconcile.Request
		for _, p := range pods.Items {
			r := reconcile.Request{NamespacedName: types.NamespacedName{Namespace: p.Namespace, Name: p.Labels[kvv1.LabelPool]}}
			if !slices.Contains(reqs, r) {
				reqs = append(reqs, r)
			}
		}
		return reqs
	})
}

// agentChanged passes node updates that change what the manager reads of the node's
// transfer agent (its ready label, its health report); the kubelet's status updates do not.
var agentChanged = predicate.Funcs{
	UpdateFunc: func(e ctrlevent.UpdateEvent) bool {
		o, n := e.ObjectOld, e.ObjectNew
		return o.GetLabels()[kvv1.LabelAgentReady] != n.GetLabels()[kvv1.LabelAgentReady] ||
			o.GetAnnotations()[kvv1.AnnotationAgentHealth] != n.GetAnnotations()[kvv1.AnnotationAgentHealth]
	},
}

func indexReferences(ctx context.Context, mgr ctrl.Manager, role kvv1.Role) error {
	idx := mgr.GetFieldIndexer()
	if err := idx.IndexField(ctx, newPool(role).object(), indexPolicy, func(o client.Object) []string {
		return []string{poolOf(o).engine().TransferPolicyRef.Name}
	}); err != nil {
		return err
	}
	if role != kvv1.RoleDecode {
		return nil
	}
	return idx.IndexField(ctx, &kvv1.DecodePool{}, indexPrefillPool, func(o client.Object) []string {
		return []string{o.(*kvv1.DecodePool).Spec.PrefillPoolRef.Name}
	})
}

// enqueueReferrers maps a referenced object (a policy, a prefill pool) to the pools of
// role whose field index names it.
func enqueueReferrers(c client.Client, role kvv1.Role, index string) handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		return poolRequests(ctx, c, role, o.GetNamespace(), client.MatchingFields{index: o.GetName()})
	})
}

// enqueuePoolsIn maps a Namespace to every pool of role in it.
func enqueuePoolsIn(c client.Client, role kvv1.Role) handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		return poolRequests(ctx, c, role, o.GetName())
	})
}

// poolRequests lists the pools of role in namespace that match opts, as requests.
func poolRequests(ctx context.Context, c client.Client, role kvv1.Role, namespace string, opts ...client.ListOption) []reconcile.Request {
	var names []string
	opts = append(opts, client.InNamespace(namespace))
	if role == kvv1.RoleDecode {
		list := &kvv1.DecodePoolList{}
		if err := c.List(ctx, list, opts...); err != nil {
			return nil
		}
		for _, d := range list.Items {
			names = append(names, d.Name)
		}
	} else {
		list := &kvv1.PrefillPoolList{}
		if err := c.List(ctx, list, opts...); err != nil {
			return nil
		}
		for _, p := range list.Items {
			names = append(names, p.Name)
		}
	}
	reqs := make([]reconcile.Request, 0, len(names))
	for _, n := range names {
		reqs = append(reqs, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: namespace, Name: n}})
	}
	return reqs
}

// enqueuePoolOfName maps a StatefulSet or Service to the pool of the same name, whose
// workload it is or would be.
func enqueuePoolOfName() handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
		return []reconcile.Request{{NamespacedName: client.ObjectKeyFromObject(o)}}
	})
}

// enqueuePoolOfPod maps an engine pod to its pool through the pool and role labels.
func enqueuePoolOfPod(role kvv1.Role) handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
		l := o.GetLabels()
		if l[kvv1.LabelRole] != string(role) || l[kvv1.LabelPool] == "" {
			return nil
		}
		return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: o.GetNamespace(), Name: l[kvv1.LabelPool]}}}
	})
}

// enqueuePrefillPoolOf maps a DecodePool to the PrefillPool it names.
func enqueuePrefillPoolOf() handler.EventHandler {
	return handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
		d := o.(*kvv1.DecodePool)
		return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: d.Namespace, Name: d.Spec.PrefillPoolRef.Name}}}
	})
}
