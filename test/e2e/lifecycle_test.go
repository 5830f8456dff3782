package e2e

import (
	"fmt"
	"strings"
	"sync"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// inLargestZone pins the sample's pools to the zone with the most p5en nodes, so that
// specs that need spare nodes next to the engines have them, and returns how many there
// are. It uses the pools' templates, the way a user pins what the API does not cover. Both
// pools are pinned: a decode engine scheduled before the pin follows the prefill engine's
// first zone, and rolls into the pinned one.
func inLargestZone(ns string) int {
	zone, nodes := largestZone("p5en.48xlarge")
	pin := `{"spec":{"template":{"spec":{"nodeSelector":{"topology.kubernetes.io/zone":"` + zone + `"}}}}}`
	mustKubectl(ns, "patch", "pfp", "qwen3-32b-prefill", "--type=merge", "-p", pin)
	mustKubectl(ns, "patch", "dcp", "qwen3-32b-decode", "--type=merge", "-p", pin)
	Eventually(func(g Gomega) {
		for _, role := range []kvv1.Role{kvv1.RolePrefill, kvv1.RoleDecode} {
			pods := poolPods(ns, "qwen3-32b-"+string(role), role)
			g.Expect(pods).To(HaveLen(1))
			g.Expect(pods[0].Spec.NodeSelector).To(HaveKeyWithValue("topology.kubernetes.io/zone", zone))
			g.Expect(pods[0].Status.Phase).To(Equal(corev1.PodRunning))
		}
	}).Should(Succeed())
	return len(nodes)
}

var _ = Describe("Lifecycle", Label("p5en"), func() {
	It("scales through /scale with kubectl scale, reports engines that do not fit, and recovers when scaled back", func() {
		ns := namespace()
		applySample(ns, "p5en-push.yaml")
		n := inLargestZone(ns)
		running(ns, "qwen3-32b-prefill", kvv1.RolePrefill, 1)

		By(fmt.Sprintf("scaling decode to %d: the zone has %d p5en nodes, one of them taken by prefill", n-1, n))
		mustKubectl(ns, "scale", "dcp", "qwen3-32b-decode", fmt.Sprintf("--replicas=%d", n-1))
		running(ns, "qwen3-32b-decode", kvv1.RoleDecode, n-1)

		By(fmt.Sprintf("scaling decode to %d: one engine cannot fit", n))
		mustKubectl(ns, "scale", "dcp", "qwen3-32b-decode", fmt.Sprintf("--replicas=%d", n))
		Eventually(func(g Gomega) {
			c := conditionOf(poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode), kvv1.ConditionDegraded)
			g.Expect(c.Reason).To(Equal(kvv1.ReasonEnginesUnschedulable))
			g.Expect(c.Message).To(ContainSubstring("Insufficient vpc.amazonaws.com/efa"))
			g.Expect(c.Message).To(ContainSubstring(fmt.Sprintf("qwen3-32b-decode-%d", n-1)))
		}).Should(Succeed())
		Expect(conditionOf(poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode), kvv1.ConditionReady).Status).To(Equal(metav1.ConditionFalse))

		By("scaling back to 1")
		mustKubectl(ns, "scale", "dcp", "qwen3-32b-decode", "--replicas=1")
		Eventually(func(g Gomega) {
			st := poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode)
			g.Expect(conditionOf(st, kvv1.ConditionDegraded).Status).To(Equal(metav1.ConditionFalse))
			g.Expect(conditionOf(st, kvv1.ConditionReady).Status).To(Equal(metav1.ConditionTrue))
			g.Expect(st.Engines).To(HaveLen(1))
		}).Should(Succeed())
	})

	It("reschedules engines off a drained node and updates their identity", func() {
		ns := namespace()
		applySample(ns, "p5en-push.yaml")
		inLargestZone(ns)
		running(ns, "qwen3-32b-prefill", kvv1.RolePrefill, 1)
		before := running(ns, "qwen3-32b-decode", kvv1.RoleDecode, 1)[0]

		By("cordoning and draining " + before.Spec.NodeName)
		mustKubectl(ns, "cordon", before.Spec.NodeName)
		DeferCleanup(func() { uncordon(ns, before.Spec.NodeName) })
		Expect(k8s.SubResource("eviction").Create(ctx, &before, &policyv1.Eviction{
			ObjectMeta: metav1.ObjectMeta{Name: before.Name, Namespace: ns},
		})).To(Succeed())

		Eventually(func(g Gomega) {
			pods := poolPods(ns, "qwen3-32b-decode", kvv1.RoleDecode)
			g.Expect(pods).To(HaveLen(1))
			g.Expect(pods[0].UID).NotTo(Equal(before.UID))
			g.Expect(pods[0].Status.Phase).To(Equal(corev1.PodRunning))
			g.Expect(pods[0].Spec.NodeName).NotTo(Equal(before.Spec.NodeName))
			st := poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode)
			g.Expect(st.Engines).To(ConsistOf(And(
				HaveField("NodeName", pods[0].Spec.NodeName), HaveField("Host", pods[0].Status.PodIP))))
			g.Expect(conditionOf(st, kvv1.ConditionReady).Status).To(Equal(metav1.ConditionTrue))
		}).Should(Succeed())
	})

	It("rolls both pools on a policy change: Paired is False while their compat-hashes differ and True once both rolled", func() {
		ns := namespace()
		applySample(ns, "p5en-push.yaml")
		Eventually(func() metav1.ConditionStatus {
			return conditionOf(poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode), kvv1.ConditionPaired).Status
		}).Should(Equal(metav1.ConditionTrue))
		hashBefore := poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode).CompatHash

		// Simulated engines roll faster than the manager may reconcile on a loaded machine, so
		// the window where the hashes differ is held open: the decode engine is pinned to its
		// node and the node cordoned, so its replacement waits while the prefill pool rolls.
		node := running(ns, "qwen3-32b-decode", kvv1.RoleDecode, 1)[0].Spec.NodeName
		mustKubectl(ns, "patch", "dcp", "qwen3-32b-decode", "--type=merge", "-p",
			`{"spec":{"template":{"spec":{"nodeSelector":{"kubernetes.io/hostname":"`+node+`"}}}}}`)
		Eventually(func(g Gomega) {
			pods := poolPods(ns, "qwen3-32b-decode", kvv1.RoleDecode)
			g.Expect(pods).To(HaveLen(1))
			g.Expect(pods[0].Spec.NodeSelector).To(HaveKeyWithValue("kubernetes.io/hostname", node))
			g.Expect(pods[0].Status.Phase).To(Equal(corev1.PodRunning))
			g.Expect(conditionOf(poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode), kvv1.ConditionPaired).Status).To(Equal(metav1.ConditionTrue))
		}).Should(Succeed())
		mustKubectl(ns, "cordon", node)
		release := sync.OnceFunc(func() { uncordon(ns, node) })
		DeferCleanup(release)

		By("switching the policy from Push to Pull, which changes the connector")
		mustKubectl(ns, "patch", "kvtp", "p5en-push", "--type=merge", "-p", `{"spec":{"mode":"Pull"}}`)
		Eventually(func(g Gomega) {
			prefill := poolStatus(ns, "qwen3-32b-prefill", kvv1.RolePrefill).CompatHash
			g.Expect(prefill).NotTo(BeEmpty())
			g.Expect(prefill).NotTo(Equal(hashBefore))
			c := conditionOf(poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode), kvv1.ConditionPaired)
			g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
			g.Expect(c.Reason).To(Equal(kvv1.ReasonCompatHashMismatch))
		}).Should(Succeed())

		By("letting the decode engine roll")
		// Its pin goes too: while it waited, another pod (this spec's rolled prefill engine,
		// placed before the scheduler saw the cordon, or one a previous spec's namespace still
		// holds) may have taken its node, and the spec is about hashes, not that node.
		mustKubectl(ns, "patch", "dcp", "qwen3-32b-decode", "--type=json", "-p",
			`[{"op":"remove","path":"/spec/template/spec/nodeSelector"}]`)
		release()
		Eventually(func(g Gomega) {
			st := poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode)
			g.Expect(st.CompatHash).NotTo(BeEmpty())
			g.Expect(st.CompatHash).NotTo(Equal(hashBefore))
			g.Expect(st.CompatHash).To(Equal(poolStatus(ns, "qwen3-32b-prefill", kvv1.RolePrefill).CompatHash))
			g.Expect(conditionOf(st, kvv1.ConditionPaired).Status).To(Equal(metav1.ConditionTrue))
		}).Should(Succeed())
		for _, pool := range []string{"qwen3-32b-prefill", "qwen3-32b-decode"} {
			sts := &appsv1.StatefulSet{}
			Expect(k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: pool}, sts)).To(Succeed())
			Expect(strings.Join(sts.Spec.Template.Spec.Containers[0].Args, " ")).To(ContainSubstring(`"kv_connector":"NixlConnector"`))
		}
	})
})

