// Package mesh is the transfer agents' peer mesh: the TCP connections between the agents
// of a cluster, their mutual authentication, and what each remote agent said about its
// engines. A decode agent dials the prefill agents its engines name; the prefill agent
// answers on the same connection. The mesh knows nothing of sessions or transfers: every
// message that is not about the mesh itself goes to Config.OnMessage, and a connection
// that fails is reported once to Config.OnLost.
package mesh

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
)

// Caps on inbound connections, so that connections nobody authenticates cannot exhaust
// the agent or lock other agents out. Each connection mid-handshake holds at most a
// handshake frame and a goroutine for at most handshakeTimeout.
//   - maxHandshakes may be mid-handshake at once from hosts no agent has connected from;
//   - as many again from known hosts (an agent of theirs completed a handshake with this
//     one, or this one dialled them), so strangers cannot crowd out the cluster's agents;
//   - maxHandshakesPerHost of those that have sent their first frame, from any one host;
//   - maxInbound open in all, one per decode agent of the cluster that talks to this one.
//
// A connection that finds its budget, or (once it speaks) its host's share, full evicts
// the one there that has made the least progress (silent first, then by handshake frames
// sent), the oldest first, rather than being refused. A host's address is shared by every
// hostNetwork pod on it and by pod traffic translated to it: refusing newcomers let one
// pod that kept silent connections open lock out the agent beside it (4 of 60 handshakes
// got through). An agent sends its Hello as soon as it connects, so its handshake is
// never the one with the least progress for longer than a round trip.
const (
	// frameTimeout bounds the arrival of one frame after its first bytes (the largest,
	// wire.MaxFrame, takes milliseconds between nodes).
	frameTimeout = 10 * time.Second

	maxHandshakes        = 64
	maxHandshakesPerHost = 4
	maxInbound           = 4096
)

// Config is what a mesh needs of its agent.
type Config struct {
	// Self is the agent's advertised peer address: how other agents name it.
	Self string
	// Epoch is the agent's epoch, new at every start.
	Epoch uint64
	// Token authenticates peers: both sides prove they hold it (see handshake).
	Token []byte
	// Known, when set, vets every address before it is dialled (an error fails the peer
	// at once, as a refused connection would, and nothing is sent): agents dial only
	// agents they know, never whatever host:port an engine names.
	Known func(addr string) error
	Log   *slog.Logger
	// Peers counts open connections; Refused counts refused frames and connections by
	// reason (its labels are the socket, "peer", and the reason).
	Peers   prometheus.Gauge
	Refused *prometheus.CounterVec
	// OnMessage receives, on the connection's reader goroutine, every message of an
	// authenticated peer that is not about the mesh itself (engine descriptions are kept
	// by the Peer: see Info).
	OnMessage func(*Peer, wire.Message)
	// OnLost is told once of every connection that ended (Close included), after the
	// mesh stopped counting it.
	OnLost func(*Peer)
}

// Mesh is one agent's connections to the others.
type Mesh struct {
	cfg Config

	mu      sync.Mutex
	peers   map[string]*Peer // outbound, by address
	inbound map[*Peer]struct{}
	// handshakes are the inbound connections not yet authenticated, in accept order.
	handshakes []*Peer
	// known are the hosts agents have authenticated from or been dialled at (at most
	// maxInbound).
	known  map[string]struct{}
	closed bool
	wg     sync.WaitGroup
}

// New returns an empty mesh.
func New(cfg Config) *Mesh {
	return &Mesh{cfg: cfg, peers: map[string]*Peer{}, inbound: map[*Peer]struct{}{}, known: map[string]struct{}{}}
}

// Dial returns the connection to the agent at addr, opening it in the background when
// there is none: messages sent before it is up are queued.
func (m *Mesh) Dial(addr string) *Peer {
	m.mu.Lock()
	defer m.mu.Unlock()
	if p, ok := m.peers[addr]; ok {
		return p
	}
	if addr == m.cfg.Self {
		return m.dialSelf()
	}
	p := newPeer(m, nil, true, addr)
	m.peers[addr] = p
	m.count()
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		if m.cfg.Known != nil {
			if err := m.cfg.Known(addr); err != nil {
				m.cfg.Refused.WithLabelValues("peer", "PermissionDenied").Inc()
				p.fail(fmt.Errorf("not connecting to agent %s: %w", addr, err))
				return
			}
		}
		conn, err := net.DialTimeout("tcp", addr, handshakeTimeout)
		if err != nil {
			p.fail(fmt.Errorf("connecting to agent %s: %w", addr, err))
			return
		}
		p.conn = conn
		p.serve()
	}()
	return p
}

