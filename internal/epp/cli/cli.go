// Package cli is the endpoint picker's command line: flags and logging around package
// epp, served by package serve.
package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/kvhandoff/kvhandoff/internal/epp"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/serve"
)

// Run runs the endpoint picker until SIGINT or SIGTERM and returns the exit status.
// ready, when not nil, receives the address of its gRPC services once it serves.
func Run(args []string, stderr io.Writer, ready chan<- string) int {
	fs := flag.NewFlagSet("endpoint-picker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := epp.Defaults()
	listen := fs.String("listen", ":9002", "address of the gRPC ext_proc and health services: the gateway's side")
	adminListen := fs.String("admin-listen", ":9003", "address of /metrics and /healthz: the operators' side")
	source := discovery.AddFlags(fs)
	fs.Func("leg-runner-port", fmt.Sprintf("the decode pods' leg-runner port, where the gateway sends requests (default %d); a comma-separated "+
		"list for data-parallel ranks, one endpoint each (the InferencePool's target ports)", cfg.LegRunnerPorts[0]), func(v string) error {
		cfg.LegRunnerPorts = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.ParseInt(strings.TrimSpace(f), 10, 32)
			if err != nil || n < 1 || n > 65535 {
				return fmt.Errorf("%q: must be a port number, 1 to 65535", f)
			}
			cfg.LegRunnerPorts = append(cfg.LegRunnerPorts, int32(n))
		}
		return nil
	})
	fs.IntVar(&cfg.Fallbacks, "fallbacks", cfg.Fallbacks, "decode endpoints listed after the first, for a gateway that retries down the list")
	fs.Int64Var(&cfg.MaxBodyBytes, "max-body-bytes", cfg.MaxBodyBytes, "largest request body read; past it 413")
	fs.Int64Var(&cfg.MaxBufferedBytes, "max-buffered-bytes", cfg.MaxBufferedBytes, "request body bytes held at once, all streams together; past it 429")
	fs.IntVar(&cfg.MaxInFlight, "max-in-flight", cfg.MaxInFlight, "requests (ext_proc streams past their headers) unfinished at once; past it 429 at once")
	fs.DurationVar(&cfg.BodyTimeout, "body-timeout", cfg.BodyTimeout, "limit of a stream's request side, from its start to its route (then 408)")
	fs.DurationVar(&cfg.MaxStreamDuration, "max-stream-duration", cfg.MaxStreamDuration, "limit of a stream's whole life, its response included")
	maxConns := fs.Int("max-connections", 256, "gateway connections open at once (a gateway multiplexes its streams over a few); more wait to be accepted")
	fs.DurationVar(&cfg.ScrapeInterval, "scrape-interval", cfg.ScrapeInterval, "how often engines' /metrics are read for their load; 0 never")
	fs.IntVar(&cfg.PrefixIndexBlocks, "prefix-index-blocks", cfg.PrefixIndexBlocks, "the most KV blocks the prefix index (routing PrefixAware) keeps of one decode engine, "+
		"about 40 bytes each; each engine's own KV capacity bounds it too")
	fs.StringVar(&cfg.KVEventsTokenFile, "kv-events-token-file", "", "the token of the engines' kv-events sidecars (a mounted Secret's key): "+
		"the picker presents it and follows the events of every engine that serves them")
	drain := fs.Duration("drain", 50*time.Second, "on SIGTERM, how long streams in flight may take to finish")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log := slog.New(slog.NewJSONHandler(stderr, nil))
	fail := func(err error) int { log.Error("endpoint-picker", "err", err); return 1 }
	src, err := source.Source(log)
	if err != nil {
		return fail(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	cfg.Log, cfg.Registry = log, reg
	s := epp.New(cfg)
	// Streams a connection: all the picker takes at once, so one gateway connection can
	// carry them (streams past the limit are refused by the picker, 429).
	g := grpc.NewServer(grpcOptions(uint32(cfg.MaxInFlight) + 16)...)
	s.Register(g)
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	client := &http.Client{Timeout: 5 * time.Second}
	err = serve.Run(serve.Program{
		Name: "endpoint picker", Log: log, Drain: *drain, Ready: ready,
		Listeners: []serve.Listener{
			{Flag: "listen", Addr: *listen, MaxConns: *maxConns, GRPC: g},
			{Flag: "admin-listen", Addr: *adminListen, MaxConns: 64, HTTP: mux},
		},
		Run: func(ctx context.Context) error { return s.Run(ctx, src, client) },
		// The gateway's health check sees NOT_SERVING from the moment the pod terminates.
		Stopping: s.Stop,
	})
	if err != nil {
		return fail(err)
	}
	return 0
}

// grpcOptions bound the gateway's connections: at most maxStreams streams each, none
// idle for longer than serve.IdleTimeout, no keepalive pings more often than every 10 s.
func grpcOptions(maxStreams uint32) []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.MaxConcurrentStreams(maxStreams),
		grpc.ConnectionTimeout(serve.HeaderTimeout),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: serve.IdleTimeout, Time: time.Minute, Timeout: 20 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	}
}
