package realnode

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
	"github.com/kvhandoff/kvhandoff/test/envtest"
)

// What the tier and the demo run on the node: kvhandoff's chart, then a CPU pair of
// pools per transfer mode, named <mode>-prefill and <mode>-decode, in namespace default.

// PlainMetrics serves the agent's metrics over plain HTTP, for AgentMetric.
const PlainMetrics = `agent.metricsSecure=false`

// InstallChart installs charts/kvhandoff as release kvhandoff in kvhandoff-system, with
// the images built here (Tag, never pulled) and values (helm --set-json).
func (n *Node) InstallChart(values ...string) error {
	args := []string{"install", "kvhandoff", filepath.Join(envtest.RepoRoot(), "charts", "kvhandoff"), "--namespace", "kvhandoff-system", "--create-namespace",
		"--kubeconfig", n.Kubeconfig, "--set", "image.tag=" + Tag, "--set", "image.pullPolicy=Never"}
	for _, v := range values {
		args = append(args, "--set-json", v)
	}
	return helm(context.Background(), args...)
}

// helmPath builds helm once (hack/helm.sh) and returns its path.
func helmPath() (string, error) {
	cmd := exec.Command(filepath.Join(envtest.RepoRoot(), "hack", "helm.sh"))
	cmd.Stderr = os.Stderr
	bin, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("hack/helm.sh: %w", err)
	}
	return strings.TrimSpace(string(bin)), nil
}

// helm runs helm with args.
func helm(ctx context.Context, args ...string) error {
	bin, err := helmPath()
	if err != nil {
		return err
	}
	if out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("helm %s: %w\n%s", args[0], err, out)
	}
	return nil
}

// Engines is what a pair's pools run, as a user's pools would say it: an image built
// here, its model, and what the pools add to the rendered engine.
type Engines struct {
	Image, Model string
	BlockSize    int32
	Args         []string
	Env          map[kvv1.Role][]corev1.EnvVar
}

// SimEngines are the simulated engine (test/simvllm): `vllm serve` that answers chat
// requests and moves real KV bytes through the agent.
var SimEngines = Engines{Image: "simvllm", Model: "sim", BlockSize: 16}

// CreatePair creates a mode's policy and CPU pair of pools running e, the decode pool
// with one router.
func (n *Node) CreatePair(ctx context.Context, e Engines, mode kvv1.TransferMode, tune ...func(*kvv1.DecodePool)) error {
	pol, prefill, decode := PairObjects(e, mode)
	for _, f := range tune {
		f(decode)
	}
	return n.Create(ctx, pol, prefill, decode)
}

// PairObjects are what CreatePair creates, for a test to shape further.
func PairObjects(e Engines, mode kvv1.TransferMode) (*kvv1.KVTransferPolicy, *kvv1.PrefillPool, *kvv1.DecodePool) {
	name := strings.ToLower(string(mode))
	image := Registry + "/" + e.Image + ":" + Tag
	pol := builder.Policy(name).Mode(mode).Executor(kvv1.ExecutorAgent).Provider(kvv1.ProviderTCP).Obj()
	prefill := builder.PrefillPool(name+"-prefill").Image(image).Model(e.Model).TP(1).InstanceType("").BlockSize(e.BlockSize).
		Accelerator(kvv1.AcceleratorCPU, 0).Policy(name).EngineArgs(e.Args...).Obj()
	prefill.Spec.Env = e.Env[kvv1.RolePrefill]
	decode := builder.DecodePool(name+"-decode", name+"-prefill").Image(image).Model(e.Model).TP(1).InstanceType("").BlockSize(e.BlockSize).
		Accelerator(kvv1.AcceleratorCPU, 0).Policy(name).EngineArgs(e.Args...).Obj()
	decode.Spec.Env = e.Env[kvv1.RoleDecode]
	decode.Spec.Router.Replicas = ptr.To[int32](1)
	return pol, prefill, decode
}

// Create creates objs in namespace default.
func (n *Node) Create(ctx context.Context, objs ...client.Object) error {
	for _, o := range objs {
		o.SetNamespace("default")
		if err := n.Client.Create(ctx, o); err != nil {
			return fmt.Errorf("creating %s: %w", o.GetName(), err)
		}
	}
	return nil
}

// WaitPair waits up to limit until a mode's pools are Ready and its router Service
// answers.
func (n *Node) WaitPair(ctx context.Context, mode string, limit time.Duration) error {
	var why string
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, limit, true, func(ctx context.Context) (bool, error) {
		w := n.pairNotServing(ctx, mode)
		if ctx.Err() == nil { // a call cut by the deadline says nothing of the pair
			why = w
		}
		return w == "", nil
	})
	if err != nil {
		return fmt.Errorf("the %s pair did not serve within %s: %s", mode, limit, why)
	}
	return nil
}

