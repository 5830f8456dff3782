package kvevents

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"syscall"
	"time"
)

// Subscribe listens at endpoint (tcp://127.0.0.1:port: the pod's own loopback, which no
// other pod reaches) for vLLM's publisher, which connects to it, and relays its events
// into hub until ctx ends. Listening here, rather than at a socket vLLM binds, needs no
// file both containers may write, and vLLM reconnects by itself after a restart.
func Subscribe(ctx context.Context, endpoint, topic string, hub *Server, log *slog.Logger) error {
	addr, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return fmt.Errorf("listening for vLLM's KV events at %s: must be tcp://host:port", endpoint)
	}
	// A message or a publisher that cannot be read changed what the engine holds in ways
	// not known: as a lost batch.
	refuse := func(err error) {
		log.Error("refusing a KV events message", "err", err)
		hub.Refused()
	}
	sub, err := listenZMTP(addr, topic, refuse)
	if err != nil {
		return fmt.Errorf("listening for vLLM's KV events at %s: %w", endpoint, err)
	}
	log.Info("listening for vLLM's KV events", "endpoint", endpoint, "topic", topic)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- sub.serve(ctx) }()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-served:
			return fmt.Errorf("receiving vLLM's KV events: %w", err)
		case m := <-sub.messages:
			b, err := DecodeMessage(m)
			if err != nil {
				refuse(err)
				continue
			}
			hub.Apply(b)
		}
	}
}

// WatchEngine tells hub when the engine at addr (its API on the pod's loopback) stops:
// a connection refused there means no vLLM runs in the pod, and its cache went with it.
// vLLM's batch numbers starting again say the same once it publishes, but a restarted
// engine may be ready before its first batch, and routers must not trust the old keys
// in between.
func WatchEngine(ctx context.Context, addr string, every time.Duration, hub *Server) {
	d := net.Dialer{Timeout: every}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		c, err := d.DialContext(ctx, "tcp", addr)
		switch {
		case err == nil:
			_ = c.Close()
		case errors.Is(err, syscall.ECONNREFUSED):
			hub.Lost()
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
