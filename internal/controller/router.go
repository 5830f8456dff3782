package controller

import (
	"context"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
)

func routerEnabled(p pool) bool {
	d, ok := p.object().(*kvv1.DecodePool)
	return ok && ptr.Deref(d.Spec.Router.Enabled, true)
}

// applyRouter applies a DecodePool's router, or removes it when the pool disables it.
func (r *PoolReconciler) applyRouter(ctx context.Context, p pool, v *validation) error {
	d := p.object().(*kvv1.DecodePool)
	if !routerEnabled(p) {
		return r.deleteRouter(ctx, p)
	}
	w, err := render.Router(render.RouterInput{Pool: d.Name, Namespace: d.Namespace, Spec: &d.Spec.Router, DefaultImage: r.routerImage(d),
		KVEventsSecret: kvEventsSecret(d, &v.policy.Spec)})
	if err != nil {
		return err
	}
	return r.applyAll(ctx, p, w.Objects())
}

// emptyLike returns an empty object of obj's type, to read the live one into.
func emptyLike(obj metav1.Object) client.Object {
	switch obj.(type) {
	case *corev1.ServiceAccount:
		return &corev1.ServiceAccount{}
	case *rbacv1.Role:
		return &rbacv1.Role{}
	case *rbacv1.RoleBinding:
		return &rbacv1.RoleBinding{}
	case *appsv1.Deployment:
		return &appsv1.Deployment{}
	case *corev1.Service:
		return &corev1.Service{}
	case *policyv1.PodDisruptionBudget:
		return &policyv1.PodDisruptionBudget{}
	case *networkingv1.NetworkPolicy:
		return &networkingv1.NetworkPolicy{}
	}
	panic("controllers: no empty object for a rendered object") // every rendered kind is listed above
}

// deleteRouter deletes the router objects the pool controls.
func (r *PoolReconciler) deleteRouter(ctx context.Context, p pool) error {
	return r.deleteControlled(ctx, p, render.RouterName(p.object().GetName()), serviceKinds()...)
}

// serviceKinds are the kinds of a render.ServiceWorkload, in the order they are deleted.
func serviceKinds() []client.Object {
	return []client.Object{&appsv1.Deployment{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{},
		&networkingv1.NetworkPolicy{}, &rbacv1.RoleBinding{}, &rbacv1.Role{}, &corev1.ServiceAccount{}}
}
