// Package controller holds the manager's reconcilers: PrefillPool and DecodePool become
// engine StatefulSets wired by their KVTransferPolicy.
package controller

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/source"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/compat"
	"github.com/kvhandoff/kvhandoff/internal/render"
)

// FieldOwner is the server-side apply field manager of everything the manager writes.
const FieldOwner = "kvhandoff"

// PoolReconciler reconciles the pools of one role: PrefillPools or DecodePools.
type PoolReconciler struct {
	client.Client
	// APIReader reads what the manager does not cache (its kv-events token Secrets);
	// nil reads through Client.
	APIReader client.Reader
	Recorder  events.EventRecorder
	Role      kvv1.Role
	// RouterImage is the router image of the manager's version, for DecodePools that
	// name none.
	RouterImage string
	// ConnectorImage is the vLLM connector init container's image ("" for the default).
	ConnectorImage string
	// routers holds the routers' health reports (DecodePools).
	routers *routerHealth
	// inferencePools starts the watch on the DecodePools' InferencePools (DecodePools).
	inferencePools *inferencePoolWatch
	// crdRecheck is how soon a DecodePool with a gateway looks again for the InferencePool
	// CRD while the cluster has none: installing the CRD raises no event of the pool's.
	crdRecheck time.Duration
	// kvTokens remembers the kv-events token Secrets seen.
	kvTokens kvEventsTokens
}

// +kubebuilder:rbac:groups=kvhandoff.io,resources=prefillpools;decodepools,verbs=get;list;watch
// +kubebuilder:rbac:groups=kvhandoff.io,resources=prefillpools/status;decodepools/status,verbs=get;patch
// +kubebuilder:rbac:groups=kvhandoff.io,resources=kvtransferpolicies,verbs=get;list;watch
// +kubebuilder:rbac:groups=apps,resources=statefulsets,verbs=get;list;watch;create;patch
// +kubebuilder:rbac:groups="",resources=services,verbs=get;list;watch;create;patch
// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch
// +kubebuilder:rbac:groups=apps,resources=deployments,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=apps,resources=replicasets,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=services;serviceaccounts,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=policy,resources=poddisruptionbudgets,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=networking.k8s.io,resources=networkpolicies,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=rbac.authorization.k8s.io,resources=roles;rolebindings,verbs=get;list;watch;create;patch;delete
// Owned objects are applied server-side (create and patch, never update) and removed by
// the garbage collector through their owner references. The manager deletes only a
// DecodePool's router objects, when the pool disables its router; the Role it gives
// routers grants only what the manager itself holds (reading pools and pods).

