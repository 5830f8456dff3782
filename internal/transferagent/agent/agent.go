// Package agent is the node transfer agent: it serves the engine API (gRPC on a Unix
// socket), talks to other nodes' agents (package wire over TCP), and drives each engine
// rank's fabric endpoint from one goroutine of its own — the rank's writer (push) or
// reader (pull). Engine-facing calls validate, record and return; none waits on the
// fabric.
package agent

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/cudaipc"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/mesh"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/peercred"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
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
	Timeouts
	// EventsDeadline is how long a registered engine rank has to open its event stream
	// (the stream is its liveness); a session that never opens one is closed, so it cannot
	// hold an endpoint and memory forever.
	EventsDeadline time.Duration
	// Pods, when set, makes the agent check that each engine runs in the pod its
	// engine_id names (identity.go); nil outside a cluster.
	Pods Pods
	// KnownPeer, when set, vets every peer address before the agent dials it (package
	// peerset: the addresses ready agents publish); nil dials any.
	KnownPeer func(addr string) error
	// ProcRoot is where callers' /proc entries are read ("" for /proc).
	ProcRoot string
	Log      *slog.Logger
	// Registry receives the agent's metrics.
	Registry prometheus.Registerer
}

// Timeouts are a KVTransferPolicy's timeouts as an agent applies them to one engine's
// registrations, sources and holds, and the watchdog's period that enforces them.
type Timeouts struct {
	// Lease is how long a push registration or a pull hold lives without a heartbeat
	// (spec.leaseSeconds; vLLM's kv_lease_duration).
	Lease time.Duration
	// RegistrationTimeout is how long a push registration waits for its source
	// (spec.registrationTimeoutSeconds; push_registration_timeout).
	RegistrationTimeout time.Duration
	// BlocksTTL is how long ready prefill blocks wait for a registration or a pull
	// (spec.blocksTTLSeconds; decoder_kv_blocks_ttl).
	BlocksTTL time.Duration
	// Tick is the watchdog's period.
	Tick time.Duration
}

// DefaultTimeouts are the agent's fallbacks when neither an engine nor a flag sets them:
// the KVTransferPolicy's defaults.
func DefaultTimeouts() Timeouts {
	return Timeouts{
		Lease:               kvv1.DefaultLeaseSeconds * time.Second,
		RegistrationTimeout: kvv1.DefaultRegistrationTimeoutSeconds * time.Second,
		BlocksTTL:           kvv1.DefaultBlocksTTLSeconds * time.Second,
	}.complete(Timeouts{})
}

// complete fills what t leaves zero from fallback, and sets the watchdog's tick: four
// times per lease, and at least every 100 ms.
func (t Timeouts) complete(fallback Timeouts) Timeouts {
	pick := func(v, f time.Duration) time.Duration {
		if v > 0 {
			return v
		}
		return f
	}
	t.Lease = pick(t.Lease, fallback.Lease)
	t.RegistrationTimeout = pick(t.RegistrationTimeout, fallback.RegistrationTimeout)
	t.BlocksTTL = pick(t.BlocksTTL, fallback.BlocksTTL)
	t.Tick = min(t.Lease/4, 100*time.Millisecond)
	return t
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
	c.Timeouts = c.Timeouts.complete(DefaultTimeouts())
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

// Agent is one node's transfer agent.
type Agent struct {
	cfg     Config
	log     *slog.Logger
	metrics *metrics
	// epoch is new at every start, so peers and engines can tell this run from the last.
	epoch uint64
	// providerErr is why the configured provider cannot be used (readiness fails).
	providerErr error
	limits      fabric.Limits

	grpc   *grpc.Server
	engLn  net.Listener
	peerLn net.Listener
	memLn  *net.UnixListener // the memory socket: engines pass their KV memfds
	self   string            // the advertised peer address
	// callers reads who connected to the engine sockets; calls and memConns are each
	// owner's share of calls in flight and of memory socket connections.
	callers  peercred.Reader
	calls    *peercred.Slots
	memConns *peercred.Slots

	mu        sync.Mutex
	sessions  map[string]*session // by session id
	engines   map[string]*session // by engine key (id/rank), the live incarnation
	nextEpoch uint64
	memory    memoryIndex
	closed    bool
	mesh      *mesh.Mesh
	node      *node
	wg        sync.WaitGroup
}

// node is what an engine session uses of its agent, handed to each session instead of
// the agent itself: logging, metrics, the peer mesh, the GPUs' contexts and opened
// allocations, and two calls back into the agent's tables.
type node struct {
	log     *slog.Logger
	metrics *metrics
	mesh    *mesh.Mesh
	gpus    *cudaipc.Devices
	// forget removes an ended session from the agent's tables.
	forget func(*session)
	// notifyDecode delivers a signal to a decode engine of this agent (a same-node pair).
	notifyDecode func(engine string, epoch, data uint64) error
}

// New checks the configuration and the provider, and binds both listeners. A provider
// that cannot be opened does not fail New: the agent serves, and reports not-ready with
// the reason (no silent fallback to another provider).
func New(cfg Config) (*Agent, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	a := &Agent{
		cfg: cfg, log: cfg.Log, epoch: newEpoch(),
		sessions: map[string]*session{}, engines: map[string]*session{},
		memory:  memoryIndex{},
		callers: peercred.Reader{ProcRoot: cfg.ProcRoot},
		calls:   peercred.NewSlots(maxCallsPerOwner), memConns: peercred.NewSlots(maxMemoryConnsPerOwner),
	}
	a.nextEpoch = a.epoch
	a.metrics = newMetrics(cfg.Registry)
	var err error
	a.limits, a.providerErr = probe(cfg.Provider, cfg.Rails)
	if a.providerErr != nil {
		a.log.Error("libfabric provider unavailable; not ready", "provider", cfg.Provider, "err", a.providerErr)
	} else {
		maj, minor := fabric.Version()
		a.log.Info("libfabric provider ready", "provider", a.limits.Provider, "libfabric", fmt.Sprintf("%d.%d", maj, minor),
			"rma_iov_limit", a.limits.RMAIovLimit, "max_msg_size", a.limits.MaxMsgSize, "cq_data_size", a.limits.CQDataSize, "rails", a.cfg.Rails)
		a.metrics.provider.WithLabelValues(a.limits.Provider).Set(1)
	}

	if err := os.MkdirAll(filepath.Dir(cfg.Socket), 0o755); err != nil {
		return nil, err
	}
	if err := ownSocketDir(filepath.Dir(cfg.Socket)); err != nil {
		return nil, err
	}
	ln, err := listenUnix("unix", cfg.Socket)
	if err != nil {
		return nil, err
	}
	a.engLn = ln
	mem, err := listenUnix("unixpacket", agentv1.MemorySocket(cfg.Socket))
	if err != nil {
		ln.Close()
		return nil, err
	}
	a.memLn = mem.(*net.UnixListener)
	if a.peerLn, err = net.Listen("tcp", cfg.PeerListen); err != nil {
		ln.Close()
		mem.Close()
		return nil, err
	}
	a.self = cfg.Advertise
	if a.self == "" {
		a.self = a.peerLn.Addr().String()
	}
	a.mesh = mesh.New(mesh.Config{
		Self: a.self, Epoch: a.epoch, Token: cfg.Token, Known: cfg.KnownPeer, Log: a.log,
		Peers: a.metrics.peers, Refused: a.metrics.refused,
		OnMessage: a.dispatch, OnLost: a.peerLost,
	})
	a.node = &node{log: a.log, metrics: a.metrics, mesh: a.mesh, gpus: &cudaipc.Devices{}, forget: a.forget, notifyDecode: a.notifyDecode}
	a.grpc = grpc.NewServer(
		grpc.Creds(peercred.Credentials{Reader: a.callers, Conns: peercred.NewSlots(maxConnsPerOwner), Refused: func(code string, err error) {
			a.metrics.refused.WithLabelValues("connection", code).Inc()
			a.log.Warn("refused an engine connection", "err", err)
		}}),
		grpc.InTapHandle(a.callLimit),
		grpc.MaxRecvMsgSize(maxRequest),
		grpc.StatsHandler(refusals{a}),
	)
	agentv1.RegisterAgentServer(a.grpc, &engineAPI{a: a})
	return a, nil
}

// listenUnix binds a socket engines reach: only root and the socket's group (engines run
// in it) may use it.
func listenUnix(network, path string) (net.Listener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("agent: removing the stale socket %s: %w", path, err)
	}
	ln, err := net.Listen(network, path)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o660); err != nil {
		ln.Close()
		return nil, err
	}
	return ln, nil
}

