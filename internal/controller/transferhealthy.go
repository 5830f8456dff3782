package controller

import (
	"fmt"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/health"
)

// agentView is what the manager knows of one node's transfer agent: its ready label and
// the health report it publishes on the node.
type agentView struct {
	ready  bool
	report health.Report
	// reported is false when the node has no (readable) report.
	reported bool
}

// transferProblems are TransferHealthy's reasons, worst first: the condition carries the
// first one found. An agent that cannot move KV at all outranks one on the wrong fabric,
// which outranks failures seen by agents, and those the routers' view of them.
var transferProblems = []string{
	kvv1.ReasonAgentNotReady, kvv1.ReasonProviderFallback, kvv1.ReasonPeersLost,
	kvv1.ReasonLeasesExpiring, kvv1.ReasonTransferFailures, kvv1.ReasonHandoffFailures,
}

// transferHealth is the TransferHealthy condition of a pool whose engines are engines
// (filled in here with their agent session and fabric), given the agents of their nodes
// (by node name), the routers' reports (by pod name; a PrefillPool has none) and the
// policy's provider. Only engines of executor Agent depend on agents.
func transferHealth(engines []kvv1.EngineStatus, agents map[string]agentView, routers map[string]health.Report, provider kvv1.FabricProvider) metav1.Condition {
	where := map[string][]string{} // reason -> nodes or pods
	says := map[string]string{}    // reason -> the first reporter's message
	add := func(reason, at, message string) {
		if !slices.Contains(where[reason], at) {
			where[reason] = append(where[reason], at)
		}
		if says[reason] == "" {
			says[reason] = message
		}
	}
	opened := map[string]bool{}
	agentsSeen := 0
	for i := range engines {
		e := &engines[i]
		if e.Agent == "" || e.NodeName == "" {
			continue
		}
		a := agents[e.NodeName]
		e.Fabric = a.report.Provider
		e.AgentSession = a.reported && slices.Contains(a.report.Engines, e.EngineID)
		if slices.Contains(where[kvv1.ReasonAgentNotReady], e.NodeName) || opened[e.NodeName] {
			continue
		}
		switch {
		case !a.ready:
			msg := "the agent is not running"
			if a.reported && a.report.Problem == kvv1.ReasonAgentNotReady {
				msg = a.report.Message
			}
			add(kvv1.ReasonAgentNotReady, e.NodeName, msg)
			continue
		case a.reported && a.report.Problem != "":
			add(a.report.Problem, e.NodeName, a.report.Message)
		}
		opened[e.NodeName] = true
		agentsSeen++
		if a.reported && provider != "" && providerName(a.report.Provider) != string(provider) {
			add(kvv1.ReasonProviderFallback, e.NodeName, a.report.Provider)
		}
	}
	pods := make([]string, 0, len(routers))
	for pod := range routers {
		pods = append(pods, pod)
	}
	slices.Sort(pods)
	for _, pod := range pods {
		if r := routers[pod]; r.Problem != "" {
			add(r.Problem, pod, r.Message)
		}
	}

	for _, reason := range transferProblems {
		at := where[reason]
		if len(at) == 0 {
			continue
		}
		slices.Sort(at)
		c := metav1.Condition{Type: kvv1.ConditionTransferHealthy, Status: metav1.ConditionFalse, Reason: reason}
		switch reason {
		case kvv1.ReasonAgentNotReady:
			c.Message = fmt.Sprintf("engines run on node(s) %s whose transfer agent is not ready, so their KV cannot move: %s", list(at), says[reason])
		case kvv1.ReasonProviderFallback:
			c.Message = fmt.Sprintf("the policy asks for provider %s, and the agents of node(s) %s opened %s", provider, list(at), says[reason])
		case kvv1.ReasonHandoffFailures:
			c.Message = fmt.Sprintf("router pod(s) %s: %s", list(at), says[reason])
		default:
			c.Message = fmt.Sprintf("the agents of node(s) %s: %s", list(at), says[reason])
		}
		return c
	}
	return metav1.Condition{Type: kvv1.ConditionTransferHealthy, Status: metav1.ConditionTrue, Reason: kvv1.ReasonTransfersHealthy,
		Message: fmt.Sprintf("%d transfer agent(s) and %d router(s) report no problem", agentsSeen, len(routers))}
}

// providerName is the policy's name of a libfabric provider string: tcp for "tcp;ofi_rxm".
func providerName(opened string) string {
	name, _, _ := strings.Cut(opened, ";")
	return name
}

// list names at most five items, then how many more there are, so a message stays short
// on a large pool.
func list(items []string) string {
	if len(items) <= 5 {
		return strings.Join(items, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(items[:5], ", "), len(items)-5)
}
