// Package router is kvhandoff's request path: an OpenAI-compatible HTTP front end that
// sends each request's prefill and decode legs to the engines of a DecodePool and its
// PrefillPool, the way vLLM's NIXL connectors expect (package protocol). In push mode
// the decode engine is chosen at arrival and both legs go out at once, so decode can
// register its blocks while prefill runs; in pull mode decode is chosen and sent after
// prefill returns its block ids. docs/router.md describes the protocol, selection,
// failures and metrics.
package router

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/health"
	"github.com/kvhandoff/kvhandoff/internal/load"
	"github.com/kvhandoff/kvhandoff/internal/router/balance"
	"github.com/kvhandoff/kvhandoff/internal/router/choice"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/kvfollow"
	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
)

// Config is the router's behaviour; Defaults has the values cmd/router starts with.
type Config struct {
	// PrefillTimeout bounds a prefill leg, from send to its whole response.
	PrefillTimeout time.Duration
	// DecodeTimeout bounds a decode leg from send to its first byte (in push mode that
	// includes the prefill, which runs at the same time).
	DecodeTimeout time.Duration
	// MaxBodyBytes is the largest request body accepted.
	MaxBodyBytes int64
	// BodyTimeout bounds receiving a request's body, from its headers to its last byte.
	BodyTimeout time.Duration
	// MaxInFlight bounds the requests the router serves at once; past it, a request is
	// answered 429 at once.
	MaxInFlight int
	// ScrapeInterval is how often engines' /metrics are read for their load; 0 never.
	ScrapeInterval time.Duration
	// PrefixIndexBlocks bounds the prefix index of each decode engine (routing
	// PrefixAware), in blocks; each engine's own KV capacity bounds it too.
	PrefixIndexBlocks int
	// KVEventsTokenFile holds the token the engines' kv-events sidecars ask for; set, the
	// prefix index follows the events of every engine that serves them.
	KVEventsTokenFile string
	// HealthWindow is how far back the health report (GET /health/transfer) looks, and
	// HealthInterval how often it is computed.
	HealthWindow, HealthInterval time.Duration
	// Local, when set, makes the router a decode pod's leg runner: its decode engine is
	// the one whose URL this is (as the DecodePool's status publishes it), and a request's
	// prefill engine is the one the gateway's endpoint picker named (protocol.PrefillHeader),
	// if it is a ready engine of the paired PrefillPool.
	Local string
	// Log gets one line per request and every change of endpoints.
	Log *slog.Logger
	// Registry gets the router's metrics; /metrics serves Gatherer.
	Registry prometheus.Registerer
	Gatherer prometheus.Gatherer
}

// Defaults are the router's defaults, the one place they are defined.
func Defaults() Config {
	return Config{
		PrefillTimeout:    5 * time.Minute,
		DecodeTimeout:     10 * time.Minute,
		MaxBodyBytes:      32 << 20,
		BodyTimeout:       30 * time.Second,
		MaxInFlight:       1024,
		ScrapeInterval:    time.Second,
		PrefixIndexBlocks: prefix.DefaultMaxBlocks,
		HealthWindow:      time.Minute,
		HealthInterval:    5 * time.Second,
	}
}

// Server routes requests over the engines of the latest Set.
type Server struct {
	cfg    Config
	set    atomic.Pointer[discovery.Set]
	bal    *balance.Balancer
	choose *choice.Chooser
	events *kvfollow.Follower
	client *http.Client
	m      *metrics
	mux    *http.ServeMux // clients'
	admin  *http.ServeMux // operators' (Admin)
	health atomic.Pointer[health.Report]
	// load counts what the manager's autoscaler reads (GET /load).
	load *load.Recorder

	// slots holds a token per request being served (MaxInFlight).
	slots chan struct{}
}

// New returns a router with no engines: it answers 503 until the first Update.
func New(cfg Config) *Server {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Registry == nil {
		r := prometheus.NewRegistry()
		cfg.Registry, cfg.Gatherer = r, r
	}
	s := &Server{
		cfg: cfg,
		client: &http.Client{Transport: &http.Transport{
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:        1024,
			MaxIdleConnsPerHost: 256,
			// Below vLLM's HTTP keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): the
			// router drops an idle connection before the engine closes it, so a leg
			// seldom meets a closing one (send re-sends it when it does).
			IdleConnTimeout: 4 * time.Second,
			// Bytes pass through as the engine sent them: the router never asks for,
			// nor undoes, compression.
			DisableCompression: true,
		}},
		m:     newMetrics(cfg.Registry),
		mux:   http.NewServeMux(),
		admin: http.NewServeMux(),
		slots: make(chan struct{}, max(cfg.MaxInFlight, 1)),
		load:  load.NewRecorder(),
	}
	a := choice.Assemble(choice.Config{Metrics: "kvhandoff_router", ScrapeInterval: cfg.ScrapeInterval, PrefixIndexBlocks: cfg.PrefixIndexBlocks,
		KVEventsTokenFile: cfg.KVEventsTokenFile, Registry: cfg.Registry, InFlight: s.m.inflight, Log: cfg.Log})
	s.bal, s.events, s.choose = a.Balancer, a.Events, a.Chooser
	s.mux.HandleFunc("POST /v1/completions", s.completions("/v1/completions"))
	s.mux.HandleFunc("POST /v1/chat/completions", s.completions("/v1/chat/completions"))
	s.mux.HandleFunc("GET /v1/models", s.models)
	// The probes answer on both listeners; what tells of the engines and their traffic
	// (metrics, the health report) only on the admin one, which is not the Service's.
	for _, m := range []*http.ServeMux{s.mux, s.admin} {
		m.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
		m.HandleFunc("GET /readyz", s.readyz)
		m.HandleFunc("GET /discovered", s.discovered)
	}
	if cfg.Gatherer != nil {
		s.admin.Handle("GET /metrics", promhttp.HandlerFor(cfg.Gatherer, promhttp.HandlerOpts{}))
	}
	s.admin.HandleFunc("GET /load", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(s.load.Report(time.Now()))
	})
	s.health.Store(&health.Report{})
	s.admin.HandleFunc("GET /health/transfer", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(s.health.Load().Encode()))
	})
	return s
}

