package kvevents

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"syscall"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Subscribe listens at endpoint (tcp://127.0.0.1:port: the pod's own loopback, which no
// other pod reaches) for vLLM's publisher, which connects to it, and relays its events
// into hub until ctx ends. Listening here, rather than at a socket vLLM binds, needs no
// file both containers may write, and vLLM reconnects by itself after a restart.
func Subscribe(ctx context.Context, endpoint, topic string, hub *Server, log *slog.Logger) error {
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.Listen(endpoint); err != nil {
		return fmt.Errorf("listening for vLLM's KV events at %s: %w", endpoint, err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, topic); err != nil {
		return err
	}
	log.Info("listening for vLLM's KV events", "endpoint", endpoint, "topic", topic)
	for {
		m, err := sub.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("receiving vLLM's KV events: %w", err)
		}
		b, err := DecodeMessage(m.Frames)
		if err != nil {
			// A message that cannot be read changed what the engine holds in ways not
			// known: as a lost batch.
			log.Error("refusing a KV events message", "err", err)
			hub.Refused()
			continue
		}
		hub.Apply(b)
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
