package controller

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/internal/router"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
)

var _ = Describe("Autoscaling", func() {
	// A real router in front of simulated engines, whose pod the manager polls for its
	// load report: under load the pair's prefill grows (the prefill engine is busy all
	// the time), and once the load stops both roles go back to their minimums, each
	// step in the DecodePool's status, its Autoscaling condition and an event; the
	// PrefillPool says who sizes it. A budget that cannot hold the minimums is reported;
	// removing autoscaling gives the replicas back to spec.replicas.
	It("sizes both pools from the router's load, within the budget, and says why", func() {
		ns, _, p, d := readyPair()
		r := routerOverSimulatedEngines(ns)
		srv, admin := httptest.NewServer(r), httptest.NewServer(r.Admin())
		DeferCleanup(srv.Close)
		DeferCleanup(admin.Close)
		routerPod(ns, "d", "d-router-5d9c7-x2x1", routerReplicaSet(ns, "d", "d-router-5d9c7", true), admin.URL)

		update(d, func(d *kvv1.DecodePool) {
			d.Spec.Autoscaling = &kvv1.AutoscalingSpec{
				TTFT: kvv1.LatencyTarget{Milliseconds: 250}, ITL: kvv1.LatencyTarget{Milliseconds: 100},
				Prefill: kvv1.ReplicaRange{MinReplicas: 1, MaxReplicas: 3}, Decode: kvv1.ReplicaRange{MinReplicas: 1, MaxReplicas: 2},
				AcceleratorBudget: 32, WindowSeconds: 5, WarmupSeconds: ptr.To[int32](0), StabilizationWindowSeconds: ptr.To[int32](0),
			}
		})
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(p), p)).To(Succeed())
			g.Expect(p.Status.Autoscaling).To(Equal(&kvv1.AutoscalingStatus{Owner: "d", PrefillReplicas: 1}))
			g.Expect(condition(d, kvv1.ConditionAutoscaling).Reason).To(Equal(kvv1.ReasonWithinTargets))
		}).Should(Succeed())

		// Four clients, each sending its next request when the last is answered: the
		// prefill engine (one prefill of 100 ms at a time) is never idle, and a request
		// waits for three others: a TTFT of 400 ms, over the 250 ms target.
		stop := closedLoop(srv.URL, 4)
		DeferCleanup(stop)
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
			st := d.Status.Autoscaling
			g.Expect(st).NotTo(BeNil())
			g.Expect(st.PrefillReplicas).To(BeNumerically(">=", 2))
			g.Expect(st.Signals.PrefillTokensPerSecondPerEngine).To(BeNumerically(">", 0))
			g.Expect(st.Signals.TTFTMilliseconds).To(BeNumerically(">", 250))
			g.Expect(ptr.Deref(statefulSet(ns, "p").Spec.Replicas, 0)).To(Equal(st.PrefillReplicas))
		}, 30*time.Second).Should(Succeed())
		expectAutoscaleEvent(d, kvv1.ReasonScaledUp, "prompt tokens/s")
		applied, _ := gauge("kvhandoff_autoscaler_replicas", map[string]string{"namespace": ns, "pool": "d", "role": "prefill", "kind": "applied"})
		Expect(applied).To(BeNumerically(">=", 2))

		stop()
		Eventually(func(g Gomega) {
			g.Expect(ptr.Deref(statefulSet(ns, "p").Spec.Replicas, 0)).To(BeEquivalentTo(1))
			g.Expect(condition(d, kvv1.ConditionAutoscaling)).To(And(HaveField("Reason", kvv1.ReasonWithinTargets),
				HaveField("Message", ContainSubstring("no prompts; no decode streams"))))
		}, 30*time.Second).Should(Succeed())
		expectAutoscaleEvent(d, kvv1.ReasonScaledDown, "→1, decode 1→1 (ScaledDown): ")

		// Each engine takes 8 GPUs: 16 do not fit in 10.
		update(d, func(d *kvv1.DecodePool) { d.Spec.Autoscaling.AcceleratorBudget = 10 })
		Eventually(func(g Gomega) {
			c := condition(d, kvv1.ConditionAutoscaling)
			g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
			g.Expect(c.Reason).To(Equal(kvv1.ReasonAutoscalingBudgetTooSmall))
			g.Expect(c.Message).To(ContainSubstring("acceleratorBudget 10 does not hold the minimums: 1 prefill engines of 8 accelerators and 1 decode engines of 8 need 16"))
		}).Should(Succeed())
		expectEvent(d, kvv1.ReasonAutoscalingBudgetTooSmall)

		update(d, func(d *kvv1.DecodePool) { d.Spec.Autoscaling = nil; d.Spec.Replicas = ptr.To[int32](2) })
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(p), p)).To(Succeed())
			g.Expect(p.Status.Autoscaling).To(BeNil())
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
			g.Expect(d.Status.Autoscaling).To(BeNil())
			g.Expect(condition(d, kvv1.ConditionAutoscaling).Type).To(BeEmpty())
			g.Expect(ptr.Deref(statefulSet(ns, "d").Spec.Replicas, 0)).To(BeEquivalentTo(2))
		}).Should(Succeed())
	})

	// Behind a gateway, requests reach decode pods' leg runners, not the router: the
	// autoscaler reads each decode pod's leg runner (its admin port, 8101) when the pod is
	// the pool's StatefulSet's, by UID.
	It("reads the leg runners of a pool behind a gateway", func() {
		ns, _, _, d := readyPair()
		r := routerOverSimulatedEngines(ns)
		srv := httptest.NewServer(r)
		DeferCleanup(srv.Close)
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", render.LegRunnerAdminPort))
		Expect(err).NotTo(HaveOccurred())
		admin := &http.Server{Handler: r.Admin(), ReadHeaderTimeout: time.Second}
		go func() { _ = admin.Serve(l) }()
		DeferCleanup(admin.Close)
		// The decode pod, as the StatefulSet controller makes it, at the leg runner's address.
		sts := statefulSet(ns, "d")
		pod := &corev1.Pod{}
		Expect(k8s.Get(ctx, key(ns, "d-0"), pod)).To(Succeed())
		pod.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "d", UID: sts.UID, Controller: ptr.To(true)}}
		Expect(k8s.Update(ctx, pod)).To(Succeed())
		pod.Status.PodIP, pod.Status.PodIPs = "127.0.0.1", []corev1.PodIP{{IP: "127.0.0.1"}}
		Expect(k8s.Status().Update(ctx, pod)).To(Succeed())

		update(d, func(d *kvv1.DecodePool) {
			d.Spec.Gateway.InferencePool = true
			d.Spec.Autoscaling = &kvv1.AutoscalingSpec{TTFT: kvv1.LatencyTarget{Milliseconds: 2000}, ITL: kvv1.LatencyTarget{Milliseconds: 100},
				Prefill: kvv1.ReplicaRange{MinReplicas: 1, MaxReplicas: 3}, Decode: kvv1.ReplicaRange{MinReplicas: 1, MaxReplicas: 2},
				AcceleratorBudget: 32, WindowSeconds: 5, WarmupSeconds: ptr.To[int32](0)}
		})
		stop := closedLoop(srv.URL, 2)
		DeferCleanup(stop)
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
			g.Expect(d.Status.Autoscaling).NotTo(BeNil())
			g.Expect(d.Status.Autoscaling.Signals).NotTo(BeNil())
			g.Expect(d.Status.Autoscaling.Signals.PromptTokensPerSecond).To(BeNumerically(">", 0))
		}, 30*time.Second).Should(Succeed())
	})

	It("refuses two autoscaling DecodePools sizing one PrefillPool", func() {
		ns, _, p, _ := readyPair()
		as := func(d *kvv1.DecodePool) {
			d.Spec.Autoscaling = &kvv1.AutoscalingSpec{TTFT: kvv1.LatencyTarget{Milliseconds: 2000}, ITL: kvv1.LatencyTarget{Milliseconds: 100},
				Prefill: kvv1.ReplicaRange{MinReplicas: 1, MaxReplicas: 3}, Decode: kvv1.ReplicaRange{MinReplicas: 1, MaxReplicas: 2}, AcceleratorBudget: 64}
		}
		update(&kvv1.DecodePool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "d"}}, as)
		d2 := &kvv1.DecodePool{}
		Expect(k8s.Get(ctx, key(ns, "d"), d2)).To(Succeed())
		d2 = &kvv1.DecodePool{ObjectMeta: metav1.ObjectMeta{Name: "d2"}, Spec: *d2.Spec.DeepCopy()}
		create(ns, d2)
		Eventually(func(g Gomega) {
			c := condition(p, kvv1.ConditionDegraded)
			g.Expect(c.Reason).To(Equal(kvv1.ReasonAutoscalingConflict))
			g.Expect(c.Message).To(HavePrefix("DecodePools d, d2 all set spec.autoscaling and name this PrefillPool"))
		}).Should(Succeed())
		expectEvent(p, kvv1.ReasonAutoscalingConflict)
	})
})

