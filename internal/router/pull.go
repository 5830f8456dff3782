package router

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/router/choice"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// pull sends the prefill leg first and chooses the decode engine when it returns; the
// decode leg carries the prefill engine's kv_transfer_params, and decode reads the
// blocks (and, for a text completion, the prompt's token ids from prefill: protocol.PullPrefillLeg).
func (s *Server) pull(rq *request, set *discovery.Set) result {
	return s.withRetry(rq, set, func(prefills, _ []discovery.Engine, mark time.Time) (result, bool) {
		if rq.planned != nil {
			prefills = choice.SameHash(prefills, rq.planned.CompatHash)
			if len(prefills) == 0 {
				return result{outcome: OutcomeNoEngine, status: http.StatusServiceUnavailable, msg: fmt.Sprintf(
					"no ready prefill engine left with decode engine %s's compat-hash %q (%s)", rq.planned.EngineID, rq.planned.CompatHash, set.Source)}, false
			}
		}
		p := s.choose.Prefill(rq.routing, prefills, rq.choice)
		rq.prefill = p.EngineID
		rq.added = time.Since(mark)
		pr := s.prefillLeg(rq.r.Context(), rq, p, protocol.PullPrefillLeg(rq.body).Marshal(), true)
		got := time.Now()
		rq.prefillTime = pr.took
		if pr.res.outcome != "" {
			return pr.res, pr.res.outcome == OutcomePrefillFailed
		}
		s.m.leg.WithLabelValues(rq.mode, "prefill").Observe(pr.took.Seconds())

		// Decode is the planned engine, or chosen now among engines of the prefill
		// engine's configuration.
		var d choice.Pick
		if rq.planned != nil {
			d = *rq.planned
		} else {
			var why string
			if d, why = s.choose.PullDecode(s.set.Load(), p.Engine, rq.tokens, nil); why != "" {
				return result{outcome: OutcomeNoEngine, status: http.StatusServiceUnavailable, msg: why}, false
			}
		}
		leg, ids := protocol.PullDecodeLeg(rq.body, pr.prefilled)
		body := leg.Marshal()
		rq.promptIDs = ids
		ctx, cancel := context.WithCancel(rq.r.Context())
		defer cancel()
		rq.added += time.Since(got)
		send := func() *decodeStart {
			rq.decode = d.EngineID
			sent := time.Now()
			ds := s.decodeLeg(ctx, rq, d, body)
			rq.decodeTime = time.Since(sent)
			return ds
		}
		ds := send()
		if unanswered(ds) && rq.r.Context().Err() == nil {
			// The engine is gone (its pod not yet out of the set) and nothing reached it:
			// the prefill engine's blocks wait for any decode engine to read them.
			if next, why := s.choose.PullDecode(s.set.Load(), p.Engine, rq.tokens, map[string]bool{d.EngineID: true}); why == "" {
				s.retried(rq, "decode", d.EngineID, s.decodeRefused(rq, d.Engine, ds).msg)
				d = next
				ds = send()
			}
		}
		s.m.leg.WithLabelValues(rq.mode, "decode").Observe(rq.decodeTime.Seconds())
		return s.finishDecode(rq, d.Engine, ds), false
	})
}
