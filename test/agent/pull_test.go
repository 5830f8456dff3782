package agent_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

func TestPullReadsVerifiedBytesAndReleasesTheSource(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PULL, 2, 256)
	for i := range 3 {
		req := fmt.Sprintf("pull-%d", i)
		for r := range p.P {
			src, dst := alloc(t, p.P[r], 16+i), alloc(t, p.D[r], 16+i)
			p.P[r].Cache.Fill(req, src)
			if err := p.P[r].SourceReady(bg, req, 0, src, true); err != nil {
				t.Fatal(err)
			}
			// The router relays the block ids; decode pulls them.
			if err := p.D[r].Pull(bg, req, 1, p.P[r].Self, src, dst); err != nil {
				t.Fatal(err)
			}
			ev := wait(t, p.D[r], req, 1)
			expect(t, ev, agentv1.Event_DELIVERED)
			if want := uint64(runs(src, dst) * p.layout.Regions()); ev.Descriptors != want {
				t.Errorf("%d reads, want %d", ev.Descriptors, want)
			}
			if err := p.D[r].Cache.Verify(req, dst); err != nil {
				t.Fatal(err)
			}
			expect(t, wait(t, p.P[r], req, 1), agentv1.Event_SOURCE_DONE)
		}
	}
}

// A decode engine that holds a prompt's prefix pulls the tail's blocks only: both agents
// count the tail's bytes, not the prompt's.
func TestAPullOfTheTailCountsTheTail(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PULL, 1, 64)
	const prompt, cached = 12, 5
	src, dst := alloc(t, p.P[0], prompt), alloc(t, p.D[0], prompt-cached)
	p.P[0].Cache.Fill("tail", src)
	if err := p.P[0].SourceReady(bg, "tail", 0, src, true); err != nil {
		t.Fatal(err)
	}
	if err := p.D[0].Pull(bg, "tail", 1, p.P[0].Self, src[cached:], dst); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, p.D[0], "tail", 1), agentv1.Event_DELIVERED)
	if err := p.D[0].Cache.VerifyTail("tail", cached, dst); err != nil {
		t.Fatal(err)
	}
	done := wait(t, p.P[0], "tail", 1)
	expect(t, done, agentv1.Event_SOURCE_DONE)
	want := uint64((prompt - cached) * p.layout.BlockBytes() * p.layout.Regions())
	if done.Bytes != want {
		t.Errorf("SOURCE_DONE says %d bytes, want the tail's %d", done.Bytes, want)
	}
	for _, a := range []*agentProc{p.A, p.B} {
		if got := a.Metric(t, `kvhandoff_agent_transferred_bytes_total{mode="pull"}`); got != float64(want) {
			t.Errorf("an agent counted %v pulled bytes, want the tail's %d", got, want)
		}
	}
}

// The pull race: the prefill engine's answer can reach the router, and the decode
// engine's pull the prefill agent, before the engine's worker reports the blocks ready.
// Such a pull waits for them and reads them, in one part or several; it is not failed at
// once (which the decode engine would turn into a recompute of the whole prompt).
func TestAPullThatComesBeforeItsBlocksWaitsForThemAndReadsThem(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PULL, 1, 64)
	waits := 0.0
	for _, parts := range []int{1, 2} {
		req := fmt.Sprintf("early-%d", parts)
		src, dst := alloc(t, p.P[0], 8), alloc(t, p.D[0], 8)
		p.P[0].Cache.Fill(req, src)
		if err := p.D[0].Pull(bg, req, 1, p.P[0].Self, src, dst); err != nil {
			t.Fatal(err)
		}
		// The pull has reached the prefill agent and waits there: only now is the source
		// reported, in parts.
		waits++
		until(t, "the pull to wait at the prefill agent", func() bool { return p.A.Metric(t, "kvhandoff_agent_pull_waits_total") == waits })
		per := len(src) / parts
		for i := range parts {
			if err := p.P[0].SourceReady(bg, req, uint32(i*per), src[i*per:(i+1)*per], i == parts-1); err != nil {
				t.Fatal(err)
			}
		}
		expect(t, wait(t, p.D[0], req, 1), agentv1.Event_DELIVERED)
		if err := p.D[0].Cache.Verify(req, dst); err != nil {
			t.Fatal(err)
		}
		expect(t, wait(t, p.P[0], req, 1), agentv1.Event_SOURCE_DONE)
	}
	if got := p.A.Metric(t, `kvhandoff_agent_refused_total{call="peer",code="Acquire"}`); got != 0 {
		t.Errorf("prefill agent refused %v acquires", got)
	}
}

// A pull whose blocks never come is refused with a named reason after half the lease,
// and one that names a block outside the request's final set at once: the decode agent
// hears, and nothing waits forever.
func TestAPullOfBlocksThatNeverComeIsRefusedByName(t *testing.T) {
	A, P, D := pullPairWithLease(t, testLayout(1, 64), 400*time.Millisecond)
	src, dst := alloc(t, P, 4), alloc(t, D, 4)
	if err := D.Pull(bg, "never", 1, P.Self, src, dst); err != nil {
		t.Fatal(err)
	}
	ev := wait(t, D, "never", 1)
	expect(t, ev, agentv1.Event_FAILED)
	if !strings.Contains(ev.Reason, "were not reported ready within 200ms") {
		t.Errorf("reason %q does not say the blocks never came", ev.Reason)
	}
	if got := A.Metric(t, `kvhandoff_agent_failures_total{reason="acquire_timeout"}`); got != 1 {
		t.Errorf("acquire timeouts: %v, want 1", got)
	}
	// Ready, and final, but without a block the pull names.
	if err := P.SourceReady(bg, "partial", 0, src[:3], true); err != nil {
		t.Fatal(err)
	}
	if err := D.Pull(bg, "partial", 1, P.Self, src, dst); err != nil {
		t.Fatal(err)
	}
	ev = wait(t, D, "partial", 1)
	expect(t, ev, agentv1.Event_FAILED)
	if !strings.Contains(ev.Reason, "is not among request partial's ready blocks") {
		t.Errorf("reason %q does not name the missing block", ev.Reason)
	}
	if got := A.Metric(t, `kvhandoff_agent_refused_total{call="peer",code="Acquire"}`); got != 2 {
		t.Errorf("prefill agent counted %v refused acquires, want 2", got)
	}
}

