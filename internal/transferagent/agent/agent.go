// Package agent is the node transfer agent, composed of two halves that do not know
// each other's insides: the engine-facing side (package engineapi: the gRPC engine API,
// the memory socket, doorbells, who each caller is) and the engine sessions (package
// session: one pump per engine rank driving its fabric endpoint, with its prefill or
// decode side). Peers (package mesh, over TCP) reach the sessions. Engine-facing calls
// validate, record and return; none waits on the fabric.
package agent

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/engineapi"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/mesh"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/session"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
)

// Config is the agent's configuration (cmd/transfer-agent's flags).
type Config struct {
	// Provider is the libfabric provider: "efa" on AWS, "tcp;ofi_rxm" or "shm" here.
	Provider string
	// Rails is how many endpoints each engine rank's session opens (one per NIC; a P5en
	// GPU has two); a rank's writes and reads are split over them. 0 means 1.
	Rails int
	// Socket is the engine API's Unix socket.
	Socket string
	// PeerListen is the TCP address peers connect to; Advertise is how they name it
	// (defaults to the listener's address).
	PeerListen, Advertise string
	// Token authenticates peers: both sides prove they hold it (see package mesh).
	Token []byte
	// Timeouts are the fallbacks for engines that do not send their policy's in
	// RegisterEngine.
	session.Timeouts
	// EventsDeadline is how long a registered engine rank has to open its event stream
	// (the stream is its liveness); a session that never opens one is closed, so it cannot
	// hold an endpoint and memory forever.
	EventsDeadline time.Duration
	// DropDeliverySignals is a fault hook for tests (session.Config's).
	DropDeliverySignals int
	// Pods, when set, makes the agent check that each engine runs in the pod its
	// engine_id names (package engineapi); nil outside a cluster.
	Pods engineapi.Pods
	// KnownPeer, when set, vets every peer address before the agent dials it (package
	// peerset: the addresses ready agents publish); nil dials any.
	KnownPeer func(addr string) error
	// ProcRoot is where callers' /proc entries are read ("" for /proc).
	ProcRoot string
	Log      *slog.Logger
	// Registry receives the agent's metrics.
	Registry prometheus.Registerer
}

