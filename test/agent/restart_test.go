package agent_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/landing"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// transfer pushes one verified request from P to D.
func transfer(t *testing.T, P, D *simengine.Engine, req string) {
	t.Helper()
	src, dst := alloc(t, P, 8), alloc(t, D, 8)
	defer P.Free(src)
	defer D.Free(dst)
	P.Cache.Fill(req, src)
	if err := D.RegisterDestination(bg, req, 1, dst, P.Self); err != nil {
		t.Fatal(err)
	}
	if err := P.SourceReady(bg, req, 0, src, true); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, D, req, 1), agentv1.Event_DELIVERED)
	if err := D.Cache.Verify(req, dst); err != nil {
		t.Fatal(err)
	}
}

func TestPrefillAgentRestart(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64, "--lease", "500ms")
	transfer(t, p.P[0], p.D[0], "before")
	// Decode registers; the prefill node's agent dies before the source is ready.
	dst := alloc(t, p.D[0], 8)
	if err := p.D[0].RegisterDestination(bg, "orphaned", 1, dst, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	p.A.Kill()
	// The decode agent fails the attempt only after a lease of quarantine and a margin for
	// the watchdog and the drain: whatever the dead agent had sent can no longer land.
	ev := wait(t, p.D[0], "orphaned", 1)
	expect(t, ev, agentv1.Event_FAILED)
	if quarantined, want := time.Since(killed), landing.QuarantineFor(500*time.Millisecond, 100*time.Millisecond); quarantined < want {
		t.Errorf("the blocks were released %s after the prefill agent died, before the quarantine of %s", quarantined, want)
	}
	t.Logf("decode was told: %s", ev.Reason)
	// A new agent on the same node (new epoch) and a re-registered prefill engine.
	a2 := startAgent(t, "prefill-node-2", p.dirA, p.agentArgs...)
	P2 := engine(t, a2, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PUSH, 0, p.layout)
	transfer(t, P2, p.D[0], "after-prefill-restart")
}

func TestDecodeAgentRestart(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64, "--lease", "500ms")
	transfer(t, p.P[0], p.D[0], "before")
	src, dst := alloc(t, p.P[0], 8), alloc(t, p.D[0], 8)
	if err := p.D[0].RegisterDestination(bg, "lost-decode", 1, dst, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	// Make sure the registration reached the prefill agent before the decode node dies
	// (RegisterDestination returns once the decode agent queued it): pair it with a first
	// part of the source, which the prefill agent records as a rendezvous.
	if err := p.P[0].SourceReady(bg, "lost-decode", 0, src[:4], false); err != nil {
		t.Fatal(err)
	}
	until(t, "the prefill agent paired the registration", func() bool {
		return p.A.Metric(t, `kvhandoff_agent_handoff_stage_seconds_count{mode="push",stage="rendezvous_wait"}`) >= 2
	})
	p.B.Kill()
	// The prefill agent learns its peer is gone and fails the attempt to prefill.
	ev := wait(t, p.P[0], "lost-decode", 1)
	expect(t, ev, agentv1.Event_FAILED)
	// The decode node comes back with a new agent and a new incarnation of the engine,
	// possibly with the same block ids: the prefill agent must use the new memory.
	b2 := startAgent(t, "decode-node-2", p.dirB, p.agentArgs...)
	D2 := engine(t, b2, "decode-0.default", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, 0, p.layout)
	if D2.Epoch <= p.D[0].Epoch {
		t.Fatalf("the restarted engine's epoch %d is not newer than %d", D2.Epoch, p.D[0].Epoch)
	}
	transfer(t, p.P[0], D2, "after-decode-restart")
}

// A decode engine restarts (same engine id, same memory file name, new epoch) while 32 MiB
// writes to its predecessor are in flight, and reuses the same block ids at once. Nothing
// meant for the predecessor may reach the new incarnation: its requests verify byte for
// byte, and after one of them is cancelled mid-write and acknowledged, nothing lands in
// its blocks (the sentinel written after CANCEL_ACKED survives a later request).
func TestARestartedDecodeEngineGetsNothingMeantForItsPredecessor(t *testing.T) {
	l := testLayout(1, 2048)
	l.Layers = 8 // a 512-block request is 16 MiB
	p := &pair{layout: l, dirA: t.TempDir(), dirB: t.TempDir()}
	p.A, p.B = startAgent(t, "prefill-node", p.dirA), startAgent(t, "decode-node", p.dirB)
	P := engine(t, p.A, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PUSH, 0, l)
	D1 := engine(t, p.B, "decode-0.default", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, 0, l)
	for _, req := range []string{"old-a", "old-b"} {
		src, dst := alloc(t, P, 512), alloc(t, D1, 512)
		P.Cache.Fill(req, src)
		if err := D1.RegisterDestination(bg, req, 1, dst, P.Self); err != nil {
			t.Fatal(err)
		}
		if err := P.SourceReady(bg, req, 0, src, true); err != nil {
			t.Fatal(err)
		}
	}
	D1.Stop() // the pod restarts with both writes in flight

	// The new incarnation registers as soon as the agent lets it (the old session drains
	// first) and gets the same block ids from its fresh allocator.
	var D2 *simengine.Engine
	until(t, "the restarted engine registers", func() bool {
		ctx, cancel := context.WithTimeout(bg, 5*time.Second)
		defer cancel()
		e, err := simengine.Start(ctx, simengine.Config{ID: "decode-0.default", Role: agentv1.Role_ROLE_DECODE,
			Mode: agentv1.Mode_MODE_PUSH, Layout: l, Socket: p.B.Socket})
		if err != nil {
			return false
		}
		D2 = e
		return true
	})
	t.Cleanup(D2.Stop)
	if D2.Epoch <= D1.Epoch {
		t.Fatalf("the restarted engine's epoch %d is not newer than %d", D2.Epoch, D1.Epoch)
	}
	// The old sources stay with prefill (they wait for a retry until the blocks TTL).
	// The new request gets the same block ids as old-a and old-b, and is cancelled mid-write.
	src, dst := alloc(t, P, 1000), alloc(t, D2, 1000)
	P.Cache.Fill("new-cancelled", src)
	if err := D2.RegisterDestination(bg, "new-cancelled", 1, dst, P.Self); err != nil {
		t.Fatal(err)
	}
	if err := P.SourceReady(bg, "new-cancelled", 0, src, true); err != nil {
		t.Fatal(err)
	}
	if err := D2.Cancel(bg, "new-cancelled", 1); err != nil {
		t.Fatal(err)
	}
	ev := wait(t, D2, "new-cancelled", 1)
	if ev.Type == agentv1.Event_DELIVERED {
		if err := D2.Cache.Verify("new-cancelled", dst); err != nil {
			t.Fatal(err)
		}
	} else {
		expect(t, ev, agentv1.Event_CANCEL_ACKED)
		sentinel(t, D2, dst)
	}
	// Another request into the other half, verified; then the sentinel must be intact.
	transfer(t, P, D2, "new-after")
	if ev.Type == agentv1.Event_CANCEL_ACKED {
		untouched(t, D2, dst)
	}
	t.Logf("the cancel of the new incarnation's request: %s", ev.Type)
}
