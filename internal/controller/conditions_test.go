package controller

import (
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

// expectNotReady waits until obj's Ready condition is False with reason and Degraded is
// True, and checks that no engines were rendered for it.
func expectNotReady(obj client.Object, reason, message string) {
	Eventually(func(g Gomega) {
		ready := condition(obj, kvv1.ConditionReady)
		g.Expect(ready.Status).To(Equal(metav1.ConditionFalse))
		g.Expect(ready.Reason).To(Equal(reason))
		g.Expect(ready.Message).To(ContainSubstring(message))
		g.Expect(ready.ObservedGeneration).To(Equal(obj.GetGeneration()))
		g.Expect(condition(obj, kvv1.ConditionDegraded).Status).To(Equal(metav1.ConditionTrue))
	}).Should(Succeed())
	err := k8s.Get(ctx, client.ObjectKeyFromObject(obj), &appsv1.StatefulSet{})
	Expect(apierrors.IsNotFound(err)).To(BeTrue(), "an invalid pool got engines rendered")
}

// expectRecovered waits until obj is valid again: Degraded False and a StatefulSet exists.
func expectRecovered(obj client.Object) {
	Eventually(func(g Gomega) {
		g.Expect(condition(obj, kvv1.ConditionDegraded).Status).To(Equal(metav1.ConditionFalse))
		g.Expect(condition(obj, kvv1.ConditionReady).Reason).To(Equal(kvv1.ReasonEnginesNotReady))
		g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(obj), &appsv1.StatefulSet{})).To(Succeed())
	}).Should(Succeed())
}

// expectEvent waits for a Warning event with reason about obj.
func expectEvent(obj client.Object, reason string) {
	Eventually(func(g Gomega) {
		list := &eventsv1.EventList{}
		g.Expect(k8s.List(ctx, list, client.InNamespace(obj.GetNamespace()))).To(Succeed())
		g.Expect(list.Items).To(ContainElement(And(
			HaveField("Reason", reason), HaveField("Regarding.Name", obj.GetName()), HaveField("Type", "Warning"))))
	}).Should(Succeed())
}

// update re-reads obj, applies change and writes it back.
func update[T client.Object](obj T, change func(T)) {
	Eventually(func() error {
		if err := k8s.Get(ctx, client.ObjectKeyFromObject(obj), obj); err != nil {
			return err
		}
		change(obj)
		return k8s.Update(ctx, obj)
	}).Should(Succeed())
}

