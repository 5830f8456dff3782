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

// Subscription is a listener for vLLM's publisher, whose events go into a Server.
type Subscription struct {
	sub *zmtpSubscriber
	hub *Server
	log *slog.Logger
}

// Listen listens at endpoint (tcp://127.0.0.1:port: the pod's own loopback, which no
// other pod reaches) for vLLM's publisher, which connects to it, and whose events Relay
// puts into hub. Listening here, rather than at a socket vLLM binds, needs no file both
// containers may write, and vLLM reconnects by itself after a restart.
func Listen(endpoint, topic string, hub *Server, log *slog.Logger) (*Subscription, error) {
	addr, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return nil, fmt.Errorf("listening for vLLM's KV events at %s: must be tcp://host:port", endpoint)
	}
	s := &Subscription{hub: hub, log: log}
	sub, err := listenZMTP(addr, topic, s.refuse)
	if err != nil {
		return nil, fmt.Errorf("listening for vLLM's KV events at %s: %w", endpoint, err)
	}
	s.sub = sub
	log.Info("listening for vLLM's KV events", "endpoint", endpoint, "topic", topic)
	return s, nil
}

// refuse counts a message or a publisher that cannot be read: it changed what the engine
// holds in ways not known, as a lost batch.
func (s *Subscription) refuse(err error) {
	s.log.Error("refusing a KV events message", "err", err)
	s.hub.Refused()
}

// Relay puts the publishers' events into the hub until ctx ends.
func (s *Subscription) Relay(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- s.sub.serve(ctx) }()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-served:
			return fmt.Errorf("receiving vLLM's KV events: %w", err)
		case m := <-s.sub.messages:
			b, err := DecodeMessage(m)
			if err != nil {
				s.refuse(err)
				continue
			}
			s.hub.Apply(b)
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
