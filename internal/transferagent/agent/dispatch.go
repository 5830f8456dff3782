package agent

import (
	"fmt"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/mesh"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
)

// dispatch routes a peer's message to the engine session it names. Messages for the
// prefill side name the source engine; answers for the decode side name the decode
// engine. A message naming no live engine is answered (or dropped) here.
func (a *Agent) dispatch(p *mesh.Peer, m wire.Message) {
	switch m := m.(type) {
	case *wire.Register:
		a.toPrefill(p, m.Source, m.Request, m.Attempt, m.Engine, func(ps *prefillSide) { ps.onRegister(p, m) })
	case *wire.Acquire:
		a.toPrefill(p, m.Source, m.Request, m.Attempt, m.Engine, func(ps *prefillSide) { ps.onAcquire(p, m) })
	case *wire.Heartbeat:
		a.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onHeartbeat(m) })
	case *wire.Cancel:
		a.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onCancel(p, m) })
	case *wire.Decline:
		a.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onDecline(m) })
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
		a.log.Warn("unexpected message from a peer", "peer", p.Addr(), "kind", m.Kind())
	}
}

func (a *Agent) toPrefill(p *mesh.Peer, source, req string, attempt uint64, decode string, fn func(*prefillSide)) {
	s := a.engine(source)
	var ps *prefillSide
	if s != nil {
		ps = s.prefill()
	}
	if ps == nil {
		if req != "" {
			p.Send(&wire.Failed{Request: req, Attempt: attempt, Engine: decode, Reason: fmt.Sprintf("no prefill engine %s at agent %s", source, a.self)})
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

// peerLost tells every session that a peer connection ended: each fails or fences what
// it had with that peer.
func (a *Agent) peerLost(p *mesh.Peer) {
	a.mu.Lock()
	sessions := make([]*session, 0, len(a.sessions))
	for _, s := range a.sessions {
		sessions = append(sessions, s)
	}
	a.mu.Unlock()
	for _, s := range sessions {
		s.post(func() { s.side.peerLost(time.Now(), p) })
	}
}
