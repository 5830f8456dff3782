package router

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router/balance"
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

	// What the request log and the metrics report.
	prefill, decode string
	retries         int
	fallback        string        // why the request was served on a decode engine alone, if it was
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
}

func (s *Server) completions(path string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		rq := &request{id: newID("kvh-"), path: path, w: w, r: r, start: time.Now()}
		w.Header().Set("X-Request-Id", rq.id)
		var res result
		select {
		case s.slots <- struct{}{}:
			func() {
				defer func() { <-s.slots }() // also when a handler panics (net/http recovers it)
				res = s.dispatch(rq)
			}()
		default:
			res = result{outcome: OutcomeOverloaded, status: http.StatusTooManyRequests,
				msg: fmt.Sprintf("the router is serving %d requests, its limit (--max-in-flight); retry later", cap(s.slots))}
		}
		if res.status != 0 {
			writeError(w, res.status, errorType(res.status), res.msg)
		}
		s.record(rq, res)
	}
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
	set := s.set.Load()
	if set == nil {
		return result{outcome: OutcomeNoEngine, status: http.StatusServiceUnavailable, msg: "no engines discovered yet"}
	}
	rq.mode = modeLabel(set.Mode)
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
	d, release := s.take(balance.Decode, set.Decode, rq.tokens)
	rq.decode = d.EngineID
	ctx, cancel := context.WithCancel(rq.r.Context())
	defer cancel()
	sent := time.Now()
	ds := s.decodeLeg(ctx, rq, d, release, rq.body.Marshal())
	rq.decodeTime = time.Since(sent)
	return s.finishDecode(rq, d, ds)
}

// attempts is how often a request's legs are sent: once, and once more on another
// prefill engine when the prefill leg fails.
const attempts = 2

// withRetry runs try (one attempt of a mode's legs) over the engines that can be paired,
// and once more without the prefill engine a failed attempt names. try reports whether
// its result is a prefill failure worth retrying; mark is where the router's own time of
// the attempt starts: the body's receipt, or the failure before a retry.
func (s *Server) withRetry(rq *request, set *discovery.Set, try func(prefills, decodes []discovery.Engine, mark time.Time) (res result, retry bool)) result {
	exclude := map[string]bool{}
	var failed result
	mark := rq.received
	for attempt := range attempts {
		prefills, decodes, why := pairable(set, exclude)
		if why != "" {
			if attempt > 0 {
				return failed
			}
			return result{outcome: OutcomeNoEngine, status: http.StatusServiceUnavailable, msg: why}
		}
		rq.retries = attempt
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
		s.m.retries.WithLabelValues(rq.mode).Inc()
		s.cfg.Log.Warn("prefill leg failed; retrying on another prefill engine", "request_id", rq.id, "mode", rq.mode, "prefill", res.engine, "err", res.msg)
	}
	return failed
}

// push chooses the decode engine at arrival and sends both legs at once: decode
// registers its blocks with the prefill engine while prefill runs. A prefill leg that
// fails before decode has answered aborts the decode leg (closing its connection aborts
// the request in vLLM, which frees its blocks) before the pair is tried again.
func (s *Server) push(rq *request, set *discovery.Set) result {
	return s.withRetry(rq, set, func(prefills, decodes []discovery.Engine, mark time.Time) (result, bool) {
		d, releaseD := s.take(balance.Decode, decodes, rq.tokens)
		p, releaseP := s.take(balance.Prefill, sameHash(prefills, d.CompatHash), rq.tokens)
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
		go func() { prefillDone <- s.prefillLeg(ctx, rq, p, releaseP, prefillBody, false) }()
		decodeStarted := make(chan *decodeStart, 1)
		go func() { decodeStarted <- s.decodeLeg(ctx, rq, d, releaseD, decodeBody) }()

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
			ds = <-decodeStarted
		case ds = <-decodeStarted:
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
		return s.finishDecode(rq, d, ds), false
	})
}

// errAnswered cancels a push request's prefill leg once the client has its answer.
var errAnswered = errors.New("the request was answered")

