// Package cli is the router's command line: flags and logging around package router,
// served by package serve. The same program is a decode pod's leg runner with --local.
package cli

import (
	"context"
	"flag"
	"io"
	"log/slog"
	"net"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvhandoff/kvhandoff/internal/router"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/serve"
)

// Run runs the router until SIGINT or SIGTERM and returns the exit status. ready, when
// not nil, receives the address it listens on once it serves.
func Run(args []string, stderr io.Writer, ready chan<- string) int {
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := router.Defaults()
	listen := fs.String("listen", ":8000", "address of the OpenAI API, /healthz and /readyz: the clients' side")
	adminListen := fs.String("admin-listen", ":8001", "address of /metrics, the health report (GET /health/transfer), /healthz and /readyz: "+
		"the operators' side, kept off the clients' port")
	local := fs.String("local", "", "run as a decode pod's leg runner: this pod's decode engine, its IP ($(POD_IP); the engine's API on its pod's port) or its URL; "+
		"every request's decode leg goes there, its prefill leg to the engine the endpoint picker named")
	source := discovery.AddFlags(fs)
	fs.DurationVar(&cfg.PrefillTimeout, "prefill-timeout", cfg.PrefillTimeout, "limit of a prefill leg, from send to its whole response")
	fs.DurationVar(&cfg.DecodeTimeout, "decode-timeout", cfg.DecodeTimeout, "limit of a decode leg from send to its first byte (push: includes the prefill)")
	fs.DurationVar(&cfg.ScrapeInterval, "scrape-interval", cfg.ScrapeInterval, "how often engines' /metrics are read for their load; 0 never")
	fs.IntVar(&cfg.PrefixIndexBlocks, "prefix-index-blocks", cfg.PrefixIndexBlocks, "the most KV blocks the prefix index (routing PrefixAware) keeps of one decode engine, "+
		"about 40 bytes each; each engine's own KV capacity bounds it too")
	fs.StringVar(&cfg.KVEventsTokenFile, "kv-events-token-file", "", "the token of the engines' kv-events sidecars (a mounted Secret's key): "+
		"the router presents it and follows the events of every engine that serves them")
	fs.Int64Var(&cfg.MaxBodyBytes, "max-body-bytes", cfg.MaxBodyBytes, "largest request body accepted")
	fs.DurationVar(&cfg.BodyTimeout, "body-timeout", cfg.BodyTimeout, "limit of receiving a request's body, from its headers to its last byte (then 408)")
	fs.IntVar(&cfg.MaxInFlight, "max-in-flight", cfg.MaxInFlight, "requests served at once; past it a request is answered 429 at once")
	maxConns := fs.Int("max-connections", 4096, "client connections open at once; more wait to be accepted")
	fs.DurationVar(&cfg.HealthWindow, "health-window", cfg.HealthWindow, "how far back the health report (GET /health/transfer) looks for failed and fallen-back handoffs, where the route set names no window (the policy's healthWindowSeconds)")
	fs.DurationVar(&cfg.HealthInterval, "health-interval", cfg.HealthInterval, "how often the health report is computed")
	drain := fs.Duration("drain", 50*time.Second, "on SIGTERM, how long requests in flight may take to finish")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log := slog.New(slog.NewJSONHandler(stderr, nil))
	fail := func(err error) int { log.Error("router", "err", err); return 1 }
	src, err := source.Source(log)
	if err != nil {
		return fail(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	cfg.Registry, cfg.Gatherer, cfg.Log = reg, reg, log
	if *local != "" {
		cfg.Local = *local
		if ip := net.ParseIP(*local); ip != nil {
			cfg.Local = discovery.EngineURL(ip.String())
		}
	}
	s := router.New(cfg)
	err = serve.Run(serve.Program{
		Name: "router", Log: log, Drain: *drain, Ready: ready,
		Listeners: []serve.Listener{
			{Flag: "listen", Addr: *listen, MaxConns: *maxConns, HTTP: s},
			{Flag: "admin-listen", Addr: *adminListen, MaxConns: adminConns, HTTP: s.Admin()},
		},
		Run: func(ctx context.Context) error { return s.Run(ctx, src) },
	})
	if err != nil {
		return fail(err)
	}
	return 0
}

// adminConns bounds the operators' side: Prometheus, the manager's polling, probes.
const adminConns = 64
