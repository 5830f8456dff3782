package agent

import (
	"bufio"
	"crypto/hmac"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
)

// handshakeTimeout bounds connecting and authenticating a peer.
const handshakeTimeout = 10 * time.Second

// Caps on inbound connections, so that connections nobody authenticates cannot exhaust
// the agent: maxHandshakes may be mid-handshake at once (each holds at most a handshake
// frame and a goroutine for at most handshakeTimeout); maxInbound may be open in all, one
// per decode agent of the cluster that talks to this one.
const (
	maxHandshakes = 64
	maxInbound    = 4096
)

// peer is one TCP connection to another agent. A decode agent dials the prefill agents
// its engines name; the prefill agent answers on the same connection. Messages to a peer
// are queued and written by one goroutine, so a slow peer never blocks an engine's pump.
type peer struct {
	a        *Agent
	conn     net.Conn
	outbound bool
	// local: one end of the in-process pipe between this agent's own engines (a prefill
	// and a decode engine on the same node), which needs no handshake.
	local bool
	addr  string // the address dialled (outbound) or the remote's advertised one
	epoch uint64 // the remote agent's epoch
	out   chan wire.Message
	ready chan struct{} // closed once the handshake is done
	done  chan struct{}
	once  sync.Once
	err   error

	mu       sync.Mutex
	sentInfo map[string]uint64           // engine key → epoch whose EngineInfo was sent
	infos    map[string]*wire.EngineInfo // engines the remote described, by key
}

func newPeer(a *Agent, conn net.Conn, outbound bool, addr string) *peer {
	return &peer{
		a: a, conn: conn, outbound: outbound, addr: addr,
		out: make(chan wire.Message, 4096), ready: make(chan struct{}), done: make(chan struct{}),
		sentInfo: map[string]uint64{}, infos: map[string]*wire.EngineInfo{},
	}
}

