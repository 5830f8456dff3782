package controller

import (
	"encoding/json"
	"strings"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

func quantity(c corev1.Container, name corev1.ResourceName) string {
	q := c.Resources.Limits[name]
	return q.String()
}

func envValue(c corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value
		}
	}
	return ""
}

var _ = Describe("Rendering through the API server", func() {
	It("wires the P5en push pair: vLLM command, connector JSON, 8 GPUs + 16 EFA, side channel, probes and placement", func() {
		ns := freshNamespace()
		create(ns,
			builder.Policy("p5en-push").Obj(),
			builder.PrefillPool("prefill").Policy("p5en-push").Obj(),
			builder.DecodePool("decode", "prefill").Policy("p5en-push").Obj())

		for _, role := range []kvv1.Role{kvv1.RolePrefill, kvv1.RoleDecode} {
			name := string(role)
			sts := statefulSet(ns, name)
			Expect(sts.Labels).To(HaveKeyWithValue(kvv1.LabelPool, name))
			Expect(sts.Labels).To(HaveKeyWithValue(kvv1.LabelRole, name))
			Expect(sts.Spec.Template.Labels).To(HaveKey(kvv1.LabelCompatHash))
			Expect(metav1.GetControllerOf(sts)).NotTo(BeNil())
			Expect(metav1.GetControllerOf(sts).Kind).To(Equal(map[kvv1.Role]string{kvv1.RolePrefill: "PrefillPool", kvv1.RoleDecode: "DecodePool"}[role]))

			c := sts.Spec.Template.Spec.Containers[0]
			Expect(c.Command).To(Equal([]string{"vllm", "serve"}))
			Expect(c.Args[0]).To(Equal("Qwen/Qwen3-32B"))
			Expect(strings.Join(c.Args, " ")).To(ContainSubstring("--tensor-parallel-size 8 --pipeline-parallel-size 1 --block-size 16 --port 8000 " +
				"--kv-transfer-config"))
			var cfg map[string]any
			Expect(json.Unmarshal([]byte(strings.NewReplacer("$(POD_NAME)", "x", "$(POD_NAMESPACE)", "y").Replace(c.Args[10])), &cfg)).To(Succeed())
			Expect(cfg).To(HaveKeyWithValue("kv_connector", "NixlPushConnector"))

			Expect(quantity(c, render.ResourceNvidiaGPU)).To(Equal("8"))
			Expect(quantity(c, render.ResourceEFA)).To(Equal("16"))
			Expect(envValue(c, "FI_PROVIDER")).To(Equal("efa"))
			Expect(envValue(c, "VLLM_NIXL_SIDE_CHANNEL_PORT")).To(Equal("5600"))
			Expect(c.Ports).To(ContainElement(HaveField("Name", "nixl")))
			Expect(c.StartupProbe.HTTPGet.Path).To(Equal("/v1/models"))
			Expect(c.LivenessProbe.HTTPGet.Path).To(Equal("/health"))
			Expect(sts.Spec.Template.Spec.NodeSelector).To(HaveKeyWithValue("node.kubernetes.io/instance-type", "p5en.48xlarge"))
			Expect(sts.Spec.Template.Spec.Tolerations).To(ContainElement(HaveField("Key", "nvidia.com/gpu")))

			svc := &corev1.Service{}
			Expect(k8s.Get(ctx, key(ns, name), svc)).To(Succeed())
			Expect(svc.Spec.ClusterIP).To(Equal(corev1.ClusterIPNone))
		}

		By("keeping decode engines off the nodes of their prefill engines, in the same zone")
		anti := statefulSet(ns, "decode").Spec.Template.Spec.Affinity.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution
		Expect(anti).To(HaveLen(1))
		Expect(anti[0].TopologyKey).To(Equal("kubernetes.io/hostname"))
		Expect(anti[0].LabelSelector.MatchLabels).To(Equal(map[string]string{kvv1.LabelPool: "prefill", kvv1.LabelRole: "prefill"}))
	})

	It("wires a trn2 pull pair with Neuron devices and 1 EFA per device", func() {
		ns := freshNamespace()
		create(ns,
			builder.Policy("pull").Mode(kvv1.TransferPull).Obj(),
			builder.PrefillPool("prefill").Policy("pull").TP(16).Accelerator(kvv1.AcceleratorNeuron, 4).InstanceType("trn2.48xlarge").Obj())
		c := statefulSet(ns, "prefill").Spec.Template.Spec.Containers[0]
		Expect(quantity(c, render.ResourceNeuron)).To(Equal("4"))
		Expect(quantity(c, render.ResourceEFA)).To(Equal("4"))
		Expect(c.Resources.Limits).NotTo(HaveKey(render.ResourceNvidiaGPU))
		Expect(strings.Join(c.Args, " ")).To(ContainSubstring(`"kv_connector":"NixlConnector"`))
	})

	It("wires executor Agent engines to the node's transfer agent", func() {
		ns := freshNamespace()
		create(ns,
			builder.Policy("agent").Executor(kvv1.ExecutorAgent).Obj(),
			builder.PrefillPool("prefill").Image("vllm/vllm-openai:v0.33.0").Policy("agent").Obj())
		spec := statefulSet(ns, "prefill").Spec.Template.Spec
		Expect(envValue(spec.Containers[0], "KVHANDOFF_AGENT_SOCKET")).To(Equal("/var/run/kvhandoff/agent.sock"))
		Expect(spec.NodeSelector).To(HaveKeyWithValue(kvv1.LabelAgentReady, "true"))
		Expect(spec.Volumes).To(ContainElement(HaveField("HostPath.Path", "/var/run/kvhandoff")))
		// kvhandoff's connector reaches the stock image through an init container.
		Expect(spec.Containers[0].Args).To(ContainElement(ContainSubstring(`"kv_connector":"KVHandoffConnector","kv_connector_module_path":"kvhandoff_vllm.connector"`)))
		Expect(envValue(spec.Containers[0], "PYTHONPATH")).To(Equal(render.ConnectorDir))
		Expect(spec.InitContainers).To(ConsistOf(HaveField("Image", render.DefaultConnectorImage)))

		// Status names the node's agent as the engine's KV side channel.
		p := &kvv1.PrefillPool{}
		p.Name, p.Namespace = "prefill", ns
		addEnginePod(statefulSet(ns, "prefill"), 0, "node-a", "198.18.0.7")
		Eventually(func(g Gomega) []kvv1.EngineStatus {
			g.Expect(k8s.Get(ctx, client.ObjectKeyFromObject(p), p)).To(Succeed())
			return p.Status.Engines
		}).Should(ConsistOf(HaveField("Agent", "198.19.0.7:7470")))
	})

	It("pairs executor Agent pools of different tensor-parallel sizes, each told the other's size, and refuses two decode sizes on one prefill pool", func() {
		ns := freshNamespace()
		create(ns,
			builder.Policy("agent").Executor(kvv1.ExecutorAgent).Obj(),
			builder.PrefillPool("prefill").Image("vllm/vllm-openai:v0.33.0").TP(1).Policy("agent").Obj(),
			builder.DecodePool("decode", "prefill").Image("vllm/vllm-openai:v0.33.0").TP(4).Policy("agent").Obj())
		extra := func(name string) string {
			var a string
			Eventually(func(g Gomega) {
				args := statefulSet(ns, name).Spec.Template.Spec.Containers[0].Args
				g.Expect(args).To(ContainElement(ContainSubstring("peer_tp_size")))
				a = strings.Join(args, " ")
			}).Should(Succeed())
			return a
		}
		Expect(extra("prefill")).To(ContainSubstring(`"peer_tp_size":4`))
		Expect(extra("decode")).To(ContainSubstring(`"peer_tp_size":1`))
		for _, name := range []string{"prefill", "decode"} {
			Expect(envValue(statefulSet(ns, name).Spec.Template.Spec.Containers[0], "VLLM_KV_CACHE_LAYOUT")).To(Equal("HND"))
		}
		d := &kvv1.DecodePool{}
		Expect(k8s.Get(ctx, key(ns, "decode"), d)).To(Succeed())
		Expect(condition(d, kvv1.ConditionPaired).Reason).NotTo(Equal(kvv1.ReasonTensorParallelMismatch))

		// A second DecodePool of another size: one prefill engine cannot feed both.
		create(ns, builder.DecodePool("decode-tp2", "prefill").Image("vllm/vllm-openai:v0.33.0").TP(2).Policy("agent").Obj())
		p := &kvv1.PrefillPool{}
		p.Name, p.Namespace = "prefill", ns
		Eventually(func(g Gomega) {
			c := condition(p, kvv1.ConditionDegraded)
			g.Expect(c.Reason).To(Equal(kvv1.ReasonTensorParallelMismatch))
			g.Expect(c.Message).To(HavePrefix("DecodePools decode-tp2 (tensorParallelSize 2); decode (tensorParallelSize 4) name this PrefillPool"))
		}).Should(Succeed())
		Expect(extra("prefill")).To(ContainSubstring(`"peer_tp_size":4`), "running engines are left as they were")
		Expect(k8s.Delete(ctx, &kvv1.DecodePool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "decode-tp2"}})).To(Succeed())
		Eventually(func(g Gomega) {
			g.Expect(condition(p, kvv1.ConditionDegraded).Status).To(Equal(metav1.ConditionFalse))
		}).Should(Succeed())
	})

	It("refuses executor Agent pools of different pipeline-parallel sizes, naming both, and pairs them once equal", func() {
		ns := freshNamespace()
		create(ns, builder.Policy("agent").Executor(kvv1.ExecutorAgent).Obj(),
			builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0").PP(2).Policy("agent").Obj())
		d := builder.DecodePool("d", "p").Image("vllm/vllm-openai:v0.33.0").Policy("agent").Obj()
		create(ns, d)
		expectNotReady(d, kvv1.ReasonPipelineParallelMismatch, "PrefillPool p has pipelineParallelSize 2 and this pool 1")
		update(d, func(d *kvv1.DecodePool) { d.Spec.PipelineParallelSize = 2 })
		expectRecovered(d)
	})

	It("places decode beside prefill when the policy prefers it, and keeps it off prefill's nodes again when the policy forbids it", func() {
		ns := freshNamespace()
		policy := builder.Policy("nvlink").Executor(kvv1.ExecutorAgent).SameNode(kvv1.SameNodePrefer).Obj()
		create(ns, policy,
			builder.PrefillPool("prefill").Image("vllm/vllm-openai:v0.33.0").Policy("nvlink").Obj(),
			builder.DecodePool("decode", "prefill").Image("vllm/vllm-openai:v0.33.0").Policy("nvlink").Obj())
		Eventually(func(g Gomega) {
			spec := statefulSet(ns, "decode").Spec.Template.Spec
			g.Expect(spec.HostPID).To(BeFalse()) // GPU memory reaches the agent as file descriptors
			g.Expect(spec.Affinity.PodAntiAffinity).To(BeNil())
			preferred := spec.Affinity.PodAffinity.PreferredDuringSchedulingIgnoredDuringExecution
			g.Expect(preferred).To(HaveLen(1))
			g.Expect(preferred[0].PodAffinityTerm.TopologyKey).To(Equal("kubernetes.io/hostname"))
			g.Expect(preferred[0].PodAffinityTerm.LabelSelector.MatchLabels).To(Equal(map[string]string{kvv1.LabelPool: "prefill", kvv1.LabelRole: "prefill"}))
			g.Expect(statefulSet(ns, "prefill").Spec.Template.Spec.HostPID).To(BeFalse())
		}).Should(Succeed())

		update(policy, func(p *kvv1.KVTransferPolicy) { p.Spec.SameNode = kvv1.SameNodeForbid })
		Eventually(func(g Gomega) {
			spec := statefulSet(ns, "decode").Spec.Template.Spec
			g.Expect(spec.HostPID).To(BeFalse())
			g.Expect(spec.Affinity.PodAffinity.PreferredDuringSchedulingIgnoredDuringExecution).To(BeEmpty())
			g.Expect(spec.Affinity.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution).To(HaveLen(1))
		}).Should(Succeed())
	})

	It("reports same-node pairs on Neuron devices as SameNodeUnsupported and recovers when the policy forbids them", func() {
		ns := freshNamespace()
		policy := builder.Policy("p").Executor(kvv1.ExecutorAgent).SameNode(kvv1.SameNodeAllow).Obj()
		pool := builder.PrefillPool("prefill").Image("vllm/vllm-openai:v0.33.0").Policy("p").TP(16).
			Accelerator(kvv1.AcceleratorNeuron, 4).InstanceType("trn2.48xlarge").Obj()
		create(ns, policy, pool)
		expectNotReady(pool, kvv1.ReasonSameNodeUnsupported, "this pool's accelerators are Neuron")
		expectEvent(pool, kvv1.ReasonSameNodeUnsupported)
		update(policy, func(p *kvv1.KVTransferPolicy) { p.Spec.SameNode = kvv1.SameNodeForbid })
		expectRecovered(pool)
	})
})