// pull sends the prefill leg first and chooses the decode engine when it returns; the
// decode leg carries the prefill engine's kv_transfer_params, and decode reads the
// blocks.
func (s *Server) pull(rq *request, set *discovery.Set) result {
	return s.withRetry(rq, set, func(prefills, _ []discovery.Engine, mark time.Time) (result, bool) {
		p, releaseP := s.take(balance.Prefill, prefills, rq.tokens)
		rq.prefill = p.EngineID
		rq.added = time.Since(mark)
		pr := s.prefillLeg(rq.r.Context(), rq, p, releaseP, protocol.PrefillLeg(rq.body, "").Marshal(), true)
		got := time.Now()
		rq.prefillTime = pr.took
		if pr.res.outcome != "" {
			return pr.res, pr.res.outcome == OutcomePrefillFailed
		}
		s.m.leg.WithLabelValues(rq.mode, "prefill").Observe(pr.took.Seconds())

		// Decode is chosen now, among engines of the prefill engine's configuration.
		cur := s.set.Load()
		_, decodes, _ := pairable(cur, nil)
		decodes = sameHash(decodes, p.CompatHash)
		if len(decodes) == 0 {
			return result{outcome: OutcomeNoEngine, status: http.StatusServiceUnavailable, msg: fmt.Sprintf("no ready decode engine with prefill "+
				"engine %s's compat-hash %q (%s)", p.EngineID, p.CompatHash, cur.Source)}, false
		}
		d, releaseD := s.take(balance.Decode, decodes, rq.tokens)
		rq.decode = d.EngineID
		body := protocol.PullDecodeLeg(rq.body, pr.params).Marshal()
		ctx, cancel := context.WithCancel(rq.r.Context())
		defer cancel()
		rq.added += time.Since(got)
		sent := time.Now()
		ds := s.decodeLeg(ctx, rq, d, releaseD, body)
		rq.decodeTime = time.Since(sent)
		s.m.leg.WithLabelValues(rq.mode, "decode").Observe(rq.decodeTime.Seconds())
		return s.finishDecode(rq, d, ds), false
	})
}

// readBody reads the client's body within timeout. A body's buffer is allocated from its
// announced length only up to preallocBody (a 100 KB prompt is then not copied through a
// growing buffer); past that it grows as bytes arrive, so a client that announces a large
// body and stalls holds no more than it sent.
func readBody(rq *request, limit int64, timeout time.Duration) ([]byte, error) {
	rc := http.NewResponseController(rq.w)
	if err := rc.SetReadDeadline(time.Now().Add(timeout)); err == nil {
		defer rc.SetReadDeadline(time.Time{})
	}
	r := http.MaxBytesReader(rq.w, rq.r.Body, limit)
	if n := rq.r.ContentLength; n > 0 && n <= min(limit, preallocBody) {
		buf := make([]byte, n)
		if _, err := io.ReadFull(r, buf); err != nil {
			return nil, err
		}
		return buf, nil
	}
	var buf bytes.Buffer
	_, err := buf.ReadFrom(r)
	return buf.Bytes(), err
}

// preallocBody is the largest body whose buffer is allocated from its announced length.
const preallocBody = 1 << 20

func sameHash(es []discovery.Engine, hash string) []discovery.Engine {
	var out []discovery.Engine
	for _, e := range es {
		if e.CompatHash == hash {
			out = append(out, e)
		}
	}
	return out
}

type legResult struct {
	res    result
	params []byte // pull: the prefill engine's kv_transfer_params
	took   time.Duration
}

