package session

import (
	"fmt"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/mesh"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
)

// Dispatch routes a peer's message to the engine session it names (the mesh's
// OnMessage). Messages for the prefill side name the source engine; answers for the
// decode side name the decode engine. A message naming no live engine is answered (or
// dropped) here.
func (t *Table) Dispatch(p *mesh.Peer, m wire.Message) {
	switch m := m.(type) {
	case *wire.Register:
		t.toPrefill(p, m.Source, m.Request, m.Attempt, m.Engine, func(ps *prefillSide) { ps.onRegister(p, m, 0) })
	case *wire.RegisterTail:
		t.toPrefill(p, m.Source, m.Request, m.Attempt, m.Engine, func(ps *prefillSide) { ps.onRegister(p, &m.Register, m.First) })
	case *wire.Acquire:
		t.toPrefill(p, m.Source, m.Request, m.Attempt, m.Engine, func(ps *prefillSide) { ps.onAcquire(p, m) })
	case *wire.Heartbeat:
		t.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onHeartbeat(m) })
	case *wire.Cancel:
		t.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onCancel(p, m) })
	case *wire.Decline:
		t.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onDecline(m) })
	case *wire.Resignal:
		t.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onResignal(p, m) })
	case *wire.Signalled:
		t.toDecode(m.Engine, func(ds *decodeSide) { ds.onSignalled(p, m) })
	case *wire.Abandon:
		t.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onAbandon(m) })
	case *wire.Release:
		t.toPrefill(p, m.Source, "", 0, "", func(ps *prefillSide) { ps.onRelease(p, m) })
	case *wire.CancelAcked:
		t.toDecode(m.Engine, func(ds *decodeSide) { ds.onOutcome(p, m.Request, m.Attempt, true, "", m.Signalled != 0) })
	case *wire.Failed:
		t.toDecode(m.Engine, func(ds *decodeSide) { ds.onOutcome(p, m.Request, m.Attempt, false, m.Reason, m.Signalled != 0) })
	case *wire.Acquired:
		t.toDecode(m.Engine, func(ds *decodeSide) { ds.onAcquired(p, m) })
	case *wire.Writing:
		t.toDecode(m.Engine, func(ds *decodeSide) { ds.onWriting(p, m) })
	default:
		t.cfg.Metrics.Refused.WithLabelValues("peer", "Unexpected").Inc()
		t.cfg.Log.Warn("unexpected message from a peer", "peer", p.Addr(), "kind", m.Kind())
	}
}

func (t *Table) toPrefill(p *mesh.Peer, source, req string, attempt uint64, decode string, fn func(*prefillSide)) {
	s := t.engine(source)
	var ps *prefillSide
	if s != nil {
		ps = s.prefill()
	}
	if ps == nil {
		if req != "" {
			p.Send(&wire.Failed{Request: req, Attempt: attempt, Engine: decode, Reason: fmt.Sprintf("no prefill engine %s at agent %s", source, t.cfg.Self)})
		}
		return
	}
	s.post(func() { fn(ps) })
}

func (t *Table) toDecode(engine string, fn func(*decodeSide)) {
	if s := t.engine(engine); s != nil {
		if ds := s.decode(); ds != nil {
			s.post(func() { fn(ds) })
		}
	}
}

// PeerLost tells every session that a peer connection ended (the mesh's OnLost): each
// fails or fences what it had with that peer.
func (t *Table) PeerLost(p *mesh.Peer) {
	for _, s := range t.all() {
		s.post(func() { s.side.peerLost(time.Now(), p) })
	}
}
