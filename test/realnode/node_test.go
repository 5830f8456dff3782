package realnode_test

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
	"github.com/kvhandoff/kvhandoff/test/builder"
	"github.com/kvhandoff/kvhandoff/test/envtest"
	"github.com/kvhandoff/kvhandoff/test/realnode"
)

// startNode builds images and brings up a real node for one test; it is stopped (its
// logs printed if the test failed) when the test ends.
func startNode(t testing.TB, images ...string) (*realnode.Node, *kubernetes.Clientset) {
	t.Helper()
	return startNodeWith(t, realnode.Options{}, images...)
}

// startNodeWith is startNode with the node's options.
func startNodeWith(t testing.TB, o realnode.Options, images ...string) (*realnode.Node, *kubernetes.Clientset) {
	t.Helper()
	var n *realnode.Node
	var err error
	if kubeconfig := realnode.External(); kubeconfig != "" {
		// The cluster's nodes hold the images already (realnode.External).
		n, err = realnode.Attach(kubeconfig)
	} else {
		var archives []string
		if archives, err = realnode.BuildImages(filepath.Join(envtest.RepoRoot(), "bin", "images"), append([]string{"pause"}, images...)...); err != nil {
			t.Fatal(err)
		}
		n, err = realnode.StartWith(bg, t.TempDir(), o, archives...)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(n.LogTail(30))
		}
		if err := n.Stop(); err != nil {
			t.Error(err)
		}
	})
	cfg, err := clientcmd.BuildConfigFromFlags("", n.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	return n, kubernetes.NewForConfigOrDie(cfg)
}

func logs(t *testing.T, cs *kubernetes.Clientset, ns, pod string) string {
	t.Helper()
	r, err := cs.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{}).Stream(bg)
	if err != nil {
		t.Fatalf("logs of %s/%s: %v", ns, pod, err)
	}
	defer r.Close()
	b, _ := io.ReadAll(r)
	return string(b)
}

// enginePod is the pod the manager renders for an engine of an executor-Agent pool (its
// mounts, its group, its user, the connector's init container), with the hostile probe
// (test/engineprobe) in the engine container's place, running args.
func enginePod(t *testing.T, name string, args ...string) *corev1.Pod {
	t.Helper()
	return enginePodOf(t, name, builder.Policy("agent").Executor(kvv1.ExecutorAgent).Provider(kvv1.ProviderTCP).Obj(), args...)
}

// enginePodOf is enginePod for an engine of a pool of policy pol.
func enginePodOf(t *testing.T, name string, pol *kvv1.KVTransferPolicy, args ...string) *corev1.Pod {
	t.Helper()
	pool := builder.PrefillPool(name).Image("vllm/vllm-openai:v0.33.0").InstanceType("").Policy("agent").Obj()
	w, err := render.Engines(render.Input{Role: kvv1.RolePrefill, Name: name, Namespace: "default", Spec: &pool.Spec.EngineSpec,
		Policy: &pol.Spec, ConnectorImage: "ghcr.io/kvhandoff/vllm-connector:" + realnode.Tag})
	if err != nil {
		t.Fatal(err)
	}
	tmpl := w.StatefulSet.Spec.Template
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Labels: tmpl.Labels}, Spec: tmpl.Spec}
	pod.Spec.RestartPolicy = corev1.RestartPolicyNever
	e := &pod.Spec.Containers[0]
	e.Image, e.ImagePullPolicy = "ghcr.io/kvhandoff/engineprobe:"+realnode.Tag, corev1.PullNever
	e.Command, e.Args = []string{"/engineprobe"}, append([]string{"--socket", render.AgentSocket}, args...)
	// No GPU here, and no vLLM to probe.
	e.Resources, e.StartupProbe, e.ReadinessProbe, e.LivenessProbe = corev1.ResourceRequirements{}, nil, nil, nil
	return pod
}

// runPod runs a pod to its end and returns its engine container's output.
func runPod(t *testing.T, n *realnode.Node, cs *kubernetes.Clientset, pod *corev1.Pod) string {
	t.Helper()
	if err := n.Client.Create(bg, pod); err != nil {
		t.Fatal(err)
	}
	until(t, "pod "+pod.Name+" to finish", 2*time.Minute, func() bool {
		p := &corev1.Pod{}
		return n.Client.Get(bg, client.ObjectKeyFromObject(pod), p) == nil && (p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed)
	})
	return strings.TrimSpace(logs(t, cs, pod.Namespace, pod.Name))
}