// dialSelf connects this agent's decode engines to its own prefill engines (a pair on one
// node): both ends of an in-process pipe are served as peers, so the protocol, its fences
// and its failure handling are the same as between nodes; nothing leaves the process, so
// there is no handshake. The caller holds m.mu.
func (m *Mesh) dialSelf() *Peer {
	dc, pc := net.Pipe()
	p := newPeer(m, dc, true, m.cfg.Self)
	q := newPeer(m, pc, false, m.cfg.Self)
	p.local, q.local = true, true
	m.peers[m.cfg.Self] = p
	m.inbound[q] = struct{}{}
	m.count()
	m.wg.Add(2)
	go func() { defer m.wg.Done(); p.serve() }()
	go func() { defer m.wg.Done(); q.serve() }()
	return p
}

// Serve accepts peers on ln until ln is closed.
func (m *Mesh) Serve(ln net.Listener) {
	for {
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		m.mu.Lock()
		if m.closed {
			m.mu.Unlock()
			conn.Close()
			return
		}
		if len(m.inbound) >= maxInbound {
			m.mu.Unlock()
			m.cfg.Refused.WithLabelValues("peer", "ResourceExhausted").Inc()
			conn.Close()
			continue
		}
		p := newPeer(m, conn, false, conn.RemoteAddr().String())
		p.host = hostOf(conn.RemoteAddr())
		_, p.knownHost = m.known[p.host]
		evicted := m.crowded(func(q *Peer) bool { return q.knownHost == p.knownHost }, maxHandshakes)
		if evicted != nil {
			m.dropHandshake(evicted)
		}
		m.handshakes = append(m.handshakes, p)
		m.inbound[p] = struct{}{}
		m.count()
		m.mu.Unlock()
		if evicted != nil {
			m.evict(evicted)
		}
		m.wg.Add(1)
		go func() { defer m.wg.Done(); p.serve() }()
	}
}

// Close ends every connection and waits for their goroutines. The listener given to
// Serve must be closed first.
func (m *Mesh) Close() {
	m.mu.Lock()
	m.closed = true
	peers := make([]*Peer, 0, len(m.peers)+len(m.inbound))
	for _, p := range m.peers {
		peers = append(peers, p)
	}
	for p := range m.inbound {
		peers = append(peers, p)
	}
	m.mu.Unlock()
	for _, p := range peers {
		p.fail(fmt.Errorf("agent shutting down"))
	}
	m.wg.Wait()
}

// crowded returns the handshake to evict when limit of those mid-handshake match (m.mu
// held): the one that has made the least progress, the oldest first.
func (m *Mesh) crowded(match func(*Peer) bool, limit int) *Peer {
	var victim *Peer
	least, n := 0, 0
	for _, q := range m.handshakes {
		if !match(q) {
			continue
		}
		n++
		if p := q.progress(); victim == nil || p < least {
			victim, least = q, p
		}
	}
	if n < limit {
		return nil
	}
	return victim
}

// spoke takes an inbound handshake that sent its first frame into its host's share,
// evicting one of that host's that spoke before it, if the share is full.
func (m *Mesh) spoke(p *Peer) {
	m.mu.Lock()
	victim := m.crowded(func(q *Peer) bool { return q != p && q.host == p.host && q.frames.Load() > 0 }, maxHandshakesPerHost)
	if victim != nil {
		m.dropHandshake(victim)
	}
	m.mu.Unlock()
	if victim != nil {
		m.evict(victim)
	}
}

// evict ends a handshake that a newer connection took the place of.
func (m *Mesh) evict(p *Peer) {
	p.evicted.Store(true)
	m.cfg.Refused.WithLabelValues("peer", "ResourceExhausted").Inc()
	p.fail(fmt.Errorf("handshake with %s: evicted by a newer connection, its host's or its budget's slots being full", p.conn.RemoteAddr()))
}

// progress is how far an inbound handshake has got: the frames it sent, or -1 while it
// has sent nothing, not even bytes its handshake has yet to read (a silent connection).
func (p *Peer) progress() int {
	if n := int(p.frames.Load()); n > 0 {
		return n
	}
	if queued(p.conn) > 0 {
		return 0
	}
	return -1
}

// queued is how many received bytes wait in c's socket buffer.
func queued(c net.Conn) int {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return 0
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return 0
	}
	n := 0
	_ = rc.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ) })
	return n
}

// dropHandshake removes p from the connections mid-handshake (m.mu held).
func (m *Mesh) dropHandshake(p *Peer) {
	m.handshakes = slices.DeleteFunc(m.handshakes, func(q *Peer) bool { return q == p })
}

