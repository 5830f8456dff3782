package router

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
)

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
		if res.cut {
			panic(http.ErrAbortHandler)
		}
	}
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

// relay copies an engine's response to the client as it arrives: headers, status, the
// first bytes already read, then every read flushed at once, so server-sent events pass
// through byte for byte and without delay. onFirst runs just after the first write, and
// onRead (when not nil) after each later one, with what it wrote.
func relay(w http.ResponseWriter, resp *http.Response, first []byte, onFirst func(), onRead func([]byte)) (int64, error) {
	h := w.Header()
	for _, k := range relayed {
		if vs := resp.Header.Values(k); len(vs) > 0 {
			h[k] = vs
		}
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
	if onFirst != nil {
		onFirst()
	}
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if werr := write(buf[:n]); werr != nil {
				return total, werr
			}
			if onRead != nil {
				onRead(buf[:n])
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

// relayed are the engine's response headers a client gets: what describes the body and
// how to retry. Anything else an engine sets (its server's name and version, cookies,
// headers of its own or of whatever sits in front of it) stays with the router.
var relayed = []string{"Content-Type", "Content-Encoding", "Cache-Control", "Retry-After"}

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
