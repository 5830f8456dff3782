package cli

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os/signal"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	"github.com/kvhandoff/kvhandoff/internal/router/discovery"
	"github.com/kvhandoff/kvhandoff/internal/router/epp"
)

// runEPP serves the endpoint picker's gRPC services on listen and its /metrics on admin
// until SIGINT or SIGTERM.
func runEPP(s *epp.Server, src discovery.Source, listen, admin string, drain time.Duration, reg *prometheus.Registry, log *slog.Logger, ready chan<- string) int {
	fail := func(err error) int { log.Error("epp", "err", err); return 1 }
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	l, err := net.Listen("tcp", listen)
	if err != nil {
		return fail(err)
	}
	al, err := net.Listen("tcp", admin)
	if err != nil {
		l.Close()
		return fail(fmt.Errorf("--admin-listen: %w", err))
	}
	g := grpc.NewServer()
	s.Register(g)
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	as := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	defer as.Close()
	served := make(chan error, 2)
	go func() { served <- g.Serve(l) }()
	go func() { served <- as.Serve(al) }()
	runCtx, stopRun := context.WithCancel(context.Background())
	defer stopRun()
	discovered := make(chan error, 1)
	client := &http.Client{Timeout: 5 * time.Second}
	go func() { discovered <- s.Run(runCtx, src, client) }()
	log.Info("endpoint picker serving", "listen", l.Addr().String(), "admin", al.Addr().String())
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
	// Streams in flight end with their responses; the gateway's health check has seen
	// NOT_SERVING from the moment the pod began terminating at the latest.
	stopRun()
	log.Info("shutting down: draining streams in flight", "drain", drain.String())
	stopped := make(chan struct{})
	go func() { g.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(drain):
		g.Stop()
	}
	return 0
}
