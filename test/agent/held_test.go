package agent_test

import (
	"testing"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// kvhandoff_agent_held_requests counts the requests each agent keeps transfer state for,
// and comes back to zero however a request ends: delivered, its source unclaimed past
// the blocks TTL, its registration silent past the lease, or its engine gone. The fleet's fault tests (test/realnode) read it as the agents' leak check.
func TestHeldRequestsComeBackToZero(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64, "--lease", "3s", "--registration-timeout", "3s", "--blocks-ttl", "2s")
	held := func(a *agentProc, role string) float64 {
		return a.Metric(t, `kvhandoff_agent_held_requests{role="`+role+`"}`)
	}
	settle := func(what string, prefill, decode float64) {
		t.Helper()
		// -1: either count (a push registration is held on both agents).
		until(t, what, func() bool {
			return (prefill < 0 || held(p.A, "prefill") == prefill) && held(p.B, "decode") == decode
		})
	}

	// A source no decode engine registers for: held until the blocks TTL frees it.
	src := alloc(t, p.P[0], 4)
	if err := p.P[0].SourceReady(bg, "unclaimed", 0, src, true); err != nil {
		t.Fatal(err)
	}
	settle("the prefill agent holds the unclaimed source", 1, 0)
	expect(t, wait(t, p.P[0], "unclaimed", 0), agentv1.Event_FAILED)
	settle("the unclaimed source is let go", 0, 0)

	// A registration whose engine stops heartbeating: held until its lease ends.
	dst := alloc(t, p.D[0], 4)
	if err := p.D[0].RegisterDestination(bg, "unpaired", 1, dst, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	settle("the decode agent holds the registration", -1, 1)
	expect(t, wait(t, p.D[0], "unpaired", 1), agentv1.Event_FAILED)
	settle("the unpaired registration is let go", 0, 0)

	// A delivered transfer leaves nothing behind.
	transfer(t, p.P[0], p.D[0], "delivered")
	settle("a delivered transfer is let go", 0, 0)

	// A registration whose engine goes away: its session ends and its count with it.
	dst = alloc(t, p.D[0], 4)
	if err := p.D[0].RegisterDestination(bg, "orphaned", 1, dst, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	settle("the decode agent holds the registration of an engine about to go", -1, 1)
	p.D[0].Stop()
	settle("the gone engine's registration is let go", 0, 0)
}