// dial returns the connection to the agent at addr, opening it in the background when
// there is none: messages sent before it is up are queued.
func (a *Agent) dial(addr string) *peer {
	a.mu.Lock()
	defer a.mu.Unlock()
	if p, ok := a.peers[addr]; ok {
		return p
	}
	if addr == a.self {
		return a.dialSelf()
	}
	p := newPeer(a, nil, true, addr)
	a.peers[addr] = p
	a.metrics.peers.Set(float64(len(a.peers) + len(a.inbound)))
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
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
// there is no handshake. The caller holds a.mu.
func (a *Agent) dialSelf() *peer {
	dc, pc := net.Pipe()
	p := newPeer(a, dc, true, a.self)
	q := newPeer(a, pc, false, a.self)
	p.local, q.local = true, true
	a.peers[a.self] = p
	a.inbound[q] = struct{}{}
	a.metrics.peers.Set(float64(len(a.peers) + len(a.inbound)))
	a.wg.Add(2)
	go func() { defer a.wg.Done(); p.serve() }()
	go func() { defer a.wg.Done(); q.serve() }()
	return p
}

func (a *Agent) acceptPeers() {
	for {
		conn, err := a.peerLn.Accept()
		if err != nil {
			return
		}
		a.mu.Lock()
		if a.closed {
			a.mu.Unlock()
			conn.Close()
			return
		}
		if a.handshaking >= maxHandshakes || len(a.inbound) >= maxInbound {
			a.mu.Unlock()
			a.metrics.refused.WithLabelValues("peer", "ResourceExhausted").Inc()
			conn.Close()
			continue
		}
		p := newPeer(a, conn, false, conn.RemoteAddr().String())
		a.handshaking++
		a.inbound[p] = struct{}{}
		a.metrics.peers.Set(float64(len(a.peers) + len(a.inbound)))
		a.mu.Unlock()
		a.wg.Add(1)
		go func() { defer a.wg.Done(); p.serve() }()
	}
}

// serve authenticates the connection (a local pipe needs none), then reads and
// dispatches frames until it fails.
func (p *peer) serve() {
	if p.local {
		p.epoch = p.a.epoch
	} else {
		err := p.handshake()
		if !p.outbound {
			p.a.mu.Lock()
			p.a.handshaking--
			p.a.mu.Unlock()
		}
		if err != nil {
			p.a.metrics.refused.WithLabelValues("peer", "Unauthenticated").Inc()
			p.fail(fmt.Errorf("handshake with %s: %w", p.conn.RemoteAddr(), err))
			return
		}
	}
	close(p.ready)
	go p.writeLoop()
	r := bufio.NewReaderSize(p.conn, 64<<10)
	for {
		m, err := wire.Read(r)
		if err != nil {
			// A malformed frame ends this connection only; the agent serves every other.
			p.a.metrics.refused.WithLabelValues("peer", "Malformed").Inc()
			p.fail(fmt.Errorf("reading from agent %s: %w", p.addr, err))
			return
		}
		p.a.dispatch(p, m)
	}
}

// handshake authenticates a connection both ways with the cluster token.
//
// Both sides send a Hello (agent, epoch, fresh nonce). Each proof is an HMAC over the
// prover's role and both Hellos, dialer's first, so a proof is good for one direction of
// one connection only: it cannot be reflected back to its signer or replayed on another
// connection. The dialer proves first; the acceptor checks that proof before it signs
// anything, so a party that has not proved it holds the token never gets a signature.
// A Hello that carries this agent's own identity or nonce is refused: mirroring an
// agent's Hello back at it is how a reflection would start.
func (p *peer) handshake() error {
	p.conn.SetDeadline(time.Now().Add(handshakeTimeout))
	defer p.conn.SetDeadline(time.Time{})
	var nonce [16]byte
	_, _ = rand.Read(nonce[:])
	mine := &wire.Hello{Agent: p.a.self, Epoch: p.a.epoch, Nonce: hex.EncodeToString(nonce[:])}
	if err := p.write(mine); err != nil {
		return err
	}
	m, err := wire.ReadLimit(p.conn, wire.MaxHandshakeFrame)
	if err != nil {
		return err
	}
	theirs, ok := m.(*wire.Hello)
	switch {
	case !ok || len(theirs.Nonce) < 16:
		return fmt.Errorf("expected a Hello with a nonce, got %T", m)
	case theirs.Nonce == mine.Nonce || (theirs.Agent == mine.Agent && theirs.Epoch == mine.Epoch):
		return errors.New("the peer's Hello is this agent's own")
	}
	dialer, acceptor := mine, theirs
	if !p.outbound {
		dialer, acceptor = theirs, mine
	}
	expect := func(role string) error {
		m, err := wire.ReadLimit(p.conn, wire.MaxHandshakeFrame)
		if err != nil {
			return err
		}
		auth, ok := m.(*wire.Auth)
		if !ok || !hmac.Equal([]byte(auth.MAC), []byte(wire.Proof(p.a.cfg.Token, role, dialer, acceptor))) {
			return errors.New("peer did not prove it holds the agents' token")
		}
		return nil
	}
	if p.outbound {
		if err := p.write(&wire.Auth{MAC: wire.Proof(p.a.cfg.Token, wire.RoleDialer, dialer, acceptor)}); err != nil {
			return err
		}
		if err := expect(wire.RoleAcceptor); err != nil {
			return err
		}
	} else {
		if err := expect(wire.RoleDialer); err != nil {
			return err
		}
		if err := p.write(&wire.Auth{MAC: wire.Proof(p.a.cfg.Token, wire.RoleAcceptor, dialer, acceptor)}); err != nil {
			return err
		}
	}
	if !p.outbound {
		p.addr = theirs.Agent
	}
	p.epoch = theirs.Epoch
	p.a.log.Info("peer connected", "peer", p.addr, "epoch", p.epoch, "outbound", p.outbound)
	return nil
}

// reached reports whether the handshake completed: only then does the write loop send
// anything queued (Register, EngineInfo), so a connection that never got there carried
// nothing of this agent's to the peer.
func (p *peer) reached() bool {
	select {
	case <-p.ready:
		return true
	default:
		return false
	}
}

func (p *peer) write(m wire.Message) error {
	b, err := wire.Encode(nil, m)
	if err != nil {
		return err
	}
	_, err = p.conn.Write(b)
	return err
}

func (p *peer) writeLoop() {
	w := bufio.NewWriterSize(p.conn, 64<<10)
	var buf []byte
	for {
		select {
		case m := <-p.out:
			var err error
			if buf, err = wire.Encode(buf[:0], m); err != nil {
				p.a.log.Error("cannot encode a message", "peer", p.addr, "err", err)
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

// send queues m; it is dropped when the connection has failed (whoever waits on it
// learns of the failure through peerLost).
func (p *peer) send(m wire.Message) {
	select {
	case p.out <- m:
	case <-p.done:
	}
}

// describe sends s's EngineInfo unless this connection already has it for s's epoch.
func (p *peer) describe(s *session) {
	p.mu.Lock()
	sent := p.sentInfo[s.key] == s.epoch
	p.sentInfo[s.key] = s.epoch
	p.mu.Unlock()
	if !sent {
		for _, m := range s.describe(p.local) {
			p.send(m)
		}
	}
}

func (p *peer) info(key string) *wire.EngineInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.infos[key]
}

// amend completes the EngineInfo of engine with a message that follows it on the same
// connection, before any message naming the engine. One that does not fit is refused,
// and with forget the engine is forgotten.
func (p *peer) amend(engine, what string, forget bool, with func(*wire.EngineInfo) (*wire.EngineInfo, error)) {
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
		p.a.metrics.refused.WithLabelValues("peer", "Malformed").Inc()
		p.a.log.Warn("refused a peer's description of an engine", "peer", p.addr, "what", what, "err", err)
	}
}

func (p *peer) fail(err error) {
	p.once.Do(func() {
		p.err = err
		close(p.done)
		a := p.a
		a.mu.Lock()
		if a.peers[p.addr] == p {
			delete(a.peers, p.addr)
		}
		delete(a.inbound, p)
		a.metrics.peers.Set(float64(len(a.peers) + len(a.inbound)))
		// Closed only once the agent no longer counts it: whoever sees the connection end
		// sees the agent's state without it.
		if p.conn != nil {
			p.conn.Close()
		}
		sessions := make([]*session, 0, len(a.sessions))
		for _, s := range a.sessions {
			sessions = append(sessions, s)
		}
		closed := a.closed
		a.mu.Unlock()
		if !closed {
			a.log.Warn("peer lost", "peer", p.addr, "err", err)
		}
		for _, s := range sessions {
			s.post(func() { s.side.peerLost(time.Now(), p) })
		}
	})
}

func (p *peer) close() { p.fail(fmt.Errorf("agent shutting down")) }

// dispatch routes a peer's message to the engine session it names. Messages for the
// prefill side name the source engine; answers for the decode side name the decode
// engine. A message naming no live engine is answered (or dropped) here.
func (a *Agent) dispatch(p *peer, m wire.Message) {
	switch m := m.(type) {
	case *wire.EngineInfo:
		p.mu.Lock()
		p.infos[m.Engine] = m
		p.mu.Unlock()
	case *wire.Rails:
		// Rails that do not fit their EngineInfo leave the engine reached over its first
		// rail alone.
		p.amend(m.Engine, "rails", false, func(info *wire.EngineInfo) (*wire.EngineInfo, error) { return info.WithRails(m) })
	case *wire.GPU:
		// Without a GPU message that fits, the engine's region addresses mean nothing:
		// forget it, so what names it is refused rather than written to.
		p.amend(m.Engine, "GPU memory", true, func(info *wire.EngineInfo) (*wire.EngineInfo, error) { return info.WithGPU(m) })
	case *wire.Register:
		a.toPrefill(p, m.Source, m.Request, m.Attempt, m.Engine, func(ps *prefillSide) { ps.onRegister(p, m) })
	case *wire.Acquire:
		a.toPrefill(p, m.Source, m.Request, m.Attempt, m.Engine, func(ps *prefillSide) { ps.onAcquire(p, m) })
	case *wire.Heartbeat:
		a.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onHeartbeat(m) })
	case *wire.Cancel:
		a.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onCancel(p, m) })
	case *wire.Release:
		a.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onRelease(p, m) })
	case *wire.CancelAcked:
		a.toDecode(m.Engine, func(ds *decodeSide) { ds.onOutcome(p, m.Request, m.Attempt, true, "", m.Signalled != 0) })
	case *wire.Failed:
		a.toDecode(m.Engine, func(ds *decodeSide) { ds.onOutcome(p, m.Request, m.Attempt, false, m.Reason, m.Signalled != 0) })
	case *wire.Acquired:
		a.toDecode(m.Engine, func(ds *decodeSide) { ds.onAcquired(p, m) })
	case *wire.Writing:
		a.toDecode(m.Engine, func(ds *decodeSide) { ds.onWriting(p, m) })
	default:
		a.metrics.refused.WithLabelValues("peer", "Unexpected").Inc()
		a.log.Warn("unexpected message from a peer", "peer", p.addr, "kind", m.Kind())
	}
}

func (a *Agent) toPrefill(p *peer, source, req string, attempt uint64, decode string, fn func(*prefillSide)) {
	s := a.engine(source)
	var ps *prefillSide
	if s != nil {
		ps = s.prefill()
	}
	if ps == nil {
		if req != "" {
			p.send(&wire.Failed{Request: req, Attempt: attempt, Engine: decode, Reason: fmt.Sprintf("no prefill engine %s at agent %s", source, a.self)})
		}
		return
	}
	s.post(func() { fn(ps) })
}

func (a *Agent) toDecode(engine string, fn func(*decodeSide)) {
	if s := a.engine(engine); s != nil {
		if ds := s.decode(); ds != nil {
			s.post(func() { fn(ds) })
		}
	}
}
