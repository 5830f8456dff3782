// Package serve is the skeleton the request path's programs share (router, endpoint
// picker, kv-events sidecar): their listeners, bounded; what runs beside them; and a
// graceful end on SIGINT or SIGTERM.
//
// Every listener takes at most MaxConns connections at once: past it, new ones wait in
// the kernel's accept queue and cost the program nothing. HTTP servers drop a connection
// whose headers take longer than HeaderTimeout and a keep-alive connection idle for
// IdleTimeout (without it an idle connection was kept forever: 3,000 of them cost a
// sidecar 56 MB). A gRPC server bounds its own streams and idle connections (the
// endpoint picker's options).
package serve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/net/netutil"
)

const (
	// HeaderTimeout bounds a request's headers, from the connection's start or its last
	// request.
	HeaderTimeout = 10 * time.Second
	// IdleTimeout closes a connection that has carried no request (HTTP) or stream (gRPC)
	// for so long.
	IdleTimeout = 2 * time.Minute
)

// Listener is one address a program serves, with an HTTP handler or a gRPC server.
type Listener struct {
	// Flag names the address's flag, for errors.
	Flag string
	Addr string
	// MaxConns bounds the connections at once (0: no bound).
	MaxConns int
	HTTP     http.Handler
	GRPC     GRPCServer
}

// GRPCServer is a *grpc.Server as Run serves it: an interface, so that the programs
// without gRPC do not link it.
type GRPCServer interface {
	Serve(net.Listener) error
	GracefulStop()
	Stop()
}

// Program is what Run serves.
type Program struct {
	// Name is the program's, in its log.
	Name string
	Log  *slog.Logger
	// Listeners are served until the end; the first is the clients' (its address goes to
	// Ready).
	Listeners []Listener
	// Run, when set, runs beside them (discovery, subscriptions) until its context ends;
	// an error from it ends the program.
	Run func(ctx context.Context) error
	// Stopping, when set, is called on SIGINT or SIGTERM before the drain (say NOT_SERVING).
	// The first listener drains; the others serve until the program ends.
	Stopping func()
	// Drain is how long requests in flight may take to finish after the signal.
	Drain time.Duration
	// Ready, when set, receives the first listener's address once everything serves.
	Ready chan<- string
}

// Run serves p until SIGINT or SIGTERM and a drain, or until a listener or p.Run fails.
func Run(p Program) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for _, l := range p.Listeners {
		nl, err := net.Listen("tcp", l.Addr)
		if err != nil {
			return fmt.Errorf("--%s: %w", l.Flag, err)
		}
		if l.MaxConns > 0 {
			nl = netutil.LimitListener(nl, l.MaxConns)
		}
		ls = append(ls, nl)
	}
	served := make(chan error, len(p.Listeners)+1)
	var https []*http.Server
	for i, l := range p.Listeners {
		if l.GRPC != nil {
			go func() { served <- l.GRPC.Serve(ls[i]) }()
			defer l.GRPC.Stop()
			continue
		}
		hs := &http.Server{Handler: l.HTTP, ReadHeaderTimeout: HeaderTimeout, IdleTimeout: IdleTimeout}
		https = append(https, hs)
		go func() { served <- hs.Serve(ls[i]) }()
		defer hs.Close()
	}
	runCtx, stopRun := context.WithCancel(context.Background())
	defer stopRun()
	if p.Run != nil {
		go func() { served <- p.Run(runCtx) }()
	}
	attrs := []any{}
	for i, l := range p.Listeners {
		attrs = append(attrs, l.Flag, ls[i].Addr().String())
	}
	p.Log.Info(p.Name+" serving", attrs...)
	if p.Ready != nil {
		p.Ready <- ls[0].Addr().String()
	}
	select {
	case err := <-served:
		if err == nil {
			err = errors.New("stopped")
		}
		return err
	case <-ctx.Done():
	}
	if p.Stopping != nil {
		p.Stopping()
	}
	// Requests in flight finish (a decode stream can be long); new connections are
	// refused, and the Service has stopped sending them once the pod is terminating.
	p.Log.Info("shutting down: draining requests in flight", "drain", p.Drain.String())
	dctx, cancel := context.WithTimeout(context.Background(), p.Drain)
	defer cancel()
	// The clients' listener drains; the others (metrics, probes) serve until the end.
	done := make(chan struct{})
	go func() {
		defer close(done)
		if g := p.Listeners[0].GRPC; g != nil {
			g.GracefulStop()
		} else {
			_ = https[0].Shutdown(dctx)
		}
	}()
	select {
	case <-done:
		return nil
	case <-dctx.Done():
		return fmt.Errorf("draining: requests still in flight after %s", p.Drain)
	}
}
