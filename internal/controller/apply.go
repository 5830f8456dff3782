package controller

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// apply makes the live object equal to desired with server-side apply, owned by the pool.
// It writes nothing when the live object already carries desired's rendered-hash and
// every field desired sets has the desired value (so a hand edit of an owned field is
// undone, and an unchanged pool costs no write). live is an empty object of desired's type.
func (r *PoolReconciler) apply(ctx context.Context, p pool, desired, live client.Object) error {
	exists, err := r.readOwned(ctx, p, desired, live)
	if err != nil {
		return err
	}
	if exists && unchanged(desired, live) {
		return nil
	}
	return r.serverSideApply(ctx, p.object(), desired)
}

// applyAll applies a set of objects (a router's account, Role, binding, Deployment, ...)
// once none of them belongs to something else: a conflict on one leaves all as they were.
func (r *PoolReconciler) applyAll(ctx context.Context, p pool, objs []metav1.Object) error {
	for _, obj := range objs {
		if _, err := r.readOwned(ctx, p, obj.(client.Object), emptyLike(obj)); err != nil {
			return err
		}
	}
	for _, obj := range objs {
		if err := r.apply(ctx, p, obj.(client.Object), emptyLike(obj)); err != nil {
			return err
		}
	}
	return nil
}

// readOwned reads the object of desired's kind and name into live: false when there is
// none, a NameConflict problem when the pool does not control it. The cache holds only
// kvhandoff's own objects of some kinds (CacheOptions), so an object it does not hold is
// looked for in the API server too: a foreign ServiceAccount, Role or binding of the
// name would otherwise read as absent and be taken over by the apply.
func (r *PoolReconciler) readOwned(ctx context.Context, p pool, desired, live client.Object) (bool, error) {
	key := client.ObjectKeyFromObject(desired)
	err := r.Get(ctx, key, live)
	if apierrors.IsNotFound(err) && r.APIReader != nil {
		err = r.APIReader.Get(ctx, key, live)
	}
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, err
	}
	if ref := metav1.GetControllerOf(live); ref == nil || ref.UID != p.object().GetUID() {
		return true, &problem{Reason: kvv1.ReasonNameConflict, Message: fmt.Sprintf("%s %s already exists and is not managed by this pool; rename "+
			"the pool or delete that object", desired.GetObjectKind().GroupVersionKind().Kind, desired.GetName())}
	}
	return true, nil
}

// serverSideApply applies desired, controlled by owner, as field manager kvhandoff.
func (r *PoolReconciler) serverSideApply(ctx context.Context, owner, desired client.Object) error {
	if err := controllerutil.SetControllerReference(owner, desired, r.Scheme()); err != nil {
		return err
	}
	u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(desired)
	if err != nil {
		return err
	}
	// Apply only what kvhandoff renders: no status, no server-set metadata.
	delete(u, "status")
	unstructured.RemoveNestedField(u, "metadata", "creationTimestamp")
	unstructured.RemoveNestedField(u, "spec", "template", "metadata", "creationTimestamp")
	err = r.Apply(ctx, client.ApplyConfigurationFromUnstructured(&unstructured.Unstructured{Object: u}),
		client.FieldOwner(FieldOwner), client.ForceOwnership)
	if apierrors.IsInvalid(err) {
		// What kvhandoff renders is valid by construction (the golden files and the
		// samples prove it); what the pool's template and env add may not be.
		return &problem{Reason: kvv1.ReasonInvalidTemplate, Message: fmt.Sprintf("the API server refused the %s this pool renders to; check "+
			"spec.template and spec.env: %v", desired.GetObjectKind().GroupVersionKind().Kind, err)}
	}
	return err
}

// unchanged reports whether live already is what desired renders.
func unchanged(desired, live client.Object) bool {
	if live.GetAnnotations()[kvv1.AnnotationRenderedHash] != desired.GetAnnotations()[kvv1.AnnotationRenderedHash] {
		return false
	}
	d, err := runtime.DefaultUnstructuredConverter.ToUnstructured(desired)
	if err != nil {
		return false
	}
	l, err := runtime.DefaultUnstructuredConverter.ToUnstructured(live)
	if err != nil {
		return false
	}
	// DeepDerivative ignores what desired leaves unset (server defaults) but catches
	// any field desired sets that the live object holds differently: spec, or a Role's
	// rules and a RoleBinding's roleRef and subjects, which have no spec.
	for k, v := range d {
		switch k {
		case "apiVersion", "kind", "metadata", "status":
			continue
		}
		if !equality.Semantic.DeepDerivative(v, l[k]) {
			return false
		}
	}
	return equality.Semantic.DeepDerivative(desired.GetLabels(), live.GetLabels())
}
