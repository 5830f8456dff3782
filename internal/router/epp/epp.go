// Package epp is kvhandoff's endpoint picker for the Gateway API Inference Extension: an
// Envoy ext_proc server that, per request, picks the decode engine (the endpoint the
// gateway sends the request to: that engine pod's leg runner) and the prefill engine of
// its compat-hash with the router's engine choice (package choice), and says so in the
// headers and metadata the EPP protocol and llm-d define. The leg runner in the decode
// pod then runs both legs. docs/gateway.md describes the path.
//
// Who reaches it: the gateway's ext_proc client (Envoy), on the EPP Service's gRPC port.
// What it trusts: nothing a client sent. Routing headers in the client's request are
// removed before the gateway routes, and the prefill it names is checked again by the leg
// runner against its own PrefillPool, so a forged header reaches no other address.
package epp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/router/balance"
	"github.com/kvhandoff/kvhandoff/internal/router/choice"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
)

// The EPP protocol's names (GIE docs/proposals/004-endpoint-picker-protocol) and llm-d's
// prefill header (llm-d-router pkg/common/routing).
const (
	// DestinationHeader and the envoy.lb metadata key of the same name carry the picked
	// decode endpoints, "ip:port[,ip:port…]", in order of preference.
	DestinationHeader = "x-gateway-destination-endpoint"
	// MetadataNamespace wraps the destination in the response's dynamic metadata and the
	// served endpoint in the request's metadata context.
	MetadataNamespace = "envoy.lb"
	// ServedKey is the endpoint that served the request, reported back by the gateway.
	ServedKey = "x-gateway-destination-endpoint-served"
	// SubsetNamespace and SubsetKey carry the gateway's subset hint: the endpoints the
	// EPP must pick from.
	SubsetNamespace = "envoy.lb.subset_hint"
	SubsetKey       = "x-gateway-destination-endpoint-subset"
	// PrefillHeader is the prefill engine's "ip:port" (its OpenAI API), llm-d's header.
	PrefillHeader = "x-prefiller-host-port"
)

// routingHeaders are what a client may not set: the gateway routes by them and the leg
// runner dials by them.
var routingHeaders = []string{DestinationHeader, PrefillHeader}

// Config is the picker's behaviour.
type Config struct {
	// LegRunnerPort is the decode pods' leg-runner port: the endpoints the gateway gets
	// are each decode engine's pod address on it.
	LegRunnerPort int32
	// Fallbacks is how many more decode endpoints follow the first, for a gateway that
	// retries down the list. 0 for Envoy's ORIGINAL_DST cluster, which takes one endpoint
	// (a list there is no destination at all).
	Fallbacks int
	// MaxBodyBytes is the largest request body read; past it the request is refused 413.
	MaxBodyBytes int64
	// MaxInFlight is how many requests may be picked for and unfinished at once; past it
	// a request is answered 429 (shed) at once.
	MaxInFlight int
	// ScrapeInterval is how often engines' /metrics are read for their load; 0 never.
	ScrapeInterval time.Duration
	Log            *slog.Logger
	Registry       prometheus.Registerer
}

// Defaults are the picker's defaults.
func Defaults() Config {
	return Config{LegRunnerPort: 8100, MaxBodyBytes: 32 << 20, MaxInFlight: 4096, ScrapeInterval: time.Second}
}

// Server picks endpoints over the engines of the latest Set.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	cfg    Config
	set    atomic.Pointer[discovery.Set]
	bal    *balance.Balancer
	choose *choice.Chooser
	health *health.Server
	m      *metrics
	slots  chan struct{}
}

// New returns a picker with no engines: it answers 503 and reports NOT_SERVING for
// readiness until the first Update.
func New(cfg Config) *Server {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	m := newMetrics(cfg.Registry)
	bal := balance.New(5 * max(cfg.ScrapeInterval, time.Second))
	s := &Server{cfg: cfg, bal: bal, choose: choice.New(bal, m.inflight), health: health.NewServer(), m: m,
		slots: make(chan struct{}, max(cfg.MaxInFlight, 1))}
	s.health.SetServingStatus(Liveness, healthpb.HealthCheckResponse_SERVING)
	for _, svc := range []string{Readiness, extprocv3.ExternalProcessor_ServiceDesc.ServiceName} {
		s.health.SetServingStatus(svc, healthpb.HealthCheckResponse_NOT_SERVING)
	}
	return s
}

// The gRPC health services the EPP protocol names.
const (
	Liveness  = "liveness"
	Readiness = "readiness"
)

// Register adds the ext_proc and health services to g.
func (s *Server) Register(g *grpc.Server) {
	extprocv3.RegisterExternalProcessorServer(g, s)
	healthpb.RegisterHealthServer(g, s.health)
}

