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
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvhandoff/kvhandoff/internal/router/kvevents"
)

// kvEventsConfig is the kv-events sidecar's command line.
type kvEventsConfig struct {
	model, endpoint, topic string
	maxBlocks              int
}

func kvEventsFlags(fs *flag.FlagSet) *kvEventsConfig {
	c := &kvEventsConfig{}
	fs.StringVar(&c.model, "served-model", "", "kv-events: the model name requests give the engine (its first --served-model-name): the root of its blocks' keys")
	fs.StringVar(&c.endpoint, "kv-events-endpoint", "tcp://127.0.0.1:5557", "kv-events: where vLLM's publisher connects (its --kv-events-config endpoint); "+
		"keep it on the pod's loopback: the events carry every prompt's token ids")
	fs.StringVar(&c.topic, "kv-events-topic", "kv", "kv-events: the publisher's topic")
	fs.IntVar(&c.maxBlocks, "max-blocks", 1<<22, "kv-events: the most blocks kept (about 60 bytes each)")
	return c
}

// run serves the keys of the blocks the pod's engine holds on listen (GET /v1/kv-keys to
// followers bearing the token in tokenFile; /metrics, /healthz) until SIGINT or SIGTERM.
func (c *kvEventsConfig) run(listen, engine, tokenFile string, stderr io.Writer, ready chan<- string) int {
	log := slog.New(slog.NewJSONHandler(stderr, nil))
	fail := func(err error) int { log.Error("kv-events", "err", err); return 1 }
	switch {
	case c.model == "":
		return fail(errors.New("--served-model is required with --mode kv-events: the model name requests give the engine"))
	case engine == "":
		return fail(errors.New("--local is required with --mode kv-events: the engine's API address on the pod's loopback"))
	case c.maxBlocks <= 0:
		return fail(fmt.Errorf("--max-blocks is %d: must be positive", c.maxBlocks))
	case tokenFile == "":
		return fail(errors.New("--kv-events-token-file is required with --mode kv-events: the token every follower must present"))
	}
	if _, err := kvevents.ReadToken(tokenFile); err != nil {
		return fail(fmt.Errorf("--kv-events-token-file: %w", err))
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	hub := kvevents.NewHub(kvevents.NewKeys(c.model, c.maxBlocks), reg)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	mux := http.NewServeMux()
	mux.Handle("GET "+kvevents.StreamPath, kvevents.Authorized(tokenFile, hub))
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	l, err := net.Listen("tcp", listen)
	if err != nil {
		return fail(err)
	}
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	defer hs.Close()
	done := make(chan error, 2)
	go func() { done <- hs.Serve(l) }()
	go func() { done <- kvevents.Subscribe(ctx, c.endpoint, c.topic, hub, log) }()
	go kvevents.WatchEngine(ctx, engine, time.Second, hub)
	log.Info("kv-events serving", "listen", l.Addr().String(), "model", c.model)
	if ready != nil {
		ready <- l.Addr().String()
	}
	select {
	case err := <-done:
		if ctx.Err() == nil {
			return fail(err)
		}
	case <-ctx.Done():
	}
	return 0
}
