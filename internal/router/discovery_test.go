package router_test

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/router"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/routertest"
	"github.com/kvhandoff/kvhandoff/test/simengine/vllmserver"
)

func writeEndpoints(t *testing.T, path string, s discovery.Set) {
	t.Helper()
	data, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	// Replace, as editors and ConfigMap mounts do.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func TestTheRouterFollowsItsEndpointsFile(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	p, d1, d2 := routertest.StartEngine(t, "p-0", kv, 0), routertest.StartEngine(t, "d-1", kv, 0), routertest.StartEngine(t, "d-2", kv, 0)
	path := filepath.Join(t.TempDir(), "endpoints.json")
	writeEndpoints(t, path, discovery.Set{Mode: kvv1.TransferPush, Prefill: routertest.Engines(p), Decode: routertest.Engines(d1)})

	cfg := router.Defaults()
	cfg.ScrapeInterval = 0
	cfg.Registry = prometheus.NewRegistry()
	s := router.New(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = s.Run(ctx, &discovery.File{Path: path}) }()
	hs := routertest.StartHTTP(t, s)

	routertest.Eventually(t, "the router reads the file", 2*time.Second, func() bool { return routertest.Get(hs+"/readyz") == http.StatusOK })
	if resp, body := routertest.Post(t, hs, "/v1/completions", small); resp.StatusCode != http.StatusOK || len(d1.Seen()) != 1 {
		t.Fatalf("%s %s; d-1 saw %d legs", resp.Status, body, len(d1.Seen()))
	}

	// The pool changes: d-1 leaves, d-2 joins, and the mode becomes Pull.
	writeEndpoints(t, path, discovery.Set{Mode: kvv1.TransferPull, Prefill: routertest.Engines(p), Decode: routertest.Engines(d2)})
	routertest.Eventually(t, "requests reach the new decode engine", 2*time.Second, func() bool {
		resp, _ := routertest.Post(t, hs, "/v1/completions", small)
		return resp.StatusCode == http.StatusOK && len(d2.Seen()) > 0
	})
	n := len(d1.Seen())
	for range 3 {
		routertest.Post(t, hs, "/v1/completions", small)
	}
	if len(d1.Seen()) != n {
		t.Error("a request went to a decode engine that left the file")
	}
	if params(t, d2.Seen()[len(d2.Seen())-1].Body)["remote_block_ids"] == nil {
		t.Error("the mode change did not take: the decode leg carries no block ids")
	}

	// A broken file is refused; the last good set stays.
	if err := os.WriteFile(path, []byte(`{"mode":"Sideways","prefill":[],"decode":[]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	resp, _ := routertest.Post(t, hs, "/v1/completions", small)
	if resp.StatusCode != http.StatusOK {
		t.Errorf("after an invalid file: %s; the last good endpoints must stay", resp.Status)
	}
}

func TestReadFileNamesTheFieldThatIsWrong(t *testing.T) {
	dir := t.TempDir()
	for body, wantErr := range map[string]string{
		`{"mode":"Push","prefill":[{"url":"http://a:1","engineID":"p"}],"decode":[]}`: "prefill[0]: host, sideChannelPort and " +
			"tensorParallelSize must be set in Push mode",
		`{"mode":"Pull","prefill":[{"url":"a:1","engineID":"p"}],"decode":[]}`:                                            `prefill[0].url "a:1"`,
		`{"mode":"Pull","prefill":[],"decode":[{"url":"http://a:1"}]}`:                                                    "decode[0].engineID: must be set",
		`{"mode":"Pull","prefill":[],"decode":[{"url":"http://a:1","engineID":"d"},{"url":"http://b:1","engineID":"d"}]}`: `decode[1].engineID "d": appears twice`,
		`{"mode":"Pull","prefill":[],"decode":[],"extra":1}`:                                                              `unknown field "extra"`,
		`{"mode":"pull","prefill":[],"decode":[]}`:                                                                        `mode is "pull": must be Push or Pull`,
	} {
		path := filepath.Join(dir, "e.json")
		if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := discovery.ReadFile(path)
		if err == nil || !contains(err.Error(), wantErr) {
			t.Errorf("%s: error %v, want one containing %q", body, err, wantErr)
		}
	}
}

func contains(s, sub string) bool {
	return len(sub) == 0 || (len(s) >= len(sub) && (s[:len(sub)] == sub || contains(s[1:], sub)))
}

func TestLoadSpreadsOverEngines(t *testing.T) {
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		t.Run(string(mode), func(t *testing.T) {
			kv := vllmserver.NewLocalKV()
			// Prefill takes long enough that all requests are outstanding at once.
			p1, p2 := routertest.StartEngine(t, "p-1", kv, 300*time.Millisecond), routertest.StartEngine(t, "p-2", kv, 300*time.Millisecond)
			d1, d2 := routertest.StartEngine(t, "d-1", kv, 0), routertest.StartEngine(t, "d-2", kv, 0)
			r := routertest.StartRouter(t, mode, routertest.Engines(p1, p2), routertest.Engines(d1, d2))
			var wg sync.WaitGroup
			for range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if resp, body := routertest.Post(t, r.URL, "/v1/completions", small); resp.StatusCode != http.StatusOK {
						t.Errorf("%s: %s", resp.Status, body)
					}
				}()
			}
			wg.Wait()
			for _, e := range []*routertest.Engine{p1, p2, d1, d2} {
				if n := len(e.Seen()); n < 3 || n > 5 {
					t.Errorf("%s got %d of 8 requests; equal engines must share the load", e.EngineID, n)
				}
			}
		})
	}
}

func TestDecodeSelectionAvoidsAnEngineItsMetricsSayIsBusy(t *testing.T) {
	kv := vllmserver.NewLocalKV()
	p := routertest.StartEngine(t, "p-0", kv, 0)
	busy, idle := routertest.StartEngine(t, "d-busy", kv, 0), routertest.StartEngine(t, "d-idle", kv, 0)
	// d-busy exports a long queue (requests from other routers, say).
	var scrapes atomic.Int32
	busyMetrics := routertest.StartHTTP(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			scrapes.Add(1)
			_, _ = w.Write([]byte("vllm:num_requests_running{engine=\"0\"} 40\nvllm:num_requests_waiting{engine=\"0\"} 12\nvllm:kv_cache_usage_perc 0.5\n"))
			return
		}
		busy.ServeHTTP(w, r)
	}))
	be := busy.Engine
	be.URL = busyMetrics
	r := routertest.StartRouter(t, kvv1.TransferPull, routertest.Engines(p), []discovery.Engine{be, idle.Engine}, func(c *router.Config) { c.ScrapeInterval = 20 * time.Millisecond })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_ = r.Run(ctx, staticSource{&discovery.Set{Mode: kvv1.TransferPull, Prefill: routertest.Engines(p), Decode: []discovery.Engine{be, idle.Engine}, Source: "test"}})
	}()
	// A second scrape of d-busy has begun only after the first one's numbers were taken in
	// (the scraper reads engines in turn); before that the two engines look alike.
	routertest.Eventually(t, "the router scraped d-busy twice", 5*time.Second, func() bool { return scrapes.Load() >= 2 })
	before := len(busy.Seen())
	for range 5 {
		routertest.Post(t, r.URL, "/v1/completions", small)
	}
	if len(busy.Seen()) != before {
		t.Errorf("the router sent %d requests to an engine exporting 52 queued while another was idle", len(busy.Seen())-before)
	}
}

type staticSource struct{ s *discovery.Set }

func (s staticSource) Run(ctx context.Context, out chan<- *discovery.Set) error {
	select {
	case out <- s.s:
	case <-ctx.Done():
	}
	return nil
}

// A router whose engines are all gone stays ready (/discovered, its readiness probe) and
// refuses each client with a status naming why; /readyz says there is no pair. Were it
// unready, every replica would leave the Service at once (they share one view of the
// engines) and clients would get connection refused, which names nothing.
func TestARouterWithoutEnginesStaysInTheServiceAndSaysWhy(t *testing.T) {
	path := filepath.Join(t.TempDir(), "endpoints.json")
	cfg := router.Defaults()
	cfg.ScrapeInterval = 0
	cfg.Registry = prometheus.NewRegistry()
	s := router.New(cfg)
	hs := routertest.StartHTTP(t, s)
	if code := routertest.Get(hs + "/discovered"); code != http.StatusServiceUnavailable {
		t.Errorf("/discovered before the router read its engines: %d, want 503", code)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The file exists before the router starts: File.Run refuses a missing one.
	writeEndpoints(t, path, discovery.Set{Mode: kvv1.TransferPush})
	go func() { _ = s.Run(ctx, &discovery.File{Path: path}) }()
	routertest.Eventually(t, "the router reads the file", 2*time.Second, func() bool { return routertest.Get(hs+"/discovered") == http.StatusOK })
	if code := routertest.Get(hs + "/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz without engines: %d, want 503", code)
	}
	if resp, body := routertest.Post(t, hs, "/v1/completions", small); resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "no ready") {
		t.Errorf("a request without engines: %s %s, want 503 naming what is missing", resp.Status, body)
	}
}
