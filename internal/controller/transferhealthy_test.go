package controller

import (
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/health"
)

// The condition table of TransferHealthy: which reason wins, what the message names, and
// what each engine's entry says of its agent.
func TestTransferHealth(t *testing.T) {
	engine := func(pod, node string) kvv1.EngineStatus {
		return kvv1.EngineStatus{PodName: pod, EngineID: pod + ".ns", NodeName: node, Agent: node + ":7470"}
	}
	healthy := func(engines ...string) agentView {
		return agentView{ready: true, reported: true, report: health.Report{Provider: "tcp;ofi_rxm", Engines: engines}}
	}
	for _, tc := range []struct {
		name     string
		engines  []kvv1.EngineStatus
		agents   map[string]agentView
		routers  map[string]health.Report
		provider kvv1.FabricProvider
		reason   string
		says     []string
	}{{
		name:    "healthy",
		engines: []kvv1.EngineStatus{engine("d-0", "n1"), engine("d-1", "n2")},
		agents:  map[string]agentView{"n1": healthy("d-0.ns"), "n2": healthy("d-1.ns")},
		routers: map[string]health.Report{"r-1": {}}, provider: kvv1.ProviderTCP,
		reason: kvv1.ReasonTransfersHealthy, says: []string{"2 transfer agent(s) and 1 router(s)"},
	}, {
		name:    "an agent whose provider is missing outranks everything",
		engines: []kvv1.EngineStatus{engine("d-0", "n1"), engine("d-1", "n2")},
		agents: map[string]agentView{"n1": {reported: true, report: health.Report{Problem: kvv1.ReasonAgentNotReady,
			Message: `libfabric provider "efa" unavailable`}}, "n2": {ready: true, reported: true, report: health.Report{Provider: "shm"}}},
		routers:  map[string]health.Report{"r-1": {Problem: kvv1.ReasonHandoffFailures, Message: "x"}},
		provider: kvv1.ProviderTCP, reason: kvv1.ReasonAgentNotReady, says: []string{"node(s) n1 ", `"efa" unavailable`},
	}, {
		name:    "no agent at all",
		engines: []kvv1.EngineStatus{engine("d-0", "n1")}, agents: map[string]agentView{"n1": {}},
		provider: kvv1.ProviderTCP, reason: kvv1.ReasonAgentNotReady, says: []string{"not running"},
	}, {
		name:     "the wrong provider",
		engines:  []kvv1.EngineStatus{engine("d-0", "n1"), engine("d-1", "n2")},
		agents:   map[string]agentView{"n1": healthy(), "n2": {ready: true, reported: true, report: health.Report{Provider: "tcp;ofi_rxm"}}},
		provider: kvv1.ProviderEFA, reason: kvv1.ReasonProviderFallback, says: []string{"asks for provider efa", "n1, n2", "opened tcp;ofi_rxm"},
	}, {
		name:    "peers lost outrank failures",
		engines: []kvv1.EngineStatus{engine("d-0", "n1"), engine("d-1", "n2")},
		agents: map[string]agentView{
			"n1": {ready: true, reported: true, report: health.Report{Provider: "tcp;ofi_rxm", Problem: kvv1.ReasonTransferFailures, Message: "f"}},
			"n2": {ready: true, reported: true, report: health.Report{Provider: "tcp;ofi_rxm", Problem: kvv1.ReasonPeersLost, Message: "lost"}},
		},
		provider: kvv1.ProviderTCP, reason: kvv1.ReasonPeersLost, says: []string{"node(s) n2: lost"},
	}, {
		name:    "a router over its limit",
		engines: []kvv1.EngineStatus{engine("d-0", "n1")}, agents: map[string]agentView{"n1": healthy("d-0.ns")},
		routers:  map[string]health.Report{"r-2": {Problem: kvv1.ReasonHandoffFailures, Message: "more than 5%"}, "r-1": {}},
		provider: kvv1.ProviderTCP, reason: kvv1.ReasonHandoffFailures, says: []string{"router pod(s) r-2: more than 5%"},
	}, {
		name:    "engines of another executor do not depend on agents",
		engines: []kvv1.EngineStatus{{PodName: "d-0", NodeName: "n1"}}, agents: map[string]agentView{},
		provider: kvv1.ProviderEFA, reason: kvv1.ReasonTransfersHealthy,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			c := transferHealth(tc.engines, tc.agents, tc.routers, tc.provider)
			if c.Reason != tc.reason || (c.Status == metav1.ConditionTrue) != (tc.reason == kvv1.ReasonTransfersHealthy) {
				t.Fatalf("got %s=%s (%s): %s; want reason %s", c.Type, c.Status, c.Reason, c.Message, tc.reason)
			}
			for _, s := range tc.says {
				if !strings.Contains(c.Message, s) {
					t.Errorf("message %q does not say %q", c.Message, s)
				}
			}
		})
	}
}

func TestEnginesSayWhetherTheirAgentHasASession(t *testing.T) {
	engines := []kvv1.EngineStatus{
		{PodName: "d-0", EngineID: "d-0.ns", NodeName: "n1", Agent: "n1:7470"},
		{PodName: "d-1", EngineID: "d-1.ns", NodeName: "n1", Agent: "n1:7470"},
	}
	transferHealth(engines, map[string]agentView{"n1": {ready: true, reported: true, report: health.Report{Provider: "efa", Engines: []string{"d-1.ns"}}}},
		nil, kvv1.ProviderEFA)
	if engines[0].AgentSession || !engines[1].AgentSession || engines[0].Fabric != "efa" || engines[1].Fabric != "efa" {
		t.Errorf("engines: %+v", engines)
	}
}
