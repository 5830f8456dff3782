package controller

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
)

// +kubebuilder:rbac:groups=inference.networking.k8s.io,resources=inferencepools,verbs=get;list;watch;create;patch;delete

func gatewayEnabled(p pool) bool {
	d, ok := p.object().(*kvv1.DecodePool)
	return ok && d.Spec.Gateway.InferencePool
}

// gatewayState is what the status says of a DecodePool's InferencePool.
type gatewayState struct {
	crdMissing bool
	pool       *infv1.InferencePool // live, with the gateways' status; nil before it exists
}

// applyLegRunnerAccount applies the leg runners' ServiceAccount and Role before the
// decode engines that run as it.
func (r *PoolReconciler) applyLegRunnerAccount(ctx context.Context, p pool) error {
	sa, role, rb, err := render.LegRunnerAccount(p.GetName(), p.GetNamespace())
	if err != nil {
		return err
	}
	return r.applyAll(ctx, p, []metav1.Object{sa, role, rb})
}

// applyGateway applies a DecodePool's endpoint picker and InferencePool, or removes them
// (and the leg runners' account) when the pool has no gateway. A cluster without the
// InferencePool CRD gets the picker still, and a state that says the CRD is missing.
func (r *PoolReconciler) applyGateway(ctx context.Context, p pool, v *validation) (*gatewayState, error) {
	d := p.object().(*kvv1.DecodePool)
	if !gatewayEnabled(p) {
		return nil, r.deleteGateway(ctx, p)
	}
	in := render.GatewayInput{Pool: d.Name, Namespace: d.Namespace, Spec: &d.Spec.Gateway, Image: r.routerImage(d), Resources: d.Spec.Router.Resources,
		KVEventsSecret: kvEventsSecret(d, &v.policy.Spec)}
	w, err := render.EndpointPicker(in)
	if err != nil {
		return nil, err
	}
	if err := r.applyAll(ctx, p, w.Objects()); err != nil {
		return nil, err
	}
	ip, err := render.InferencePool(in)
	if err != nil {
		return nil, err
	}
	live := &infv1.InferencePool{}
	if err := r.apply(ctx, p, ip, live); err != nil {
		if meta.IsNoMatchError(err) {
			return &gatewayState{crdMissing: true}, nil
		}
		return nil, err
	}
	if err := r.inferencePools.start(); err != nil {
		return nil, err
	}
	if live.UID == "" { // created just now: its status comes with the next reconcile
		return &gatewayState{}, nil
	}
	return &gatewayState{pool: live}, nil
}

// deleteGateway deletes the gateway objects the pool controls.
func (r *PoolReconciler) deleteGateway(ctx context.Context, p pool) error {
	if err := r.deleteControlled(ctx, p, render.EndpointPickerName(p.GetName()), serviceKinds()...); err != nil {
		return err
	}
	if err := r.deleteControlled(ctx, p, render.LegRunnerName(p.GetName()), &rbacv1.RoleBinding{}, &rbacv1.Role{}, &corev1.ServiceAccount{}); err != nil {
		return err
	}
	// Only a pool that had a gateway has an InferencePool to remove: every other pool's
	// reconcile would otherwise look one up, and in a cluster without the CRD each lookup
	// asks the API server's discovery again.
	if meta.FindStatusCondition(p.status().Conditions, kvv1.ConditionInferencePoolReady) == nil {
		return nil
	}
	err := r.deleteControlled(ctx, p, p.GetName(), &infv1.InferencePool{})
	if meta.IsNoMatchError(err) {
		return nil // no CRD, so no InferencePool
	}
	return err
}

// deleteControlled deletes the objects of name and the given kinds that the pool
// controls; objects of that name that belong to something else are left alone.
func (r *PoolReconciler) deleteControlled(ctx context.Context, p pool, name string, kinds ...client.Object) error {
	for _, obj := range kinds {
		err := r.Get(ctx, client.ObjectKey{Namespace: p.GetNamespace(), Name: name}, obj)
		if apierrors.IsNotFound(err) {
			continue
		}
		if err != nil {
			return err
		}
		if !metav1.IsControlledBy(obj, p.object()) {
			continue
		}
		if err := r.Delete(ctx, obj, client.Preconditions{UID: ptr.To(obj.GetUID())}); client.IgnoreNotFound(err) != nil {
			return err
		}
	}
	return nil
}

// inferencePoolReady is the InferencePoolReady condition of a DecodePool's gateway state:
// True when a gateway accepted the InferencePool and resolved its references.
func inferencePoolReady(pool string, g *gatewayState) metav1.Condition {
	c := metav1.Condition{Type: kvv1.ConditionInferencePoolReady, Status: metav1.ConditionFalse}
	switch {
	case g.crdMissing:
		c.Reason = kvv1.ReasonInferencePoolCRDMissing
		c.Message = "the cluster has no InferencePool CRD (inference.networking.k8s.io/v1): install the Gateway API Inference Extension's CRDs; " +
			"the endpoint picker and leg runners are in place"
		return c
	case g.pool == nil || len(g.pool.Status.Parents) == 0:
		c.Status, c.Reason = metav1.ConditionUnknown, kvv1.ReasonNoParentGateway
		c.Message = fmt.Sprintf("no gateway reports on InferencePool %s yet: point an HTTPRoute of a gateway that implements the Gateway API "+
			"Inference Extension at it (docs/gateway.md)", pool)
		return c
	}
	var refused []string
	for _, parent := range g.pool.Status.Parents {
		accepted := meta.FindStatusCondition(parent.Conditions, string(infv1.InferencePoolConditionAccepted))
		resolved := meta.FindStatusCondition(parent.Conditions, string(infv1.InferencePoolConditionResolvedRefs))
		if accepted != nil && accepted.Status == metav1.ConditionTrue && resolved != nil && resolved.Status == metav1.ConditionTrue {
			c.Status, c.Reason = metav1.ConditionTrue, kvv1.ReasonInferencePoolAccepted
			c.Message = fmt.Sprintf("gateway %s accepted InferencePool %s and resolved its endpoint picker", parentName(parent), pool)
			return c
		}
		for _, cond := range []*metav1.Condition{accepted, resolved} {
			if cond != nil && cond.Status != metav1.ConditionTrue {
				refused = append(refused, fmt.Sprintf("%s: %s %s (%s)", parentName(parent), cond.Type, cond.Reason, cond.Message))
			}
		}
	}
	c.Reason = kvv1.ReasonNotAccepted
	c.Message = "no gateway accepted InferencePool " + pool + ": " + strings.Join(refused, "; ")
	return c
}

func parentName(p infv1.ParentStatus) string {
	if p.ParentRef.Namespace != "" {
		return string(p.ParentRef.Namespace) + "/" + string(p.ParentRef.Name)
	}
	return string(p.ParentRef.Name)
}
