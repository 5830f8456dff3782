package controller

import (
	"strings"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

// readyPair creates a push pair in a fresh namespace and brings both pools to Ready
// with one engine each, playing the StatefulSet controller and kubelet.
func readyPair() (string, *kvv1.KVTransferPolicy, *kvv1.PrefillPool, *kvv1.DecodePool) {
	ns := freshNamespace()
	pol, p, d := builder.Policy("policy").Obj(), builder.PrefillPool("p").Obj(), builder.DecodePool("d", "p").Obj()
	create(ns, pol, p, d)
	for i, name := range []string{"p", "d"} {
		sts := statefulSet(ns, name)
		addEnginePod(sts, 0, []string{"node-a", "node-b"}[i], []string{"198.18.0.1", "198.18.0.2"}[i])
		markRolledOut(sts, 1)
	}
	Eventually(func() metav1.ConditionStatus { return condition(d, kvv1.ConditionPaired).Status }).Should(Equal(metav1.ConditionTrue))
	return ns, pol, p, d
}

var _ = Describe("Status", func() {
	It("publishes every engine's identity and becomes Ready and Paired when both pools roll out", func() {
		ns, _, p, d := readyPair()
		Expect(condition(p, kvv1.ConditionReady)).To(HaveField("Status", metav1.ConditionTrue))
		Expect(p.Status.ReadyReplicas).To(BeEquivalentTo(1))
		Expect(p.Status.Mode).To(Equal(kvv1.TransferPush))
		Expect(d.Status.HandoffFailurePolicy).To(Equal(kvv1.HandoffFailureFail))
		Expect(d.Status.HealthWindowSeconds).To(BeEquivalentTo(kvv1.DefaultHealthWindowSeconds))
		Expect(p.Status.Selector).To(Equal("kvhandoff.io/pool=p,kvhandoff.io/role=prefill"))
		Expect(p.Status.CompatHash).NotTo(BeEmpty())
		Expect(p.Status.Engines).To(Equal([]kvv1.EngineStatus{{
			PodName: "p-0", EngineID: "p-0." + ns, Host: "198.18.0.1", SideChannelPort: 5600,
			TensorParallelSize: 8, PipelineParallelSize: 1, NodeName: "node-a", CompatHash: p.Status.CompatHash, Ready: true,
		}}))
		Expect(d.Status.CompatHash).To(Equal(p.Status.CompatHash))
		Expect(condition(d, kvv1.ConditionPaired).Reason).To(Equal(kvv1.ReasonCompatible))
	})

	It("is not Paired while the pools' engines differ, and is again once both run the same configuration", func() {
		ns, _, p, d := readyPair()
		update(d, func(d *kvv1.DecodePool) { d.Spec.Image = "vllm/vllm-openai:v0.29.1" })
		Eventually(func() string { return condition(d, kvv1.ConditionPaired).Reason }).Should(Equal(kvv1.ReasonCompatHashMismatch))
		markRolledOut(statefulSet(ns, "d"), 1)
		Eventually(func(g Gomega) {
			c := condition(d, kvv1.ConditionPaired)
			g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
			g.Expect(c.Message).To(ContainSubstring("model, KV-cache dtype, mode, connector or image differ"))
		}).Should(Succeed())

		update(p, func(p *kvv1.PrefillPool) { p.Spec.Image = "vllm/vllm-openai:v0.29.1" })
		Eventually(func() string { return statefulSet(ns, "p").Spec.Template.Spec.Containers[0].Image }).Should(Equal("vllm/vllm-openai:v0.29.1"))
		markRolledOut(statefulSet(ns, "p"), 1)
		Eventually(func() metav1.ConditionStatus { return condition(d, kvv1.ConditionPaired).Status }).Should(Equal(metav1.ConditionTrue))
	})
})

// gauge reads a pool metric's value; ok is false when the series does not exist.
func gauge(name string, labels map[string]string) (value float64, ok bool) {
	families, err := metrics.Registry.Gather()
	Expect(err).NotTo(HaveOccurred())
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue series
				}
			}
			return m.GetGauge().GetValue(), true
		}
	}
	return 0, false
}

