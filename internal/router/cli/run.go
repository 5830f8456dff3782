// Package cli is the router's command line: flags, logging, discovery and graceful
// shutdown around package router.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvhandoff/kvhandoff/internal/kubeconfig"
	"github.com/kvhandoff/kvhandoff/internal/router"
	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/epp"
)

// Run runs the router until SIGINT or SIGTERM and returns the exit status. ready, when
// not nil, receives the address it listens on once it serves.
func Run(args []string, stderr io.Writer, ready chan<- string) int {
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := router.Defaults()
	mode := fs.String("mode", "router", "router: the OpenAI front end of a DecodePool; epp: the Gateway API Inference Extension endpoint picker "+
		"(Envoy ext_proc over gRPC on --listen); leg-runner: a decode pod's sidecar running the legs the endpoint picker chose (needs --local); "+
		"kv-events: an engine pod's sidecar serving the keys of the blocks its vLLM holds, from vLLM's KV cache events (--served-model, --kv-events-endpoint, --local)")
	listen := fs.String("listen", ":8000", "address of the OpenAI API, /healthz and /readyz: the clients' side (epp: its gRPC ext_proc and health services)")
	local := fs.String("local", "", "leg-runner: this pod's decode engine: its IP ($(POD_IP); the engine's API on its pod's port), or its URL; "+
		"kv-events: the engine's API address on the pod's loopback (127.0.0.1:8000), watched to learn when vLLM stops")
	kv := kvEventsFlags(fs)
	eppCfg := epp.Defaults()
	fs.Func("leg-runner-port", fmt.Sprintf("epp: the decode pods' leg-runner port, where the gateway sends requests (default %d); a comma-separated "+
		"list for data-parallel ranks, one endpoint each (the InferencePool's target ports)", eppCfg.LegRunnerPorts[0]), func(v string) error {
		eppCfg.LegRunnerPorts = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.ParseInt(strings.TrimSpace(f), 10, 32)
			if err != nil || n < 1 || n > 65535 {
				return fmt.Errorf("%q: must be a port number, 1 to 65535", f)
			}
			eppCfg.LegRunnerPorts = append(eppCfg.LegRunnerPorts, int32(n))
		}
		return nil
	})
	fs.IntVar(&eppCfg.Fallbacks, "fallbacks", eppCfg.Fallbacks, "epp: decode endpoints listed after the first, for a gateway that retries down the list")
	adminListen := fs.String("admin-listen", ":8001", "address of /metrics, the health report (GET /health/transfer), /healthz and /readyz: "+
		"the operators' side, kept off the clients' port")
	endpoints := fs.String("endpoints", "", "JSON file of engines (outside a cluster); re-read when it changes")
	pool := fs.String("decode-pool", "", "DecodePool to route to (in a cluster)")
	namespace := fs.String("namespace", "", "namespace of the DecodePool")
	kubeconfigPath := fs.String("kubeconfig", "", "kubeconfig (default: in-cluster)")
	fs.DurationVar(&cfg.PrefillTimeout, "prefill-timeout", cfg.PrefillTimeout, "limit of a prefill leg, from send to its whole response")
	fs.DurationVar(&cfg.DecodeTimeout, "decode-timeout", cfg.DecodeTimeout, "limit of a decode leg from send to its first byte (push: includes the prefill)")
	fs.DurationVar(&cfg.ScrapeInterval, "scrape-interval", cfg.ScrapeInterval, "how often engines' /metrics are read for their load; 0 never")
	fs.IntVar(&cfg.PrefixIndexBlocks, "prefix-index-blocks", cfg.PrefixIndexBlocks, "the most KV blocks the prefix index (routing PrefixAware) keeps of one decode engine, "+
		"about 40 bytes each; each engine's own KV capacity bounds it too")
	fs.StringVar(&cfg.KVEventsTokenFile, "kv-events-token-file", "", "the token of the engines' kv-events sidecars (a mounted Secret's key): "+
		"router and epp present it and follow the events of every engine that serves them; kv-events asks every follower for it (required)")
	fs.Int64Var(&cfg.MaxBodyBytes, "max-body-bytes", cfg.MaxBodyBytes, "largest request body accepted")
	fs.DurationVar(&cfg.BodyTimeout, "body-timeout", cfg.BodyTimeout, "limit of receiving a request's body, from its headers to its last byte (then 408)")
	fs.IntVar(&cfg.MaxInFlight, "max-in-flight", cfg.MaxInFlight, "requests served at once; past it a request is answered 429 at once")
	fs.DurationVar(&cfg.HealthWindow, "health-window", cfg.HealthWindow, "how far back the health report (GET /health/transfer) looks for failed and fallen-back handoffs")
	fs.DurationVar(&cfg.HealthInterval, "health-interval", cfg.HealthInterval, "how often the health report is computed")
	drain := fs.Duration("drain", 50*time.Second, "on SIGTERM, how long requests in flight may take to finish")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	switch {
	case *mode == "kv-events":
		return kv.run(*listen, *local, cfg.KVEventsTokenFile, stderr, ready)
	case *mode != "router" && *mode != "epp" && *mode != "leg-runner":
		fmt.Fprintf(stderr, "--mode %q: must be router, epp, leg-runner or kv-events\n", *mode)
		return 2
	case (*mode == "leg-runner") != (*local != ""):
		fmt.Fprintln(stderr, "--local is the leg runner's decode engine: required with --mode leg-runner, and only there")
		return 2
	}
	log := slog.New(slog.NewJSONHandler(stderr, nil))
	fail := func(err error) int { log.Error("router", "err", err); return 1 }

	var src discovery.Source
	switch {
	case *endpoints != "" && *pool != "":
		return fail(errors.New("--endpoints and --decode-pool exclude each other: one source of engines"))
	case *endpoints != "":
		if _, err := discovery.ReadFile(*endpoints); err != nil {
			return fail(fmt.Errorf("--endpoints: %w", err))
		}
		src = &discovery.File{Path: *endpoints, Log: log}
	case *pool != "":
		if *namespace == "" {
			return fail(errors.New("--namespace is required with --decode-pool"))
		}
		rc, err := kubeconfig.Load(*kubeconfigPath)
		if err != nil {
			return fail(err)
		}
		src = &discovery.Cluster{Config: rc, Namespace: *namespace, DecodePool: *pool, Log: log}
	default:
		return fail(errors.New("name the engines: --decode-pool and --namespace in a cluster, or --endpoints FILE"))
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if *mode == "epp" {
		eppCfg.MaxBodyBytes, eppCfg.MaxInFlight, eppCfg.ScrapeInterval = cfg.MaxBodyBytes, cfg.MaxInFlight, cfg.ScrapeInterval
		eppCfg.PrefixIndexBlocks, eppCfg.KVEventsTokenFile = cfg.PrefixIndexBlocks, cfg.KVEventsTokenFile
		eppCfg.Log, eppCfg.Registry = log, reg
		return runEPP(epp.New(eppCfg), src, *listen, *adminListen, *drain, reg, log, ready)
	}
	cfg.Registry, cfg.Gatherer, cfg.Log = reg, reg, log
	if *local != "" {
		cfg.Local = *local
		if ip := net.ParseIP(*local); ip != nil {
			cfg.Local = discovery.EngineURL(ip.String())
		}
	}
	s := router.New(cfg)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	l, err := net.Listen("tcp", *listen)
	if err != nil {
		return fail(err)
	}
	al, err := net.Listen("tcp", *adminListen)
	if err != nil {
		l.Close()
		return fail(fmt.Errorf("--admin-listen: %w", err))
	}
	hs := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	as := &http.Server{Handler: s.Admin(), ReadHeaderTimeout: 10 * time.Second}
	defer as.Close()
	served := make(chan error, 2)
	go func() { served <- hs.Serve(l) }()
	go func() { served <- as.Serve(al) }()
	discovered := make(chan error, 1)
	runCtx, stopRun := context.WithCancel(context.Background())
	defer stopRun()
	go func() { discovered <- s.Run(runCtx, src) }()
	log.Info("router serving", "listen", l.Addr().String(), "admin", al.Addr().String())
	if ready != nil {
		ready <- l.Addr().String()
	}

	select {
	case err := <-served:
		return fail(err)
	case err := <-discovered:
		if err != nil {
			return fail(err)
		}
	case <-ctx.Done():
	}
	// Requests in flight finish (a decode stream can be long); new connections are
	// refused, and the Service has stopped sending them once the pod is terminating.
	log.Info("shutting down: draining requests in flight", "drain", drain.String())
	sctx, cancel := context.WithTimeout(context.Background(), *drain)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		return fail(fmt.Errorf("draining: %w", err))
	}
	return 0
}
