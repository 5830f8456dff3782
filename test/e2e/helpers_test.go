package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// namespace creates a namespace for one spec. When the spec fails, the namespace is
// dumped (objects, events, manager and cluster logs); in any case it is deleted and the
// spec waits until its pods are gone, so the next spec finds the nodes free.
func namespace() string {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "e2e-"}}
	Expect(k8s.Create(ctx, ns)).To(Succeed())
	DeferCleanup(func() {
		if CurrentSpecReport().Failed() {
			dump(ns.Name)
		}
		Expect(k8s.Delete(ctx, ns)).To(Succeed())
		Eventually(func() []corev1.Pod { return pods(ns.Name, nil) }).Should(BeEmpty())
	})
	return ns.Name
}

func dump(ns string) {
	w := GinkgoWriter
	fmt.Fprintf(w, "\n===== namespace %s =====\n", ns)
	for _, args := range [][]string{
		{"get", "kvtp,pfp,dcp,statefulsets,services,pods", "-o", "wide"},
		{"get", "pfp,dcp", "-o", "yaml"},
		{"get", "events", "--sort-by=.lastTimestamp"},
	} {
		out, _ := kubectlIn(ns, args...)
		fmt.Fprintf(w, "$ kubectl %s\n%s\n", strings.Join(args, " "), out)
	}
	if managerLog != "" {
		data, _ := os.ReadFile(managerLog)
		lines := strings.Split(string(data), "\n")
		fmt.Fprintf(w, "===== manager log (last 60 lines) =====\n%s\n", strings.Join(lines[max(0, len(lines)-60):], "\n"))
	}
	if sim != nil {
		fmt.Fprintf(w, "===== cluster logs =====\n%s\n", sim.LogTail(15))
	}
}

// kubectlCmd is a kubectl command against the cluster in namespace ns.
func kubectlCmd(ns string, args ...string) *exec.Cmd {
	return exec.Command(kubectl, append([]string{"--kubeconfig", kubeconfig, "-n", ns}, args...)...)
}

// kubectlIn runs kubectl against the cluster in namespace ns.
func kubectlIn(ns string, args ...string) (string, error) {
	out, err := kubectlCmd(ns, args...).CombinedOutput()
	return string(out), err
}

// mustKubectl runs kubectl and fails the spec when it fails.
func mustKubectl(ns string, args ...string) string {
	out, err := kubectlIn(ns, args...)
	Expect(err).NotTo(HaveOccurred(), "kubectl %s: %s", strings.Join(args, " "), out)
	return out
}

// uncordon makes node schedulable again and waits until the node controller has taken
// its unschedulable taint off too: a pod the scheduler rejects for that taint is not
// always tried again once it goes (a pending engine of the next spec sat there 2 min).
func uncordon(ns, node string) {
	mustKubectl(ns, "uncordon", node)
	Eventually(func(g Gomega) {
		n := &corev1.Node{}
		g.Expect(k8s.Get(ctx, client.ObjectKey{Name: node}, n)).To(Succeed())
		g.Expect(n.Spec.Taints).NotTo(ContainElement(HaveField("Key", corev1.TaintNodeUnschedulable)))
	}).Should(Succeed())
}

// applySample applies a file of config/samples into ns, server-side, as a GitOps tool would.
func applySample(ns, file string) string {
	return mustKubectl(ns, "apply", "--server-side", "-f", filepath.Join(envtest.RepoRoot(), "config", "samples", file))
}

// pods lists the pods in ns that match labels (all of them when labels is nil).
func pods(ns string, labels map[string]string) []corev1.Pod {
	list := &corev1.PodList{}
	Expect(k8s.List(ctx, list, client.InNamespace(ns), client.MatchingLabels(labels))).To(Succeed())
	return list.Items
}

func poolPods(ns, pool string, role kvv1.Role) []corev1.Pod {
	return pods(ns, map[string]string{kvv1.LabelPool: pool, kvv1.LabelRole: string(role)})
}

// running waits until exactly n pods of the pool run, and returns them.
func running(ns, pool string, role kvv1.Role, n int) []corev1.Pod {
	var out []corev1.Pod
	Eventually(func(g Gomega) {
		out = nil
		var others []string
		for _, p := range poolPods(ns, pool, role) {
			if p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
				out = append(out, p)
				continue
			}
			why := string(p.Status.Phase)
			for _, c := range p.Status.Conditions {
				if c.Status != corev1.ConditionTrue && c.Message != "" {
					why += "; " + string(c.Type) + ": " + c.Message
				}
			}
			others = append(others, p.Name+" ("+why+")")
		}
		g.Expect(out).To(HaveLen(n), "pods not running: %v", others)
	}).Should(Succeed())
	return out
}

func node(name string) *corev1.Node {
	n := &corev1.Node{}
	Expect(k8s.Get(ctx, client.ObjectKey{Name: name}, n)).To(Succeed())
	return n
}

// poolStatus reads a pool's status.
func poolStatus(ns, name string, role kvv1.Role) kvv1.PoolStatus {
	if role == kvv1.RolePrefill {
		p := &kvv1.PrefillPool{}
		Expect(k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, p)).To(Succeed())
		return p.Status
	}
	d := &kvv1.DecodePool{}
	Expect(k8s.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, d)).To(Succeed())
	return d.Status
}

func conditionOf(st kvv1.PoolStatus, t string) metav1.Condition {
	for _, c := range st.Conditions {
		if c.Type == t {
			return c
		}
	}
	return metav1.Condition{}
}

// largestZone returns the zone with the most nodes of an instance type, and those nodes,
// sorted. Specs that need spare nodes beside an engine use it, so they run on any
// cluster with such nodes, not only the simulated one.
func largestZone(instanceType string) (string, []string) {
	byZone := map[string][]string{}
	for _, n := range devicePluginNodes(instanceType) {
		z := n.Labels["topology.kubernetes.io/zone"]
		byZone[z] = append(byZone[z], n.Name)
	}
	best := ""
	for z, nodes := range byZone {
		if len(nodes) > len(byZone[best]) || (len(nodes) == len(byZone[best]) && z < best) {
			best = z
		}
	}
	Expect(len(byZone[best])).To(BeNumerically(">=", 2), "this spec needs at least two %s nodes in one zone", instanceType)
	slices.Sort(byZone[best])
	return best, byZone[best]
}

// allNodes lists the names of the nodes of an instance type.
func allNodes(instanceType string) []string {
	var names []string
	for _, n := range devicePluginNodes(instanceType) {
		names = append(names, n.Name)
	}
	return names
}

// devicePluginNodes are the nodes of an instance type whose accelerators device plugins
// advertise (allocatable nvidia.com/gpu or aws.amazon.com/neuron), what the specs of
// engines on extended resources place on; DRA nodes hand theirs out by claim.
func devicePluginNodes(instanceType string) []corev1.Node {
	list := &corev1.NodeList{}
	Expect(k8s.List(ctx, list, client.MatchingLabels{"node.kubernetes.io/instance-type": instanceType})).To(Succeed())
	var out []corev1.Node
	for _, n := range list.Items {
		for _, r := range []corev1.ResourceName{"nvidia.com/gpu", "aws.amazon.com/neuron"} {
			if q, ok := n.Status.Allocatable[r]; ok && !q.IsZero() {
				out = append(out, n)
				break
			}
		}
	}
	return out
}
