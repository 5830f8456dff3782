package realnode_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
	"github.com/kvhandoff/kvhandoff/test/realnode"
)

// The whole system as a user installs it: the chart on a real node, then a CPU pair of
// pools per mode whose engines are the simulated-engine image (`vllm serve` as the
// manager renders it). The pools become Ready; a chat request through each DecodePool's
// router Service returns the engines' answer, its KV moved through the agent pod and
// verified by the decode engine before its first token; the agent counts the bytes.
func TestAChatRequestThroughTheRouterServiceInPushAndPull(t *testing.T) {
	n, _ := startNode(t, "manager", "router", "transfer-agent", "device-plugin", "vllm-connector", "simvllm")
	helmInstall(t, n, `agent.provider="tcp;ofi_rxm"`, `agent.token.create=true`, `agent.metricsSecure=false`,
		"agent.nodeAffinity="+onTheRealNode, "devicePlugin.nodeAffinity="+onTheRealNode)
	image := "ghcr.io/kvhandoff/simvllm:" + realnode.Tag
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		name := strings.ToLower(string(mode))
		pol := builder.Policy(name).Mode(mode).Executor(kvv1.ExecutorAgent).Provider(kvv1.ProviderTCP).Obj()
		prefill := builder.PrefillPool(name+"-prefill").Image(image).Model("sim").TP(1).InstanceType("").
			Accelerator(kvv1.AcceleratorCPU, 0).Policy(name).Obj()
		decode := builder.DecodePool(name+"-decode", name+"-prefill").Image(image).Model("sim").TP(1).InstanceType("").
			Accelerator(kvv1.AcceleratorCPU, 0).Policy(name).Obj()
		decode.Spec.Router.Replicas = ptr.To[int32](1)
		for _, o := range []client.Object{pol, prefill, decode} {
			o.SetNamespace("default")
			if err := n.Client.Create(bg, o); err != nil {
				t.Fatalf("creating %s: %v", o.GetName(), err)
			}
		}
	}
	for _, mode := range []string{"push", "pull"} {
		until(t, "the "+mode+" pools to be Ready", 4*time.Minute, func() bool {
			ready := 0
			p, d := &kvv1.PrefillPool{}, &kvv1.DecodePool{}
			for _, o := range []client.Object{p, d} {
				name := mode + "-prefill"
				if o == client.Object(d) {
					name = mode + "-decode"
				}
				if n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: name}, o) != nil {
					return false
				}
			}
			for _, c := range [][]metav1.Condition{p.Status.Conditions, d.Status.Conditions} {
				for _, cond := range c {
					if cond.Type == kvv1.ConditionReady && cond.Status == metav1.ConditionTrue {
						ready++
					}
				}
			}
			return ready == 2
		})
		until(t, "the "+mode+" router to be available", 2*time.Minute, func() bool {
			dep := &appsv1.Deployment{}
			return n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: mode + "-decode-router"}, dep) == nil && dep.Status.AvailableReplicas == 1
		})
	}
	before := agentMetric(t, "kvhandoff_agent_transferred_bytes_total")
	for _, mode := range []string{"push", "pull"} {
		svc := &corev1.Service{}
		if err := n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: mode + "-decode-router"}, svc); err != nil {
			t.Fatal(err)
		}
		body, _ := json.Marshal(map[string]any{"model": "sim", "max_tokens": 8,
			"messages": []map[string]string{{"role": "user", "content": "What moves the KV cache in " + mode + " mode?"}}})
		url := fmt.Sprintf("http://%s:%d/v1/chat/completions", svc.Spec.ClusterIP, svc.Spec.Ports[0].Port)
		resp, err := http.Post(url, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatalf("%s: %v", mode, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var answer struct {
			Choices []struct {
				Message struct{ Content string } `json:"message"`
			} `json:"choices"`
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &answer) != nil || len(answer.Choices) != 1 || answer.Choices[0].Message.Content == "" {
			t.Errorf("%s through %s: %d %s", mode, url, resp.StatusCode, b)
		}
	}
	if after := agentMetric(t, "kvhandoff_agent_transferred_bytes_total"); after <= before {
		t.Errorf("the agent pod moved no KV bytes for the two requests (%v before, %v after)", before, after)
	}
}

// agentMetric sums a metric's series on the agent pod's /metrics (host network, plain
// HTTP in this test's install).
func agentMetric(t *testing.T, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + realnode.NodeIP + ":9470/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var sum float64
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, name+"{") || strings.HasPrefix(line, name+" ") {
			var v float64
			if _, err := fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v); err == nil {
				sum += v
			}
		}
	}
	return sum
}
