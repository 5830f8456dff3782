package agent_test

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
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
	if !p.B.WaitLog("names itself", 10*time.Second) {
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

// Connections that never speak cannot lock the cluster's agents out. Silent strangers
// fill at most the strangers' handshake slots, and each newcomer evicts the oldest; the
// slots of hosts an agent has authenticated from stay free for them. Before, 64 silent
// connections from anywhere refused every agent.
func TestSilentConnectionsCannotLockAgentsOut(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	transfer(t, p.P[0], p.D[0], "known") // the decode agent's host is now known to A
	// Another decode agent on that host, which has not dialled A yet.
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
	for h := byte(2); h < 2+maxHandshakesForTest/8; h++ {
		silent(h, 8)
	}
	until(t, "the strangers' slots are full", func() bool {
		return p.A.Metric(t, "kvhandoff_agent_peer_connections") >= maxHandshakesForTest+1 // and the decode agent's
	})
	refused := `kvhandoff_agent_refused_total{call="peer",code="ResourceExhausted"}`
	if n := p.A.Metric(t, refused); n != 0 {
		t.Fatalf("%v connections evicted or refused before the slots were full", n)
	}
	first := silent(200, 1)[0]
	until(t, "a stranger past the slots evicts the oldest", func() bool { return p.A.Metric(t, refused) == 1 })
	first.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := wire.Read(first); err != nil { // the newcomer's handshake goes on: the agent's Hello
		t.Fatalf("the newest stranger was closed (%v); the oldest should have been", err)
	}

	// The new agent on the known host gets through while the slots are held.
	transfer(t, p.P[0], dc, "while-flooded")
}

// maxHandshakesForTest is the mesh's cap on handshakes per budget, as the tests see it.
const maxHandshakesForTest = 64

// maxHandshakesPerHostForTest is the mesh's per-host cap, as the tests see it.
const maxHandshakesPerHostForTest = 4

// Connections that send a Hello and stall hold at most their host's share of handshake
// slots: the next connection of that host to speak evicts the oldest.
func TestStalledHandshakesHoldAtMostTheirHostsShare(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	speak := func(i int) net.Conn {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 9)}}
		c, err := d.Dial("tcp", p.A.Peer)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		hello, _ := wire.Encode(nil, &wire.Hello{Agent: c.LocalAddr().String(), Epoch: 1, Nonce: fmt.Sprintf("%032d", i)})
		c.Write(hello)
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := wire.Read(c); err != nil { // the agent's Hello
			t.Fatal(err)
		}
		return c
	}
	var conns []net.Conn
	for i := range maxHandshakesPerHostForTest {
		conns = append(conns, speak(i))
	}
	refused := `kvhandoff_agent_refused_total{call="peer",code="ResourceExhausted"}`
	if n := p.A.Metric(t, refused); n != 0 {
		t.Fatalf("%v handshakes evicted within the host's share", n)
	}
	speak(maxHandshakesPerHostForTest)
	until(t, "the fifth speaker evicts one", func() bool { return p.A.Metric(t, refused) == 1 })
	if _, err := wire.Read(conns[0]); err == nil {
		t.Fatal("the oldest stalled handshake is still open; it should have been evicted")
	}
}

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
	c, err := tryHandshake(addr)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func tryHandshake(addr string) (net.Conn, error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (net.Conn, error) { c.Close(); return nil, err }
	c.SetDeadline(time.Now().Add(10 * time.Second))
	mine := &wire.Hello{Agent: c.LocalAddr().String(), Epoch: 7, Nonce: "00112233445566778899aabbccddeeff"}
	b, _ := wire.Encode(nil, mine)
	if _, err := c.Write(b); err != nil {
		return fail(err)
	}
	m, err := wire.Read(c)
	if err != nil {
		return fail(err)
	}
	theirs, ok := m.(*wire.Hello)
	if !ok {
		return fail(fmt.Errorf("got %T, want the agent's Hello", m))
	}
	b, _ = wire.Encode(nil, &wire.Auth{MAC: wire.Proof([]byte(agentproc.Token), wire.RoleDialer, mine, theirs)})
	if _, err := c.Write(b); err != nil {
		return fail(err)
	}
	if m, err := wire.Read(c); err != nil {
		return fail(fmt.Errorf("the agent did not accept the handshake: %w", err))
	} else if _, ok := m.(*wire.Auth); !ok {
		return fail(fmt.Errorf("got %T, want the agent's Auth", m))
	}
	c.SetDeadline(time.Time{})
	return c, nil
}

// The attack: a pod on an agent's host (every hostNetwork pod, and pod traffic
// translated to the node's address, share its source) keeps 64 silent connections open
// to another agent and reopens each one the agent closes (here 80, reopened after 10 ms);
// before, that host's four handshake slots stayed taken and 4 of 60 of the agent's
// handshakes got through. Now a handshake evicts a connection that has sent less than it
// has, and every one gets through.
func TestSilentConnectionsFromAnAgentsHostCannotLockItOut(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	stop := make(chan struct{})
	var mu sync.Mutex
	open := map[net.Conn]bool{}
	var wg sync.WaitGroup
	for range 80 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := net.Dial("tcp", p.A.Peer)
				mu.Lock()
				select {
				case <-stop:
					mu.Unlock()
					if err == nil {
						c.Close()
					}
					return
				default:
				}
				if err == nil {
					open[c] = true
				}
				mu.Unlock()
				if err == nil {
					_, _ = io.Copy(io.Discard, c) // silent until the agent closes it
					c.Close()
				}
				select {
				case <-stop:
					return
				case <-time.After(10 * time.Millisecond):
				}
			}
		}()
	}
	defer func() {
		mu.Lock()
		close(stop)
		for c := range open {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}()
	until(t, "the silent connections fill the handshake slots", func() bool {
		return p.A.Metric(t, `kvhandoff_agent_refused_total{call="peer",code="ResourceExhausted"}`) >= 80-maxHandshakesForTest
	})
	ok := 0
	var last error
	for range 60 {
		c, err := tryHandshake(p.A.Peer)
		if err != nil {
			last = err
			continue
		}
		ok++
		c.Close()
	}
	if ok != 60 {
		t.Errorf("%d of 60 handshakes from the silent connections' host got through (the last failure: %v); want every one", ok, last)
	}
}
