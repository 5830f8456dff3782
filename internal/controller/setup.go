package controller

import (
	"cmp"
	"context"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/selection"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/informer"
	"github.com/kvhandoff/kvhandoff/internal/render"
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
	// The Gateway API Inference Extension's InferencePool, which DecodePools with a
	// gateway render (the CRD need not be installed).
	if err := infv1.Install(s); err != nil {
		panic(err)
	}
	return s
}

// Images are the images the manager renders besides the engines' own: "" takes the
// default of the manager's version.
type Images struct {
	// Router is the router image DecodePools get when they name none.
	Router string
	// Connector is the vLLM connector image whose init container puts kvhandoff's
	// connector on engines' PYTHONPATH (executor Agent).
	Connector string
}

// Options are the manager's settings beyond the controller-runtime manager's own.
type Options struct {
	Images Images
	// RouterHealthInterval is how often every router pod's health report is read.
	RouterHealthInterval time.Duration
	// AutoscaleInterval is how often the autoscaler reads the load reports of the
	// routers of autoscaled DecodePools and decides their sizes.
	AutoscaleInterval time.Duration
	// InferencePoolCRDRecheck is how often a DecodePool with a gateway looks again for the
	// InferencePool CRD while the cluster has none.
	InferencePoolCRDRecheck time.Duration
	// KVEventsTokenRecheck is how often a PrefillPool whose engines serve KV events looks
	// again for its token Secret, which the manager does not watch: a deleted one is made
	// again within it.
	KVEventsTokenRecheck time.Duration
}

// Setup registers the PrefillPool and DecodePool reconcilers with mgr, the poller of
// the routers' health reports, and the autoscaler.
func Setup(mgr ctrl.Manager, o Options) error {
	if err := indexPodNodes(context.Background(), mgr); err != nil {
		return err
	}
	routers := newRouterHealth(mgr.GetClient(), cmp.Or(o.RouterHealthInterval, 10*time.Second))
	if err := mgr.Add(routers); err != nil {
		return err
	}
	if err := mgr.Add(newAutoscaler(mgr.GetClient(), mgr.GetEventRecorder("kvhandoff-autoscaler"), cmp.Or(o.AutoscaleInterval, 15*time.Second))); err != nil {
		return err
	}
	for _, role := range []kvv1.Role{kvv1.RolePrefill, kvv1.RoleDecode} {
		r := &PoolReconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Recorder: mgr.GetEventRecorder("kvhandoff-" + string(role) + "pool"), Role: role,
			RouterImage: o.Images.Router, ConnectorImage: o.Images.Connector, routers: routers,
			crdRecheck: cmp.Or(o.InferencePoolCRDRecheck, time.Minute), kvTokens: kvEventsTokens{recheck: cmp.Or(o.KVEventsTokenRecheck, time.Minute)}}
		if err := r.SetupWithManager(mgr); err != nil {
			return err
		}
	}
	return nil
}

// CacheOptions keep the manager's memory proportional to its engines: of all pods it
// caches only those that carry a pool label (engines and routers); of nodes, only their
// metadata (the agents' labels and health reports). StatefulSets and Services are cached whole,
// so that a foreign object with a pool's name is seen and reported, never taken over.
//
// Of Deployments, ReplicaSets, PodDisruptionBudgets, NetworkPolicies, ServiceAccounts,
// Roles and RoleBindings it caches only its own (labelled app.kubernetes.io/managed-by=kvhandoff:
// routers, endpoint pickers, leg runners' accounts): those kinds are numerous in a
// cluster and the manager owns no others.
//
// Its informers watch again within a second or two of an API-server outage's end
// (package informer), so a fault soon after one is reported.
func CacheOptions() cache.Options {
	has := func(key string) cache.ByObject {
		r, err := labels.NewRequirement(key, selection.Exists, nil)
		if err != nil {
			panic(err) // a constant label key always makes a valid requirement
		}
		return cache.ByObject{Label: labels.NewSelector().Add(*r)}
	}
	router := cache.ByObject{Label: labels.SelectorFromSet(labels.Set{render.LabelManagedBy: render.ManagedBy})}
	return cache.Options{NewInformer: informer.New(ctrl.Log.WithName("informer")), ByObject: map[client.Object]cache.ByObject{
		&corev1.Pod{}:                   has(kvv1.LabelPool),
		&appsv1.Deployment{}:            router,
		&appsv1.ReplicaSet{}:            router,
		&policyv1.PodDisruptionBudget{}: router,
		&corev1.ServiceAccount{}:        router,
		&rbacv1.Role{}:                  router,
		&rbacv1.RoleBinding{}:           router,
		&networkingv1.NetworkPolicy{}:   router,
	}}
}

// MetricsOptions serves the manager's Prometheus metrics on addr ("0" disables them).
// Secure serves HTTPS and lets only callers whom the API server authenticates (a bearer
// token, checked by TokenReview) and authorizes to get the /metrics URL
// (SubjectAccessReview; config/rbac's kvhandoff-metrics-reader grants it) read them.
func MetricsOptions(addr string, secure bool) metricsserver.Options {
	o := metricsserver.Options{BindAddress: addr, SecureServing: secure}
	if secure {
		o.FilterProvider = filters.WithAuthenticationAndAuthorization
	}
	return o
}
