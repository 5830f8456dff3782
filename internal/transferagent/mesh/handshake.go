package mesh

import (
	"crypto/hmac"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
)

// handshakeTimeout bounds connecting and authenticating a peer.
const handshakeTimeout = 10 * time.Second

// handshake authenticates a connection both ways with the cluster token.
//
// Both sides send a Hello (agent, epoch, fresh nonce). Each proof is an HMAC over the
// prover's role and both Hellos, dialer's first, so a proof is good for one direction of
// one connection only: it cannot be reflected back to its signer or replayed on another
// connection. The dialer proves first; the acceptor checks that proof before it signs
// anything, so a party that has not proved it holds the token never gets a signature.
// A Hello that carries this agent's own identity or nonce is refused: mirroring an
// agent's Hello back at it is how a reflection would start.
func (p *Peer) handshake() error {
	cfg := &p.m.cfg
	p.conn.SetDeadline(time.Now().Add(handshakeTimeout))
	defer p.conn.SetDeadline(time.Time{})
	var nonce [16]byte
	_, _ = rand.Read(nonce[:])
	mine := &wire.Hello{Agent: cfg.Self, Epoch: cfg.Epoch, Nonce: hex.EncodeToString(nonce[:])}
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
		if !ok || !hmac.Equal([]byte(auth.MAC), []byte(wire.Proof(cfg.Token, role, dialer, acceptor))) {
			return errors.New("peer did not prove it holds the agents' token")
		}
		return nil
	}
	if p.outbound {
		if err := p.write(&wire.Auth{MAC: wire.Proof(cfg.Token, wire.RoleDialer, dialer, acceptor)}); err != nil {
			return err
		}
		if err := expect(wire.RoleAcceptor); err != nil {
			return err
		}
	} else {
		if err := expect(wire.RoleDialer); err != nil {
			return err
		}
		if err := p.write(&wire.Auth{MAC: wire.Proof(cfg.Token, wire.RoleAcceptor, dialer, acceptor)}); err != nil {
			return err
		}
	}
	if !p.outbound {
		p.addr = theirs.Agent
	}
	p.epoch = theirs.Epoch
	cfg.Log.Info("peer connected", "peer", p.addr, "epoch", p.epoch, "outbound", p.outbound)
	return nil
}
