package agent_test

import (
	"bytes"
	"context"
	"os"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
)

// The agents under test are real processes of cmd/transfer-agent, talking over real
// libfabric (tcp;ofi_rxm on loopback unless KVHANDOFF_TEST_PROVIDER says otherwise).
var agentBin string

func TestMain(m *testing.M) { os.Exit(agentproc.RunTests(m, &agentBin)) }

func provider() string {
	if p := os.Getenv("KVHANDOFF_TEST_PROVIDER"); p != "" {
		return p
	}
	return "tcp;ofi_rxm"
}

// agentProc is one running agent, tied to the test that started it.
type agentProc struct {
	*agentproc.Proc
	t *testing.T
}

// startAgent starts an agent and waits until it serves; it is stopped when the test
// ends, and its log printed if the test failed. Reusing a dir restarts "the same node's"
// agent.
func startAgent(t *testing.T, name, dir string, flags ...string) *agentProc {
	t.Helper()
	return &agentProc{Proc: agentproc.StartTest(t, agentBin, name, dir, provider(), flags...), t: t}
}

// Metric reads one series' value from the agent's /metrics (0 when absent).
func (a *agentProc) Metric(t *testing.T, series string) float64 {
	t.Helper()
	v, err := a.Proc.Metric(series)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// testLayout is small enough for many requests, with 2 layers (4 regions) per rank.
func testLayout(tp, blocks int) simengine.Layout {
	return simengine.Layout{Layers: 2, BlockSize: 16, KVHeads: 8, HeadDim: 16, DTypeBytes: 2, TP: tp, Blocks: blocks}
}

func engine(t *testing.T, a *agentProc, id string, role agentv1.Role, mode agentv1.Mode, rank int, l simengine.Layout) *simengine.Engine {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e, err := simengine.Start(ctx, simengine.Config{ID: id, Role: role, Mode: mode, Rank: rank, Layout: l, Socket: a.Socket})
	if err != nil {
		t.Fatalf("starting engine %s/%d on agent %s: %v", id, rank, a.Name, err)
	}
	t.Cleanup(e.Stop)
	return e
}

func wait(t *testing.T, e *simengine.Engine, req string, attempt uint64) *agentv1.Event {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ev, err := e.Wait(ctx, req, attempt)
	if err != nil {
		t.Fatalf("waiting for %s attempt %d: %v", req, attempt, err)
	}
	return ev
}

func expect(t *testing.T, ev *agentv1.Event, typ agentv1.Event_Type) {
	t.Helper()
	if ev.Type != typ {
		t.Fatalf("%s attempt %d: got %s (%q), want %s", ev.RequestId, ev.Attempt, ev.Type, ev.Reason, typ)
	}
}

// until polls cond (a condition on the agents' observable state, such as a metric) until
// it holds, failing after 30 s instead of hanging.
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		<-tick.C
	}
}

// sentinel overwrites blocks of every region of e with a pattern no request writes, after
// their attempt was acknowledged cancelled; untouched checks later that nothing landed.
func sentinel(t *testing.T, e *simengine.Engine, blocks []uint32) {
	t.Helper()
	if err := e.Cache.Set(blocks, 0xEE); err != nil {
		t.Fatal(err)
	}
}

func untouched(t *testing.T, e *simengine.Engine, blocks []uint32) {
	t.Helper()
	if err := e.Cache.Load(blocks); err != nil {
		t.Fatal(err)
	}
	bb := e.Cache.Layout.BlockBytes()
	for r, region := range e.Cache.Regions {
		for _, b := range blocks {
			if !bytes.Equal(region[int(b)*bb:int(b+1)*bb], bytes.Repeat([]byte{0xEE}, bb)) {
				t.Fatalf("region %d block %d changed after the cancel was acknowledged", r, b)
			}
		}
	}
}

// bareEngine registers engine rank id with agent a through the client alone, with no
// memory: the tests that pass memory of their own making. It ends with the test.
func bareEngine(t *testing.T, a *agentProc, id string, role agentv1.Role) *client.Engine {
	t.Helper()
	cl, err := client.Dial(a.Socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	e, err := cl.RegisterEngine(bg, &agentv1.RegisterEngineRequest{EngineId: id, Role: role, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1,
		Layout: &agentv1.KVLayout{Layers: 1, BlockSize: 16, KvHeads: 8, HeadDim: 16, DtypeBytes: 2}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e
}
