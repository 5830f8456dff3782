package router

import (
	"context"
	"fmt"
	"strings"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/health"
)

// minHandoffFailures keeps a single failed request from making a quiet pool unhealthy.
const minHandoffFailures = 3

// Health is the router's report over the window w (sampled by the caller): HandoffFailures
// when more of its requests than the policy's limit failed on the prefill side or were
// served on decode alone.
func (s *Server) Health(w *health.Window) health.Report {
	limit := int32(kvv1.DefaultHandoffFailureLimitPercent)
	if set := s.set.Load(); set != nil && set.HandoffFailureLimitPercent != nil {
		limit = *set.HandoffFailureLimitPercent
	}
	handedOff := w.Increase("kvhandoff_router_requests_total", func(l map[string]string) bool {
		switch l["outcome"] {
		case OutcomeBadRequest, OutcomeOverloaded, OutcomeClientGone, OutcomeEngineRefused:
			return false // not a handoff's doing
		}
		return true
	})
	failed := w.Increase("kvhandoff_router_requests_total", func(l map[string]string) bool {
		return l["outcome"] == OutcomePrefillFailed || l["outcome"] == OutcomeNoEngine
	}) + w.Increase("kvhandoff_router_fallbacks_total", nil)
	if failed < minHandoffFailures || failed*100 <= float64(limit)*handedOff {
		return health.Report{}
	}
	reasons := w.Labels("kvhandoff_router_fallbacks_total", "reason")
	for _, o := range []string{OutcomePrefillFailed, OutcomeNoEngine} {
		if w.Increase("kvhandoff_router_requests_total", func(l map[string]string) bool { return l["outcome"] == o }) > 0 {
			reasons = append(reasons, o)
		}
	}
	return health.Report{Problem: kvv1.ReasonHandoffFailures, Message: fmt.Sprintf("more than %d%% of requests failed before decode or "+
		"were served on decode alone in the last %s (%s)", limit, w.Span, strings.Join(reasons, ", "))}
}

// HealthWindow is how far back the health report looks: the policy's window, where the
// route set carries one, else the router's own.
func (s *Server) HealthWindow() time.Duration {
	if set := s.set.Load(); set != nil && set.HealthWindowSeconds > 0 {
		return time.Duration(set.HealthWindowSeconds) * time.Second
	}
	return s.cfg.HealthWindow
}

// watchHealth recomputes the report GET /health/transfer serves every HealthInterval,
// from the router's own metrics; the manager polls it into the DecodePool's
// TransferHealthy condition.
func (s *Server) watchHealth(ctx context.Context) {
	w := &health.Window{Gatherer: s.cfg.Gatherer, Span: s.cfg.HealthWindow}
	t := time.NewTicker(s.cfg.HealthInterval)
	defer t.Stop()
	for {
		w.Span = s.HealthWindow() // the policy's, followed as it changes
		if err := w.Observe(time.Now()); err != nil {
			s.cfg.Log.Error("reading the router's metrics for its health report", "err", err)
		}
		r := s.Health(w)
		if old := s.health.Swap(&r); old.Problem != r.Problem {
			s.cfg.Log.Info("transfer health", "problem", r.Problem, "message", r.Message)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