// pairNotServing says what a mode's pair still lacks ("" when it serves).
func (n *Node) pairNotServing(ctx context.Context, mode string) string {
	p, d := &kvv1.PrefillPool{}, &kvv1.DecodePool{}
	if err := n.Client.Get(ctx, client.ObjectKey{Namespace: "default", Name: mode + "-prefill"}, p); err != nil {
		return err.Error()
	}
	if err := n.Client.Get(ctx, client.ObjectKey{Namespace: "default", Name: mode + "-decode"}, d); err != nil {
		return err.Error()
	}
	if !meta.IsStatusConditionTrue(p.Status.Conditions, kvv1.ConditionReady) || !meta.IsStatusConditionTrue(d.Status.Conditions, kvv1.ConditionReady) {
		return "the pools are not Ready"
	}
	dep := &appsv1.Deployment{}
	if err := n.Client.Get(ctx, client.ObjectKey{Namespace: "default", Name: mode + "-decode-router"}, dep); err != nil || dep.Spec.Replicas == nil || dep.Status.AvailableReplicas != *dep.Spec.Replicas {
		return "the router is not available"
	}
	// An available Deployment is not yet a reachable Service: kube-proxy programs the
	// Service's rules once it sees the EndpointSlice, and until then the cluster IP
	// refuses connections. Clients wait for the Service itself to answer.
	url, err := n.RouterURL(mode, "/readyz")
	if err != nil {
		return err.Error()
	}
	resp, err := n.HTTPClient(url, 5*time.Second).Get(url)
	if err != nil {
		return "the router Service: " + err.Error()
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "the router Service: " + resp.Status
	}
	return ""
}

// RouterURL is the URL of path on a mode's router Service.
func (n *Node) RouterURL(mode, path string) (string, error) {
	return n.ServiceURL(mode+"-decode-router", path)
}

// ServiceURL is the URL of path on the first port of Service name in namespace default:
// its cluster IP on this node (through kube-proxy's rules), the API server's Service proxy
// on an existing cluster, whose Service addresses are not reachable from outside it.
func (n *Node) ServiceURL(name, path string) (string, error) {
	svc := &corev1.Service{}
	if err := n.Client.Get(context.Background(), client.ObjectKey{Namespace: "default", Name: name}, svc); err != nil {
		return "", err
	}
	if n.external {
		return fmt.Sprintf("%s/api/v1/namespaces/default/services/http:%s:%d/proxy%s", strings.TrimSuffix(n.api.Host, "/"), svc.Name, svc.Spec.Ports[0].Port, path), nil
	}
	return fmt.Sprintf("http://%s:%d%s", svc.Spec.ClusterIP, svc.Spec.Ports[0].Port, path), nil
}

// Chat sends one chat request through a mode's router Service, with a deadline (a
// request must end, one way or the other), and returns the status, the body, and for a
// 200 the answer.
func (n *Node) Chat(mode, model, prompt string) (status int, body, answer string, err error) {
	return n.ChatVia(mode+"-decode-router", model, prompt)
}

// ChatVia is Chat through Service name.
func (n *Node) ChatVia(name, model, prompt string) (status int, body, answer string, err error) {
	url, err := n.ServiceURL(name, "/v1/chat/completions")
	if err != nil {
		return 0, "", "", err
	}
	req, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 8, "messages": []map[string]string{{"role": "user", "content": prompt}}})
	resp, err := n.HTTPClient(url, 90*time.Second).Post(url, "application/json", bytes.NewReader(req))
	if err != nil {
		return 0, "", "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return resp.StatusCode, string(b), "", nil
	}
	var out struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	if json.Unmarshal(b, &out) != nil || len(out.Choices) != 1 || out.Choices[0].Message.Content == "" {
		return resp.StatusCode, string(b), "", errors.New("no answer in a 200")
	}
	return resp.StatusCode, string(b), out.Choices[0].Message.Content, nil
}

// AgentMetric sums a metric's series, or gives one series (name with its labels), over
// the agent pods' /metrics (plain HTTP with PlainMetrics), read through the API server.
func (n *Node) AgentMetric(name string) (float64, error) {
	return n.PodsMetric("kvhandoff-node", client.MatchingLabels{"app.kubernetes.io/component": "transfer-agent"}, AgentMetricsPort, name)
}

// PodsMetric is AgentMetric over the pods of namespace that match labels, their /metrics
// on port (plain HTTP), read through the API server.
func (n *Node) PodsMetric(namespace string, labels client.MatchingLabels, port int, name string) (float64, error) {
	pods := &corev1.PodList{}
	if err := n.Client.List(context.Background(), pods, client.InNamespace(namespace), labels); err != nil {
		return 0, err
	}
	if len(pods.Items) == 0 {
		return 0, fmt.Errorf("no pod in %s matches %v", namespace, labels)
	}
	var sum float64
	for _, p := range pods.Items {
		m, err := n.PodMetrics(p.Namespace, p.Name, port)
		if err != nil {
			return 0, err
		}
		sum += Sum(m, name)
	}
	return sum, nil
}

// AgentMetricsPort is where the chart's agents serve /metrics.
const AgentMetricsPort = 9470

// AgentsServe says whether every agent pod is Ready and its node labelled as serving
// (the label engines of executor Agent select).
func (n *Node) AgentsServe(ctx context.Context) bool {
	pods := &corev1.PodList{}
	if n.Client.List(ctx, pods, client.InNamespace("kvhandoff-node"), client.MatchingLabels{"app.kubernetes.io/component": "transfer-agent"}) != nil || len(pods.Items) == 0 {
		return false
	}
	for _, p := range pods.Items {
		node := &corev1.Node{}
		if !PodReady(&p) || n.Client.Get(ctx, client.ObjectKey{Name: p.Spec.NodeName}, node) != nil || node.Labels[kvv1.LabelAgentReady] != "true" {
			return false
		}
	}
	return true
}

// PodReady says whether a pod's Ready condition is true.
func PodReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