// expectAutoscaleEvent waits for a Normal event of the autoscaler with reason about obj
// whose note contains text.
func expectAutoscaleEvent(obj client.Object, reason, text string) {
	Eventually(func(g Gomega) {
		list := &eventsv1.EventList{}
		g.Expect(k8s.List(ctx, list, client.InNamespace(obj.GetNamespace()))).To(Succeed())
		g.Expect(list.Items).To(ContainElement(And(HaveField("Reason", reason), HaveField("Regarding.Name", obj.GetName()),
			HaveField("Type", "Normal"), HaveField("Note", ContainSubstring(text)))))
	}).Should(Succeed())
}

// routerOverSimulatedEngines is a real router over a simulated prefill engine of 100 ms
// a prefill, one at a time, and a decode engine, with the ids of readyPair's engines.
func routerOverSimulatedEngines(ns string) *router.Server {
	kv := vllmserver.NewLocalKV()
	engine := func(id string, prefill time.Duration) discovery.Engine {
		s := httptest.NewServer(vllmserver.New(vllmserver.Config{EngineID: id, Model: "m", SideChannelHost: "127.0.0.1", SideChannelPort: 5600, TP: 8,
			KV: kv, PrefillTime: func(int) time.Duration { return prefill }, TPOT: time.Millisecond}))
		DeferCleanup(s.Close)
		return discovery.Engine{URL: s.URL, EngineID: id, Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 8}
	}
	cfg := router.Defaults()
	cfg.ScrapeInterval = 0
	r := router.New(cfg)
	r.Update(&discovery.Set{Mode: kvv1.TransferPush, Prefill: []discovery.Engine{engine("p-0."+ns, 100*time.Millisecond)},
		Decode: []discovery.Engine{engine("d-0."+ns, 0)}})
	return r
}

// closedLoop starts clients that each send a streamed completion to url as soon as the
// last is answered; stop stops them and waits.
func closedLoop(url string, clients int) (stop func()) {
	loadCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i := range clients {
		wg.Go(func() {
			for n := 0; loadCtx.Err() == nil; n++ {
				body := fmt.Sprintf(`{"model":"m","prompt":"client %d request %d of a longer prompt","max_tokens":4,"stream":true}`, i, n)
				req, _ := http.NewRequestWithContext(loadCtx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
				if resp, err := http.DefaultClient.Do(req); err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}
		})
	}
	var once sync.Once
	return func() { once.Do(func() { cancel(); wg.Wait() }) }
}
