package e2e

import (
	"path/filepath"
	"strings"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/instancetype"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

const zoneLabel = "topology.kubernetes.io/zone"

// pushPolicy is a push KVTransferPolicy named push, to put before pools in a manifest.
const pushPolicy = `
apiVersion: kvhandoff.io/v1alpha1
kind: KVTransferPolicy
metadata: {name: push}
spec: {mode: Push}
---`

var _ = Describe("Placement", func() {
	It("runs the P5en push sample's engines on two nodes of one zone and publishes them", Label("p5en"), func() {
		ns := namespace()
		applySample(ns, "p5en-push.yaml")
		prefill := running(ns, "qwen3-32b-prefill", kvv1.RolePrefill, 1)[0]
		decode := running(ns, "qwen3-32b-decode", kvv1.RoleDecode, 1)[0]

		Expect(decode.Spec.NodeName).NotTo(Equal(prefill.Spec.NodeName), "EFA has no intra-host loopback")
		Expect(node(decode.Spec.NodeName).Labels[zoneLabel]).To(Equal(node(prefill.Spec.NodeName).Labels[zoneLabel]), "EFA does not cross zones")
		for _, p := range []corev1.Pod{prefill, decode} {
			Expect(node(p.Spec.NodeName).Labels).To(HaveKeyWithValue("node.kubernetes.io/instance-type", "p5en.48xlarge"))
		}

		for _, c := range []struct {
			pool string
			role kvv1.Role
			pod  corev1.Pod
		}{{"qwen3-32b-prefill", kvv1.RolePrefill, prefill}, {"qwen3-32b-decode", kvv1.RoleDecode, decode}} {
			Eventually(func(g Gomega) {
				st := poolStatus(ns, c.pool, c.role)
				g.Expect(conditionOf(st, kvv1.ConditionReady).Status).To(Equal(metav1.ConditionTrue))
				g.Expect(st.ReadyReplicas).To(BeEquivalentTo(1))
				g.Expect(st.Engines).To(ConsistOf(kvv1.EngineStatus{
					PodName: c.pod.Name, EngineID: c.pod.Name + "." + ns, Host: c.pod.Status.PodIP, SideChannelPort: 5600,
					TensorParallelSize: 8, PipelineParallelSize: 1, NodeName: c.pod.Spec.NodeName,
					CompatHash: c.pod.Labels[kvv1.LabelCompatHash], Ready: true,
				}))
			}).Should(Succeed())
		}
		Eventually(func() metav1.ConditionStatus {
			return conditionOf(poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode), kvv1.ConditionPaired).Status
		}).Should(Equal(metav1.ConditionTrue))
	})

	It("runs the DecodePool's router off every accelerator node and names its Service", Label("p5en"), func() {
		ns := namespace()
		applySample(ns, "p5en-push.yaml")
		var routers []corev1.Pod
		Eventually(func(g Gomega) {
			routers = nil
			for _, p := range pods(ns, map[string]string{kvv1.LabelRouter: "qwen3-32b-decode"}) {
				if p.Status.Phase == corev1.PodRunning {
					routers = append(routers, p)
				}
			}
			g.Expect(routers).To(HaveLen(2), "two router replicas by default")
		}).Should(Succeed())
		accelerated := map[string]bool{}
		for _, it := range instancetype.Accelerated() {
			accelerated[it] = true
		}
		for _, p := range routers {
			n := node(p.Spec.NodeName)
			Expect(accelerated[n.Labels["node.kubernetes.io/instance-type"]]).To(BeFalse(), "router %s landed on %s (%s)", p.Name,
				n.Name, n.Labels["node.kubernetes.io/instance-type"])
			Expect(n.Labels).NotTo(HaveKey(kvv1.LabelAgentReady))
		}
		Eventually(func() string { return poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode).RouterService }).Should(Equal("qwen3-32b-decode-router"))
		svc := &corev1.Service{}
		Expect(k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: "qwen3-32b-decode-router"}, svc)).To(Succeed())
		Expect(svc.Spec.Ports[0].Port).To(BeEquivalentTo(8000))
	})

	It("keeps a decode engine Pending rather than on its prefill engine's node, even where it would fit", Label("p5en"), func() {
		ns := namespace()
		_, zoneNodes := largestZone("p5en.48xlarge")
		only, spare := zoneNodes[0], zoneNodes[1]
		By("leaving " + only + " the only schedulable p5en node")
		for _, n := range allNodes("p5en.48xlarge") {
			if n != only {
				mustKubectl(ns, "cordon", n)
				DeferCleanup(uncordon, ns, n)
			}
		}
		By("running a TP 4 pair: 4 GPUs and 8 EFA each, so both would fit on one node")
		applyYAML(ns, pushPolicy+`
apiVersion: kvhandoff.io/v1alpha1
kind: PrefillPool
metadata: {name: p}
spec: {model: Qwen/Qwen3-32B, image: "vllm/vllm-openai:v0.29.0", tensorParallelSize: 4, accelerator: {type: NvidiaGPU},
	instanceType: p5en.48xlarge, transferPolicyRef: {name: push}}
---
apiVersion: kvhandoff.io/v1alpha1
kind: DecodePool
metadata: {name: d}
spec: {model: Qwen/Qwen3-32B, image: "vllm/vllm-openai:v0.29.0", tensorParallelSize: 4, accelerator: {type: NvidiaGPU},
	instanceType: p5en.48xlarge, transferPolicyRef: {name: push}, prefillPoolRef: {name: p}}
`)
		Expect(running(ns, "p", kvv1.RolePrefill, 1)[0].Spec.NodeName).To(Equal(only))
		Eventually(func(g Gomega) {
			c := conditionOf(poolStatus(ns, "d", kvv1.RoleDecode), kvv1.ConditionDegraded)
			g.Expect(c.Reason).To(Equal(kvv1.ReasonEnginesUnschedulable))
			g.Expect(c.Message).To(ContainSubstring("didn't match pod anti-affinity rules"))
		}).Should(Succeed())
		Expect(poolPods(ns, "d", kvv1.RoleDecode)).To(ConsistOf(HaveField("Spec.NodeName", "")))

		By("uncordoning " + spare + ", in the same zone")
		uncordon(ns, spare)
		Expect(running(ns, "d", kvv1.RoleDecode, 1)[0].Spec.NodeName).To(Equal(spare))
	})

	It("runs the trn2 pull sample's engines on the Trainium nodes", Label("trn2"), func() {
		ns := namespace()
		applySample(ns, "trn2-pull.yaml")
		for _, p := range append(running(ns, "llama-70b-prefill", kvv1.RolePrefill, 1), running(ns, "llama-70b-decode", kvv1.RoleDecode, 1)...) {
			Expect(node(p.Spec.NodeName).Labels).To(HaveKeyWithValue("node.kubernetes.io/instance-type", "trn2.48xlarge"))
		}
		prefillNodes := map[string]bool{}
		for _, p := range poolPods(ns, "llama-70b-prefill", kvv1.RolePrefill) {
			prefillNodes[p.Spec.NodeName] = true
		}
		for _, p := range poolPods(ns, "llama-70b-decode", kvv1.RoleDecode) {
			Expect(prefillNodes).NotTo(HaveKey(p.Spec.NodeName))
		}
		Eventually(func() metav1.ConditionStatus {
			return conditionOf(poolStatus(ns, "llama-70b-decode", kvv1.RoleDecode), kvv1.ConditionReady).Status
		}).Should(Equal(metav1.ConditionTrue))
	})

	It("keeps a pool whose instance type no node has Pending, and says so", func() {
		ns := namespace()
		applyYAML(ns, pushPolicy+`
apiVersion: kvhandoff.io/v1alpha1
kind: PrefillPool
metadata: {name: h100}
spec:
  model: Qwen/Qwen3-32B
  image: vllm/vllm-openai:v0.29.0
  tensorParallelSize: 8
  accelerator: {type: NvidiaGPU}
  instanceType: p5.48xlarge
  transferPolicyRef: {name: push}
`)
		Eventually(func(g Gomega) {
			st := poolStatus(ns, "h100", kvv1.RolePrefill)
			c := conditionOf(st, kvv1.ConditionDegraded)
			g.Expect(c.Status).To(Equal(metav1.ConditionTrue))
			g.Expect(c.Reason).To(Equal(kvv1.ReasonEnginesUnschedulable))
			g.Expect(c.Message).To(ContainSubstring("didn't match Pod's node affinity/selector"))
		}).Should(Succeed())
		Expect(poolPods(ns, "h100", kvv1.RolePrefill)).To(ConsistOf(HaveField("Status.Phase", corev1.PodPending)))
	})
})

