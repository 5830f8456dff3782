package router

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router/balance"
	"github.com/kvhandoff/kvhandoff/internal/router/choice"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// serveOnDecode serves a request whose prefill side failed on a decode engine alone
// (handoffFailurePolicy ServeOnDecode): the client's own body, so the engine prefills it
// itself. The failed attempt's legs have ended (push aborts its decode leg before it
// returns), so the request holds no other engine's resources and gets one answer. Each
// such request is counted, logged with its id, and says so in X-Kvhandoff-Fallback.
func (s *Server) serveOnDecode(rq *request, set *discovery.Set, reason string, failed result) result {
	if len(set.Decode) == 0 {
		return failed
	}
	s.m.fallbacks.WithLabelValues(rq.mode, reason).Inc()
	s.cfg.Log.Warn("serving the request on a decode engine alone (handoffFailurePolicy ServeOnDecode)", "request_id", rq.id, "mode", rq.mode,
		"reason", reason, "err", failed.msg)
	rq.fallback = reason
	rq.w.Header().Set("X-Kvhandoff-Fallback", reason)
	// A request id of its own, as for any new attempt (legID).
	rq.retries++
	return s.alone(rq, s.choose.Take(balance.Decode, set.Decode, rq.tokens))
}

// decodeAlone serves a request its plan put on decode engine d alone (reason: prefill
// does not pay): not a fallback, and counted apart from them.
func (s *Server) decodeAlone(rq *request, d choice.Pick, reason string) result {
	rq.decodeOnly = reason
	rq.w.Header().Set(protocol.DecodeOnlyHeader, reason)
	return s.alone(rq, d)
}

// alone sends the client's own body to decode engine d, which prefills it itself.
func (s *Server) alone(rq *request, d choice.Pick) result {
	rq.decode = d.EngineID
	ctx, cancel := context.WithCancel(rq.r.Context())
	defer cancel()
	sent := time.Now()
	ds := s.decodeLeg(ctx, rq, d, rq.body.Marshal())
	rq.decodeTime = time.Since(sent)
	return s.finishDecode(rq, d.Engine, ds)
}

type legResult struct {
	res       result
	prefilled protocol.Prefilled // pull: what the decode leg takes from the prefill engine's response
	took      time.Duration
}

// prefillLeg sends a prefill leg and reads its whole response, then calls release (the
// engine's count from take). A refused connection, a
// timeout, a 5xx or (pull) a response without kv_transfer_params is a failure to retry
// elsewhere; a 4xx is the client's request refused, answered as the engine said.
func (s *Server) prefillLeg(ctx context.Context, rq *request, pick choice.Pick, body []byte, needParams bool) legResult {
	e, release := pick.Engine, pick.Release
	ctx, cancel := context.WithTimeout(ctx, s.cfg.PrefillTimeout)
	defer cancel()
	defer release()
	start := time.Now()
	tokens := 0 // of a completed leg, for the autoscaler's prefill rate
	end := s.load.Leg(false, e.EngineID, start)
	defer func() { end(time.Now(), tokens) }()
	fail := func(reason, msg string) legResult {
		if context.Cause(ctx) != errAnswered {
			s.m.legFails.WithLabelValues("prefill", e.EngineID, reason).Inc()
		}
		return legResult{res: result{outcome: OutcomePrefillFailed, status: http.StatusBadGateway, engine: e.EngineID,
			msg: fmt.Sprintf("prefill engine %s: %s", e.EngineID, msg)}, took: time.Since(start)}
	}
	resp, err := s.send(ctx, rq, e, body)
	if err != nil {
		return fail(transportReason(ctx, err), err.Error())
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return fail(transportReason(ctx, err), "reading the response: "+err.Error())
	}
	switch {
	case resp.StatusCode >= 500:
		return fail("status_5xx", fmt.Sprintf("%s: %.256s", resp.Status, data))
	case resp.StatusCode >= 400:
		return legResult{res: result{outcome: OutcomeEngineRefused, status: resp.StatusCode, engine: e.EngineID,
			msg: fmt.Sprintf("prefill engine %s refused the request: %s", e.EngineID, engineMessage(data))}, took: time.Since(start)}
	}
	out := legResult{took: time.Since(start)}
	if needParams {
		if out.prefilled, err = protocol.ReadPrefill(data); err != nil {
			return fail("no_kv_transfer_params", err.Error())
		}
	}
	tokens = rq.tokens
	return out
}