// Update makes set the one new requests are picked from. Readiness follows whether a
// prefill and a decode engine can be paired.
func (s *Server) Update(set *discovery.Set) {
	if err := set.Validate(); err != nil {
		s.cfg.Log.Error("refusing an invalid set of engines; keeping the last one", "source", set.Source, "err", err)
		return
	}
	s.set.Store(set)
	s.choose.Forget(set)
	st := healthpb.HealthCheckResponse_SERVING
	if _, _, why := choice.Pairable(set, nil); why != "" {
		st = healthpb.HealthCheckResponse_NOT_SERVING
	}
	for _, svc := range []string{Readiness, extprocv3.ExternalProcessor_ServiceDesc.ServiceName} {
		s.health.SetServingStatus(svc, st)
	}
}

// Run follows src, and scrapes the engines' load, until ctx ends.
func (s *Server) Run(ctx context.Context, src discovery.Source, client *http.Client) error {
	if s.cfg.ScrapeInterval > 0 {
		go s.bal.Follow(ctx, client, s.cfg.ScrapeInterval, s.set.Load)
	}
	defer s.health.Shutdown() // NOT_SERVING from the moment the picker stops
	return discovery.Follow(ctx, src, s.Update)
}

// Endpoint is where the gateway sends a decode engine's requests: its pod address on the
// leg-runner port.
func (s *Server) Endpoint(e discovery.Engine) string {
	return net.JoinHostPort(urlHost(e.URL), strconv.Itoa(int(s.cfg.LegRunnerPort)))
}

// PrefillAddress is the prefill engine as the leg runner finds it: its API's host:port.
func PrefillAddress(e discovery.Engine) string {
	u, err := url.Parse(e.URL)
	if err != nil {
		return ""
	}
	return u.Host
}

func urlHost(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return ""
	}
	return u.Hostname()
}

// picked is one request's choice, counted on both engines until release.
type picked struct {
	destinations []string
	prefill      string
	release      func()
}

// refusal is a request the picker answers itself: its HTTP status and why.
type refusal struct {
	status  int
	outcome string
	msg     string
}

func (r *refusal) Error() string { return r.msg }

// pick chooses a request's decode endpoints and prefill engine. subset, when not nil,
// is the gateway's hint: only those endpoints may be picked.
func (s *Server) pick(subset map[string]bool, tokens int) (*picked, error) {
	set := s.set.Load()
	if set == nil {
		return nil, &refusal{http.StatusServiceUnavailable, OutcomeNoEngine, "no engines discovered yet"}
	}
	prefills, decodes, why := choice.Pairable(set, nil)
	if why != "" {
		return nil, &refusal{http.StatusServiceUnavailable, OutcomeNoEngine, why}
	}
	if subset != nil {
		var in []discovery.Engine
		for _, d := range decodes {
			if subset[s.Endpoint(d)] {
				in = append(in, d)
			}
		}
		if len(in) == 0 {
			return nil, &refusal{http.StatusServiceUnavailable, OutcomeNoEngine, fmt.Sprintf(
				"none of the %d endpoints of the gateway's subset hint is a ready decode engine that can be paired (%s)", len(subset), set.Source)}
		}
		decodes = in
	}
	p, d := s.choose.Push(prefills, decodes, tokens)
	out := &picked{destinations: []string{s.Endpoint(d.Engine)}, prefill: PrefillAddress(p.Engine),
		release: func() { p.Release(); d.Release() }}
	// Fallbacks: other decode engines of the same compat-hash, best first, so that the
	// prefill engine named for the first pairs with each of them too.
	rest := choice.SameHash(decodes, d.CompatHash)
	for len(out.destinations) <= s.cfg.Fallbacks {
		var others []discovery.Engine
		for _, e := range rest {
			if !contains(out.destinations, s.Endpoint(e)) {
				others = append(others, e)
			}
		}
		e, ok := s.bal.Pick(balance.Decode, others)
		if !ok {
			break
		}
		out.destinations = append(out.destinations, s.Endpoint(e))
	}
	return out, nil
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// Process serves one request's ext_proc stream. Envoy sends the request's headers, its
// body in chunks (FULL_DUPLEX_STREAMED), then the response's headers and body. The picker
// answers the headers only once it has the whole body (the prompt's length weighs the
// choice), then the body chunks; the response passes through unchanged.
func (s *Server) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	r := &stream{s: s, srv: srv, start: time.Now()}
	defer r.finish()
	for {
		req, err := srv.Recv()
		if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return status.Errorf(codes.Unknown, "receiving from the gateway: %v", err)
		}
		done, err := r.handle(req)
		if err != nil {
			return status.Errorf(codes.Unknown, "answering the gateway: %v", err)
		}
		if done {
			return nil
		}
	}
}
