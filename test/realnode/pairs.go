package realnode

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
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

// ChartValues are the chart values the node needs (helm --set-json): tcp between agents
// (there is no EFA), the agents' peer token made by the chart, and the node components
// on this node, which carries no instance type.
var ChartValues = []string{`agent.provider="tcp;ofi_rxm"`, `agent.token.create=true`,
	"agent.nodeAffinity=" + onThisNode, "devicePlugin.nodeAffinity=" + onThisNode}

// PlainMetrics serves the agent's metrics over plain HTTP, for AgentMetric.
const PlainMetrics = `agent.metricsSecure=false`

const onThisNode = `{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":` +
	`[{"key":"kubernetes.io/hostname","operator":"In","values":["` + Name + `"]}]}]}}`

// InstallChart installs charts/kvhandoff as release kvhandoff in kvhandoff-system, with
// the images built here (Tag, never pulled) and values (helm --set-json).
func (n *Node) InstallChart(values ...string) error {
	root := envtest.RepoRoot()
	helm, err := exec.Command(filepath.Join(root, "hack", "helm.sh")).Output()
	if err != nil {
		return fmt.Errorf("hack/helm.sh: %w", err)
	}
	args := []string{"install", "kvhandoff", filepath.Join(root, "charts", "kvhandoff"), "--namespace", "kvhandoff-system", "--create-namespace",
		"--kubeconfig", n.Kubeconfig, "--set", "image.tag=" + Tag, "--set", "image.pullPolicy=Never"}
	for _, v := range values {
		args = append(args, "--set-json", v)
	}
	if out, err := exec.Command(strings.TrimSpace(string(helm)), args...).CombinedOutput(); err != nil {
		return fmt.Errorf("helm install: %w\n%s", err, out)
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
func (n *Node) CreatePair(ctx context.Context, e Engines, mode kvv1.TransferMode) error {
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
	for _, o := range []client.Object{pol, prefill, decode} {
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
		why = n.pairNotServing(ctx, mode)
		return why == "", nil
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
	if err := n.Client.Get(ctx, client.ObjectKey{Namespace: "default", Name: mode + "-decode-router"}, dep); err != nil || dep.Status.AvailableReplicas != 1 {
		return "the router is not available"
	}
	// An available Deployment is not yet a reachable Service: kube-proxy programs the
	// Service's rules once it sees the EndpointSlice, and until then the cluster IP
	// refuses connections. Clients wait for the Service itself to answer.
	url, err := n.RouterURL(mode, "/readyz")
	if err != nil {
		return err.Error()
	}
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(url)
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
	svc := &corev1.Service{}
	if err := n.Client.Get(context.Background(), client.ObjectKey{Namespace: "default", Name: mode + "-decode-router"}, svc); err != nil {
		return "", err
	}
	return fmt.Sprintf("http://%s:%d%s", svc.Spec.ClusterIP, svc.Spec.Ports[0].Port, path), nil
}

// Chat sends one chat request through a mode's router Service, with a deadline (a
// request must end, one way or the other), and returns the status, the body, and for a
// 200 the answer.
func (n *Node) Chat(mode, model, prompt string) (status int, body, answer string, err error) {
	url, err := n.RouterURL(mode, "/v1/chat/completions")
	if err != nil {
		return 0, "", "", err
	}
	req, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 8, "messages": []map[string]string{{"role": "user", "content": prompt}}})
	resp, err := (&http.Client{Timeout: 90 * time.Second}).Post(url, "application/json", bytes.NewReader(req))
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

// AgentMetric sums a metric's series, or gives one series (name with its labels), on
// the agent pod's /metrics (host network, plain HTTP with PlainMetrics).
func AgentMetric(name string) (float64, error) {
	resp, err := http.Get("http://" + NodeIP + ":9470/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	var sum float64
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, name); ok && (strings.HasPrefix(rest, " ") || !strings.HasSuffix(name, "}") && strings.HasPrefix(rest, "{")) {
			var v float64
			if _, err := fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v); err == nil {
				sum += v
			}
		}
	}
	return sum, nil
}