// Reconcile makes one pool's engines match the pool and its policy:
//  1. fetch the pool;
//  2. validate it against its policy and, for a decode pool, its prefill pool — what CEL
//     cannot check becomes a condition, and an invalid pool is never rendered;
//  3. render its StatefulSet and headless Service (pure, see package render);
//  4. apply them, writing only when the live objects differ;
//  5. publish status: engines, compat-hash, conditions — patched only when changed.
func (r *PoolReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	p := newPool(r.Role)
	if err := r.Get(ctx, req.NamespacedName, p.object()); err != nil {
		if apierrors.IsNotFound(err) {
			forgetMetrics(req.Namespace, req.Name, r.Role)
		}
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	before := p.object().DeepCopyObject().(client.Object)

	v, err := r.validate(ctx, p)
	if err != nil {
		return ctrl.Result{}, err
	}
	if v.problem == nil {
		if err := r.renderAndApply(ctx, p, v); err != nil {
			if v.problem = asProblem(err); v.problem == nil {
				return ctrl.Result{}, err
			}
		}
	}
	err = r.updateStatus(ctx, p, before, v)
	if apierrors.IsConflict(err) {
		// The status was computed from a stale copy. The change that made it stale is a
		// watch event of its own, which reconciles the pool again from the fresh one.
		return ctrl.Result{}, nil
	}
	if err == nil && v.gateway != nil && v.gateway.crdMissing && r.crdRecheck > 0 {
		return ctrl.Result{RequeueAfter: r.crdRecheck}, nil
	}
	if err == nil && r.Role == kvv1.RolePrefill && v.policy != nil && v.policy.Spec.Routing.KVEvents() && r.kvTokens.recheck > 0 {
		// The token Secret raises no event here (the manager does not watch Secrets).
		return ctrl.Result{RequeueAfter: r.kvTokens.recheck}, nil
	}
	return ctrl.Result{}, err
}

// problem is why a pool is not rendered as written: a condition reason and a message
// that tells the user what to change.
type problem struct{ Reason, Message string }

func (p *problem) Error() string { return p.Reason + ": " + p.Message }

// asProblem is err as a problem when it is one of the pool's own (a compatibility
// problem, a template that does not fit, a name taken by another object), else nil.
func asProblem(err error) *problem {
	var (
		own    *problem
		compat *compat.Problem
		tmpl   *render.TemplateError
	)
	switch {
	case err == nil:
		return nil
	case errors.As(err, &own):
		return own
	case errors.As(err, &compat):
		return fromCompat(compat)
	case errors.As(err, &tmpl):
		return &problem{Reason: kvv1.ReasonInvalidTemplate, Message: tmpl.Message}
	}
	return nil
}

func fromCompat(p *compat.Problem) *problem {
	if p == nil {
		return nil
	}
	return &problem{Reason: p.Reason, Message: p.Message}
}

// validation is what validate learned about a pool.
type validation struct {
	policy   *kvv1.KVTransferPolicy
	prefill  *kvv1.PrefillPool
	problem  *problem
	warnings []compat.Warning
	// gateway is what was found of the DecodePool's InferencePool (gateway.inferencePool).
	gateway *gatewayState
	// replicas is what the pool's StatefulSet runs: spec.replicas, or the autoscaler's
	// size while a DecodePool's autoscaling owns the pool (autoscaledBy names it).
	replicas     int32
	autoscaledBy string
	// peerTP is the tensor-parallel size of the engines on the pair's other side (0: none
	// known, or the pool's own).
	peerTP int32
}

func (r *PoolReconciler) validate(ctx context.Context, p pool) (*validation, error) {
	v := &validation{policy: &kvv1.KVTransferPolicy{}}
	spec := p.engine()
	if err := r.replicas(ctx, p, v); err != nil || v.problem != nil {
		return v, err
	}
	err := r.Get(ctx, types.NamespacedName{Namespace: p.GetNamespace(), Name: spec.TransferPolicyRef.Name}, v.policy)
	switch {
	case apierrors.IsNotFound(err):
		v.policy = nil
		v.problem = &problem{Reason: kvv1.ReasonPolicyNotFound, Message: fmt.Sprintf("KVTransferPolicy %s does not exist in namespace %s; create "+
			"it or fix spec.transferPolicyRef.name", spec.TransferPolicyRef.Name, p.GetNamespace())}
		return v, nil
	case err != nil:
		return nil, err
	}
	var prob *compat.Problem
	prob, v.warnings = compat.CheckPool(spec, &v.policy.Spec)
	if v.problem = fromCompat(prob); v.problem != nil {
		return v, nil
	}
	if v.policy.Spec.Fabric.Privileged {
		if v.problem, err = r.checkPrivileged(ctx, p.GetNamespace(), v.policy.Name); v.problem != nil || err != nil {
			return v, err
		}
	}
	if p.role() != kvv1.RoleDecode {
		v.peerTP, v.problem, err = r.decodeSize(ctx, p, v.policy)
		return v, err
	}

	v.prefill = &kvv1.PrefillPool{}
	err = r.Get(ctx, types.NamespacedName{Namespace: p.GetNamespace(), Name: p.prefillPoolName()}, v.prefill)
	switch {
	case apierrors.IsNotFound(err):
		v.prefill = nil
		v.problem = &problem{Reason: kvv1.ReasonPrefillPoolNotFound, Message: fmt.Sprintf("PrefillPool %s does not exist in namespace %s; create "+
			"it or fix spec.prefillPoolRef.name", p.prefillPoolName(), p.GetNamespace())}
	case err != nil:
		return nil, err
	default:
		v.problem = fromCompat(compat.CheckPair(v.prefill.Name, &v.prefill.Spec.EngineSpec, spec, &v.policy.Spec))
		v.peerTP = v.prefill.Spec.TensorParallelSize
	}
	return v, nil
}

// decodeSize is the tensor-parallel size of the DecodePools that pair with PrefillPool p
// (those naming it under its policy): a prefill engine's ranks each feed the decode ranks
// holding their heads, so with executor Agent all must have one size. With executor Engine
// vLLM's connector pairs ranks itself, and the size only chooses the KV layout.
func (r *PoolReconciler) decodeSize(ctx context.Context, p pool, policy *kvv1.KVTransferPolicy) (int32, *problem, error) {
	list := &kvv1.DecodePoolList{}
	if err := r.List(ctx, list, client.InNamespace(p.GetNamespace())); err != nil {
		return 0, nil, err
	}
	sizes := map[int32][]string{}
	for _, d := range list.Items {
		if d.Spec.PrefillPoolRef.Name == p.GetName() && d.Spec.TransferPolicyRef.Name == policy.Name {
			sizes[d.Spec.TensorParallelSize] = append(sizes[d.Spec.TensorParallelSize], d.Name)
		}
	}
	if len(sizes) <= 1 {
		for tp := range sizes {
			return tp, nil, nil
		}
		return 0, nil, nil
	}
	if policy.Spec.Executor != kvv1.ExecutorAgent {
		return 0, nil, nil
	}
	var named []string
	for _, tp := range slices.Sorted(maps.Keys(sizes)) {
		named = append(named, fmt.Sprintf("%s (tensorParallelSize %d)", strings.Join(sizes[tp], ", "), tp))
	}
	return 0, &problem{Reason: kvv1.ReasonTensorParallelMismatch, Message: fmt.Sprintf("DecodePools %s name this PrefillPool; with "+
		"executor Agent its engines hand each rank's KV heads to the decode ranks holding them, which needs one decode size: give each "+
		"size a PrefillPool of its own", strings.Join(named, "; "))}, nil
}

// checkPrivileged refuses privileged engines in a namespace the cluster's administrators
// have not opened to them: a privileged container owns its node, and whoever may write a
// policy in a namespace must not be able to take a node through it.
func (r *PoolReconciler) checkPrivileged(ctx context.Context, namespace, policy string) (*problem, error) {
	ns := &corev1.Namespace{}
	if err := r.Get(ctx, types.NamespacedName{Name: namespace}, ns); err != nil {
		return nil, err
	}
	if ns.Labels[kvv1.LabelPrivilegedEngines] == "true" {
		return nil, nil
	}
	return &problem{Reason: kvv1.ReasonPrivilegedNotAllowed, Message: fmt.Sprintf("KVTransferPolicy %s sets fabric.privileged, and namespace %s "+
		"is not labelled %s=true; a privileged engine owns its node, so a cluster administrator must label the namespace (or the policy must "+
		"drop fabric.privileged: IPC_LOCK is all memory registration needs)", policy, namespace, kvv1.LabelPrivilegedEngines)}, nil
}

func (r *PoolReconciler) renderAndApply(ctx context.Context, p pool, v *validation) error {
	spec := *p.engine()
	spec.Replicas = &v.replicas
	in := render.Input{
		Role: p.role(), Name: p.GetName(), Namespace: p.GetNamespace(),
		Spec: &spec, Policy: &v.policy.Spec, PrefillPool: p.prefillPoolName(), ConnectorImage: r.ConnectorImage,
		PeerTensorParallelSize: v.peerTP,
	}
	if gatewayEnabled(p) {
		// The decode engines run as the leg runners' account: it exists before they do.
		if err := r.applyLegRunnerAccount(ctx, p); err != nil {
			return err
		}
		in.LegRunnerImage = r.routerImage(p.object().(*kvv1.DecodePool))
	}
	if v.policy.Spec.Routing.KVEvents() {
		prefill, ok := p.object().(*kvv1.PrefillPool)
		if !ok {
			prefill = v.prefill
		}
		if err := r.ensureKVEventsToken(ctx, prefill); err != nil {
			return err
		}
		in.KVEventsImage = r.kvEventsImage(p)
	}
	w, err := render.Engines(in)
	if err != nil {
		return err
	}
	if err := r.apply(ctx, p, w.Service, &corev1.Service{}); err != nil {
		return err
	}
	// The sidecars' port is closed to all but routers and pickers before they listen.
	if w.KVEventsNetworkPolicy != nil {
		if err := r.apply(ctx, p, w.KVEventsNetworkPolicy, &networkingv1.NetworkPolicy{}); err != nil {
			return err
		}
	} else if err := r.deleteControlled(ctx, p, render.KVEventsNetworkPolicyName(p.GetName()), &networkingv1.NetworkPolicy{}); err != nil {
		return err
	}
	if err := r.applyDeviceClaims(ctx, p, w.DeviceClaims); err != nil {
		return err
	}
	if err := r.apply(ctx, p, w.StatefulSet, &appsv1.StatefulSet{}); err != nil {
		return err
	}
	if err := r.apply(ctx, p, w.PDB, &policyv1.PodDisruptionBudget{}); err != nil {
		return err
	}
	if err := r.pruneDeviceClaims(ctx, p, w.DeviceClaims); err != nil {
		return err
	}
	if p.role() == kvv1.RoleDecode {
		if err := r.applyRouter(ctx, p, v); err != nil {
			return err
		}
		v.gateway, err = r.applyGateway(ctx, p, v)
		return err
	}
	return nil
}

// SetupWithManager registers the reconciler: it follows the StatefulSet, Service and
// PodDisruptionBudget of the pool's name (its own, or a foreign one that blocks it: deleting that must clear the
// NameConflict), the pool's pods, the policy (and, for a decode pool, the prefill pool)
// it references, its namespace (whose label allows privileged engines), the agents'
// labels and reports on its engines' nodes, and (a decode pool) its routers' reports.
func (r *PoolReconciler) SetupWithManager(mgr ctrl.Manager) error {
	if err := indexReferences(context.Background(), mgr, r.Role); err != nil {
		return err
	}
	b := ctrl.NewControllerManagedBy(mgr).
		Named(string(r.Role)+"pool").
		For(newPool(r.Role).object()).
		Watches(&appsv1.StatefulSet{}, enqueuePoolOfName()).
		Watches(&corev1.Service{}, enqueuePoolOfName()).
		Watches(&policyv1.PodDisruptionBudget{}, enqueuePoolOfName()).
		Watches(&corev1.Pod{}, enqueuePoolOfPod(r.Role)).
		Watches(&kvv1.KVTransferPolicy{}, enqueueReferrers(mgr.GetClient(), r.Role, indexPolicy)).
		Watches(&corev1.Namespace{}, enqueuePoolsIn(mgr.GetClient(), r.Role)).
		WatchesMetadata(&corev1.Node{}, enqueuePoolsOnNode(mgr.GetClient(), r.Role), builder.WithPredicates(agentChanged))
	if r.Role == kvv1.RolePrefill {
		// An autoscaling DecodePool sets its PrefillPool's replicas.
		b = b.Watches(&kvv1.DecodePool{}, enqueuePrefillPoolOf())
	}
	if r.Role == kvv1.RoleDecode {
		b = b.WatchesRawSource(source.Channel(r.routers.events, &handler.EnqueueRequestForObject{})).
			Watches(&kvv1.PrefillPool{}, enqueueReferrers(mgr.GetClient(), r.Role, indexPrefillPool)).
			// A hand edit of the router's Deployment or Service is undone.
			Owns(&appsv1.Deployment{}).
			Owns(&corev1.Service{})
	}
	c, err := b.Build(r)
	if err != nil || r.Role != kvv1.RoleDecode {
		return err
	}
	// The watch on InferencePools starts at the first one applied (applyGateway): its
	// first list brings every pool a gateway reported on before.
	r.inferencePools = &inferencePoolWatch{ctrl: c, mgr: mgr}
	return nil
}

// Secure metrics check each caller with the API server.
// +kubebuilder:rbac:groups=authentication.k8s.io,resources=tokenreviews,verbs=create
// +kubebuilder:rbac:groups=authorization.k8s.io,resources=subjectaccessreviews,verbs=create

// Leader election takes a Lease in the manager's own namespace only.
// +kubebuilder:rbac:groups=coordination.k8s.io,resources=leases,verbs=get;list;watch;create;update;patch,namespace=kvhandoff-system
// and announces a new leader with a core Event there (client-go's leader election).
// +kubebuilder:rbac:groups="",resources=events,verbs=create;patch,namespace=kvhandoff-system
