package router

import (
	"context"
	"errors"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/router/choice"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// push chooses the decode engine at arrival and sends both legs at once: decode
// registers its blocks with the prefill engine while prefill runs. A prefill leg that
// fails before decode has answered aborts the decode leg (closing its connection aborts
// the request in vLLM, which frees its blocks) before the pair is tried again.
func (s *Server) push(rq *request, set *discovery.Set) result {
	return s.withRetry(rq, set, func(prefills, decodes []discovery.Engine, mark time.Time) (result, bool) {
		var p, d choice.Pick
		if rq.planned != nil && rq.retries == 0 {
			d = *rq.planned
			p = s.choose.Prefill(rq.routing, choice.SameHash(prefills, d.CompatHash), rq.choice)
		} else {
			// A retry takes a prefill leg whatever its tail: the plan said it pays.
			r := rq.routing
			r.MinPrefillTokens = 0
			p, d, _ = s.choose.Push(r, prefills, decodes, rq.choice)
		}
		rq.prefill, rq.decode = p.EngineID, d.EngineID
		// A new transfer id for every attempt: a retried pair never matches the aborted one.
		transferID := newID("xfer-")
		rq.transferID = transferID
		prefillBody := protocol.PrefillLeg(rq.body, transferID).Marshal()
		decodeBody := protocol.PushDecodeLeg(rq.body, protocol.Prefill{
			EngineID: p.EngineID, Host: p.Host, Port: p.SideChannelPort,
			TP: p.TensorParallelSize, PP: p.PipelineParallelSize,
		}, rq.legID(), transferID).Marshal()

		// Once the client has its answer, a prefill leg still in flight (its response
		// late, or sent again on a new connection) is cancelled as answered, not failed.
		ctx, cancel := context.WithCancelCause(rq.r.Context())
		defer cancel(errAnswered)
		rq.added = time.Since(mark)
		sent := time.Now()
		prefillDone := make(chan legResult, 1)
		go func() { prefillDone <- s.prefillLeg(ctx, rq, p, prefillBody, false) }()
		decodeStarted := make(chan *decodeStart, 1)
		go func() { decodeStarted <- s.decodeLeg(ctx, rq, d, decodeBody) }()

		var ds *decodeStart
		select {
		case pr := <-prefillDone:
			rq.prefillTime = time.Since(sent)
			if pr.res.outcome != "" {
				cancel(nil)
				if ds := <-decodeStarted; ds.resp != nil {
					ds.resp.Body.Close()
				}
				return pr.res, pr.res.outcome == OutcomePrefillFailed
			}
			s.m.leg.WithLabelValues(rq.mode, "prefill").Observe(pr.took.Seconds())
			if ds = <-decodeStarted; unanswered(ds) && rq.r.Context().Err() == nil {
				// As below, but the prefill engine's blocks are ready: its agent holds them
				// until the policy's blocks TTL, as for any request no decode engine took.
				return s.decodeRefused(rq, d.Engine, ds), true
			}
		case ds = <-decodeStarted:
			if unanswered(ds) && rq.r.Context().Err() == nil {
				// The decode engine is gone (its pod not yet out of the set) and nothing
				// reached it: the prefill leg is aborted (vLLM frees its blocks) and the
				// pair is tried again without it.
				cancel(nil)
				<-prefillDone
				return s.decodeRefused(rq, d.Engine, ds), true
			}
			// Decode answered first: its bytes are the client's, whatever prefill's
			// response says later. The prefill leg finishes on its own.
			go func() {
				if pr := <-prefillDone; pr.res.outcome == "" {
					s.m.leg.WithLabelValues(rq.mode, "prefill").Observe(pr.took.Seconds())
				}
			}()
		}
		rq.decodeTime = time.Since(sent)
		s.m.leg.WithLabelValues(rq.mode, "decode").Observe(rq.decodeTime.Seconds())
		return s.finishDecode(rq, d.Engine, ds), false
	})
}

// errAnswered cancels a push request's prefill leg once the client has its answer.
var errAnswered = errors.New("the request was answered")
