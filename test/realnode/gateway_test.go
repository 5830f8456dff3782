package realnode_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/client"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/realnode"
)

// The gateway path as a user sets it up: the Gateway API Inference Extension's CRD, a
// DecodePool per mode with gateway.inferencePool, and Envoy as a pod configured as GIE's
// and llm-d's end-to-end tests configure it, its ext_proc the pool's endpoint picker
// Service. A chat request through Envoy reaches the decode pod the picker chose, whose
// leg runner runs both legs with the prefill engine the picker named: the answer is the
// router's for the same prompt, and the agent pod moves the KV.
func TestAChatRequestThroughEnvoyAndTheEndpointPickerInPushAndPull(t *testing.T) {
	modes := []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull}
	n := createPairsBehindGateways(t, realnode.SimEngines, modes...)
	for _, mode := range modes {
		waitPair(t, n, strings.ToLower(string(mode)))
	}
	before := agentMetric(t, n, "kvhandoff_agent_transferred_bytes_total")
	for _, m := range modes {
		mode := strings.ToLower(string(m))
		pool := &infv1.InferencePool{}
		if err := n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: mode + "-decode"}, pool); err != nil {
			t.Fatalf("%s: the manager rendered no InferencePool: %v", mode, err)
		}
		envoy, err := n.StartGateway(bg, mode, "sim", 2*time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		prompt := "Which engine prefilled this " + mode + " request?"
		status, body, got, err := n.ChatVia(envoy, "sim", prompt)
		if err != nil || status != http.StatusOK {
			t.Fatalf("%s through envoy: %d %s %v", mode, status, body, err)
		}
		if _, _, want, err := n.Chat(mode, "sim", prompt); err != nil || got != want {
			t.Errorf("%s: envoy answered %q, the router %q (%v)", mode, got, want, err)
		}
	}
	if after := agentMetric(t, n, "kvhandoff_agent_transferred_bytes_total"); after <= before {
		t.Errorf("the agent pod moved no KV bytes for the requests through envoy (%v before, %v after)", before, after)
	}

	// One of the two endpoint picker pods, then the decode engine's pod, deleted under
	// traffic through Envoy: every request answered or failed by name, and served again
	// once the pod is back. (The picker drains its streams on SIGTERM and Envoy opens its
	// next stream to the other replica; with one replica the gateway would refuse requests
	// until the replacement is ready, and Envoy's refusal of a request whose body it had
	// begun to stream to the picker carries no body at all.)
	send := func(prompt string) (int, string, error) {
		status, body, _, err := n.ChatVia("push-gateway", "sim", prompt)
		return status, body, err
	}
	for _, victim := range []struct {
		what, selector string
		max            int
	}{
		{"an endpoint picker", kvv1.LabelEndpointPicker + "=push-decode", 1},
		{"the decode engine", "kvhandoff.io/pool=push-decode,kvhandoff.io/role=decode", 0},
	} {
		deleteUnderTraffic(t, n, victim.what, "default", victim.selector, victim.max, send, func() { waitPair(t, n, "push") })
	}
}

// createPairsBehindGateways is createPairs with the gateway path: the InferencePool CRD
// (before the manager starts, so that it watches InferencePools), the envoy image, and
// each DecodePool with gateway.inferencePool.
func createPairsBehindGateways(t *testing.T, e realnode.Engines, modes ...kvv1.TransferMode) *realnode.Node {
	t.Helper()
	n, _ := startNode(t, "manager", "router", "transfer-agent", "device-plugin", "vllm-connector", "envoy", e.Image)
	if err := n.InstallGatewayCRDs(); err != nil {
		t.Fatal(err)
	}
	if err := n.InstallChart(append(n.ChartValues(), realnode.PlainMetrics)...); err != nil {
		t.Fatal(err)
	}
	for _, mode := range modes {
		if err := n.CreatePair(bg, e, mode, func(d *kvv1.DecodePool) { d.Spec.Gateway.InferencePool = true }); err != nil {
			t.Fatal(err)
		}
	}
	return n
}
