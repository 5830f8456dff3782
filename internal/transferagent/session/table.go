package session

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/cudaipc"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/mesh"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

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
	}.Complete(Timeouts{})
}

// Complete fills what t leaves zero from fallback, and sets the watchdog's tick: four
// times per lease, and at least every 100 ms.
func (t Timeouts) Complete(fallback Timeouts) Timeouts {
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

// RequestTimeouts are the timeouts an engine sent (zero where it sent none).
func RequestTimeouts(r *agentv1.RegisterEngineRequest) Timeouts {
	ms := func(v uint32) time.Duration { return time.Duration(v) * time.Millisecond }
	return Timeouts{Lease: ms(r.LeaseMillis), RegistrationTimeout: ms(r.RegistrationTimeoutMillis), BlocksTTL: ms(r.BlocksTtlMillis)}
}

// Config is what the sessions of one agent share.
type Config struct {
	// Provider and Rails are the libfabric provider and the rails a session opens when
	// its engine names no NICs.
	Provider string
	Rails    int
	// Timeouts are the fallbacks for engines that send none.
	Timeouts Timeouts
	// EventsDeadline is how long a registered engine rank has to open its event stream
	// (the stream is its liveness); a session that never opens one is closed.
	EventsDeadline time.Duration
	// Epoch is the agent's; sessions count up from it.
	Epoch uint64
	// Self is the agent's peer address, named in answers to peers.
	Self string
	// DropDeliverySignals is a fault hook for tests: the first this many delivery signals
	// are not posted, as if the provider lost them (their Signalled messages still go).
	DropDeliverySignals int
	Mesh                *mesh.Mesh
	Log                 *slog.Logger
	Metrics             *Metrics
}

// maxSessions bounds the engine ranks one agent serves: a p5en node runs at most 16 (two
// TP8 engines), and each session holds a fabric endpoint and mapped memory.
// maxSessionsPerOwner bounds one pod's share: an engine pod needs one session per rank
// (TP8 at most on a node of 8 GPUs), twice over while a restarted engine's new sessions
// replace the old ones.
const (
	maxSessions         = 256
	maxSessionsPerOwner = 16
)

// Table is an agent's engine sessions: by session id and by engine rank (the live
// incarnation), the memory they registered, and the peer messages routed to them.
type Table struct {
	cfg  Config
	node *node

	mu        sync.Mutex
	sessions  map[string]*Session // by session id
	engines   map[string]*Session // by engine key (id/rank), the live incarnation
	nextEpoch uint64
	closed    bool
}

// node is what an engine session uses of its agent, handed to each session instead of
// the table itself: logging, metrics, the peer mesh, the GPUs' contexts and opened
// allocations, the agent-wide memory claims, and two calls back into the table.
type node struct {
	log     *slog.Logger
	metrics *Metrics
	mesh    *mesh.Mesh
	gpus    *cudaipc.Devices
	memory  *memoryIndex
	// forget removes an ended session from the tables.
	forget func(*Session)
	// notifyDecode delivers a signal to a decode engine of this agent (a same-node pair).
	notifyDecode func(engine string, epoch, data uint64) error
	// dropSignals counts down the delivery signals the fault hook drops.
	dropSignals atomic.Int64
}

// dropSignal reports whether the fault hook drops this delivery signal.
func (n *node) dropSignal() bool { return n.dropSignals.Load() > 0 && n.dropSignals.Add(-1) >= 0 }

// NewTable makes an agent's empty table.
func NewTable(cfg Config) *Table {
	t := &Table{cfg: cfg, sessions: map[string]*Session{}, engines: map[string]*Session{}, nextEpoch: cfg.Epoch}
	t.node = &node{log: cfg.Log, metrics: cfg.Metrics, mesh: cfg.Mesh, gpus: &cudaipc.Devices{}, memory: &memoryIndex{files: map[fileID][]claimed{}},
		forget: t.forget, notifyDecode: t.notifyDecode}
	t.node.dropSignals.Store(int64(cfg.DropDeliverySignals))
	return t
}

func engineKey(id string, rank uint32) string { return fmt.Sprintf("%s/%d", id, rank) }

// Register opens a session for an engine rank whose request the engine API checked, on
// behalf of owner: it opens the rank's fabric endpoint (the NICs r names, else the
// agent's rails) and starts the session's pump. A live incarnation of the same rank is
// replaced only when r names it (replaces_session) and owner holds it.
func (t *Table) Register(r *agentv1.RegisterEngineRequest, owner string) (*Session, error) {
	ep, err := t.openEndpoint(r.FabricDomains)
	if err != nil {
		return nil, err
	}
	var id [16]byte
	_, _ = rand.Read(id[:])
	key := engineKey(r.EngineId, r.TpRank)

	t.mu.Lock()
	old := t.engines[key]
	if err := t.admit(r, key, owner, old); err != nil {
		t.mu.Unlock()
		ep.Close()
		return nil, err
	}
	t.nextEpoch++
	s := newSession(t.node, t.cfg.Timeouts, hex.EncodeToString(id[:]), key, owner, t.nextEpoch, r, ep)
	// Stopped once the stream opens or the session ends, so that no timer holds an ended
	// session's memory.
	s.streamDeadline = time.AfterFunc(t.cfg.EventsDeadline, func() {
		if !s.attached.Load() {
			s.Close(fmt.Sprintf("no event stream within %s of registering", t.cfg.EventsDeadline))
		}
	})
	t.sessions[s.id], t.engines[key] = s, s
	t.cfg.Metrics.sessions.Set(float64(len(t.sessions)))
	t.mu.Unlock()
	if old != nil {
		// A new incarnation of the same rank: the old one's memory is gone.
		old.Close("replaced by a new incarnation of the engine")
	}
	go s.run()
	t.cfg.Log.Info("engine registered", "engine", key, "owner", owner, "role", r.Role.String(), "mode", r.Mode.String(), "epoch", s.epoch, "rails", ep.Domains())
	return s, nil
}

// admit refuses a registration the table cannot take (t.mu held): the agent is closing,
// the rank is live and held by another owner or not handed over, or the table or the
// owner's share of it is full.
func (t *Table) admit(r *agentv1.RegisterEngineRequest, key, owner string, old *Session) error {
	switch {
	case t.closed:
		return status.Error(codes.Unavailable, "agent is shutting down")
	case old != nil && !old.Ended() && old.owner != owner:
		return status.Errorf(codes.PermissionDenied, "engine_id: %s rank %d is held by %s, not the caller's %s", r.EngineId, r.TpRank, old.owner, owner)
	case old != nil && !old.Ended() && old.id != r.ReplacesSession:
		// Only the live incarnation itself, which alone knows its session id, may hand its
		// rank over; a restarted engine finds the rank free once its old stream closed.
		return status.Errorf(codes.AlreadyExists, "engine_id: %s rank %d has a live session; register again once its event stream has "+
			"ended, or name it in replaces_session", r.EngineId, r.TpRank)
	case old == nil && len(t.sessions) >= maxSessions:
		return status.Errorf(codes.ResourceExhausted, "the agent serves %d engine ranks, its limit", maxSessions)
	case old == nil && t.owned(owner) >= maxSessionsPerOwner:
		return status.Errorf(codes.ResourceExhausted, "%s holds %d engine sessions, its limit (one per engine rank; "+
			"a session ends when its event stream closes)", owner, maxSessionsPerOwner)
	}
	return nil
}

// owned counts owner's sessions, ending ones included: they hold their endpoints until
// they have drained (t.mu held).
func (t *Table) owned(owner string) int {
	n := 0
	for _, s := range t.sessions {
		if s.owner == owner {
			n++
		}
	}
	return n
}

// openEndpoint opens a rank's endpoint on the NICs it names, or on the agent's rails.
func (t *Table) openEndpoint(domains []string) (*fabric.Endpoint, error) {
	if err := checkDomains(t.cfg.Provider, domains); err != nil {
		return nil, err
	}
	var ep *fabric.Endpoint
	var err error
	if len(domains) > 0 {
		ep, err = fabric.OpenDomains(t.cfg.Provider, domains)
	} else {
		ep, err = fabric.OpenRails(t.cfg.Provider, t.cfg.Rails)
	}
	if err != nil {
		return nil, openFailure(t.cfg.Provider, domains, err)
	}
	return ep, nil
}

const errNoSession = "no such session (register the engine first; a session ends when its event stream closes)"

// Lookup returns the session a call names, if owner owns it.
func (t *Table) Lookup(id, owner string) (*Session, error) {
	t.mu.Lock()
	s, ok := t.sessions[id]
	t.mu.Unlock()
	switch {
	case !ok:
		return nil, status.Errorf(codes.NotFound, "session %q: %s", id, errNoSession)
	case s.owner != owner:
		return nil, status.Errorf(codes.PermissionDenied, "session %q belongs to %s, not the caller's %s", id, s.owner, owner)
	}
	return s, nil
}

// engine returns the live session of an engine rank key.
func (t *Table) engine(key string) *Session {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.engines[key]
}

func (t *Table) forget(s *Session) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.sessions, s.id)
	if t.engines[s.key] == s {
		delete(t.engines, s.key)
	}
	t.node.memory.remove(s)
	t.cfg.Metrics.sessions.Set(float64(len(t.sessions)))
}

// all returns every session.
func (t *Table) all() []*Session {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*Session, 0, len(t.sessions))
	for _, s := range t.sessions {
		out = append(out, s)
	}
	return out
}

// Close refuses new sessions, ends every session (each fences and drains before its
// endpoint closes) and waits until they have.
func (t *Table) Close() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	sessions := t.all()
	for _, s := range sessions {
		s.Close("agent shutting down")
	}
	for _, s := range sessions {
		<-s.stopped
	}
}

// EngineIDs are the engine ids with a live session, sorted.
func (t *Table) EngineIDs() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var ids []string
	for key := range t.engines {
		id := key[:strings.LastIndexByte(key, '/')] // engineKey: id/rank
		if !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}

// notifyDecode delivers a signal to a decode engine of this agent, as a write carrying
// data would: only to the incarnation it was meant for.
func (t *Table) notifyDecode(engine string, epoch, data uint64) error {
	s := t.engine(engine)
	if s == nil || s.epoch != epoch || s.decode() == nil {
		return fmt.Errorf("decode engine %s epoch %d is gone", engine, epoch)
	}
	s.post(func() { s.decode().onSignal(time.Now(), data) })
	return nil
}
