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
	"slices"
	"strconv"
	"sync"
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
	"github.com/kvhandoff/kvhandoff/internal/router/kvfollow"
	"github.com/kvhandoff/kvhandoff/internal/router/prefix"
	"github.com/kvhandoff/kvhandoff/internal/router/protocol"
)

// Config is the picker's behaviour.
type Config struct {
	// LegRunnerPorts are the decode pods' leg-runner ports, the InferencePool's target
	// ports: one per data-parallel rank, each its own endpoint (its pod address on the
	// port). One for engines without data parallelism.
	LegRunnerPorts []int32
	// Fallbacks is how many more decode endpoints follow the first, for a gateway that
	// retries down the list. 0 for Envoy's ORIGINAL_DST cluster, which takes one endpoint
	// (a list there is no destination at all).
	Fallbacks int
	// MaxBodyBytes is the largest request body read; past it the request is refused 413.
	MaxBodyBytes int64
	// MaxInFlight is how many requests (ext_proc streams past their headers) may be
	// unfinished at once; past it a request is answered 429 (shed) at once.
	MaxInFlight int
	// MaxBufferedBytes bounds the request bodies the picker holds at once, all streams
	// together; past it a request is answered 429 (shed).
	MaxBufferedBytes int64
	// BodyTimeout bounds a stream's request side, from its start to its route: a stream
	// that has not sent its whole request by then is answered 408 and ended.
	BodyTimeout time.Duration
	// MaxStreamDuration bounds a stream's whole life, its response included.
	MaxStreamDuration time.Duration
	// ScrapeInterval is how often engines' /metrics are read for their load; 0 never.
	ScrapeInterval time.Duration
	// PrefixIndexBlocks bounds the prefix index of each decode engine (routing
	// PrefixAware), in blocks; each engine's own KV capacity bounds it too.
	PrefixIndexBlocks int
	// KVEventsTokenFile holds the token the engines' kv-events sidecars ask for; set, the
	// prefix index follows the events of every engine that serves them.
	KVEventsTokenFile string
	Log               *slog.Logger
	Registry          prometheus.Registerer
}

// Defaults are the picker's defaults.
func Defaults() Config {
	return Config{LegRunnerPorts: []int32{8100}, MaxBodyBytes: 32 << 20, MaxInFlight: 4096, MaxBufferedBytes: 64 << 20,
		BodyTimeout: 30 * time.Second, MaxStreamDuration: time.Hour, ScrapeInterval: time.Second, PrefixIndexBlocks: prefix.DefaultMaxBlocks}
}

// Server picks endpoints over the engines of the latest Set.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	cfg    Config
	set    atomic.Pointer[discovery.Set]
	bal    *balance.Balancer
	choose *choice.Chooser
	events *kvfollow.Follower
	health *health.Server
	m      *metrics
	slots  chan struct{}
	// buffered is the request body bytes all streams hold (MaxBufferedBytes).
	buffered       atomic.Int64
	warnUnobserved sync.Once

	mu sync.Mutex
	// onEndpoint counts the picks not yet finished per endpoint, to spread an engine's
	// requests over its ranks; turns, per engine, breaks ties.
	onEndpoint map[string]int
	turns      map[string]int
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
	if len(cfg.LegRunnerPorts) == 0 {
		cfg.LegRunnerPorts = Defaults().LegRunnerPorts
	}
	a := choice.Assemble(choice.Config{Metrics: "kvhandoff_epp", ScrapeInterval: cfg.ScrapeInterval, PrefixIndexBlocks: cfg.PrefixIndexBlocks,
		KVEventsTokenFile: cfg.KVEventsTokenFile, Registry: cfg.Registry, InFlight: m.inflight, Log: cfg.Log})
	s := &Server{cfg: cfg, bal: a.Balancer, events: a.Events, choose: a.Chooser, health: health.NewServer(), m: m,
		slots: make(chan struct{}, max(cfg.MaxInFlight, 1)), onEndpoint: map[string]int{}, turns: map[string]int{}}
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
	s.mu.Lock()
	for id := range s.turns {
		if !slices.ContainsFunc(set.Decode, func(e discovery.Engine) bool { return e.EngineID == id }) {
			delete(s.turns, id)
		}
	}
	s.mu.Unlock()
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
	defer s.Stop()
	defer s.events.Stop()
	return discovery.Follow(ctx, src, s.Update)
}

// Stop says NOT_SERVING on every health service from now on: the picker is stopping.
func (s *Server) Stop() { s.health.Shutdown() }

// Endpoints are where the gateway may send a decode engine's requests: its pod address on
// each leg-runner port.
func (s *Server) Endpoints(e discovery.Engine) []string {
	out := make([]string, len(s.cfg.LegRunnerPorts))
	for i, p := range s.cfg.LegRunnerPorts {
		out[i] = net.JoinHostPort(urlHost(e.URL), strconv.Itoa(int(p)))
	}
	return out
}

// endpoint takes the endpoint of e (among allowed, nil: any) with the fewest picks
// unfinished, counting one more on it until the returned release.
func (s *Server) endpoint(e discovery.Engine, allowed map[string]bool) (string, func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	best, n := "", 0
	eps := s.Endpoints(e)
	turn := s.turns[e.EngineID]
	s.turns[e.EngineID] = turn + 1
	for i := range eps {
		ep := eps[(turn+i)%len(eps)]
		if allowed != nil && !allowed[ep] {
			continue
		}
		if c := s.onEndpoint[ep]; best == "" || c < n {
			best, n = ep, c
		}
	}
	s.onEndpoint[best]++
	var once sync.Once
	return best, func() {
		once.Do(func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.onEndpoint[best]--; s.onEndpoint[best] == 0 {
				delete(s.onEndpoint, best)
			}
		})
	}
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
	// decodeOnly, when set, is why the request takes no prefill leg (prefill is "").
	decodeOnly string
	release    func()
}

