package controller

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// The manager runs against a real kube-apiserver and etcd, exactly as cmd/manager wires
// it. There is no kube-controller-manager here, so specs play the StatefulSet controller
// and the kubelet where they need pods and rollout status (markRolledOut, addEnginePod);
// test/e2e runs the real ones.

var (
	env    *envtest.Env
	k8s    client.Client
	ctx    context.Context
	cancel context.CancelFunc
)

func TestControllers(t *testing.T) {
	RegisterFailHandler(Fail)
	RunSpecs(t, "manager controllers")
}

var _ = BeforeSuite(func() {
	// Generous on a loaded 2-core CI machine; a passing wait returns as soon as it holds.
	SetDefaultEventuallyTimeout(30 * time.Second)
	SetDefaultEventuallyPollingInterval(20 * time.Millisecond)
	logf.SetLogger(zap.New(zap.WriteTo(GinkgoWriter), zap.UseDevMode(true)))
	ctx, cancel = context.WithCancel(context.Background())
	var err error
	env, err = envtest.Start(NewScheme())
	Expect(err).NotTo(HaveOccurred())
	k8s = env.Client

	mgr, err := ctrl.NewManager(env.Config, ctrl.Options{
		Scheme:                 env.Scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Cache:                  CacheOptions(),
	})
	Expect(err).NotTo(HaveOccurred())
	Expect(Setup(mgr, Options{RouterHealthInterval: 200 * time.Millisecond, AutoscaleInterval: 250 * time.Millisecond,
		InferencePoolCRDRecheck: time.Second, KVEventsTokenRecheck: time.Second})).To(Succeed())
	go func() {
		defer GinkgoRecover()
		Expect(mgr.Start(ctx)).To(Succeed())
	}()
})

var _ = AfterSuite(func() {
	cancel()
	if env != nil {
		Expect(env.Stop()).To(Succeed())
	}
})

func freshNamespace() string {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "mgr-"}}
	Expect(k8s.Create(ctx, ns)).To(Succeed())
	return ns.Name
}

// create creates each object in namespace ns.
func create(ns string, objs ...client.Object) {
	for _, o := range objs {
		o.SetNamespace(ns)
		Expect(k8s.Create(ctx, o)).To(Succeed(), "creating %T %s", o, o.GetName())
	}
}

func key(ns, name string) client.ObjectKey { return client.ObjectKey{Namespace: ns, Name: name} }

// statefulSet waits for the pool's StatefulSet and returns it.
func statefulSet(ns, name string) *appsv1.StatefulSet {
	sts := &appsv1.StatefulSet{}
	Eventually(func() error { return k8s.Get(ctx, key(ns, name), sts) }).Should(Succeed())
	return sts
}

// markRolledOut plays the StatefulSet controller: the StatefulSet's pods all run its current
// template and ready of them are ready.
func markRolledOut(sts *appsv1.StatefulSet, ready int32) {
	Eventually(func(g Gomega) {
		g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(sts), sts)).To(Succeed())
		n := ptr.Deref(sts.Spec.Replicas, 1)
		sts.Status = appsv1.StatefulSetStatus{
			ObservedGeneration: sts.Generation, Replicas: n, UpdatedReplicas: n, ReadyReplicas: ready, AvailableReplicas: ready,
			CurrentRevision: fmt.Sprintf("%s-%d", sts.Name, sts.Generation), UpdateRevision: fmt.Sprintf("%s-%d", sts.Name, sts.Generation),
		}
		g.Expect(k8s.Status().Update(ctx, sts)).To(Succeed())
	}).Should(Succeed())
}

// addEnginePod plays the StatefulSet controller and the kubelet: pod i of the
// StatefulSet exists, with its template's labels, on node, with ip.
func addEnginePod(sts *appsv1.StatefulSet, i int, node, ip string) {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d", sts.Name, i), Namespace: sts.Namespace, Labels: sts.Spec.Template.Labels,
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(sts, appsv1.SchemeGroupVersion.WithKind("StatefulSet"))}},
		Spec: *sts.Spec.Template.Spec.DeepCopy(),
	}
	pod.Spec.NodeName = node
	Expect(k8s.Create(ctx, pod)).To(Succeed())
	pod.Status.PodIP = ip
	pod.Status.PodIPs = []corev1.PodIP{{IP: ip}}
	pod.Status.HostIP = "198.19.0." + ip[strings.LastIndex(ip, ".")+1:]
	pod.Status.Phase = corev1.PodRunning
	pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	Expect(k8s.Status().Update(ctx, pod)).To(Succeed())
}

// condition re-reads the pool and returns its condition of type t; the zero value
// until the manager has set it.
func condition(obj client.Object, t string) metav1.Condition {
	Expect(k8s.Get(ctx, client.ObjectKeyFromObject(obj), obj)).To(Succeed())
	for _, c := range poolOf(obj).status().Conditions {
		if c.Type == t {
			return c
		}
	}
	return metav1.Condition{}
}

// writeCounter wraps a client and counts every call that could write.
type writeCounter struct {
	client.Client
	writes atomic.Int64
}

func countingClient() *writeCounter {
	direct, err := client.NewWithWatch(env.Config, client.Options{Scheme: env.Scheme})
	Expect(err).NotTo(HaveOccurred())
	w := &writeCounter{}
	count := func() { w.writes.Add(1) }
	w.Client = interceptor.NewClient(direct, interceptor.Funcs{
		Create: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.CreateOption) error {
			count()
			return c.Create(ctx, o, opts...)
		},
		Update: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.UpdateOption) error {
			count()
			return c.Update(ctx, o, opts...)
		},
		Patch: func(ctx context.Context, c client.WithWatch, o client.Object, p client.Patch, opts ...client.PatchOption) error {
			count()
			return c.Patch(ctx, o, p, opts...)
		},
		Delete: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.DeleteOption) error {
			count()
			return c.Delete(ctx, o, opts...)
		},
		Apply: func(ctx context.Context, c client.WithWatch, o runtime.ApplyConfiguration, opts ...client.ApplyOption) error {
			count()
			return c.Apply(ctx, o, opts...)
		},
		SubResourceUpdate: func(ctx context.Context, c client.Client, sub string, o client.Object, opts ...client.SubResourceUpdateOption) error {
			count()
			return c.SubResource(sub).Update(ctx, o, opts...)
		},
		SubResourcePatch: func(ctx context.Context, c client.Client, sub string, o client.Object, p client.Patch, opts ...client.SubResourcePatchOption) error {
			count()
			return c.SubResource(sub).Patch(ctx, o, p, opts...)
		},
	})
	return w
}