var _ = Describe("Metrics", func() {
	It("publishes engines and conditions per pool, and forgets a deleted pool", func() {
		ns, _, p, _ := readyPair()
		decode := map[string]string{"namespace": ns, "pool": "d", "role": "decode"}
		with := func(extra ...string) map[string]string {
			m := map[string]string{}
			for k, v := range decode {
				m[k] = v
			}
			m[extra[0]] = extra[1]
			return m
		}
		Eventually(func(g Gomega) {
			v, ok := gauge("kvhandoff_pool_engines", with("state", "ready"))
			g.Expect(ok).To(BeTrue())
			g.Expect(v).To(Equal(1.0))
			v, _ = gauge("kvhandoff_pool_condition", with("type", "Paired"))
			g.Expect(v).To(Equal(1.0))
			v, _ = gauge("kvhandoff_pool_engines", with("state", "unschedulable"))
			g.Expect(v).To(Equal(0.0))
		}).Should(Succeed())

		Expect(k8s.Delete(ctx, p)).To(Succeed())
		Eventually(func() bool {
			_, ok := gauge("kvhandoff_pool_engines", map[string]string{"namespace": ns, "pool": "p", "role": "prefill", "state": "desired"})
			return ok
		}).Should(BeFalse())
	})
})

var _ = Describe("Lifecycle", func() {
	It("makes zero API writes when a reconcile has nothing to change", func() {
		ns, _, _, _ := readyPair()
		counter := countingClient()
		for _, role := range []kvv1.Role{kvv1.RolePrefill, kvv1.RoleDecode} {
			r := &PoolReconciler{Client: counter, Recorder: events.NewFakeRecorder(10), Role: role}
			name := map[kvv1.Role]string{kvv1.RolePrefill: "p", kvv1.RoleDecode: "d"}[role]
			// The manager may still be finishing its own last write; wait until a
			// reconcile here has nothing left to do, then prove the next one writes nothing.
			Eventually(func(g Gomega) {
				counter.writes.Store(0)
				_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key(ns, name)})
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(counter.writes.Load()).To(BeZero())
			}).Should(Succeed())
			for range 3 {
				_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key(ns, name)})
				Expect(err).NotTo(HaveOccurred())
			}
			Expect(counter.writes.Load()).To(BeZero(), "reconciling an unchanged %s pool wrote to the API server", role)
		}
	})

	It("applies the same manifests twice server-side without a change", func() {
		ns, pol, p, _ := readyPair()
		before := statefulSet(ns, "p").ResourceVersion
		r := &PoolReconciler{Client: k8s, Recorder: events.NewFakeRecorder(10), Role: kvv1.RolePrefill}
		for range 2 {
			w, err := render.Engines(render.Input{Role: kvv1.RolePrefill, Name: "p", Namespace: ns, Spec: &p.Spec.EngineSpec, Policy: &pol.Spec})
			Expect(err).NotTo(HaveOccurred())
			Expect(r.serverSideApply(ctx, p, w.StatefulSet)).To(Succeed())
		}
		Expect(statefulSet(ns, "p").ResourceVersion).To(Equal(before))
	})

	It("follows /scale on the pool into the StatefulSet", func() {
		ns, _, p, _ := readyPair()
		scale := &autoscalingv1.Scale{}
		Expect(k8s.SubResource("scale").Get(ctx, p, scale)).To(Succeed())
		scale.Spec.Replicas = 3
		Expect(k8s.SubResource("scale").Update(ctx, p, client.WithSubResourceBody(scale))).To(Succeed())
		Eventually(func() int32 { return ptr.Deref(statefulSet(ns, "p").Spec.Replicas, 0) }).Should(BeEquivalentTo(3))
		Eventually(func() string { return condition(p, kvv1.ConditionReady).Reason }).Should(Equal(kvv1.ReasonEnginesNotReady))
	})

	It("says which engines the scheduler cannot place and why, and recovers when they are placed", func() {
		ns, _, _, d := readyPair()
		update(d, func(d *kvv1.DecodePool) { d.Spec.Replicas = ptr.To[int32](2) })
		sts := statefulSet(ns, "d")
		Eventually(func() int32 { return ptr.Deref(statefulSet(ns, "d").Spec.Replicas, 0) }).Should(BeEquivalentTo(2))
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "d-1", Namespace: ns, Labels: sts.Spec.Template.Labels,
				OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(sts, appsv1.SchemeGroupVersion.WithKind("StatefulSet"))}},
			Spec: *sts.Spec.Template.Spec.DeepCopy(),
		}
		Expect(k8s.Create(ctx, pod)).To(Succeed())
		const says = "0/8 nodes are available: 2 Insufficient vpc.amazonaws.com/efa, 6 node(s) didn't match Pod's node affinity/selector."
		pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse,
			Reason: corev1.PodReasonUnschedulable, Message: says}}
		Expect(k8s.Status().Update(ctx, pod)).To(Succeed())
		Eventually(func(g Gomega) {
			c := condition(d, kvv1.ConditionDegraded)
			g.Expect(c.Status).To(Equal(metav1.ConditionTrue))
			g.Expect(c.Reason).To(Equal(kvv1.ReasonEnginesUnschedulable))
			g.Expect(c.Message).To(Equal("1 engine(s) cannot be scheduled (d-1): " + says))
			g.Expect(condition(d, kvv1.ConditionReady).Reason).To(Equal(kvv1.ReasonEnginesUnschedulable))
			v, _ := gauge("kvhandoff_pool_engines", map[string]string{"namespace": ns, "pool": "d", "role": "decode", "state": "unschedulable"})
			g.Expect(v).To(Equal(1.0))
		}).Should(Succeed())

		pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}}
		Expect(k8s.Status().Update(ctx, pod)).To(Succeed())
		Eventually(func() metav1.ConditionStatus { return condition(d, kvv1.ConditionDegraded).Status }).Should(Equal(metav1.ConditionFalse))
	})

	It("rolls both pools when their policy changes", func() {
		ns, pol, _, _ := readyPair()
		hash := func(name string) string {
			return statefulSet(ns, name).Spec.Template.Annotations[kvv1.AnnotationPolicyHash]
		}
		prefillBefore, decodeBefore := hash("p"), hash("d")
		update(pol, func(p *kvv1.KVTransferPolicy) { p.Spec.LeaseSeconds = 45 })
		for name, before := range map[string]string{"p": prefillBefore, "d": decodeBefore} {
			Eventually(func() string { return hash(name) }).ShouldNot(Equal(before))
			Expect(strings.Join(statefulSet(ns, name).Spec.Template.Spec.Containers[0].Args, " ")).To(ContainSubstring(`"kv_lease_duration":45`))
		}
	})

	It("hands a change of handoffFailurePolicy, healthWindowSeconds and routing to the router through the DecodePool's status, rolling no engine", func() {
		ns, pol, _, d := readyPair()
		sts := func(name string) *appsv1.StatefulSet { return statefulSet(ns, name) }
		before := map[string]string{"p": sts("p").ResourceVersion, "d": sts("d").ResourceVersion}
		routing := kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoicePrefixAware, OverlapWeight: 8, LoadWeight: 2, MinPrefillTokens: 256,
			PrefixSource: kvv1.PrefixSourceRoutingHistory}
		update(pol, func(p *kvv1.KVTransferPolicy) {
			p.Spec.HandoffFailurePolicy = kvv1.HandoffFailureServeOnDecode
			p.Spec.HealthWindowSeconds = ptr.To[int32](20)
			p.Spec.Routing = &routing
		})
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
			g.Expect(d.Status.HandoffFailurePolicy).To(Equal(kvv1.HandoffFailureServeOnDecode))
			g.Expect(d.Status.HealthWindowSeconds).To(Equal(int32(20)))
			g.Expect(d.Status.Routing).To(Equal(&routing))
		}).Should(Succeed())
		for name, rv := range before {
			Expect(sts(name).ResourceVersion).To(Equal(rv), "the %s StatefulSet was rewritten for a router-only setting", name)
		}
	})

	It("runs the kv-events sidecar in both pools' engines while routing follows KV events, and takes it out when routing stops", func() {
		ns, pol, p, _ := readyPair()
		sidecar := func(name string) func(g Gomega) []string {
			return func(g Gomega) []string {
				var names []string
				for _, c := range statefulSet(ns, name).Spec.Template.Spec.InitContainers {
					names = append(names, c.Name)
				}
				return names
			}
		}
		// PrefixAware alone: prefixSource defaults to KVEvents.
		update(pol, func(p *kvv1.KVTransferPolicy) {
			p.Spec.Routing = &kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoicePrefixAware}
		})
		for _, name := range []string{"p", "d"} {
			Eventually(sidecar(name)).Should(ContainElement("kv-events"), "pool %s", name)
			tpl := statefulSet(ns, name).Spec.Template
			Expect(tpl.Labels).To(HaveKeyWithValue(kvv1.LabelKVEventsPort, "8102"))
			Expect(strings.Join(tpl.Spec.Containers[0].Args, " ")).To(ContainSubstring(`--kv-events-config {"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:5557"`))
			Expect(tpl.Spec.Volumes).To(ContainElement(HaveField("VolumeSource.Secret.SecretName", "p-kv-events")), "pool %s", name)
			// Only routers and pickers reach the sidecars' port; the engines' others stay open.
			np := &networkingv1.NetworkPolicy{}
			Expect(k8s.Get(ctx, key(ns, name+"-kv-events"), np)).To(Succeed(), "pool %s", name)
			Expect(np.Spec.PodSelector.MatchLabels).To(HaveKeyWithValue(kvv1.LabelPool, name))
			Expect(np.Spec.Ingress).To(HaveLen(2))
			Expect(np.Spec.Ingress[1].From).To(HaveLen(2))
			Expect(np.Spec.Ingress[1].Ports).To(ConsistOf(HaveField("Port.IntVal", BeEquivalentTo(8102))))
		}
		// The token the sidecars ask for: made once, random, immutable, the PrefillPool's;
		// the routers hold it, and nothing else of the pool does.
		secret := &corev1.Secret{}
		Eventually(func() error { return k8s.Get(ctx, key(ns, "p-kv-events"), secret) }).Should(Succeed())
		Expect(secret.Data["token"]).To(MatchRegexp(`^[0-9a-f]{64}$`))
		Expect(*secret.Immutable).To(BeTrue())
		Expect(secret.OwnerReferences).To(ConsistOf(HaveField("UID", p.UID)))
		Eventually(func(g Gomega) {
			dep := &appsv1.Deployment{}
			g.Expect(k8s.Get(ctx, key(ns, "d-router"), dep)).To(Succeed())
			g.Expect(dep.Spec.Template.Spec.Volumes).To(ContainElement(HaveField("VolumeSource.Secret.SecretName", "p-kv-events")))
			g.Expect(dep.Spec.Template.Spec.Containers[0].Args).To(ContainElement("--kv-events-token-file=/var/run/kvhandoff/kv-events/token"))
		}).Should(Succeed())
		token := string(secret.Data["token"])
		update(pol, func(p *kvv1.KVTransferPolicy) { p.Spec.Routing.PrefixSource = kvv1.PrefixSourceRoutingHistory })
		for _, name := range []string{"p", "d"} {
			Eventually(sidecar(name)).ShouldNot(ContainElement("kv-events"), "pool %s", name)
			tpl := statefulSet(ns, name).Spec.Template
			Expect(tpl.Labels).NotTo(HaveKey(kvv1.LabelKVEventsPort))
			Expect(strings.Join(tpl.Spec.Containers[0].Args, " ")).NotTo(ContainSubstring("--kv-events-config"))
			Expect(apierrors.IsNotFound(k8s.Get(ctx, key(ns, name+"-kv-events"), &networkingv1.NetworkPolicy{}))).To(BeTrue(), "pool %s", name)
		}
		Eventually(func(g Gomega) {
			dep := &appsv1.Deployment{}
			g.Expect(k8s.Get(ctx, key(ns, "d-router"), dep)).To(Succeed())
			g.Expect(dep.Spec.Template.Spec.Volumes).To(BeEmpty())
		}).Should(Succeed())
		Expect(k8s.Get(ctx, key(ns, "p-kv-events"), secret)).To(Succeed())
		Expect(string(secret.Data["token"])).To(Equal(token), "the token changed")
	})

	It("makes a deleted kv-events token again, and never uses one the PrefillPool does not control", func() {
		ns, pol, p, _ := readyPair()
		// A token someone else made first: its author would hold every follower's token.
		foreign := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "p-kv-events", Namespace: ns},
			Data: map[string][]byte{"token": []byte(strings.Repeat("ab", 32))}}
		Expect(k8s.Create(ctx, foreign)).To(Succeed())
		update(pol, func(p *kvv1.KVTransferPolicy) {
			p.Spec.Routing = &kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoicePrefixAware}
		})
		Eventually(func() string { return condition(p, kvv1.ConditionReady).Reason }).Should(Equal(kvv1.ReasonNameConflict))
		Expect(condition(p, kvv1.ConditionReady).Message).To(ContainSubstring("Secret p-kv-events already exists and is not this PrefillPool's kv-events token"))

		By("deleting the foreign Secret: the pool makes its own")
		Expect(k8s.Delete(ctx, foreign)).To(Succeed())
		secret := &corev1.Secret{}
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, key(ns, "p-kv-events"), secret)).To(Succeed())
			g.Expect(metav1.IsControlledBy(secret, p)).To(BeTrue())
		}).Should(Succeed())
		Eventually(func() string { return condition(p, kvv1.ConditionReady).Reason }).ShouldNot(Equal(kvv1.ReasonNameConflict))

		By("deleting the pool's own Secret: it is made again, with a new token, without a restart")
		token := string(secret.Data["token"])
		Expect(k8s.Delete(ctx, secret)).To(Succeed())
		Eventually(func(g Gomega) {
			again := &corev1.Secret{}
			g.Expect(k8s.Get(ctx, key(ns, "p-kv-events"), again)).To(Succeed())
			g.Expect(metav1.IsControlledBy(again, p)).To(BeTrue())
			g.Expect(string(again.Data["token"])).NotTo(Equal(token))
		}).Should(Succeed())
	})

	It("undoes a hand edit of a field it owns", func() {
		ns, _, _, _ := readyPair()
		update(statefulSet(ns, "p"), func(s *appsv1.StatefulSet) { s.Spec.Replicas = ptr.To[int32](5) })
		Eventually(func() int32 { return ptr.Deref(statefulSet(ns, "p").Spec.Replicas, 0) }).Should(BeEquivalentTo(1))
	})

	It("lets a drain evict one engine of a pool at a time, and restores a deleted budget", func() {
		ns, _, _, _ := readyPair()
		pdb := &policyv1.PodDisruptionBudget{}
		Expect(k8s.Get(ctx, key(ns, "p"), pdb)).To(Succeed())
		Expect(pdb.Spec.MaxUnavailable).To(Equal(ptr.To(intstr.FromInt32(1))))
		Expect(pdb.Spec.Selector.MatchLabels).To(Equal(render.SelectorLabels(kvv1.RolePrefill, "p")))
		Expect(k8s.Delete(ctx, pdb)).To(Succeed())
		Eventually(func(g Gomega) {
			again := &policyv1.PodDisruptionBudget{}
			g.Expect(k8s.Get(ctx, key(ns, "p"), again)).To(Succeed())
			g.Expect(again.UID).NotTo(Equal(pdb.UID))
		}).Should(Succeed())
	})

	It("makes its objects owned by the pool, so deleting the pool deletes them", func() {
		ns, _, p, _ := readyPair()
		for _, obj := range []client.Object{&appsv1.StatefulSet{}, &corev1.Service{}, &policyv1.PodDisruptionBudget{}} {
			Expect(k8s.Get(ctx, key(ns, "p"), obj)).To(Succeed())
			ref := metav1.GetControllerOf(obj)
			Expect(ref).NotTo(BeNil())
			Expect(ref.UID).To(Equal(p.UID))
			Expect(ref.BlockOwnerDeletion).To(Equal(ptr.To(true)))
		}
	})

	It("reports a StatefulSet of the pool's name that it does not own, and leaves it alone", func() {
		ns := freshNamespace()
		foreign := &appsv1.StatefulSet{
			ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: ns},
			Spec: appsv1.StatefulSetSpec{
				Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "other"}},
				Template: corev1.PodTemplateSpec{
					ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "other"}},
					Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "busybox"}}},
				},
			},
		}
		Expect(k8s.Create(ctx, foreign)).To(Succeed())
		p := builder.PrefillPool("p").Obj()
		create(ns, builder.Policy("policy").Obj(), p)
		Eventually(func() string { return condition(p, kvv1.ConditionReady).Reason }).Should(Equal(kvv1.ReasonNameConflict))
		Expect(statefulSet(ns, "p").Spec.Template.Spec.Containers[0].Image).To(Equal("busybox"))

		By("deleting the foreign StatefulSet, which clears the conflict")
		Expect(k8s.Delete(ctx, foreign)).To(Succeed())
		Eventually(func(g Gomega) {
			sts := &appsv1.StatefulSet{}
			g.Expect(k8s.Get(ctx, key(ns, "p"), sts)).To(Succeed())
			g.Expect(metav1.IsControlledBy(sts, p)).To(BeTrue())
			g.Expect(condition(p, kvv1.ConditionDegraded).Status).To(Equal(metav1.ConditionFalse))
		}).Should(Succeed())
	})
})
