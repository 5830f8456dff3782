package router_test

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

const model = "tiny"

// engine is a simulated vLLM engine behind a real HTTP server.
type engine struct {
	*vllmserver.Server
	discovery.Engine
	kv *vllmserver.AgentKV // nil for engines without agents
}

func startEngine(t *testing.T, id string, kv vllmserver.KV, prefill time.Duration, tune ...func(*vllmserver.Config)) *engine {
	t.Helper()
	cfg := vllmserver.Config{EngineID: id, Model: model, SideChannelHost: "127.0.0.1", SideChannelPort: 5600, TP: 1, KV: kv}
	if prefill > 0 {
		cfg.PrefillTime = func(int) time.Duration { return prefill }
	}
	for _, f := range tune {
		f(&cfg)
	}
	s := vllmserver.New(cfg)
	hs := httptest.NewServer(s)
	t.Cleanup(hs.Close)
	return &engine{Server: s, Engine: discovery.Engine{URL: hs.URL, EngineID: id, Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 1}}
}

// deadEngine is an engine whose port refuses connections.
func deadEngine(t *testing.T, id string) discovery.Engine {
	t.Helper()
	return discovery.Engine{URL: "http://" + loopback.Refusing(t), EngineID: id, Host: "127.0.0.1", SideChannelPort: 5600, TensorParallelSize: 1}
}

// requestLogs keeps the router's request log lines (JSON) for a test to read.
type requestLogs struct {
	mu    sync.Mutex
	lines []map[string]any
}

func (l *requestLogs) Write(p []byte) (int, error) {
	var rec map[string]any
	if json.Unmarshal(p, &rec) == nil && rec["msg"] == "request" {
		l.mu.Lock()
		l.lines = append(l.lines, rec)
		l.mu.Unlock()
	}
	return len(p), nil
}

func (l *requestLogs) get() []map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]map[string]any(nil), l.lines...)
}

// logTo sends the router's logs to l.
func logTo(l *requestLogs) func(*router.Config) {
	return func(c *router.Config) { c.Log = slog.New(slog.NewJSONHandler(l, nil)) }
}

type testRouter struct {
	*router.Server
	URL string
	reg *prometheus.Registry
}

func startRouter(t *testing.T, mode kvv1.TransferMode, prefill, decode []discovery.Engine, tune ...func(*router.Config)) *testRouter {
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
	return &testRouter{Server: s, URL: hs.URL, reg: reg}
}

func engines(es ...*engine) []discovery.Engine {
	out := make([]discovery.Engine, len(es))
	for i, e := range es {
		out[i] = e.Engine
	}
	return out
}

// post sends a body to the router and returns the response and its whole body.
func post(t *testing.T, url, path, body string) (*http.Response, []byte) {
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

// metric sums the series of the router's registry whose labels include labels (0 if
// none): counts, gauges, and histograms' sample counts.
func (r *testRouter) metric(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := r.reg.Gather()
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

// field decodes one field of a JSON body.
func field(t *testing.T, body []byte, key string) json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatalf("%s: %v", body, err)
	}
	return m[key]
}

// completionText is the text of a non-streamed completion or chat completion.
func completionText(t *testing.T, body []byte) string {
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

// sseText joins the text of every chunk of a server-sent-event stream.
func sseText(t *testing.T, stream []byte) string {
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

func want(prompt string, n int) string {
	return strings.Join(vllmserver.Output(strings.Fields(prompt), n), "")
}

func eventually(t *testing.T, what string, within time.Duration, cond func() bool) {
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

func startHTTP(t *testing.T, h http.Handler) string {
	t.Helper()
	hs := httptest.NewServer(h)
	t.Cleanup(hs.Close)
	return hs.URL
}

func get(url string) int {
	resp, err := http.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}
