package agent_test

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// relay accepts connections and joins each to a new connection to target, dialled from
// the loopback address from: a party without the token between two agents. It returns
// its address; it stops when the test ends.
func relay(t *testing.T, target string, from net.IP) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: from}}
			out, err := d.Dial("tcp", target)
			if err != nil {
				in.Close()
				continue
			}
			go func() { io.Copy(out, in); out.Close() }()
			go func() { io.Copy(in, out); in.Close() }()
		}
	}()
	return ln.Addr().String()
}

// A relay between two agents cannot complete a handshake: the dialling agent finds the
// prefill agent's name where it dialled the relay, and the prefill agent finds the decode
// agent's name on a connection from the relay's host. Before both checked, the relay sat
// on an authenticated connection and could inject frames either way.
func TestARelayBetweenAgentsIsRefused(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	via := relay(t, p.A.Peer, net.IPv4(127, 0, 0, 2))
	connected := strings.Count(p.A.Log(), `"peer connected"`)

	src, dst := alloc(t, p.P[0], 4), alloc(t, p.D[0], 4)
	through := &agentv1.EngineRef{Agent: via, EngineId: p.P[0].Self.EngineId, TpRank: p.P[0].Self.TpRank}
	if err := p.D[0].RegisterDestination(bg, "relayed", 1, dst, through); err != nil {
		t.Fatal(err)
	}
	if err := p.P[0].SourceReady(bg, "relayed", 0, src, true); err != nil {
		t.Fatal(err)
	}
	ev := wait(t, p.D[0], "relayed", 1)
	expect(t, ev, agentv1.Event_FAILED)
	until(t, "the decode agent refuses the relayed handshake", func() bool {
		return p.B.Metric(t, `kvhandoff_agent_refused_total{call="peer",code="Unauthenticated"}`) >= 1
	})
	if !strings.Contains(p.B.Log(), "names itself") {
		t.Errorf("the decode agent's log does not say who the relay's far end claimed to be:\n%s", p.B.Log())
	}
	if n := strings.Count(p.A.Log(), `"peer connected"`); n != connected {
		t.Errorf("the prefill agent authenticated %d connections through the relay", n-connected)
	}
	p.P[0].Free(src)
	p.D[0].Free(dst)
	transfer(t, p.P[0], p.D[0], "direct")
}

// A connection that claims to be an agent on another host is refused by the acceptor,
// even with a valid proof: agents connect from the host they name, and a relay's
// connection comes from the relay.
func TestAPeerMustConnectFromTheHostItNames(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 3)}}
	c, err := d.Dial("tcp", p.A.Peer)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	mine := &wire.Hello{Agent: p.B.Peer, Epoch: 1, Nonce: "0123456789abcdef0123456789abcdef"}
	hello, _ := wire.Encode(nil, mine)
	c.Write(hello)
	m, err := wire.Read(c) // the agent's own Hello
	if err != nil {
		t.Fatal(err)
	}
	auth, _ := wire.Encode(nil, &wire.Auth{MAC: wire.Proof([]byte(agentproc.Token), wire.RoleDialer, mine, m.(*wire.Hello))})
	c.Write(auth)
	if m, err := wire.Read(c); err == nil {
		t.Errorf("the agent answered %T to a peer that names %s from 127.0.0.3", m, p.B.Peer)
	}
	until(t, "the claim is refused", func() bool {
		return p.A.Metric(t, `kvhandoff_agent_refused_total{call="peer",code="Unauthenticated"}`) == 1
	})
}