// prefillLeg sends a prefill leg and reads its whole response, then calls release (the
// engine's count from take). A refused connection, a
// timeout, a 5xx or (pull) a response without kv_transfer_params is a failure to retry
// elsewhere; a 4xx is the client's request refused, answered as the engine said.
func (s *Server) prefillLeg(ctx context.Context, rq *request, e discovery.Engine, release func(), body []byte, needParams bool) legResult {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.PrefillTimeout)
	defer cancel()
	defer release()
	start := time.Now()
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
		if out.params, err = protocol.PrefillParams(data); err != nil {
			return fail("no_kv_transfer_params", err.Error())
		}
	}
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
func (s *Server) decodeLeg(ctx context.Context, rq *request, e discovery.Engine, release func(), body []byte) *decodeStart {
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

type releasingBody struct {
	io.ReadCloser
	release func()
}

func (b *releasingBody) Close() error { err := b.ReadCloser.Close(); b.release(); return err }

// readSome reads until it has at least one byte, the end, or an error.
func readSome(r io.Reader, buf []byte) (int, error) {
	for {
		n, err := r.Read(buf)
		if n > 0 || err != nil {
			return n, err
		}
	}
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
	written, err := relay(rq.w, ds.resp, ds.first, func() {
		rq.firstByte = time.Now()
		rq.relay = rq.firstByte.Sub(ds.at)
		rq.added += rq.relay
	})
	if err != nil {
		if rq.r.Context().Err() != nil {
			return result{outcome: OutcomeClientGone, engine: e.EngineID, msg: "the client disconnected mid-stream; the decode leg was cancelled"}
		}
		s.m.legFails.WithLabelValues("decode", e.EngineID, "broken").Inc()
		s.cfg.Log.Error("decode stream broke after its first byte", "request_id", rq.id, "decode", e.EngineID, "bytes", written, "err", err)
		// The status is sent: abort the client's connection so it sees a truncated
		// response rather than a complete-looking one.
		panic(http.ErrAbortHandler)
	}
	return result{outcome: outcome, engine: e.EngineID}
}

// relay copies an engine's response to the client as it arrives: headers, status, the
// first bytes already read, then every read flushed at once, so server-sent events pass
// through byte for byte and without delay. onFirst runs just after the first write.
func relay(w http.ResponseWriter, resp *http.Response, first []byte, onFirst ...func()) (int64, error) {
	h := w.Header()
	for k, vs := range resp.Header {
		if hopByHop[http.CanonicalHeaderKey(k)] || k == "X-Request-Id" {
			continue
		}
		h[k] = vs
	}
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	var total int64
	write := func(p []byte) error {
		n, err := w.Write(p)
		total += int64(n)
		if err != nil {
			return err
		}
		return rc.Flush()
	}
	if err := write(first); err != nil {
		return total, err
	}
	for _, f := range onFirst {
		f()
	}
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if werr := write(buf[:n]); werr != nil {
				return total, werr
			}
		}
		if errors.Is(err, io.EOF) {
			return total, nil
		}
		if err != nil {
			return total, err
		}
	}
}

var hopByHop = map[string]bool{
	"Connection": true, "Keep-Alive": true, "Proxy-Authenticate": true, "Proxy-Authorization": true,
	"Te": true, "Trailer": true, "Transfer-Encoding": true, "Upgrade": true, "Content-Length": true,
}

// send posts a leg to an engine with the request's id and the client's end-to-end
// headers (credentials, tracing).
func (s *Server) send(ctx context.Context, rq *request, e discovery.Engine, body []byte) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(e.URL, "/")+rq.path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	copyClientHeaders(req.Header, rq.r.Header)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", rq.legID())
	// A leg may be sent again on a new connection when the kept-alive one it went out on
	// fails before a byte of answer (the engine's server closed it as idle just as the
	// leg was written): net/http does that for requests marked replayable, and the
	// engine never acted on such a leg. An empty Idempotency-Key marks it without
	// sending the header.
	req.Header["Idempotency-Key"] = nil
	return s.client.Do(req)
}

// forwarded are the client's headers that legs carry: credentials the engines may
// check, and trace context.
var forwarded = []string{"Authorization", "Traceparent", "Tracestate", "Baggage", "User-Agent", "Accept"}

func copyClientHeaders(dst, src http.Header) {
	for _, k := range forwarded {
		if v := src.Values(k); len(v) > 0 {
			dst[k] = v
		}
	}
}

// transportReason names why a leg failed to get a response, for the metrics.
func transportReason(ctx context.Context, err error) string {
	if errors.Is(err, context.DeadlineExceeded) || (ctx != nil && errors.Is(ctx.Err(), context.DeadlineExceeded)) {
		return "timeout"
	}
	if errors.Is(err, context.Canceled) {
		return "cancelled"
	}
	if strings.Contains(err.Error(), "connection refused") {
		return "refused"
	}
	return "broken"
}

// engineMessage is an engine's error message, or its body when it is not one.
func engineMessage(body []byte) string {
	return fmt.Sprintf("%.512s", bytes.TrimSpace(body))
}

func errorType(status int) string {
	switch {
	case status == http.StatusServiceUnavailable:
		return "service_unavailable"
	case status == http.StatusTooManyRequests:
		return "rate_limit_exceeded"
	case status == http.StatusBadGateway:
		return "bad_gateway"
	case status >= 500:
		return "internal_error"
	default:
		return "invalid_request_error"
	}
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