// The chart installs the node components on a real node from the images built here: the
// agent (tcp;ofi_rxm, as no EFA is here) comes up Ready, labels its node and publishes
// its address; the device plugin registers with the kubelet and says it found nothing to
// advertise. Then engine pods rendered as the manager renders them: the connector's init
// container lands the package, and the engine, as uid 1000 in the socket group with the
// socket folder mounted read-only, reaches the agent and registers its own engine_id,
// cannot register another pod's, and cannot replace the socket. This is where the
// security issue's socket group, read-only mount and pod identity run on a real kubelet.
func TestTheChartRunsTheNodeComponentsAndEnginesReachTheAgent(t *testing.T) {
	onThisMachine(t)
	n, cs := startNode(t, "manager", "transfer-agent", "device-plugin", "vllm-connector", "engineprobe")
	if err := n.InstallChart(n.ChartValues()...); err != nil {
		t.Fatal(err)
	}
	for _, ds := range []string{"kvhandoff-transfer-agent", "kvhandoff-device-plugin"} {
		until(t, ds+" to be ready on the real node", 3*time.Minute, func() bool {
			d := &appsv1.DaemonSet{}
			return n.Client.Get(bg, client.ObjectKey{Namespace: "kvhandoff-node", Name: ds}, d) == nil &&
				d.Status.DesiredNumberScheduled == 1 && d.Status.NumberReady == 1
		})
	}
	node := &corev1.Node{}
	until(t, "the agent to label its node and publish its address", time.Minute, func() bool {
		return n.Client.Get(bg, client.ObjectKey{Name: realnode.Name}, node) == nil && node.Labels[kvv1.LabelAgentReady] == "true"
	})
	if got, want := node.Annotations[kvv1.AnnotationAgentAddress], fmt.Sprintf("%s:7470", realnode.NodeIP); got != want {
		t.Errorf("published address %q, want %q", got, want)
	}
	plugins := &corev1.PodList{}
	if err := n.Client.List(bg, plugins, client.InNamespace("kvhandoff-node"), client.MatchingLabels{"app.kubernetes.io/component": "device-plugin"}); err != nil {
		t.Fatal(err)
	}
	if l := logs(t, cs, "kvhandoff-node", plugins.Items[0].Name); !strings.Contains(l, "no EFA, GPU or Neuron device found") {
		t.Errorf("the device plugin's log does not say it found nothing:\n%s", l)
	}

	if got := runPod(t, n, cs, enginePod(t, "engine-a", "register", "$(POD_NAME).$(POD_NAMESPACE)")); got != "OK" {
		t.Errorf("engine-a registering its own engine_id: %q", got)
	}
	if got := runPod(t, n, cs, enginePod(t, "engine-b", "register", "engine-a.default")); !strings.HasPrefix(got, "PermissionDenied") ||
		!strings.Contains(got, "names pod default/engine-a, and the caller") {
		t.Errorf("engine-b registering engine-a's engine_id: %q", got)
	}
	if got := runPod(t, n, cs, enginePod(t, "engine-c", "replace")); !strings.Contains(got, "read-only file system") {
		t.Errorf("engine-c replacing the agent's socket: %q", got)
	}
	if _, err := os.Stat("/var/run/kvhandoff/agent.sock"); err != nil {
		t.Errorf("the agent's socket after the attempt: %v", err)
	}

	// Engines of two GPU pools whose policy lets pairs share a node run outside the
	// host's PID namespace, each as a user of its own: one sees none of the other's
	// processes, however long both run.
	same := builder.Policy("agent").Executor(kvv1.ExecutorAgent).Provider(kvv1.ProviderTCP).SameNode(kvv1.SameNodePrefer).Obj()
	lingering := enginePodOf(t, "engine-d", same, "linger")
	if err := n.Client.Create(bg, lingering); err != nil {
		t.Fatal(err)
	}
	until(t, "engine-d to run", 2*time.Minute, func() bool {
		p := &corev1.Pod{}
		return n.Client.Get(bg, client.ObjectKeyFromObject(lingering), p) == nil && p.Status.Phase == corev1.PodRunning
	})
	looking := enginePodOf(t, "engine-e", same, "processes")
	uidD, uidE := *lingering.Spec.SecurityContext.RunAsUser, *looking.Spec.SecurityContext.RunAsUser
	if lingering.Spec.HostPID || looking.Spec.HostPID || uidD == uidE {
		t.Errorf("same-node GPU engine pods: hostPID %v and %v, uids %d and %d; want no hostPID and two uids",
			lingering.Spec.HostPID, looking.Spec.HostPID, uidD, uidE)
	}
	if got, want := runPod(t, n, cs, looking), fmt.Sprintf("uid %d pids [1]", uidE); got != want {
		t.Errorf("engine-e, beside engine-d (uid %d), sees %q; want %q: its own process alone", uidD, got, want)
	}
	if err := n.Client.Delete(bg, lingering); err != nil {
		t.Error(err)
	}
}

// onThisMachine fails, on an existing cluster (realnode.External), a test that checks
// this machine's node itself (its name, addresses, host folders and the images built
// here), saying which tests to run there instead: nothing passes without having run.
func onThisMachine(t *testing.T) {
	t.Helper()
	if realnode.External() != "" {
		t.Fatal("this test checks the node this machine runs, and $KVHANDOFF_TEST_KUBECONFIG names an existing cluster; " +
			"run the pair tests there: -run 'TestAChatRequest|TestPodsDeleted|TestRealVLLM'")
	}
}