// decodeStart is a decode leg whose response has begun: its status and first bytes.
type decodeStart struct {
	resp  *http.Response
	first []byte
	at    time.Time
	err   error
}

// decodeLeg sends a decode leg and waits for its first bytes, for at most DecodeTimeout;
// release (the engine's count from take) runs when the leg ends.
func (s *Server) decodeLeg(ctx context.Context, rq *request, pick choice.Pick, body []byte) *decodeStart {
	e, release := pick.Engine, pick.Release
	ctx, cancel := context.WithCancel(ctx)
	timer := time.AfterFunc(s.cfg.DecodeTimeout, cancel)
	resp, err := s.send(ctx, rq, e, body)
	if err != nil {
		if !timer.Stop() {
			err = fmt.Errorf("no response within %s: %w", s.cfg.DecodeTimeout, context.DeadlineExceeded)
		}
		release()
		cancel()
		return &decodeStart{err: err}
	}
	buf := make([]byte, 32<<10)
	n, err := readSome(resp.Body, buf)
	if !timer.Stop() {
		err = fmt.Errorf("no first byte within %s: %w", s.cfg.DecodeTimeout, context.DeadlineExceeded)
	}
	if err != nil && !errors.Is(err, io.EOF) {
		resp.Body.Close()
		release()
		cancel()
		return &decodeStart{err: err}
	}
	// From here the leg's lifetime is the relay's; closing the body releases it.
	resp.Body = &releasingBody{ReadCloser: resp.Body, release: func() { release(); cancel() }}
	return &decodeStart{resp: resp, first: buf[:n], at: time.Now()}
}

// unanswered says whether a decode leg's engine gave no answer at all: the connection
// refused, or closed or reset before a status line, as when the engine's process is gone
// and its pod has not yet left the set (a pooled connection to it is reset on use). The
// client has been sent nothing, so the leg may go to another engine. A timeout is not
// that: the engine may be working on it.
func unanswered(ds *decodeStart) bool {
	if ds.resp != nil || ds.err == nil {
		return false
	}
	reason := transportReason(nil, ds.err)
	return reason == "refused" || reason == "broken"
}

// decodeRefused counts a decode leg its engine did not answer and is its result, for a
// retry without the engine.
func (s *Server) decodeRefused(rq *request, e discovery.Engine, ds *decodeStart) result {
	s.m.legFails.WithLabelValues("decode", e.EngineID, transportReason(nil, ds.err)).Inc()
	return result{outcome: OutcomeDecodeFailed, status: http.StatusBadGateway, engine: e.EngineID,
		msg: fmt.Sprintf("decode engine %s: %v", e.EngineID, ds.err)}
}