// handshakeDone returns an inbound handshake's place in its budgets and remembers the
// host of a peer that proved itself (and of one this agent dialled).
func (m *Mesh) handshakeDone(p *Peer, ok bool) {
	host := hostOf(p.conn.RemoteAddr())
	m.mu.Lock()
	defer m.mu.Unlock()
	m.dropHandshake(p)
	if _, seen := m.known[host]; ok && !seen && len(m.known) < maxInbound {
		m.known[host] = struct{}{}
	}
}

// hostOf is the IP of a TCP address, as a string.
func hostOf(a net.Addr) string {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.IP.String()
	}
	return a.String()
}

// count publishes the number of connections; the caller holds m.mu.
func (m *Mesh) count() { m.cfg.Peers.Set(float64(len(m.peers) + len(m.inbound))) }

// Peer is one connection to another agent. Messages to a peer are queued and written by
// one goroutine, so a slow peer never blocks an engine's pump.
type Peer struct {
	m        *Mesh
	conn     net.Conn
	outbound bool
	// local: one end of the in-process pipe between this agent's own engines (a prefill
	// and a decode engine on the same node), which needs no handshake.
	local bool
	addr  string // the address dialled (outbound) or the remote's advertised one
	epoch uint64 // the remote agent's epoch
	// host is an inbound connection's remote IP; knownHost says whether an agent was
	// known there when it connected (which budget its handshake counts in); frames
	// counts the handshake frames it sent (progress).
	host      string
	knownHost bool
	frames    atomic.Int32
	evicted   atomic.Bool // a newer connection took its handshake's place
	out       chan wire.Message
	ready     chan struct{} // closed once the handshake is done
	done      chan struct{}
	once      sync.Once
	err       error

	mu       sync.Mutex
	sentInfo map[string]uint64           // engine key → epoch whose EngineInfo was sent
	infos    map[string]*wire.EngineInfo // engines the remote described, by key
}

func newPeer(m *Mesh, conn net.Conn, outbound bool, addr string) *Peer {
	return &Peer{
		m: m, conn: conn, outbound: outbound, addr: addr,
		out: make(chan wire.Message, 4096), ready: make(chan struct{}), done: make(chan struct{}),
		sentInfo: map[string]uint64{}, infos: map[string]*wire.EngineInfo{},
	}
}

// Addr is the address dialled (outbound) or the remote agent's advertised one.
func (p *Peer) Addr() string { return p.addr }

// Local reports whether the peer is this agent itself (engines paired on one node).
func (p *Peer) Local() bool { return p.local }

// Epoch is the remote agent's epoch (known once Reached).
func (p *Peer) Epoch() uint64 { return p.epoch }

// Err is why the connection failed (nil while it is up).
func (p *Peer) Err() error {
	select {
	case <-p.done:
		return p.err
	default:
		return nil
	}
}

// serve authenticates the connection (a local pipe needs none), then reads and
// dispatches frames until it fails.
func (p *Peer) serve() {
	m := p.m
	if p.local {
		p.epoch = m.cfg.Epoch
	} else {
		err := p.handshake()
		m.handshakeDone(p, err == nil)
		if err != nil {
			if !p.evicted.Load() { // counted as evicted already
				m.cfg.Refused.WithLabelValues("peer", "Unauthenticated").Inc()
			}
			p.fail(fmt.Errorf("handshake with %s: %w", p.conn.RemoteAddr(), err))
			return
		}
	}
	close(p.ready)
	go p.writeLoop()
	r := bufio.NewReaderSize(p.conn, 64<<10)
	for {
		// Between frames a connection may idle; a frame once begun must arrive whole
		// within frameTimeout, so a peer cannot pin a large frame's buffer by stalling.
		// A frame already buffered whole (the control messages, nearly always) needs
		// no deadline.
		hdr, err := r.Peek(4)
		if err != nil {
			p.fail(fmt.Errorf("reading from agent %s: %w", p.addr, err))
			return
		}
		partial := r.Buffered() < 4+int(binary.BigEndian.Uint32(hdr))
		if partial {
			p.conn.SetReadDeadline(time.Now().Add(frameTimeout))
		}
		msg, err := wire.Read(r)
		if partial {
			p.conn.SetReadDeadline(time.Time{})
		}
		if errors.Is(err, wire.ErrUnknownKind) {
			// A newer agent's message: skipped, so that agents of different releases keep
			// their connections while a DaemonSet rolls.
			m.cfg.Refused.WithLabelValues("peer", "UnknownKind").Inc()
			continue
		}
		if err != nil {
			// A malformed frame ends this connection only; the agent serves every other.
			m.cfg.Refused.WithLabelValues("peer", "Malformed").Inc()
			p.fail(fmt.Errorf("reading from agent %s: %w", p.addr, err))
			return
		}
		p.dispatch(msg)
	}
}

