package router

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router/choice"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// request is one client request on its way through the router.
type request struct {
	id     string
	path   string
	body   protocol.Body
	tokens int
	mode   string
	w      http.ResponseWriter
	r      *http.Request
	start  time.Time
	// received is when the body was read; the router's own time counts from there.
	received time.Time

	// prefer is the prefill engine the gateway's endpoint picker named (leg runner):
	// the first attempt's, when it is a ready engine of the PrefillPool.
	prefer string

	// routing is the policy's, and choice what engine choice reads of the request.
	routing choice.Routing
	choice  choice.Request
	// planned is the decode engine a planned request (routing.Planned) was given at its
	// arrival: push's first attempt and every pull attempt use it.
	planned *choice.Pick

	// What the request log and the metrics report.
	prefill, decode string
	retries         int
	fallback        string        // why the request was served on a decode engine alone, if its prefill side failed
	decodeOnly      string        // why the request was planned on a decode engine alone, if it was
	promptIDs       bool          // pull: the decode leg carried the prompt as the prefill engine's token ids
	cached          int           // prompt tokens its decode engine held, by the prefix index
	transferID      string        // push: the last attempt's, the key the agents and engines log it by
	added           time.Duration // the router's own share of the time to first byte
	relay           time.Duration // of which relaying the decode leg's first byte
	firstByte       time.Time
	prefillTime     time.Duration
	decodeTime      time.Duration // decode leg: send to first byte
}

// legID is the request id the legs of the current attempt carry (X-Request-Id, and push's
// remote_request_id): the client's request id on the first attempt, and a new one on each
// retry. vLLM's NIXL connectors pair a request's two legs by that id, not by transfer_id,
// so a retried pair must not share it with the aborted one.
func (rq *request) legID() string {
	if rq.retries == 0 {
		return rq.id
	}
	return fmt.Sprintf("%s-retry%d", rq.id, rq.retries)
}

// result is how a request ended.
type result struct {
	outcome string
	status  int
	engine  string // the engine the outcome is about
	msg     string
	// cut: the response was under way when it failed; the client's connection is
	// aborted once the request is recorded, so it never looks complete.
	cut bool
}

func (s *Server) dispatch(rq *request) result {
	data, err := readBody(rq, s.cfg.MaxBodyBytes, s.cfg.BodyTimeout)
	if err != nil {
		var tooBig *http.MaxBytesError
		switch {
		case errors.As(err, &tooBig):
			return result{outcome: OutcomeBadRequest, status: http.StatusRequestEntityTooLarge,
				msg: fmt.Sprintf("the request body exceeds %d bytes", s.cfg.MaxBodyBytes)}
		case errors.Is(err, os.ErrDeadlineExceeded):
			return result{outcome: OutcomeBadRequest, status: http.StatusRequestTimeout,
				msg: fmt.Sprintf("the request body did not arrive within %s", s.cfg.BodyTimeout)}
		}
		return result{outcome: OutcomeClientGone, msg: err.Error()}
	}
	// The router's own time starts once it holds the body: receiving it is the client's
	// upload, which an engine reached directly would wait for as well.
	rq.received = time.Now()
	if rq.body, err = protocol.Parse(data); err != nil {
		return result{outcome: OutcomeBadRequest, status: http.StatusBadRequest, msg: err.Error()}
	}
	rq.tokens = protocol.PromptTokens(rq.body)
	s.load.Arrived(rq.tokens)
	set := s.set.Load()
	if set == nil {
		return result{outcome: OutcomeNoEngine, status: http.StatusServiceUnavailable, msg: "no engines discovered yet"}
	}
	rq.mode = modeLabel(set.Mode)
	rq.routing = choice.RoutingOf(set)
	rq.choice = choice.NewRequest(rq.routing, rq.body, rq.tokens)
	if s.cfg.Local != "" {
		// The endpoint picker planned the request.
		if res, ok := s.named(rq, set); !ok {
			return res
		}
	} else if rq.routing.Planned() {
		if res, done := s.plan(rq, set); done {
			return res
		}
		if rq.planned != nil {
			defer rq.planned.Release() // a pick no leg used (idempotent)
		}
	}
	var res result
	if set.Mode == kvv1.TransferPush {
		res = s.push(rq, set)
	} else {
		res = s.pull(rq, set)
	}
	if reason := fallbackReason(res, set); reason != "" && set.HandoffFailurePolicy == kvv1.HandoffFailureServeOnDecode {
		return s.serveOnDecode(rq, set, reason, res)
	}
	return res
}

// plan chooses a planned request's decode engine at its arrival, by its prefix and load,
// and serves the request there alone when the plan says prefill does not pay (done);
// otherwise the legs use that engine (rq.planned). Without a pair of engines it leaves
// the request to its mode, which reports what is missing.
func (s *Server) plan(rq *request, set *discovery.Set) (res result, done bool) {
	_, decodes, why := choice.Pairable(set, nil)
	if why != "" {
		return result{}, false
	}
	d, plan := s.choose.Decode(rq.routing, decodes, rq.choice)
	rq.cached = plan.Cached
	if plan.DecodeOnly != "" {
		return s.decodeAlone(rq, d, plan.DecodeOnly), true
	}
	rq.planned = &d
	return result{}, false
}