// ServeHTTP serves clients: the OpenAI API and the probes.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// Admin serves the operators' side: /metrics, the health report (GET /health/transfer,
// which the manager polls) and the probes, on a listener of its own.
func (s *Server) Admin() http.Handler { return s.admin }

// Update makes set the one new requests route over. Requests in flight finish on the
// engines they were sent to.
func (s *Server) Update(set *discovery.Set) {
	if err := set.Validate(); err != nil {
		s.cfg.Log.Error("refusing an invalid set of engines; keeping the last one", "source", set.Source, "err", err)
		return
	}
	if s.cfg.Local != "" {
		set = set.WithDecode(s.cfg.Local)
	}
	old := s.set.Swap(set)
	s.choose.Forget(set)
	s.m.endpoints.WithLabelValues(string(balance.Prefill)).Set(float64(len(set.Prefill)))
	s.m.endpoints.WithLabelValues(string(balance.Decode)).Set(float64(len(set.Decode)))
	if old == nil || old.Mode != set.Mode || len(old.Prefill) != len(set.Prefill) || len(old.Decode) != len(set.Decode) {
		s.cfg.Log.Info("engines", "source", set.Source, "mode", set.Mode, "prefill", ids(set.Prefill), "decode", ids(set.Decode))
	}
}

func ids(es []discovery.Engine) []string {
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = e.EngineID
	}
	return out
}

// Run follows src, and scrapes the engines' load, until ctx ends.
func (s *Server) Run(ctx context.Context, src discovery.Source) error {
	if s.cfg.ScrapeInterval > 0 {
		go s.bal.Follow(ctx, s.client, s.cfg.ScrapeInterval, s.set.Load)
	}
	if s.cfg.Gatherer != nil && s.cfg.HealthInterval > 0 {
		go s.watchHealth(ctx)
	}
	defer s.events.Stop()
	return discovery.Follow(ctx, src, s.Update)
}

// readyz is ready when at least one prefill and one decode engine can be paired.
func (s *Server) readyz(w http.ResponseWriter, _ *http.Request) {
	set := s.set.Load()
	if set == nil {
		http.Error(w, "no engines discovered yet", http.StatusServiceUnavailable)
		return
	}
	if _, _, why := choice.Pairable(set, nil); why != "" {
		http.Error(w, why, http.StatusServiceUnavailable)
		return
	}
	fmt.Fprintf(w, "ok: %s mode, %d prefill and %d decode engines\n", set.Mode, len(set.Prefill), len(set.Decode))
}

// discovered is ready once the router has read its engine set, even one with no pair:
// it then answers every client, with a response or a refusal that says why (no ready
// prefill engine, …). It is the Deployment's readiness probe, not readyz: routers share
// one view of the engines, so while no pair is ready readyz fails on every replica, the
// Service is left without endpoints and clients get connection refused, which names
// nothing.
func (s *Server) discovered(w http.ResponseWriter, _ *http.Request) {
	if s.set.Load() == nil {
		http.Error(w, "no engines discovered yet", http.StatusServiceUnavailable)
		return
	}
	_, _ = w.Write([]byte("ok\n"))
}

// models answers from a decode engine: it serves the model the client will talk to.
func (s *Server) models(w http.ResponseWriter, r *http.Request) {
	set := s.set.Load()
	if set == nil || len(set.Decode) == 0 {
		writeError(w, http.StatusServiceUnavailable, "service_unavailable", "no ready decode engine to list models from")
		return
	}
	d, _ := s.bal.Pick(balance.Decode, set.Decode)
	req, err := http.NewRequestWithContext(r.Context(), http.MethodGet, d.URL+"/v1/models", nil)
	if err != nil {
		writeError(w, http.StatusInternalServerError, "internal_error", err.Error())
		return
	}
	copyClientHeaders(req.Header, r.Header)
	resp, err := s.client.Do(req)
	if err != nil {
		writeError(w, http.StatusBadGateway, "bad_gateway", fmt.Sprintf("decode engine %s: %v", d.EngineID, err))
		return
	}
	defer resp.Body.Close()
	_, _ = relay(w, resp, nil, nil, nil)
}

func newID(prefix string) string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// writeError answers with an OpenAI-style error object.
func writeError(w http.ResponseWriter, status int, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "type": typ, "code": status}})
}

// writeStreamError ends an event stream under way with an OpenAI-style error event.
func writeStreamError(w http.ResponseWriter, status int, msg string) {
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": errorType(status), "code": status}})
	_, _ = fmt.Fprintf(w, "data: %s\n\n", b)
	_ = http.NewResponseController(w).Flush()
}

// modeLabel is the mode as a metric label.
func modeLabel(m kvv1.TransferMode) string {
	if m == kvv1.TransferPush {
		return "push"
	}
	return "pull"
}
