package agent

import (
	"fmt"
	"strings"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/health"
)

// Thresholds of the agent's health report, over its window. A single failure is not a
// problem (a client cancels, an engine restarts); a pattern is.
const (
	minFailures      = 3
	maxFailureShare  = 0.05
	minLeaseExpiries = 3
	failuresSeries   = "kvhandoff_agent_failures_total"
	expiriesSeries   = "kvhandoff_agent_lease_expiries_total"
	deliveriesSeries = "kvhandoff_agent_handoff_stage_seconds_count" // stage wire: one per delivery, on the side that moved the bytes
	peerLostReason   = "peer_lost"
)

// Health is the agent's report over the window w (sampled by the caller): the provider
// it opened, its engines, and the worst problem it sees.
func (a *Agent) Health(w *health.Window) health.Report {
	r := health.Report{Provider: a.Provider(), Engines: a.sessions.EngineIDs()}
	span := w.Span.String()
	if err := a.Ready(); err != nil {
		r.Problem, r.Message = kvv1.ReasonAgentNotReady, err.Error()
		return r
	}
	lost := w.Increase(failuresSeries, func(l map[string]string) bool { return l["reason"] == peerLostReason })
	failed := w.Increase(failuresSeries, nil)
	delivered := w.Increase(deliveriesSeries, func(l map[string]string) bool { return l["stage"] == "wire" })
	expired := w.Increase(expiriesSeries, nil)
	switch {
	case lost > 0:
		r.Problem = kvv1.ReasonPeersLost
		r.Message = fmt.Sprintf("transfers failed because a peer agent's connection broke (reason %s) in the last %s", peerLostReason, span)
	// Expired leases fail their transfers too: the more specific diagnosis comes first.
	case expired >= minLeaseExpiries:
		r.Problem = kvv1.ReasonLeasesExpiring
		r.Message = fmt.Sprintf("%d or more leases expired in the last %s (kinds: %s)", minLeaseExpiries, span,
			strings.Join(w.Labels(expiriesSeries, "kind"), ", "))
	case failed >= minFailures && failed > maxFailureShare*(failed+delivered):
		r.Problem = kvv1.ReasonTransferFailures
		r.Message = fmt.Sprintf("more than %.0f%% of transfers failed in the last %s (reasons: %s)", 100*maxFailureShare, span,
			strings.Join(w.Labels(failuresSeries, "reason"), ", "))
	}
	return r
}
