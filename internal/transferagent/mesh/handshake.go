package mesh

import (
	"crypto/hmac"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
)

// handshakeTimeout bounds connecting and authenticating a peer: two small frames each
// way, which an agent answers at once.
const handshakeTimeout = 5 * time.Second

// handshake authenticates a connection both ways with the cluster token.
//
// Both sides send a Hello (agent, epoch, fresh nonce). Each proof is an HMAC over the
// prover's role and both Hellos, dialer's first, so a proof is good for one direction of
// one connection only: it cannot be reflected back to its signer or replayed on another
// connection. The dialer proves first; the acceptor checks that proof before it signs
// anything, so a party that has not proved it holds the token never gets a signature.
// A Hello that carries this agent's own identity or nonce is refused: mirroring an
// agent's Hello back at it is how a reflection would start. Each side also checks who
// the other claims to be (checkIdentity) before it proves anything, so a relay between
// two agents cannot complete the handshake with either.
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
	p.frames.Add(1)
	if !p.outbound {
		p.m.spoke(p)
	}
	theirs, ok := m.(*wire.Hello)
	switch {
	case !ok || len(theirs.Nonce) < 16:
		return fmt.Errorf("expected a Hello with a nonce, got %T", m)
	case theirs.Nonce == mine.Nonce || (theirs.Agent == mine.Agent && theirs.Epoch == mine.Epoch):
		return errors.New("the peer's Hello is this agent's own")
	}
	if err := p.checkIdentity(theirs.Agent); err != nil {
		return err
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
		p.frames.Add(1)
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

// checkIdentity refuses a peer whose claimed agent address is not the one this
// connection reaches. The dialer requires the address it dialled: a relay that passes on
// another agent's Hello names that agent, not itself. The acceptor requires the claimed
// address's host to be the connection's source: agents run with hostNetwork and
// advertise their node's address, so an agent's connections come from the host it names.
// Both checks run before this side sends its proof, so a refused relay learns nothing
// it could replay.
func (p *Peer) checkIdentity(claimed string) error {
	if p.outbound {
		if claimed != p.addr {
			return fmt.Errorf("dialled agent %s, but the peer names itself %s", p.addr, claimed)
		}
		return nil
	}
	host, _, err := net.SplitHostPort(claimed)
	if err != nil {
		return fmt.Errorf("the peer names itself %q, not host:port", claimed)
	}
	src, ok := p.conn.RemoteAddr().(*net.TCPAddr)
	if ip := net.ParseIP(host); ip == nil || !ok || !ip.Equal(src.IP) {
		return fmt.Errorf("the peer names itself %s but connects from %s", claimed, p.conn.RemoteAddr())
	}
	return nil
}
