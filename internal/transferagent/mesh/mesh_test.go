package mesh_test

import (
	"errors"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/mesh"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
)

// agent is one mesh, listening on loopback, with what reached it.
type agent struct {
	m        *mesh.Mesh
	addr     string
	messages chan wire.Message
	peers    chan *mesh.Peer // the peers whose messages came
	lost     chan *mesh.Peer
}

func newAgent(t *testing.T, token string, epoch uint64, known func(string) error) *agent {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0") // served here, in this process
	if err != nil {
		t.Fatal(err)
	}
	a := &agent{addr: ln.Addr().String(), messages: make(chan wire.Message, 16), peers: make(chan *mesh.Peer, 16), lost: make(chan *mesh.Peer, 16)}
	a.m = mesh.New(mesh.Config{Self: a.addr, Epoch: epoch, Token: []byte(token), Known: known, Log: slog.New(slog.DiscardHandler),
		Peers: prometheus.NewGauge(prometheus.GaugeOpts{Name: "peers"}), Refused: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "refused"}, []string{"socket", "reason"}),
		OnMessage: func(p *mesh.Peer, m wire.Message) { a.peers <- p; a.messages <- m },
		OnLost:    func(p *mesh.Peer) { a.lost <- p }})
	go a.m.Serve(ln)
	t.Cleanup(func() { ln.Close(); a.m.Close() })
	return a
}

func recv[T any](t *testing.T, c chan T, what string) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("no %s", what)
	}
	var zero T
	return zero
}

// Two agents holding the cluster's token talk both ways on the connection the decode
// agent opened: what one sends reaches the other's OnMessage, with the sender's epoch.
func TestAgentsOfOneTokenTalkBothWays(t *testing.T) {
	prefill, decode := newAgent(t, "cluster-token", 1, nil), newAgent(t, "cluster-token", 2, nil)
	p := decode.m.Dial(prefill.addr)
	p.Send(&wire.Heartbeat{Request: "r1", Attempt: 1, Source: "p-0"})
	if m := recv(t, prefill.messages, "message at the prefill agent"); m.(*wire.Heartbeat).Request != "r1" {
		t.Fatalf("got %+v", m)
	}
	back := recv(t, prefill.peers, "peer")
	if back.Epoch() != 2 {
		t.Errorf("the prefill agent sees epoch %d, want the decode agent's 2", back.Epoch())
	}
	back.Send(&wire.Cancel{Request: "r1", Attempt: 1, Source: "p-0"})
	if m := recv(t, decode.messages, "answer at the decode agent"); m.(*wire.Cancel).Request != "r1" {
		t.Fatalf("got %+v", m)
	}
	if !p.Reached() || p.Epoch() != 1 {
		t.Errorf("the decode agent's peer: reached %v, epoch %d", p.Reached(), p.Epoch())
	}
}

// A peer without the token gets no message through, and its connection fails: each
// side proves the token before the other says anything.
func TestAPeerWithoutTheTokenIsRefused(t *testing.T) {
	prefill := newAgent(t, "cluster-token", 1, nil)
	stranger := newAgent(t, "another-token", 3, nil)
	p := stranger.m.Dial(prefill.addr)
	p.Send(&wire.Heartbeat{Request: "r1", Attempt: 1, Source: "p-0"})
	if lost := recv(t, stranger.lost, "lost connection"); lost != p || lost.Err() == nil {
		t.Fatalf("lost %v, err %v", lost, lost.Err())
	}
	select {
	case m := <-prefill.messages:
		t.Fatalf("a message from a peer without the token arrived: %+v", m)
	default:
	}
}

// An agent dials only addresses Known vets: any other fails at once, and nothing is sent.
func TestAnAgentDialsOnlyKnownAgents(t *testing.T) {
	target := newAgent(t, "cluster-token", 1, nil)
	refuse := errors.New("not a ready agent")
	decode := newAgent(t, "cluster-token", 2, func(string) error { return refuse })
	p := decode.m.Dial(target.addr)
	if lost := recv(t, decode.lost, "lost connection"); lost != p || !strings.Contains(lost.Err().Error(), "not a ready agent") {
		t.Fatalf("err %v, want the Known check's", lost.Err())
	}
	p.Send(&wire.Heartbeat{Request: "r1"})
	select {
	case m := <-target.messages:
		t.Fatalf("a message reached an agent that was not to be dialled: %+v", m)
	default:
	}
}
