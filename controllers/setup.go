package controllers

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/selection"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// NewScheme returns the scheme the manager works with: Kubernetes' built-in kinds and
// kvhandoff's.
func NewScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		panic(err) // only a programming error makes registration fail
	}
	if err := kvv1.AddToScheme(s); err != nil {
		panic(err)
	}
	return s
}

// Setup registers the PrefillPool and DecodePool reconcilers with mgr.
func Setup(mgr ctrl.Manager) error {
	for _, role := range []kvv1.Role{kvv1.RolePrefill, kvv1.RoleDecode} {
		r := &PoolReconciler{Client: mgr.GetClient(), Recorder: mgr.GetEventRecorder("kvhandoff-" + string(role) + "pool"), Role: role}
		if err := r.SetupWithManager(mgr); err != nil {
			return err
		}
	}
	return nil
}

// CacheOptions keep the manager's memory proportional to its engines: of all pods it
// caches only those that carry a pool label. StatefulSets and Services are cached whole,
// so that a foreign object with a pool's name is seen and reported, never taken over.
func CacheOptions() cache.Options {
	enginePods, err := labels.NewRequirement(kvv1.LabelPool, selection.Exists, nil)
	if err != nil {
		panic(err) // a constant label key always makes a valid requirement
	}
	return cache.Options{ByObject: map[client.Object]cache.ByObject{
		&corev1.Pod{}: {Label: labels.NewSelector().Add(*enginePods)},
	}}
}