// fallbackReason names why a request's prefill side could not serve it, or is "" when it
// was not the prefill side that failed.
func fallbackReason(res result, set *discovery.Set) string {
	switch {
	case res.outcome == OutcomePrefillFailed:
		return FallbackPrefillFailed
	case res.outcome == OutcomeNoEngine && len(set.Prefill) == 0:
		return FallbackNoPrefillEngine
	}
	return ""
}

// attempts is how often a request's legs are sent: once, and once more without the
// engine that failed them: a prefill engine whose leg failed, or (push) a decode engine
// that refused the connection.
const attempts = 2

// withRetry runs try (one attempt of a mode's legs) over the engines that can be paired,
// and once more without the engine a failed attempt names. try reports whether its
// result is a failure worth retrying; mark is where the router's own time of the attempt
// starts: the body's receipt, or the failure before a retry.
func (s *Server) withRetry(rq *request, set *discovery.Set, try func(prefills, decodes []discovery.Engine, mark time.Time) (res result, retry bool)) result {
	exclude := map[string]bool{}
	var failed result
	mark := rq.received
	for attempt := range attempts {
		prefills, decodes, why := choice.Pairable(set, exclude)
		if why != "" {
			if attempt > 0 {
				return failed
			}
			return result{outcome: OutcomeNoEngine, status: http.StatusServiceUnavailable, msg: why}
		}
		rq.retries = attempt
		if attempt == 0 && rq.prefer != "" {
			prefills = choice.SameID(prefills, rq.prefer)
		}
		res, retry := try(prefills, decodes, mark)
		if !retry {
			return res
		}
		if rq.r.Context().Err() != nil {
			// The leg failed because the client left.
			return result{outcome: OutcomeClientGone, msg: "the client disconnected; both legs were cancelled"}
		}
		failed, mark = res, time.Now()
		exclude[res.engine] = true
		leg := "prefill"
		if res.outcome == OutcomeDecodeFailed {
			leg = "decode"
		}
		s.retried(rq, leg, res.engine, res.msg)
	}
	return failed
}

// retried counts and logs a leg sent again without the engine that failed it.
func (s *Server) retried(rq *request, leg, engine string, why any) {
	s.m.retries.WithLabelValues(rq.mode, leg).Inc()
	s.cfg.Log.Warn("a leg failed; sending it again without its engine", "request_id", rq.id, "mode", rq.mode, "leg", leg, "engine", engine, "err", why)
}

// record counts the request and logs one line about it.
func (s *Server) record(rq *request, res result) {
	mode := rq.mode
	if mode == "" {
		mode = "none"
	}
	engine := res.engine
	s.m.requests.WithLabelValues(mode, res.outcome, engine).Inc()
	if !rq.firstByte.IsZero() && res.outcome == OutcomeOK {
		s.m.ttft.WithLabelValues(mode).Observe(rq.firstByte.Sub(rq.start).Seconds())
		s.m.added.WithLabelValues(mode).Observe(rq.added.Seconds())
		prefill := rq.prefill
		if rq.fallback != "" || rq.decodeOnly != "" {
			prefill = ""
		}
		s.load.TTFT(prefill, rq.decode, rq.firstByte.Sub(rq.start))
	}
	attrs := []any{"request_id", rq.id, "mode", mode, "outcome", res.outcome, "prefill", rq.prefill, "decode", rq.decode,
		"prompt_tokens", rq.tokens, "retries", rq.retries, "prefill_ms", ms(rq.prefillTime), "decode_ms", ms(rq.decodeTime), "duration_ms",
		ms(time.Since(rq.start))}
	if cid := rq.r.Header.Get("X-Request-Id"); cid != "" {
		attrs = append(attrs, "client_request_id", cid)
	}
	if rq.transferID != "" {
		attrs = append(attrs, "transfer_id", rq.transferID)
	}
	if rq.fallback != "" {
		attrs = append(attrs, "fallback", rq.fallback)
	}
	if rq.decodeOnly != "" {
		attrs = append(attrs, "decode_only", rq.decodeOnly)
	}
	if rq.promptIDs {
		attrs = append(attrs, "decode_prompt", "token_ids")
	}
	if rq.routing.PrefixAware {
		attrs = append(attrs, "cached_tokens", rq.cached)
	}
	if !rq.firstByte.IsZero() {
		attrs = append(attrs, "ttft_ms", ms(rq.firstByte.Sub(rq.start)), "router_added_ms", ms(rq.added), "router_relay_ms", ms(rq.relay))
	}
	if res.outcome == OutcomeOK || res.outcome == OutcomeEngineRefused {
		s.cfg.Log.Info("request", attrs...)
		return
	}
	s.cfg.Log.Warn("request", append(attrs, "status", res.status, "err", res.msg)...)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 }
