package controller

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/internal/router"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/test/loopback"
)

var _ = Describe("Router health", func() {
	// A real router whose prefill engine refuses every connection fails its requests by
	// name (handoffFailurePolicy Fail); its report, polled by the manager from the
	// router's pod, makes the DecodePool TransferHealthy=False (HandoffFailures), Ready
	// False and Degraded; once the window passes with no new failure, it clears. Pods
	// that only look like routers are neither polled nor believed: one with the router
	// label alone, and one owned by a ReplicaSet with a router's name and labels that the
	// manager's router Deployment does not own (the attack: anyone who may create a
	// ReplicaSet in the namespace could report on the pool).
	It("brings a router's failed handoffs into the DecodePool's condition, and clears", func() {
		ns, _, _, d := readyPair()
		r := router.New(router.Config{PrefillTimeout: time.Second, DecodeTimeout: time.Second, MaxBodyBytes: 1 << 20, BodyTimeout: time.Second,
			MaxInFlight: 8, HealthWindow: 3 * time.Second, HealthInterval: 100 * time.Millisecond})
		closed := closedURL()
		set := &discovery.Set{Mode: kvv1.TransferPull, HandoffFailureLimitPercent: ptr.To[int32](5),
			Prefill: []discovery.Engine{{URL: closed, EngineID: "p-0." + ns, Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 8}},
			Decode:  []discovery.Engine{{URL: closed, EngineID: "d-0." + ns, Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 8}}}
		srv, admin := httptest.NewServer(r), httptest.NewServer(r.Admin())
		DeferCleanup(srv.Close)
		DeferCleanup(admin.Close)
		runCtx, stop := context.WithCancel(ctx)
		DeferCleanup(stop)
		go func() { _ = r.Run(runCtx, discovery.Static{Set: set}) }()
		Eventually(func() int { return get(srv.URL + "/readyz") }).Should(Equal(http.StatusOK))

		routerPod(ns, "d", "d-router-5d9c7-x2x1", routerReplicaSet(ns, "d", "d-router-5d9c7", true), admin.URL)
		routerPod(ns, "d", "impostor", nil, admin.URL) // labelled, but no router Deployment's
		routerPod(ns, "d", "d-router-f00-x2x1", routerReplicaSet(ns, "d", "d-router-f00", false), admin.URL)
		for range 4 {
			resp, err := http.Post(srv.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"a","max_tokens":1}`))
			Expect(err).NotTo(HaveOccurred())
			resp.Body.Close()
			Expect(resp.StatusCode).To(Equal(http.StatusBadGateway))
		}
		Eventually(func(g Gomega) {
			c := condition(d, kvv1.ConditionTransferHealthy)
			g.Expect(c.Reason).To(Equal(kvv1.ReasonHandoffFailures))
			g.Expect(c.Message).To(And(HavePrefix("router pod(s) d-router-5d9c7-x2x1: more than 5% of requests"), ContainSubstring("prefill_failed")))
			g.Expect(condition(d, kvv1.ConditionDegraded)).To(HaveField("Reason", kvv1.ReasonHandoffFailures))
			g.Expect(condition(d, kvv1.ConditionReady)).To(And(HaveField("Status", metav1.ConditionFalse), HaveField("Reason", kvv1.ReasonHandoffFailures)))
		}).Should(Succeed())
		Eventually(func() string { return condition(d, kvv1.ConditionTransferHealthy).Reason }).Should(Equal(kvv1.ReasonTransfersHealthy))
		Expect(condition(d, kvv1.ConditionTransferHealthy).Message).To(ContainSubstring("and 1 router(s) report no problem"))
		Expect(condition(d, kvv1.ConditionReady)).To(HaveField("Reason", kvv1.ReasonEnginesReady))
	})
})

// routerReplicaSet plays the Deployment controller: a ReplicaSet with a router's name and
// labels, controlled by the pool's router Deployment when owned.
func routerReplicaSet(ns, pool, name string, owned bool) *appsv1.ReplicaSet {
	// As the Deployment controller labels them: the router pod template's labels.
	labels := map[string]string{kvv1.LabelRouter: pool, kvv1.LabelPool: pool, render.LabelManagedBy: render.ManagedBy}
	rs := &appsv1.ReplicaSet{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
		Spec: appsv1.ReplicaSetSpec{Selector: &metav1.LabelSelector{MatchLabels: labels}, Template: corev1.PodTemplateSpec{
			ObjectMeta: metav1.ObjectMeta{Labels: labels},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "router", Image: "router"}}}}},
	}
	if owned {
		dep := &appsv1.Deployment{}
		Eventually(func() error { return k8s.Get(ctx, key(ns, render.RouterName(pool)), dep) }).Should(Succeed())
		rs.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "Deployment", Name: dep.Name, UID: dep.UID, Controller: ptr.To(true)}}
	}
	create(ns, rs)
	return rs
}

// routerPod plays the ReplicaSet controller and the kubelet: a router pod of pool,
// controlled by owner (nil for none), whose admin port serves at url.
func routerPod(ns, pool, name string, owner *appsv1.ReplicaSet, url string) {
	host, port, err := net.SplitHostPort(strings.TrimPrefix(url, "http://"))
	Expect(err).NotTo(HaveOccurred())
	p, err := strconv.Atoi(port)
	Expect(err).NotTo(HaveOccurred())
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{kvv1.LabelRouter: pool, kvv1.LabelPool: pool}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "router", Image: "router",
			Ports: []corev1.ContainerPort{{Name: "admin", ContainerPort: int32(p)}}}}},
	}
	if owner != nil {
		pod.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: owner.Name, UID: owner.UID, Controller: ptr.To(true)}}
	}
	create(ns, pod)
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: host}
	Expect(k8s.Status().Update(ctx, pod)).To(Succeed())
}

func closedURL() string {
	return "http://" + loopback.Refusing(GinkgoT())
}

func get(url string) int {
	resp, err := http.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}