var _ = Describe("Conditions for what CEL cannot check", func() {
	It("reports PolicyNotFound and recovers when the policy appears", func() {
		ns := freshNamespace()
		p := builder.PrefillPool("p").Policy("missing").Obj()
		create(ns, p)
		expectNotReady(p, kvv1.ReasonPolicyNotFound, "KVTransferPolicy missing does not exist")
		expectEvent(p, kvv1.ReasonPolicyNotFound)
		create(ns, builder.Policy("missing").Obj())
		expectRecovered(p)
	})

	It("reports PrefillPoolNotFound and recovers when the prefill pool appears", func() {
		ns := freshNamespace()
		d := builder.DecodePool("d", "p").Obj()
		create(ns, builder.Policy("policy").Obj(), d)
		expectNotReady(d, kvv1.ReasonPrefillPoolNotFound, "PrefillPool p does not exist")
		create(ns, builder.PrefillPool("p").Obj())
		expectRecovered(d)
	})

	DescribeTable("invalid pairs are reported on the DecodePool and never rendered, and fixing the object clears it",
		func(prefill *builder.PoolBuilder[*kvv1.PrefillPool], decode *builder.PoolBuilder[*kvv1.DecodePool], reason, message string,
			fix func(*kvv1.DecodePool)) {
			ns := freshNamespace()
			d := decode.Obj()
			create(ns, builder.Policy("policy").Obj(), builder.Policy("other").Obj(), prefill.Obj(), d)
			expectNotReady(d, reason, message)
			Expect(condition(d, kvv1.ConditionPaired).Reason).To(Equal(reason))
			expectEvent(d, reason)
			update(d, fix)
			expectRecovered(d)
		},
		Entry("PolicyMismatch", builder.PrefillPool("p"), builder.DecodePool("d", "p").Policy("other"),
			kvv1.ReasonPolicyMismatch, "PrefillPool p uses KVTransferPolicy policy but this pool uses other",
			func(d *kvv1.DecodePool) { d.Spec.TransferPolicyRef.Name = "policy" }),
		Entry("TensorParallelMismatch", builder.PrefillPool("p").TP(8), builder.DecodePool("d", "p").TP(4),
			kvv1.ReasonTensorParallelMismatch, "PrefillPool p has tensorParallelSize 8, more than this pool's 4",
			func(d *kvv1.DecodePool) { d.Spec.TensorParallelSize = 8 }),
		Entry("BlockSizeMismatch", builder.PrefillPool("p").BlockSize(32), builder.DecodePool("d", "p").BlockSize(16),
			kvv1.ReasonBlockSizeMismatch, "PrefillPool p has blockSize 32, more than this pool's 16",
			func(d *kvv1.DecodePool) { d.Spec.BlockSize = 32 }),
		Entry("ModelMismatch", builder.PrefillPool("p"), builder.DecodePool("d", "p").Model("Qwen/Qwen3-8B"),
			kvv1.ReasonModelMismatch, "PrefillPool p serves model Qwen/Qwen3-32B but this pool serves Qwen/Qwen3-8B",
			func(d *kvv1.DecodePool) { d.Spec.Model = builder.Model }),
		Entry("UnsupportedEngineVersion below the CVE fix", builder.PrefillPool("p"), builder.DecodePool("d", "p").Image("vllm/vllm-openai:v0.13.0"),
			kvv1.ReasonUnsupportedEngineVersion, "CVE-2026-22807",
			func(d *kvv1.DecodePool) { d.Spec.Image = builder.Image }),
		Entry("UnsupportedEngineVersion without the push connector", builder.PrefillPool("p"), builder.DecodePool("d", "p").Image("vllm/vllm-openai:v0.25.0"),
			kvv1.ReasonUnsupportedEngineVersion, "has no push connector",
			func(d *kvv1.DecodePool) { d.Spec.Image = builder.Image }),
		Entry("KVCacheDtypeMismatch", builder.PrefillPool("p"), builder.DecodePool("d", "p").EngineArgs("--kv-cache-dtype", "fp8"),
			kvv1.ReasonKVCacheDtypeMismatch, "PrefillPool p stores KV as auto but this pool as fp8",
			func(d *kvv1.DecodePool) { d.Spec.EngineArgs = nil }),
		Entry("InstanceTypeMismatch", builder.PrefillPool("p"), builder.DecodePool("d", "p").InstanceType("trn2.48xlarge"),
			kvv1.ReasonInstanceTypeMismatch, "instanceType trn2.48xlarge carries Neuron accelerators but accelerator.type is NvidiaGPU",
			func(d *kvv1.DecodePool) { d.Spec.InstanceType = "p5en.48xlarge" }),
		Entry("UnknownInstanceType", builder.PrefillPool("p"), builder.DecodePool("d", "p").InstanceType("g6.48xlarge"),
			kvv1.ReasonUnknownInstanceType, `instanceType "g6.48xlarge" is not in kvhandoff's table`,
			func(d *kvv1.DecodePool) { d.Spec.InstanceType = "p5en.48xlarge" }),
	)

	It("accepts a partial template and merges it into the engines", func() {
		ns := freshNamespace()
		create(ns, builder.Policy("policy").Obj(),
			builder.PrefillPool("p").Template(`{"spec":{"nodeSelector":{"topology.kubernetes.io/zone":"us-east-2a"}}}`).Obj())
		Eventually(func() map[string]string { return statefulSet(ns, "p").Spec.Template.Spec.NodeSelector }).Should(Equal(map[string]string{
			"topology.kubernetes.io/zone": "us-east-2a", "node.kubernetes.io/instance-type": "p5en.48xlarge",
		}))
	})

	DescribeTable("reports a template it cannot use as InvalidTemplate, and recovers when it is fixed",
		func(template, message string) {
			ns := freshNamespace()
			p := builder.PrefillPool("p").Template(template).Obj()
			create(ns, builder.Policy("policy").Obj(), p)
			expectNotReady(p, kvv1.ReasonInvalidTemplate, message)
			update(p, func(p *kvv1.PrefillPool) { p.Spec.Template = nil })
			expectRecovered(p)
		},
		Entry("a misspelt field", `{"spec":{"nodeSelecter":{"zone":"a"}}}`, `unknown field "spec.nodeSelecter"`),
		Entry("a sidecar the API server refuses", `{"spec":{"containers":[{"name":"Not_A_DNS_Label","image":"busybox"}]}}`,
			"the API server refused the StatefulSet this pool renders to"),
		Entry("the host's network", `{"spec":{"hostNetwork":true}}`, "spec.template.spec.hostNetwork: not allowed"),
		Entry("a privileged engine", `{"spec":{"containers":[{"name":"engine","securityContext":{"privileged":true}}]}}`,
			"spec.template.spec.containers[0].securityContext: the engine container's securityContext is not the template's"),
	)

	It("runs privileged engines only in a namespace an administrator labelled for them", func() {
		ns := freshNamespace()
		pol := builder.Policy("policy").Obj()
		pol.Spec.Fabric.Privileged = true
		p := builder.PrefillPool("p").Obj()
		create(ns, pol, p)
		expectNotReady(p, kvv1.ReasonPrivilegedNotAllowed, "namespace "+ns+" is not labelled kvhandoff.io/privileged-engines=true")
		update(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, func(n *corev1.Namespace) {
			n.Labels[kvv1.LabelPrivilegedEngines] = "true"
		})
		Eventually(func() *corev1.SecurityContext {
			return statefulSet(ns, "p").Spec.Template.Spec.Containers[0].SecurityContext
		}).Should(HaveField("Privileged", HaveValue(BeTrue())))
	})

	It("reports UnsupportedEngineVersion for executor Agent outside the connector's tested vLLM", func() {
		ns := freshNamespace()
		p := builder.PrefillPool("p").Image("vllm/vllm-openai:v0.35.0").Policy("agent").Obj()
		create(ns, builder.Policy("agent").Executor(kvv1.ExecutorAgent).Obj(), p)
		expectNotReady(p, kvv1.ReasonUnsupportedEngineVersion, "kvhandoff's connector (executor Agent) is tested with vLLM v0.26.0 through v0.34.x only")
	})

	It("reports UnsupportedEngineVersion on a PrefillPool too", func() {
		ns := freshNamespace()
		p := builder.PrefillPool("p").Image("vllm/vllm-openai:v0.12.1").Obj()
		create(ns, builder.Policy("policy").Obj(), p)
		expectNotReady(p, kvv1.ReasonUnsupportedEngineVersion, "vLLM v0.12.1")
	})

	It("renders an image whose tag is no version, with a warning event", func() {
		ns := freshNamespace()
		p := builder.PrefillPool("p").Image("vllm/vllm-openai:latest").Obj()
		create(ns, builder.Policy("policy").Obj(), p)
		statefulSet(ns, "p")
		expectEvent(p, "EngineVersionUnknown")
	})

	// The first reconcile of this generation finds no policy, so it cannot check the
	// image; the warning must still be sent once the policy exists.
	It("sends the warning of a pool created before its policy", func() {
		ns := freshNamespace()
		p := builder.PrefillPool("p").Image("vllm/vllm-openai:latest").Obj()
		create(ns, p)
		expectNotReady(p, kvv1.ReasonPolicyNotFound, "does not exist")
		create(ns, builder.Policy("policy").Obj())
		statefulSet(ns, "p")
		expectEvent(p, "EngineVersionUnknown")
		Eventually(func(g Gomega) {
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(p), p)).To(Succeed())
			g.Expect(p.Status.Warnings).To(ConsistOf(HaveField("Reason", "EngineVersionUnknown")))
		}).Should(Succeed())
	})

	It("leaves running engines untouched when a valid pool becomes invalid", func() {
		ns := freshNamespace()
		p := builder.PrefillPool("p").Obj()
		create(ns, builder.Policy("policy").Obj(), p)
		before := statefulSet(ns, "p")
		update(p, func(p *kvv1.PrefillPool) { p.Spec.Image = "vllm/vllm-openai:v0.10.0" })
		Eventually(func() string { return condition(p, kvv1.ConditionReady).Reason }).Should(Equal(kvv1.ReasonUnsupportedEngineVersion))
		after := statefulSet(ns, "p")
		Expect(after.Spec.Template.Spec.Containers[0].Image).To(Equal(builder.Image))
		Expect(after.Generation).To(Equal(before.Generation))
	})
})