// dispatch keeps what the remote says about its engines and hands everything else on.
func (p *Peer) dispatch(msg wire.Message) {
	switch msg := msg.(type) {
	case *wire.EngineInfo:
		p.mu.Lock()
		p.infos[msg.Engine] = msg
		p.mu.Unlock()
	case *wire.Rails:
		// Rails that do not fit their EngineInfo leave the engine reached over its first
		// rail alone.
		p.amend(msg.Engine, "rails", false, func(info *wire.EngineInfo) (*wire.EngineInfo, error) { return info.WithRails(msg) })
	case *wire.GPU:
		// Without a GPU message that fits, the engine's region addresses mean nothing:
		// forget it, so what names it is refused rather than written to.
		p.amend(msg.Engine, "GPU memory", true, func(info *wire.EngineInfo) (*wire.EngineInfo, error) { return info.WithGPU(msg) })
	case *wire.Heads:
		// Heads that do not fit their regions leave nothing safe to slice by: forget the
		// engine, so what names it is refused.
		p.amend(msg.Engine, "KV heads", true, func(info *wire.EngineInfo) (*wire.EngineInfo, error) { return info.WithHeads(msg) })
	default:
		p.m.cfg.OnMessage(p, msg)
	}
}

// Reached reports whether the handshake completed: only then does the write loop send
// anything queued (Register, EngineInfo), so a connection that never got there carried
// nothing of this agent's to the peer.
func (p *Peer) Reached() bool {
	select {
	case <-p.ready:
		return true
	default:
		return false
	}
}

func (p *Peer) write(m wire.Message) error {
	b, err := wire.Encode(nil, m)
	if err != nil {
		return err
	}
	_, err = p.conn.Write(b)
	return err
}

func (p *Peer) writeLoop() {
	w := bufio.NewWriterSize(p.conn, 64<<10)
	var buf []byte
	for {
		select {
		case m := <-p.out:
			var err error
			if buf, err = wire.Encode(buf[:0], m); err != nil {
				p.m.cfg.Log.Error("cannot encode a message", "peer", p.addr, "err", err)
				continue
			}
			if _, err := w.Write(buf); err != nil {
				p.fail(err)
				return
			}
			if len(p.out) == 0 {
				if err := w.Flush(); err != nil {
					p.fail(err)
					return
				}
			}
		case <-p.done:
			return
		}
	}
}

// Send queues m; it is dropped when the connection has failed (whoever waits on it
// learns of the failure through Config.OnLost).
func (p *Peer) Send(m wire.Message) {
	select {
	case p.out <- m:
	case <-p.done:
	}
}

// Describe sends the messages that describe engine key at epoch (its EngineInfo and what
// completes it), unless this connection already carried them for that epoch.
func (p *Peer) Describe(key string, epoch uint64, describe func(local bool) []wire.Message) {
	p.mu.Lock()
	sent := p.sentInfo[key] == epoch
	p.sentInfo[key] = epoch
	p.mu.Unlock()
	if !sent {
		for _, m := range describe(p.local) {
			p.Send(m)
		}
	}
}

// Info is what the remote said of its engine key, or nil.
func (p *Peer) Info(key string) *wire.EngineInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.infos[key]
}

// amend completes the EngineInfo of engine with a message that follows it on the same
// connection, before any message naming the engine. One that does not fit is refused,
// and with forget the engine is forgotten.
func (p *Peer) amend(engine, what string, forget bool, with func(*wire.EngineInfo) (*wire.EngineInfo, error)) {
	p.mu.Lock()
	var err error
	if info := p.infos[engine]; info == nil {
		err = fmt.Errorf("%s of %s before its memory", what, engine)
	} else if info, err = with(info); err == nil {
		p.infos[engine] = info
	} else if forget {
		delete(p.infos, engine)
	}
	p.mu.Unlock()
	if err != nil {
		p.m.cfg.Refused.WithLabelValues("peer", "Malformed").Inc()
		p.m.cfg.Log.Warn("refused a peer's description of an engine", "peer", p.addr, "what", what, "err", err)
	}
}

func (p *Peer) fail(err error) {
	p.once.Do(func() {
		p.err = err
		close(p.done)
		m := p.m
		m.mu.Lock()
		if m.peers[p.addr] == p {
			delete(m.peers, p.addr)
		}
		delete(m.inbound, p)
		m.count()
		// Closed only once the mesh no longer counts it: whoever sees the connection end
		// sees the mesh without it.
		if p.conn != nil {
			p.conn.Close()
		}
		closed := m.closed
		m.mu.Unlock()
		if !closed {
			m.cfg.Log.Warn("peer lost", "peer", p.addr, "err", err)
		}
		m.cfg.OnLost(p)
	})
}