// ownSocketDir refuses a socket folder the agent does not own alone: one another user
// owns, or anyone but its owner may write to, lets that user replace the sockets every
// engine of the node connects to, and intercept them.
func ownSocketDir(dir string) error {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return fmt.Errorf("agent: socket folder %s: %w", dir, err)
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("agent: socket folder %s is not a directory (a link?): the agent's sockets need a folder of its own", dir)
	case int(st.Uid) != os.Geteuid():
		return fmt.Errorf("agent: socket folder %s belongs to uid %d, not the agent's %d: its owner could replace the sockets", dir, st.Uid, os.Geteuid())
	case st.Mode&0o022 != 0:
		return fmt.Errorf("agent: socket folder %s is writable by its group or others (mode %o): they could replace the sockets", dir, st.Mode&0o777)
	}
	return nil
}

// maxRequest bounds an engine API message: a registration of wire.MaxBlocks blocks fits.
const maxRequest = wire.MaxFrame

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

// Serve serves both listeners until ctx ends, then shuts down: engine sessions are
// fenced and drained before their endpoints close.
func (a *Agent) Serve(ctx context.Context) error {
	a.wg.Add(3)
	go func() { defer a.wg.Done(); _ = a.grpc.Serve(a.engLn) }()
	go func() { defer a.wg.Done(); a.mesh.Serve(a.peerLn) }()
	go func() { defer a.wg.Done(); a.serveMemory() }()
	a.log.Info("serving", "socket", a.cfg.Socket, "peers", a.self, "epoch", a.epoch)
	<-ctx.Done()
	a.shutdown()
	return nil
}

func (a *Agent) shutdown() {
	a.mu.Lock()
	a.closed = true
	sessions := make([]*session, 0, len(a.sessions))
	for _, s := range a.sessions {
		sessions = append(sessions, s)
	}
	a.mu.Unlock()
	a.grpc.Stop()
	a.peerLn.Close()
	a.memLn.Close()
	for _, s := range sessions {
		s.close("agent shutting down")
	}
	for _, s := range sessions {
		<-s.stopped
	}
	a.mesh.Close()
	a.wg.Wait()
	os.Remove(a.cfg.Socket)
	a.log.Info("stopped")
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

// engine returns the live session of an engine rank key.
func (a *Agent) engine(key string) *session {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.engines[key]
}

func (a *Agent) forget(s *session) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.sessions, s.id)
	if a.engines[s.key] == s {
		delete(a.engines, s.key)
	}
	a.memory.remove(s)
	a.metrics.sessions.Set(float64(len(a.sessions)))
}