var _ = Describe("GitOps", Label("p5en"), func() {
	It("changes no spec when the samples are applied server-side a second time", func() {
		ns := namespace()
		applySample(ns, "p5en-push.yaml")
		running(ns, "qwen3-32b-decode", kvv1.RoleDecode, 1)
		Eventually(func() metav1.ConditionStatus {
			return conditionOf(poolStatus(ns, "qwen3-32b-decode", kvv1.RoleDecode), kvv1.ConditionPaired).Status
		}).Should(Equal(metav1.ConditionTrue))
		// A spec change bumps metadata.generation; status updates (the StatefulSet
		// controller's, the manager's) do not, and are not what a second apply may cause.
		versions := func() map[string]string {
			out := mustKubectl(ns, "get", "kvtp,pfp,dcp,statefulsets", "-o",
				`jsonpath={range .items[*]}{.kind}/{.metadata.name}={.metadata.generation}{"\n"}{end}`)
			m := map[string]string{}
			for _, line := range strings.Fields(out) {
				k, v, _ := strings.Cut(line, "=")
				m[k] = v
			}
			return m
		}
		before := versions()
		Expect(before).To(HaveLen(5))
		out := applySample(ns, "p5en-push.yaml")
		Expect(out).To(ContainSubstring("serverside-applied"))
		Consistently(versions, "3s").Should(Equal(before))
	})

	It("removes everything a pool owns when the pools are deleted", func() {
		ns := namespace()
		applySample(ns, "p5en-push.yaml")
		running(ns, "qwen3-32b-decode", kvv1.RoleDecode, 1)
		mustKubectl(ns, "delete", "pfp,dcp", "--all", "--wait=false")
		Eventually(func(g Gomega) {
			g.Expect(pods(ns, nil)).To(BeEmpty())
			for _, list := range []client.ObjectList{&appsv1.StatefulSetList{}, &corev1.ServiceList{}} {
				g.Expect(k8s.List(ctx, list, client.InNamespace(ns))).To(Succeed())
				g.Expect(list).To(HaveField("Items", BeEmpty()))
			}
		}).Should(Succeed())
	})
})