// Connections that never speak cannot lock the cluster's agents out. One host holds at
// most maxHandshakesPerHost handshake slots; many hosts together fill the strangers'
// slots, but not those of hosts an agent has authenticated from. Before, 64 silent
// connections from anywhere refused every agent.
func TestSilentConnectionsCannotLockAgentsOut(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	transfer(t, p.P[0], p.D[0], "known") // the decode agent's host is now known to A
	// Another decode agent on that host, which has not dialled A yet. The handshake
	// deadline frees silent slots after a few seconds, so it is ready before the flood.
	c := startAgent(t, "another-decode-node", t.TempDir())
	dc := engine(t, c, "decode-1.default", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, 0, p.layout)

	silent := func(host byte, n int) []net.Conn {
		var conns []net.Conn
		for range n {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, host)}}
			c, err := d.Dial("tcp", p.A.Peer)
			if err != nil {
				t.Fatal(err)
			}
			conns = append(conns, c)
		}
		t.Cleanup(func() {
			for _, c := range conns {
				c.Close()
			}
		})
		return conns
	}
	refused := `kvhandoff_agent_refused_total{call="peer",code="ResourceExhausted"}`
	silent(2, 10)
	until(t, "one host is held to its share", func() bool { return p.A.Metric(t, refused) == 10-maxHandshakesPerHostForTest })
	for h := byte(3); h < 3+(64-maxHandshakesPerHostForTest)/maxHandshakesPerHostForTest; h++ {
		silent(h, maxHandshakesPerHostForTest)
	}
	until(t, "the strangers' slots are full", func() bool {
		return p.A.Metric(t, "kvhandoff_agent_peer_connections") >= 64+1 // and the decode agent's
	})
	silent(200, 1)
	until(t, "a stranger past the slots is refused", func() bool { return p.A.Metric(t, refused) == 10-maxHandshakesPerHostForTest+1 })

	// The new agent on the known host gets through while the slots are held.
	transfer(t, p.P[0], dc, "while-flooded")
}

// maxHandshakesPerHostForTest is the mesh's per-host cap, as the tests see it.
const maxHandshakesPerHostForTest = 4

// An authenticated peer that starts a large frame and stalls is cut off after the frame
// timeout, and its frame's buffer grows only with what it sent.
func TestAStalledFrameEndsItsConnection(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	c := handshake(t, p.A.Peer)
	defer c.Close()
	frame := binary.BigEndian.AppendUint32(nil, wire.MaxFrame-1)
	frame = append(frame, make([]byte, 1000)...)
	if _, err := c.Write(frame); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	buf := make([]byte, 1)
	_, err := c.Read(buf)
	if err == nil || time.Since(start) > 25*time.Second {
		t.Fatalf("the agent kept a stalled frame's connection open (%v after %s)", err, time.Since(start))
	}
	transfer(t, p.P[0], p.D[0], "after-the-stall")
}

// A message of a kind this agent does not know (a newer agent's) is skipped and counted,
// and the connection goes on: agents of two releases keep talking while a DaemonSet rolls.
func TestAnUnknownKindIsSkippedAndTheConnectionKept(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	c := handshake(t, p.A.Peer)
	defer c.Close()
	frames := append(binary.BigEndian.AppendUint32(nil, 5), wire.Version, 200, 1, 2, 3)
	frames, _ = wire.Encode(frames, &wire.Register{Request: "after-unknown", Attempt: 1, Engine: "stranger/0", EngineEpoch: 1,
		Source: "nobody/0", Blocks: []uint32{1}})
	if _, err := c.Write(frames); err != nil {
		t.Fatal(err)
	}
	// The registration after it is answered on the same connection: no such prefill engine.
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		m, err := wire.Read(c)
		if err != nil {
			t.Fatalf("the connection ended after a frame of an unknown kind: %v", err)
		}
		if f, ok := m.(*wire.Failed); ok && f.Request == "after-unknown" {
			break
		}
	}
	if got := p.A.Metric(t, `kvhandoff_agent_refused_total{call="peer",code="UnknownKind"}`); got != 1 {
		t.Errorf("unknown kinds counted: %v, want 1", got)
	}
	transfer(t, p.P[0], p.D[0], "after-an-unknown-kind")
}

// handshake authenticates a test connection to the agent at addr with the cluster token,
// as an agent on 127.0.0.1 would.
func handshake(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	mine := &wire.Hello{Agent: c.LocalAddr().String(), Epoch: 7, Nonce: "00112233445566778899aabbccddeeff"}
	write := func(m wire.Message) {
		b, _ := wire.Encode(nil, m)
		if _, err := c.Write(b); err != nil {
			t.Fatal(err)
		}
	}
	write(mine)
	m, err := wire.Read(c)
	if err != nil {
		t.Fatal(err)
	}
	theirs := m.(*wire.Hello)
	write(&wire.Auth{MAC: wire.Proof([]byte(agentproc.Token), wire.RoleDialer, mine, theirs)})
	if m, err := wire.Read(c); err != nil {
		t.Fatal(fmt.Errorf("the agent did not accept the handshake: %w", err))
	} else if _, ok := m.(*wire.Auth); !ok {
		t.Fatalf("got %T, want the agent's Auth", m)
	}
	c.SetDeadline(time.Time{})
	return c
}