// The suite runs on tcp;ofi_rxm (KVHANDOFF_TEST_PROVIDER=shm runs all of it on shm);
// this keeps shm, the other provider here, covered in every run.
func TestPushAndPullOverShm(t *testing.T) {
	for _, mode := range []agentv1.Mode{agentv1.Mode_MODE_PUSH, agentv1.Mode_MODE_PULL} {
		t.Run(mode.String(), func(t *testing.T) {
			p := newPair(t, mode, 2, 64, "--provider", "shm")
			if p.P[0].Provider != "shm" {
				t.Fatalf("running on %q", p.P[0].Provider)
			}
			for r := range p.P {
				src, dst := alloc(t, p.P[r], 12), alloc(t, p.D[r], 12)
				p.P[r].Cache.Fill("shm", src)
				if mode == agentv1.Mode_MODE_PUSH {
					if err := p.D[r].RegisterDestination(bg, "shm", 1, dst, p.P[r].Self); err != nil {
						t.Fatal(err)
					}
				}
				if err := p.P[r].SourceReady(bg, "shm", 0, src, true); err != nil {
					t.Fatal(err)
				}
				if mode == agentv1.Mode_MODE_PULL {
					if err := p.D[r].Pull(bg, "shm", 1, p.P[r].Self, src, dst); err != nil {
						t.Fatal(err)
					}
				}
				expect(t, wait(t, p.D[r], "shm", 1), agentv1.Event_DELIVERED)
				if err := p.D[r].Cache.Verify("shm", dst); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// Held blocks nobody pulls are released after the blocks TTL, and a pull after that is
// refused: the prefill engine may already have reused them.
func TestUnpulledBlocksExpireAfterTheBlocksTTL(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PULL, 1, 64, "--blocks-ttl", "300ms")
	src, dst := alloc(t, p.P[0], 4), alloc(t, p.D[0], 4)
	if err := p.P[0].SourceReady(bg, "unpulled", 0, src, true); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, p.P[0], "unpulled", 0), agentv1.Event_FAILED)
	if err := p.D[0].Pull(bg, "unpulled", 1, p.P[0].Self, src, dst); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, p.D[0], "unpulled", 1), agentv1.Event_FAILED)
	if got := p.A.Metric(t, `kvhandoff_agent_lease_expiries_total{kind="hold"}`); got != 1 {
		t.Errorf("hold expiries: %v, want 1", got)
	}
}

// A pull whose reads outlast the hold's lease is reported FAILED, not left hanging: the
// prefill agent frees the blocks at the lease's end but keeps polling until the decode
// agent releases them, since on tcp;ofi_rxm the reads in flight complete only while it
// does. (Before, it stopped polling at the lease's end, the reads never completed, and
// the decode engine never heard of its request again.) 128 MiB under a 10 ms lease
// outlasts it on any machine; a shorter lease would end before the grant, and the
// decode agent would not read at all.
func TestAPullWhoseReadsOutlastTheLeaseIsReportedFailed(t *testing.T) {
	l := testLayout(1, 256)
	l.HeadDim = 512 // 128 KiB blocks, 512 KiB a position over 4 regions
	_, P, D := pullPairWithLease(t, l, 10*time.Millisecond)
	src, dst := alloc(t, P, 256), alloc(t, D, 256)
	if err := P.SourceReady(bg, "long-reads", 0, src, true); err != nil {
		t.Fatal(err)
	}
	if err := D.Pull(bg, "long-reads", 1, P.Self, src, dst); err != nil {
		t.Fatal(err)
	}
	ev := wait(t, D, "long-reads", 1)
	expect(t, ev, agentv1.Event_FAILED)
	expect(t, wait(t, P, "long-reads", 1), agentv1.Event_FAILED)
}

// pullPairWithLease is a pull pair of one rank each, on agents of their own, whose
// policy's lease is lease; it returns the prefill agent and the two engines.
func pullPairWithLease(t *testing.T, l simengine.Layout, lease time.Duration) (prefillAgent *agentProc, p, d *simengine.Engine) {
	t.Helper()
	A, B := startAgent(t, "prefill-node", t.TempDir()), startAgent(t, "decode-node", t.TempDir())
	start := func(a *agentProc, id string, role agentv1.Role) *simengine.Engine {
		e, err := simengine.Start(bg, simengine.Config{ID: id, Role: role, Mode: agentv1.Mode_MODE_PULL, Layout: l, Socket: a.Socket,
			Lease: lease, RegistrationTimeout: time.Second, BlocksTTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Stop)
		return e
	}
	return A, start(A, "prefill-0.default", agentv1.Role_ROLE_PREFILL), start(B, "decode-0.default", agentv1.Role_ROLE_DECODE)
}
