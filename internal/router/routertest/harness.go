// Package routertest runs the router in-process against simulated vLLM engines behind
// real HTTP servers, for the router's own tests and the suites that put real transfer
// agents under it (test/agent).
package routertest

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/test/loopback"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
)

// Model is the model every simulated engine serves.
const Model = "tiny"

// Engine is a simulated vLLM engine behind a real HTTP server.
type Engine struct {
	*vllmserver.Server
	discovery.Engine
	KV *vllmserver.AgentKV // nil for engines without agents
}

// StartEngine starts a simulated engine whose KV is kv; prefill, when positive, is how
// long each prefill takes.
func StartEngine(t *testing.T, id string, kv vllmserver.KV, prefill time.Duration, tune ...func(*vllmserver.Config)) *Engine {
	t.Helper()
	cfg := vllmserver.Config{EngineID: id, Model: Model, SideChannelHost: "127.0.0.1", SideChannelPort: 5600, TP: 1, KV: kv}
	if prefill > 0 {
		cfg.PrefillTime = func(int) time.Duration { return prefill }
	}
	for _, f := range tune {
		f(&cfg)
	}
	s := vllmserver.New(cfg)
	hs := httptest.NewServer(s)
	t.Cleanup(hs.Close)
	return &Engine{Server: s, Engine: discovery.Engine{URL: hs.URL, EngineID: id, Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 1}}
}

// DeadEngine is an engine whose port refuses connections.
func DeadEngine(t *testing.T, id string) discovery.Engine {
	t.Helper()
	return discovery.Engine{URL: "http://" + loopback.Refusing(t), EngineID: id, Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 1}
}

// HangUpEngine is an engine whose process is going: it accepts a connection and closes
// it without an answer, as the kernel resets a connection an engine killed mid-accept (or
// a pooled one) held.
func HangUpEngine(t *testing.T, id string) discovery.Engine {
	t.Helper()
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close()
		}
	}))
	t.Cleanup(hs.Close)
	return discovery.Engine{URL: hs.URL, EngineID: id, Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 1}
}

// RequestLogs keeps the router's request log lines (JSON) for a test to read.
type RequestLogs struct {
	mu    sync.Mutex
	lines []map[string]any
}

func (l *RequestLogs) Write(p []byte) (int, error) {
	var rec map[string]any
	if json.Unmarshal(p, &rec) == nil && rec["msg"] == "request" {
		l.mu.Lock()
		l.lines = append(l.lines, rec)
		l.mu.Unlock()
	}
	return len(p), nil
}

// Lines are the request log lines so far.
func (l *RequestLogs) Lines() []map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]map[string]any(nil), l.lines...)
}

// LogTo sends the router's logs to l.
func LogTo(l *RequestLogs) func(*router.Config) {
	return func(c *router.Config) { c.Log = slog.New(slog.NewJSONHandler(l, nil)) }
}

// Router is a router serving on a test HTTP server, with its own metrics registry.
type Router struct {
	*router.Server
	URL string
	Reg *prometheus.Registry
}

// StartRouter starts a router of the given engines; tune edits its configuration first.
func StartRouter(t *testing.T, mode kvv1.TransferMode, prefill, decode []discovery.Engine, tune ...func(*router.Config)) *Router {
	t.Helper()
	cfg := router.Defaults()
	cfg.ScrapeInterval = 0
	reg := prometheus.NewRegistry()
	cfg.Registry, cfg.Gatherer = reg, reg
	for _, f := range tune {
		f(&cfg)
	}
	s := router.New(cfg)
	s.Update(&discovery.Set{Mode: mode, Prefill: prefill, Decode: decode, Source: "test"})
	hs := httptest.NewServer(s)
	t.Cleanup(hs.Close)
	return &Router{Server: s, URL: hs.URL, Reg: reg}
}

// Engines lists the engines' discovery records.
func Engines(es ...*Engine) []discovery.Engine {
	out := make([]discovery.Engine, len(es))
	for i, e := range es {
		out[i] = e.Engine
	}
	return out
}

// Post sends a body to the router and returns the response and its whole body.
func Post(t *testing.T, url, path, body string) (*http.Response, []byte) {
	t.Helper()
	// Bounded, so a request that can never finish fails the test instead of hanging it.
	c := &http.Client{Timeout: 30 * time.Second}
	resp, err := c.Post(url+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, data
}

// Metric sums the series of the router's registry whose labels include labels (0 if
// none): counts, gauges, and histograms' sample counts.
func (r *Router) Metric(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := r.Reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			case m.Histogram != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum
}

// Field decodes one field of a JSON body.
func Field(t *testing.T, body []byte, key string) json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatalf("%s: %v", body, err)
	}
	return m[key]
}

// CompletionText is the text of a non-streamed completion or chat completion.
func CompletionText(t *testing.T, body []byte) string {
	t.Helper()
	var r struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(body, &r); err != nil || len(r.Choices) != 1 {
		t.Fatalf("not a completion: %s (%v)", body, err)
	}
	return r.Choices[0].Text + r.Choices[0].Message.Content
}

// SSEText joins the text of every chunk of a server-sent-event stream.
func SSEText(t *testing.T, stream []byte) string {
	t.Helper()
	var text strings.Builder
	done := false
	for _, ev := range bytes.Split(stream, []byte("\n\n")) {
		data, ok := bytes.CutPrefix(ev, []byte("data: "))
		if !ok {
			continue
		}
		if string(data) == "[DONE]" {
			done = true
			continue
		}
		var c struct {
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(data, &c); err != nil {
			t.Fatalf("chunk %s: %v", data, err)
		}
		for _, ch := range c.Choices {
			text.WriteString(ch.Text + ch.Delta.Content)
		}
	}
	if !done {
		t.Fatalf("the stream did not end with [DONE]: %s", stream)
	}
	return text.String()
}

// Want is what a simulated engine answers to a completion prompt in n tokens.
func Want(prompt string, n int) string {
	return strings.Join(vllmserver.Output(strings.Fields(prompt), n), "")
}

// Eventually polls cond until it holds, failing the test after within.
func Eventually(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("not within %s: %s", within, what)
		case <-tick.C:
		}
	}
}

// StartHTTP serves h on a test HTTP server until the test ends.
func StartHTTP(t *testing.T, h http.Handler) string {
	t.Helper()
	hs := httptest.NewServer(h)
	t.Cleanup(hs.Close)
	return hs.URL
}

// Get is the status of a GET of url (0 when it cannot connect).
func Get(url string) int {
	resp, err := http.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}