func (c *Config) defaults() error {
	if c.Provider == "" {
		return errors.New("agent: no libfabric provider configured")
	}
	if c.Rails == 0 {
		c.Rails = 1
	}
	if c.Rails < 1 || c.Rails > fabric.MaxRails {
		return fmt.Errorf("agent: rails: %d is outside 1 to %d", c.Rails, fabric.MaxRails)
	}
	if len(c.Token) == 0 {
		return errors.New("agent: no peer token configured; agents must authenticate each other")
	}
	c.Timeouts = c.Timeouts.Complete(session.DefaultTimeouts())
	if c.EventsDeadline <= 0 {
		c.EventsDeadline = 30 * time.Second
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Registry == nil {
		c.Registry = prometheus.NewRegistry()
	}
	return nil
}

// Agent is one node's transfer agent: the engine-facing side (package engineapi) and the
// engine sessions (package session), which the peer mesh reaches.
type Agent struct {
	cfg     Config
	log     *slog.Logger
	metrics *session.Metrics
	// epoch is new at every start, so peers and engines can tell this run from the last.
	epoch uint64
	// providerErr is why the configured provider cannot be used (readiness fails).
	providerErr error
	limits      fabric.Limits

	engines  *engineapi.Server
	sessions *session.Table
	mesh     *mesh.Mesh
	peerLn   net.Listener
	self     string // the advertised peer address
	wg       sync.WaitGroup
}

// New checks the configuration and the provider, and binds the engine sockets and the
// peer listener. A provider that cannot be opened does not fail New: the agent serves,
// and reports not-ready with the reason (no silent fallback to another provider).
func New(cfg Config) (*Agent, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	a := &Agent{cfg: cfg, log: cfg.Log, epoch: newEpoch(), metrics: session.NewMetrics(cfg.Registry)}
	a.limits, a.providerErr = probe(cfg.Provider, cfg.Rails)
	if a.providerErr != nil {
		a.log.Error("libfabric provider unavailable; not ready", "provider", cfg.Provider, "err", a.providerErr)
	} else {
		maj, minor := fabric.Version()
		a.log.Info("libfabric provider ready", "provider", a.limits.Provider, "libfabric", fmt.Sprintf("%d.%d", maj, minor),
			"rma_iov_limit", a.limits.RMAIovLimit, "max_msg_size", a.limits.MaxMsgSize, "cq_data_size", a.limits.CQDataSize, "rails", a.cfg.Rails)
		a.metrics.Provider.WithLabelValues(a.limits.Provider).Set(1)
	}
	var err error
	if a.peerLn, err = net.Listen("tcp", cfg.PeerListen); err != nil {
		return nil, err
	}
	a.self = cfg.Advertise
	if a.self == "" {
		a.self = a.peerLn.Addr().String()
	}
	a.mesh = mesh.New(mesh.Config{
		Self: a.self, Epoch: a.epoch, Token: cfg.Token, Known: cfg.KnownPeer, Log: a.log,
		Peers: a.metrics.Peers, Refused: a.metrics.Refused,
		OnMessage: func(p *mesh.Peer, m wire.Message) { a.sessions.Dispatch(p, m) },
		OnLost:    func(p *mesh.Peer) { a.sessions.PeerLost(p) },
	})
	a.sessions = session.NewTable(session.Config{
		Provider: cfg.Provider, Rails: cfg.Rails, Timeouts: cfg.Timeouts, EventsDeadline: cfg.EventsDeadline,
		DropDeliverySignals: cfg.DropDeliverySignals, Epoch: a.epoch, Self: a.self, Mesh: a.mesh, Log: a.log, Metrics: a.metrics,
	})
	a.engines, err = engineapi.New(engineapi.Config{
		Socket: cfg.Socket, Sessions: a.sessions, Timeouts: cfg.Timeouts, Pods: cfg.Pods, ProcRoot: cfg.ProcRoot,
		Ready: a.Ready, Provider: a.limits.Provider, Self: a.self, Log: a.log, Metrics: a.metrics,
	})
	if err != nil {
		a.peerLn.Close()
		return nil, err
	}
	return a, nil
}

// probe opens and closes an endpoint of the configured rails on the provider, to learn
// its limits and whether it is there at all (rails need delivery-complete writes).
func probe(provider string, rails int) (fabric.Limits, error) {
	if provider == "efa" {
		if maj, minor := fabric.Version(); maj < 1 || (maj == 1 && minor < 18) {
			return fabric.Limits{}, fmt.Errorf("efa RDMA write needs libfabric >= 1.18; this node loaded %d.%d", maj, minor)
		}
	}
	ep, err := fabric.OpenRails(provider, rails)
	if err != nil {
		return fabric.Limits{}, err
	}
	defer ep.Close()
	return ep.Limits(), nil
}

// Serve serves the engine sockets and the peers until ctx ends, then shuts down: engine
// sessions are fenced and drained before their endpoints close.
func (a *Agent) Serve(ctx context.Context) error {
	a.engines.Serve()
	a.wg.Add(1)
	go func() { defer a.wg.Done(); a.mesh.Serve(a.peerLn) }()
	a.log.Info("serving", "socket", a.cfg.Socket, "peers", a.self, "epoch", a.epoch)
	<-ctx.Done()
	a.engines.Stop()
	a.peerLn.Close()
	a.sessions.Close()
	a.mesh.Close()
	a.wg.Wait()
	a.engines.Wait()
	a.log.Info("stopped")
	return nil
}

// Ready reports whether the agent can serve transfers, and why not.
func (a *Agent) Ready() error {
	if a.providerErr != nil {
		return fmt.Errorf("libfabric provider %q unavailable: %w", a.cfg.Provider, a.providerErr)
	}
	return nil
}

// Provider is the provider the agent runs on ("" when unavailable).
func (a *Agent) Provider() string { return a.limits.Provider }

// Address is the peer address the agent advertises.
func (a *Agent) Address() string { return a.self }

func newEpoch() uint64 {
	var b [2]byte
	_, _ = rand.Read(b[:])
	return epochAt(time.Now(), binary.BigEndian.Uint16(b[:]))
}

// epochAt is the epoch of an agent started at t: milliseconds since 1970 above 16 random
// bits. Time keeps epochs increasing across restarts (engine sessions count up from the
// agent's epoch, and a restart a second later is 65 million ahead); the random bits keep
// two agents started in the same millisecond apart. 48 bits of milliseconds last until the
// year 10889 (microseconds would not fit beside 16 bits: 2^48 µs ran out in 1978).
func epochAt(t time.Time, random uint16) uint64 {
	return uint64(t.UnixMilli())<<16 | uint64(random)
}
