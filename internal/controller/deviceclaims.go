package controller

import (
	"context"
	"slices"

	appsv1 "k8s.io/api/apps/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/kvhandoff/kvhandoff/internal/render"
)

// The manager makes each DRA pool's ResourceClaimTemplate; the ResourceClaim controller
// makes each engine's claim from it, and the scheduler allocates it.
// +kubebuilder:rbac:groups=resource.k8s.io,resources=resourceclaimtemplates,verbs=get;list;watch;create;patch;delete

// applyDeviceClaims applies the pool's ResourceClaimTemplates (allocation DRA) before the
// engines that use them. A template's spec is immutable, so a changed claim is a template
// of another name; the older ones are deleted once no engine of an older revision can
// be made again (the StatefulSet rolled out), as a re-created pod of the old revision
// would find its template gone. Templates of a pool that went back to the device
// plugins stay until the pool is deleted (they are owned by it): the manager lists
// claim templates only for pools that use them, so clusters without
// resource.k8s.io/v1 never need it.
func (r *PoolReconciler) applyDeviceClaims(ctx context.Context, p pool, claims []*resourcev1.ResourceClaimTemplate) error {
	for _, c := range claims {
		if err := r.apply(ctx, p, c, &resourcev1.ResourceClaimTemplate{}); err != nil {
			return err
		}
	}
	return nil
}

// pruneDeviceClaims deletes the pool's claim templates other than keep once its
// StatefulSet has rolled out.
func (r *PoolReconciler) pruneDeviceClaims(ctx context.Context, p pool, keep []*resourcev1.ResourceClaimTemplate) error {
	if len(keep) == 0 {
		return nil
	}
	sts := &appsv1.StatefulSet{}
	if err := r.Get(ctx, client.ObjectKey{Namespace: p.GetNamespace(), Name: p.GetName()}, sts); err != nil {
		return client.IgnoreNotFound(err)
	}
	if !rolledOut(sts) {
		return nil
	}
	list := &resourcev1.ResourceClaimTemplateList{}
	if err := r.List(ctx, list, client.InNamespace(p.GetNamespace()), client.MatchingLabels(render.SelectorLabels(p.role(), p.GetName()))); err != nil {
		return err
	}
	for i := range list.Items {
		t := &list.Items[i]
		if slices.ContainsFunc(keep, func(k *resourcev1.ResourceClaimTemplate) bool { return k.Name == t.Name }) || !metav1.IsControlledBy(t, p.object()) {
			continue
		}
		if err := r.Delete(ctx, t, client.Preconditions{UID: ptr.To(t.UID)}); client.IgnoreNotFound(err) != nil {
			return err
		}
	}
	return nil
}
