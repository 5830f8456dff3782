// Package cli is the kv-events sidecar's command line: flags and logging around package
// kvevents, served by package serve.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvhandoff/kvhandoff/internal/keystream"
	"github.com/kvhandoff/kvhandoff/internal/kvevents"
	"github.com/kvhandoff/kvhandoff/internal/serve"
)

// Run serves the keys of the blocks the pod's engine holds (GET keystream.StreamPath to
// followers bearing the pool's token; /metrics, /healthz) until SIGINT or SIGTERM, and
// returns the exit status. ready, when not nil, receives its address once it serves.
func Run(args []string, stderr io.Writer, ready chan<- string) int {
	fs := flag.NewFlagSet("kv-events", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", ":8102", "address of the key stream (GET "+keystream.StreamPath+"), /metrics and /healthz: the followers' side")
	engine := fs.String("engine", "127.0.0.1:8000", "the engine's API address on the pod's loopback, watched to learn when vLLM stops")
	model := fs.String("served-model", "", "the model name requests give the engine (its first --served-model-name): the root of its blocks' keys (required)")
	endpoint := fs.String("kv-events-endpoint", "tcp://127.0.0.1:5557", "where vLLM's publisher connects (its --kv-events-config endpoint); "+
		"keep it on the pod's loopback: the events carry every prompt's token ids")
	topic := fs.String("kv-events-topic", "kv", "the publisher's topic")
	maxBlocks := fs.Int("max-blocks", 1<<22, "the most blocks kept (about 60 bytes each)")
	tokenFile := fs.String("token-file", "", "the pool's kv-events token (a mounted Secret's key), which every follower must present (required)")
	maxConns := fs.Int("max-connections", 512, "connections open at once: followers (at most 256 streams), scrapes and probes; more wait to be accepted")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log := slog.New(slog.NewJSONHandler(stderr, nil))
	fail := func(err error) int { log.Error("kv-events", "err", err); return 1 }
	switch {
	case *model == "":
		return fail(errors.New("--served-model is required: the model name requests give the engine"))
	case *maxBlocks <= 0:
		return fail(fmt.Errorf("--max-blocks is %d: must be positive", *maxBlocks))
	case *tokenFile == "":
		return fail(errors.New("--token-file is required: the token every follower must present"))
	}
	if _, err := keystream.ReadToken(*tokenFile); err != nil {
		return fail(fmt.Errorf("--token-file: %w", err))
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	srv := kvevents.NewServer(kvevents.NewKeys(*model, *maxBlocks), reg)
	// Listening before it says it serves: a publisher may connect from then on.
	sub, err := kvevents.Listen(*endpoint, *topic, srv, log)
	if err != nil {
		return fail(fmt.Errorf("--kv-events-endpoint: %w", err))
	}
	mux := http.NewServeMux()
	mux.Handle("GET "+keystream.StreamPath, kvevents.Authorized(*tokenFile, srv))
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	err = serve.Run(serve.Program{
		Name: "kv-events", Log: log, Ready: ready,
		Listeners: []serve.Listener{{Flag: "listen", Addr: *listen, MaxConns: *maxConns, HTTP: mux}},
		Run: func(ctx context.Context) error {
			go kvevents.WatchEngine(ctx, *engine, time.Second, srv)
			return sub.Relay(ctx)
		},
	})
	if err != nil {
		return fail(err)
	}
	return 0
}