// refusal is a request the picker answers itself: its HTTP status and why.
type refusal struct {
	status  int
	outcome string
	msg     string
}

func (r *refusal) Error() string { return r.msg }

// pick chooses a request's decode endpoints and prefill engine, or that it takes none
// (routing.minPrefillTokens). subset, when not nil, is the gateway's hint: only those
// endpoints may be picked.
func (s *Server) pick(subset map[string]bool, body protocol.Body) (*picked, error) {
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
			if slices.ContainsFunc(s.Endpoints(d), func(ep string) bool { return subset[ep] }) {
				in = append(in, d)
			}
		}
		if len(in) == 0 {
			return nil, &refusal{http.StatusServiceUnavailable, OutcomeNoEngine, fmt.Sprintf(
				"none of the %d endpoints of the gateway's subset hint is a ready decode engine that can be paired (%s)", len(subset), set.Source)}
		}
		decodes = in
	}
	rt := choice.RoutingOf(set)
	p, d, plan := s.choose.Push(rt, prefills, decodes, choice.NewRequest(rt, body, protocol.PromptTokens(body)))
	ep, releaseEP := s.endpoint(d.Engine, subset)
	out := &picked{destinations: []string{ep}, decodeOnly: plan.DecodeOnly,
		release: func() { p.Release(); d.Release(); releaseEP() }}
	if plan.DecodeOnly == "" {
		out.prefill = protocol.PrefillAddress(p.URL)
	}
	// Fallbacks: other decode engines of the same compat-hash, best first, so that the
	// prefill engine named for the first pairs with each of them too.
	others := slices.DeleteFunc(slices.Clone(choice.SameHash(decodes, d.CompatHash)), func(e discovery.Engine) bool { return e.EngineID == d.EngineID })
	for len(out.destinations) <= s.cfg.Fallbacks {
		e, ok := s.bal.Pick(balance.Decode, others)
		if !ok {
			break
		}
		others = slices.DeleteFunc(others, func(o discovery.Engine) bool { return o.EngineID == e.EngineID })
		eps := slices.DeleteFunc(s.Endpoints(e), func(ep string) bool { return subset != nil && !subset[ep] })
		out.destinations = append(out.destinations, eps[0])
	}
	return out, nil
}

// Process serves one request's ext_proc stream. Envoy sends the request's headers, its
// body in chunks (FULL_DUPLEX_STREAMED), then the response's headers and body. The picker
// answers the headers only once it has the whole body (the prompt's length weighs the
// choice), then the body chunks; the response passes through unchanged. The request side
// must be in within BodyTimeout (else 408), the whole stream within MaxStreamDuration.
func (s *Server) Process(srv extprocv3.ExternalProcessor_ProcessServer) (err error) {
	r := &stream{s: s, srv: srv, start: time.Now()}
	defer func() { r.finish(err) }()
	type received struct {
		req *extprocv3.ProcessingRequest
		err error
	}
	// Recv has no deadline of its own: it runs beside the loop, which returns when time
	// is up, and the stream's end then ends the Recv too.
	recv := make(chan received)
	go func() {
		for {
			req, err := srv.Recv()
			select {
			case recv <- received{req, err}:
			case <-srv.Context().Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	requestPhase := time.NewTimer(s.cfg.BodyTimeout)
	defer requestPhase.Stop()
	whole := time.NewTimer(s.cfg.MaxStreamDuration)
	defer whole.Stop()
	for {
		var got received
		select {
		case got = <-recv:
		case <-srv.Context().Done():
			return nil // the gateway reset the stream
		case <-requestPhase.C:
			if r.picked != nil || r.bodyDone {
				continue // routed (or refused) in time
			}
			_, _ = r.refuse(&refusal{http.StatusRequestTimeout, OutcomeTimeout, fmt.Sprintf("the request did not arrive whole within %s (--body-timeout)", s.cfg.BodyTimeout)})
			return status.Errorf(codes.DeadlineExceeded, "ext_proc: the request did not arrive whole within %s", s.cfg.BodyTimeout)
		case <-whole.C:
			s.m.requests.WithLabelValues(OutcomeTimeout).Inc()
			return status.Errorf(codes.DeadlineExceeded, "ext_proc: the stream lasted %s (--max-stream-duration)", s.cfg.MaxStreamDuration)
		}
		if errors.Is(got.err, io.EOF) || status.Code(got.err) == codes.Canceled {
			return nil
		}
		if got.err != nil {
			return status.Errorf(codes.Unknown, "receiving from the gateway: %v", got.err)
		}
		done, err := r.handle(got.req)
		if status.Code(err) == codes.InvalidArgument {
			s.m.requests.WithLabelValues(OutcomeProtocolError).Inc()
			s.cfg.Log.Warn("ending an ext_proc stream that broke the protocol", "err", err)
			return err
		}
		if err != nil {
			return status.Errorf(codes.Unknown, "answering the gateway: %v", err)
		}
		if done {
			return nil
		}
	}
}