// finishDecode relays a started decode leg to the client, or reports why it failed.
func (s *Server) finishDecode(rq *request, e discovery.Engine, ds *decodeStart) result {
	if ds.err != nil {
		if rq.r.Context().Err() != nil {
			return result{outcome: OutcomeClientGone, msg: "the client disconnected; both legs were cancelled"}
		}
		reason := transportReason(nil, ds.err)
		s.m.legFails.WithLabelValues("decode", e.EngineID, reason).Inc()
		return result{outcome: OutcomeDecodeFailed, status: http.StatusBadGateway, engine: e.EngineID,
			msg: fmt.Sprintf("decode engine %s: %v", e.EngineID, ds.err)}
	}
	defer ds.resp.Body.Close()
	if ds.resp.StatusCode >= 500 {
		rest, _ := io.ReadAll(io.LimitReader(ds.resp.Body, 4<<10))
		s.m.legFails.WithLabelValues("decode", e.EngineID, "status_5xx").Inc()
		return result{outcome: OutcomeDecodeFailed, status: http.StatusBadGateway, engine: e.EngineID,
			msg: fmt.Sprintf("decode engine %s: %s: %.256s", e.EngineID, ds.resp.Status, append(ds.first, rest...))}
	}
	outcome := OutcomeOK
	if ds.resp.StatusCode >= 400 {
		outcome = OutcomeEngineRefused
	}
	// The decode engine generates from the first byte to the last: that is the stream
	// in flight the autoscaler sizes decode by, and its token gaps are the ITL.
	streaming := func(time.Time, int) {}
	defer func() { streaming(time.Now(), 0) }()
	last := time.Time{}
	written, err := relay(rq.w, ds.resp, ds.first, func() {
		rq.firstByte = time.Now()
		rq.relay = rq.firstByte.Sub(ds.at)
		rq.added += rq.relay
		streaming, last = s.load.Leg(true, e.EngineID, rq.firstByte), rq.firstByte
	}, func(p []byte) {
		if n := protocol.Events(p); n > 0 {
			now := time.Now()
			s.load.Gaps(e.EngineID, now.Sub(last)/time.Duration(n), n)
			last = now
		}
	})
	if err != nil {
		if rq.r.Context().Err() != nil {
			return result{outcome: OutcomeClientGone, engine: e.EngineID, msg: "the client disconnected mid-stream; the decode leg was cancelled"}
		}
		s.m.legFails.WithLabelValues("decode", e.EngineID, "broken").Inc()
		msg := fmt.Sprintf("decode engine %s: the stream broke after %d bytes: %v", e.EngineID, written, err)
		// The status is sent. A stream's client is told why in an error event, as vLLM
		// tells of an error mid-stream; then its connection is cut (res.cut), so that no
		// answer looks complete.
		if strings.HasPrefix(ds.resp.Header.Get("Content-Type"), "text/event-stream") {
			writeStreamError(rq.w, http.StatusBadGateway, msg)
		}
		return result{outcome: OutcomeStreamBroken, engine: e.EngineID, msg: msg, cut: true}
	}
	return result{outcome: outcome, engine: e.EngineID}
}

// named reads, in a leg runner, the prefill engine the gateway's endpoint picker chose
// (protocol.PrefillHeader, which no leg forwards): rq.prefer when its host is a ready engine's
// of the paired PrefillPool. An address that is not one is never dialled: the request is logged
// and routed as the router would. In its place, protocol.DecodeOnlyHeader serves the request on
// the decode engine alone. Without either (a gateway that failed open, or a client that
// reached the pod directly) the request follows handoffFailurePolicy; ok is false when
// res is its answer.
func (s *Server) named(rq *request, set *discovery.Set) (res result, ok bool) {
	addr := rq.r.Header.Get(protocol.PrefillHeader)
	rq.r.Header.Del(protocol.PrefillHeader)
	switch reason := rq.r.Header.Get(protocol.DecodeOnlyHeader); {
	case addr != "" || reason == "":
	case len(set.Decode) == 0:
		return result{outcome: OutcomeNoEngine, status: http.StatusServiceUnavailable, msg: fmt.Sprintf("no ready decode engine (%s)", set.Source)}, false
	case reason == choice.DecodeOnlyShortPrompt || reason == choice.DecodeOnlyPrefixCached:
		// A client reaching the pod directly could send it too: it gets what a gateway
		// that failed open gives it, its request computed on this engine.
		return s.decodeAlone(rq, s.choose.Take(balance.Decode, set.Decode, rq.tokens), reason), false
	}
	if addr == "" {
		why := result{outcome: OutcomeNoEngine, status: http.StatusServiceUnavailable,
			msg: "no " + protocol.PrefillHeader + " header: the request came without the endpoint picker's prefill choice (a gateway that failed open?)"}
		if set.HandoffFailurePolicy == kvv1.HandoffFailureServeOnDecode {
			return s.serveOnDecode(rq, set, FallbackNoPrefillHeader, why), false
		}
		return why, false
	}
	// By host: a pod's address names one engine, whatever port the picker wrote (kvhandoff's
	// picker writes the engine's API port; llm-d's, its InferencePool's target port).
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		host = addr
	}
	for _, p := range set.Prefill {
		if h, _, _ := net.SplitHostPort(protocol.PrefillAddress(p.URL)); h == host {
			rq.prefer = p.EngineID
			return result{}, true
		}
	}
	s.m.unknownPrefill.Inc()
	s.cfg.Log.Warn("the endpoint picker named a prefill engine that is not a ready engine of the PrefillPool; choosing one", "request_id", rq.id,
		"named", addr, "source", set.Source)
	return result{}, true
}
