package realnode

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// External is the kubeconfig of an existing cluster (kind, EKS) the tier runs on instead
// of a node of its own: $KVHANDOFF_TEST_KUBECONFIG, or "". It is a variable of its own,
// not $KUBECONFIG, because the suite removes kvhandoff from the cluster it runs on: a
// make test must never do that to whatever cluster a shell happens to point at.
//
// There the images must already be on the nodes, tagged Registry/<name>:Tag (make images,
// then `kind load image-archive`), and the suite owns the release "kvhandoff" in
// kvhandoff-system and the pools, policies and test pods of namespace default: it removes
// them before and after each test. Tests that check this machine's node itself fail there,
// naming the tests to run instead.
func External() string { return os.Getenv("KVHANDOFF_TEST_KUBECONFIG") }

// Attach returns a Node for the cluster of kubeconfig, cleared of what an earlier run of
// the suite left.
func Attach(kubeconfig string) (*Node, error) {
	n := &Node{Kubeconfig: kubeconfig, external: true}
	var err error
	if n.bins, err = envtest.Binaries("kubectl"); err != nil {
		return nil, err
	}
	if err := n.connect(); err != nil {
		return nil, err
	}
	return n, n.reset()
}

// IsExternal says whether n is an existing cluster (Attach) rather than this machine's
// node (Start).
func (n *Node) IsExternal() bool { return n.external }

// LabelTestPod marks the pods a test creates itself, which reset removes.
const LabelTestPod = "kvhandoff.io/realnode-test"

// reset removes what the suite installs on an existing cluster, and waits until the pods
// of it are gone, so that each test starts as on a node of its own.
func (n *Node) reset() error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := helm(ctx, "uninstall", "kvhandoff", "--namespace", "kvhandoff-system", "--kubeconfig", n.Kubeconfig, "--ignore-not-found", "--wait"); err != nil {
		return err
	}
	var errs []error
	for _, o := range []client.Object{&kvv1.DecodePool{}, &kvv1.PrefillPool{}, &kvv1.KVTransferPolicy{}} {
		errs = append(errs, n.Client.DeleteAllOf(ctx, o, client.InNamespace("default")))
	}
	errs = append(errs, n.Client.DeleteAllOf(ctx, &corev1.Pod{}, client.InNamespace("default"), client.HasLabels{LabelTestPod}))
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		pods := &corev1.PodList{}
		if err := n.Client.List(ctx, pods, client.InNamespace("default")); err != nil {
			return false, nil
		}
		for _, p := range pods.Items {
			if _, ok := p.Labels[LabelTestPod]; ok || p.Labels[kvv1.LabelPool] != "" || p.Labels[kvv1.LabelRouter] != "" {
				return false, nil
			}
		}
		return true, nil
	})
}

// ChartValues are the chart values the node needs (helm --set-json): tcp between agents
// (no EFA here; on an existing cluster too, as the suite's CPU engines use it), the
// agents' peer token made by the chart, and the node components on this node, which
// carries no instance type, or on every Linux node of an existing cluster.
func (n *Node) ChartValues() []string {
	on := onThisNode
	if n.external {
		on = onLinux
	}
	return []string{`agent.provider="tcp;ofi_rxm"`, `agent.token.create=true`, "agent.nodeAffinity=" + on, "devicePlugin.nodeAffinity=" + on}
}

const (
	onThisNode = `{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":` +
		`[{"key":"kubernetes.io/hostname","operator":"In","values":["` + Name + `"]}]}]}}`
	onLinux = `{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":` +
		`[{"key":"kubernetes.io/os","operator":"In","values":["linux"]}]}]}}`
)

// PodURL is the URL of path on a pod's port through the API server's proxy, which
// reaches pods from wherever the API server is reachable (Client sends with the
// admin's credentials).
func (n *Node) PodURL(namespace, pod string, port int, path string) string {
	return fmt.Sprintf("%s/api/v1/namespaces/%s/pods/%s:%d/proxy%s", strings.TrimSuffix(n.api.Host, "/"), namespace, pod, port, path)
}

// HTTPClient is an HTTP client for url with timeout: with the admin's credentials for
// the API server's URLs (PodURL, and RouterURL on an existing cluster), without them for
// any other (a Service address), so that no credential reaches a pod.
func (n *Node) HTTPClient(url string, timeout time.Duration) *http.Client {
	if strings.HasPrefix(url, strings.TrimSuffix(n.api.Host, "/")+"/") {
		return &http.Client{Transport: n.http, Timeout: timeout}
	}
	return &http.Client{Timeout: timeout}
}