// applyYAML applies manifests server-side into ns.
func applyYAML(ns, manifests string) {
	cmd := kubectlCmd(ns, "apply", "--server-side", "-f", "-")
	cmd.Stdin = strings.NewReader(manifests)
	out, err := cmd.CombinedOutput()
	Expect(err).NotTo(HaveOccurred(), string(out))
}

var _ = Describe("Node programs", func() {
	// Both node programs come from config/ and must land on exactly the accelerator nodes:
	// a missing toleration or a wrong affinity shows up here, not on a customer's cluster.
	for _, program := range []struct{ dir, component string }{
		{"device-plugin", "device-plugin"},
		{"dra", "dra"},
		{"agent", "transfer-agent"},
	} {
		It("runs the "+program.component+" DaemonSet from config/"+program.dir+" on exactly the accelerator nodes", func() {
			dir := filepath.Join(envtest.RepoRoot(), "config", program.dir)
			selector := map[string]string{"app.kubernetes.io/component": program.component}
			// The node components' namespace (kvhandoff-node, Pod Security privileged) comes
			// with them; the cleanup removes the DaemonSet and leaves the namespace for the
			// next spec.
			mustKubectl("kvhandoff-node", "apply", "--server-side", "-k", dir)
			DeferCleanup(func() {
				mustKubectl("kvhandoff-node", "delete", "daemonset", "-l", "app.kubernetes.io/component="+program.component, "--wait=false")
				Eventually(func() []corev1.Pod { return pods("kvhandoff-node", selector) }).Should(BeEmpty())
			})

			accelerators := map[string]bool{}
			list := &corev1.NodeList{}
			Expect(k8s.List(ctx, list)).To(Succeed())
			for _, n := range list.Items {
				switch n.Labels["node.kubernetes.io/instance-type"] {
				case "p5en.48xlarge", "p5e.48xlarge", "p5.48xlarge", "trn2.48xlarge", "trn1.32xlarge":
					accelerators[n.Name] = true
				}
			}
			Expect(len(accelerators)).To(BeNumerically("<", len(list.Items)), "the cluster needs a node without accelerators for this spec to mean anything")
			Eventually(func(g Gomega) {
				on := map[string]bool{}
				for _, p := range pods("kvhandoff-node", selector) {
					g.Expect(p.Status.Phase).To(Equal(corev1.PodRunning))
					on[p.Spec.NodeName] = true
				}
				g.Expect(on).To(Equal(accelerators))
			}).Should(Succeed())
		})
	}
})
