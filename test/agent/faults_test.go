package agent_test

import (
	"bufio"
	"bytes"
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/loopback"
	"github.com/kvhandoff/kvhandoff/test/simengine"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
)

func TestANewAttemptSupersedesTheOldOne(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 128)
	src, old, fresh := alloc(t, p.P[0], 10), alloc(t, p.D[0], 10), alloc(t, p.D[0], 10)
	p.P[0].Cache.Fill("retry", src)
	if err := p.D[0].RegisterDestination(bg, "retry", 1, old, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	// Decode preempted the request and retries it into other blocks.
	if err := p.D[0].RegisterDestination(bg, "retry", 2, fresh, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, p.D[0], "retry", 1), agentv1.Event_CANCEL_ACKED)
	// While attempt 2 is outstanding, an older attempt is refused by decode's own agent.
	if err := p.D[0].RegisterDestination(bg, "retry", 1, old, p.P[0].Self); err == nil {
		t.Fatal("a stale attempt was accepted")
	}
	if err := p.P[0].SourceReady(bg, "retry", 0, src, true); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, p.D[0], "retry", 2), agentv1.Event_DELIVERED)
	if err := p.D[0].Cache.Verify("retry", fresh); err != nil {
		t.Fatal(err)
	}
	// The superseded attempt's blocks were never written.
	for _, region := range p.D[0].Cache.Regions {
		bb := p.layout.BlockBytes()
		for _, b := range old {
			if !bytes.Equal(region[int(b)*bb:int(b+1)*bb], make([]byte, bb)) {
				t.Fatalf("superseded block %d was written", b)
			}
		}
	}
}

// A decode engine short of blocks preempts a request (cancel, wait for the agent, free)
// and retries it later with a new attempt into other blocks.
func TestPreemptedRequestIsRetriedWithANewAttempt(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64)
	src, first := alloc(t, p.P[0], 16), alloc(t, p.D[0], 16)
	p.P[0].Cache.Fill("preempted", src)
	if err := p.D[0].RegisterDestination(bg, "preempted", 1, first, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	ev, err := p.D[0].Preempt(bg, "preempted", 1, first)
	if err != nil {
		t.Fatal(err)
	}
	expect(t, ev, agentv1.Event_CANCEL_ACKED)
	// Another request takes the freed blocks in the meantime.
	transfer(t, p.P[0], p.D[0], "took-the-blocks")
	retry := alloc(t, p.D[0], 16)
	if err := p.D[0].RegisterDestination(bg, "preempted", 2, retry, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	if err := p.P[0].SourceReady(bg, "preempted", 0, src, true); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, p.D[0], "preempted", 2), agentv1.Event_DELIVERED)
	if err := p.D[0].Cache.Verify("preempted", retry); err != nil {
		t.Fatal(err)
	}
}

// TestCancelMidWriteLetsNothingLandAfterTheAcknowledgement cancels large requests while
// their writes are in flight. After CANCEL_ACKED the test overwrites the blocks with a
// sentinel; a later request through the same agents is delivered, and the sentinel must
// still be intact: no write of the cancelled attempt arrived after the acknowledgement.
func TestCancelMidWriteLetsNothingLandAfterTheAcknowledgement(t *testing.T) {
	// 8 layers × 2 × 2048 blocks × 2 KiB: a 1024-block request is 32 MiB per rank.
	l := testLayout(1, 2048)
	l.Layers = 8
	p := &pair{layout: l, dirA: t.TempDir(), dirB: t.TempDir()}
	p.A, p.B = startAgent(t, "prefill-node", p.dirA), startAgent(t, "decode-node", p.dirB)
	P := engine(t, p.A, "prefill-0.default", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_PUSH, 0, l)
	D := engine(t, p.B, "decode-0.default", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, 0, l)
	cancelsMidTransfer(t, P, D, 6)
}

// cancelsMidTransfer cancels requests of 1024 blocks right after their source is ready,
// and checks that after each CANCEL_ACKED nothing of the attempt lands: a sentinel
// written then is intact after a later request through the same engines.
func cancelsMidTransfer(t *testing.T, P, D *simengine.Engine, requests int) {
	acked := 0
	for i := range requests {
		req := "big-" + string(rune('a'+i))
		src, dst := alloc(t, P, 1024), alloc(t, D, 1024)
		P.Cache.Fill(req, src)
		if err := D.RegisterDestination(bg, req, 1, dst, P.Self); err != nil {
			t.Fatal(err)
		}
		if err := P.SourceReady(bg, req, 0, src, true); err != nil {
			t.Fatal(err)
		}
		// NotFound: the writes already won (on shm 32 MiB can land before the cancel).
		if err := D.Cancel(bg, req, 1); err != nil && status.Code(err) != codes.NotFound {
			t.Fatal(err)
		}
		ev := wait(t, D, req, 1)
		if ev.Type == agentv1.Event_DELIVERED {
			// The writes won the race with the cancel: then the data must be whole.
			if err := D.Cache.Verify(req, dst); err != nil {
				t.Fatal(err)
			}
		} else {
			expect(t, ev, agentv1.Event_CANCEL_ACKED)
			acked++
			sentinel(t, D, dst)
			// A request after the cancel, on the same connection and endpoint.
			s2, d2 := alloc(t, P, 16), alloc(t, D, 16)
			P.Cache.Fill(req+"-after", s2)
			if err := D.RegisterDestination(bg, req+"-after", 1, d2, P.Self); err != nil {
				t.Fatal(err)
			}
			if err := P.SourceReady(bg, req+"-after", 0, s2, true); err != nil {
				t.Fatal(err)
			}
			expect(t, wait(t, D, req+"-after", 1), agentv1.Event_DELIVERED)
			untouched(t, D, dst)
			P.Free(s2)
			D.Free(d2)
		}
		P.Free(src)
		D.Free(dst)
	}
	if acked == 0 {
		t.Fatal("no cancel landed while writes were in flight; the test proved nothing")
	}
	t.Logf("%d of %d cancels landed mid-write", acked, requests)
}

func TestLeaseExpiresOnBothSides(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64, "--lease", "300ms", "--registration-timeout", "20s", "--blocks-ttl", "300ms")
	// Decode registers and then goes silent: no heartbeat within the lease.
	dst := alloc(t, p.D[0], 4)
	if err := p.D[0].RegisterDestination(bg, "silent", 1, dst, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	ev := wait(t, p.D[0], "silent", 1)
	expect(t, ev, agentv1.Event_FAILED)
	expect(t, wait(t, p.P[0], "silent", 1), agentv1.Event_FAILED)
	// Prefill's blocks wait for a registration that never comes: the blocks TTL frees them.
	src := alloc(t, p.P[0], 4)
	if err := p.P[0].SourceReady(bg, "orphan", 0, src, true); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, p.P[0], "orphan", 0), agentv1.Event_FAILED)
	// A heartbeating registration outlives several leases.
	if err := p.D[0].RegisterDestination(bg, "alive", 1, dst, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	// Heartbeat every 50 ms, well inside the lease, for a second: three leases' worth.
	beat := time.NewTicker(50 * time.Millisecond)
	defer beat.Stop()
	for end := time.Now().Add(time.Second); time.Now().Before(end); <-beat.C {
		if err := p.D[0].Heartbeat(bg); err != nil {
			t.Fatal(err)
		}
	}
	p.P[0].Cache.Fill("alive", src)
	if err := p.P[0].SourceReady(bg, "alive", 0, src, true); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, p.D[0], "alive", 1), agentv1.Event_DELIVERED)
	if got := p.A.Metric(t, `kvhandoff_agent_lease_expiries_total{kind="push"}`); got != 1 {
		t.Errorf("push lease expiries: %v, want 1", got)
	}
	if got := p.A.Metric(t, `kvhandoff_agent_lease_expiries_total{kind="source"}`); got != 1 {
		t.Errorf("source TTL expiries: %v, want 1", got)
	}
}

// A decode engine that computes a request itself (its prefix cache held part of the
// prompt) declines the push: the prefill engine hears SOURCE_DONE at once, whether the
// source or the decline reached its agent first, where the blocks TTL (10 min here) would
// have held its blocks and then failed them. A decline is not a failure, and a request
// the engine registered cannot be declined.
func TestADeclinedPushFreesThePrefillBlocksAtOnce(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64, "--blocks-ttl", "10m")
	for i, req := range []string{"source-first", "decline-first"} {
		src := alloc(t, p.P[0], 4)
		ready := func() {
			if err := p.P[0].SourceReady(bg, req, 0, src, true); err != nil {
				t.Fatal(err)
			}
		}
		if i == 0 {
			ready()
		}
		if err := p.D[0].Decline(bg, req, p.P[0].Self); err != nil {
			t.Fatal(err)
		}
		if i == 1 {
			ready()
		}
		ev := wait(t, p.P[0], req, 0)
		expect(t, ev, agentv1.Event_SOURCE_DONE)
		if ev.Bytes != 0 {
			t.Errorf("%s: SOURCE_DONE says %d bytes moved, want 0", req, ev.Bytes)
		}
	}
	if got := p.A.Metric(t, "kvhandoff_agent_declines_total"); got != 2 {
		t.Errorf("declines: %v, want 2", got)
	}
	if got := p.A.Metric(t, `kvhandoff_agent_failures_total{reason="blocks_ttl"}`); got != 0 {
		t.Errorf("blocks TTL failures: %v, want 0", got)
	}
	dst := alloc(t, p.D[0], 4)
	if err := p.D[0].RegisterDestination(bg, "registered", 1, dst, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	if err := p.D[0].Decline(bg, "registered", p.P[0].Self); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("declining a registered request: %v, want FailedPrecondition", err)
	}
	if err := p.D[0].Decline(bg, "no-source", nil); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "source") {
		t.Errorf("a decline naming no source: %v, want InvalidArgument naming source", err)
	}
}

// After a push attempt fails, the prefill engine frees the request's blocks and may reuse
// them at once. A retried attempt must then fail cleanly, never be delivered what those
// blocks hold by then — even when a late part of the request still arrives.
func TestARetryAfterAFailureNeverDeliversFreedBlocks(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64, "--lease", "300ms", "--registration-timeout", "2s", "--blocks-ttl", "5s")
	src := alloc(t, p.P[0], 4)
	p.P[0].Cache.Fill("stale", src)
	dst := alloc(t, p.D[0], 4)
	// Attempt 1 goes silent (no heartbeat) after half of the request was written.
	if err := p.D[0].RegisterDestination(bg, "stale", 1, dst, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	if err := p.P[0].SourceReady(bg, "stale", 0, src[:2], false); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, p.D[0], "stale", 1), agentv1.Event_FAILED)
	expect(t, wait(t, p.P[0], "stale", 1), agentv1.Event_FAILED)
	// The prefill engine freed the blocks; another request has them now.
	p.P[0].Cache.Fill("someone-else", src)
	// Decode retries into fresh blocks, and a late final part of the request arrives.
	dst2 := alloc(t, p.D[0], 4)
	if err := p.D[0].RegisterDestination(bg, "stale", 2, dst2, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	_ = p.P[0].SourceReady(bg, "stale", 2, src[2:], true) // refused or not: it must not complete the old source
	ev := wait(t, p.D[0], "stale", 2)
	if ev.Type == agentv1.Event_DELIVERED {
		if err := p.D[0].Cache.Verify("stale", dst2); err != nil {
			t.Fatalf("the retry was delivered blocks the prefill engine had freed: %v", err)
		}
	}
	expect(t, ev, agentv1.Event_FAILED)
}

// A decode registration whose outcome never comes (a message lost while the connection
// stays up) must fail on the decode agent's own deadline, not wait forever. The "prefill
// agent" here authenticates properly and then swallows every message.
func TestADecodeRegistrationWithoutAnOutcomeFailsOnItsOwn(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go swallow(c)
		}
	}()
	b := startAgent(t, "decode-node", t.TempDir(), "--lease", "300ms", "--registration-timeout", "1s")
	d := engine(t, b, "decode-0.default", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, 0, testLayout(1, 64))
	dst := alloc(t, d, 4)
	src := &agentv1.EngineRef{Agent: l.Addr().String(), EngineId: "prefill-0.default", TpRank: 0}
	if err := d.RegisterDestination(bg, "lost", 1, dst, src); err != nil {
		t.Fatal(err)
	}
	ev := wait(t, d, "lost", 1)
	expect(t, ev, agentv1.Event_FAILED)
	if !strings.Contains(ev.Reason, "no outcome") {
		t.Errorf("reason %q", ev.Reason)
	}
}

// A registration with a prefill agent that cannot be reached never left this agent: it
// fails at once, not after a lease-long quarantine (nothing can land from an agent that
// was never told of the blocks).
func TestARegistrationWithAnUnreachableAgentFailsAtOnce(t *testing.T) {
	addr := loopback.Refusing(t) // the dial is refused
	// A lease far longer than wait's 30 s limit: a quarantine would fail the test.
	b := startAgent(t, "decode-node", t.TempDir(), "--lease", "60s", "--registration-timeout", "120s")
	d := engine(t, b, "decode-0.default", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, 0, testLayout(1, 64))
	dst := alloc(t, d, 4)
	if err := d.RegisterDestination(bg, "unreachable", 1, dst, &agentv1.EngineRef{Agent: addr, EngineId: "prefill-0.default"}); err != nil {
		t.Fatal(err)
	}
	ev := wait(t, d, "unreachable", 1)
	expect(t, ev, agentv1.Event_FAILED)
	if !strings.Contains(ev.Reason, "could not be reached") {
		t.Errorf("reason %q", ev.Reason)
	}
}

// swallow plays an agent that holds the token (acceptor side of the handshake), then
// reads and drops everything.
func swallow(c net.Conn) {
	defer c.Close()
	r := bufio.NewReader(c)
	mine := &wire.Hello{Agent: c.LocalAddr().String(), Epoch: 1, Nonce: "0123456789abcdef0123456789abcdef"}
	b, _ := wire.Encode(nil, mine)
	c.Write(b)
	m, err := wire.Read(r)
	if err != nil {
		return
	}
	theirs, ok := m.(*wire.Hello)
	if !ok {
		return
	}
	if _, err := wire.Read(r); err != nil { // the dialer's Auth
		return
	}
	b, _ = wire.Encode(nil, &wire.Auth{MAC: wire.Proof([]byte(agentproc.Token), wire.RoleAcceptor, theirs, mine)})
	c.Write(b)
	for {
		if _, err := wire.Read(r); err != nil {
			return
		}
	}
}

// A decode engine that aborts a request for good (cancel, no retry) must not leave the
// prefill engine's blocks held forever: they expire a blocks TTL later and the prefill
// engine is told to free them.
func TestAnAbortWithoutRetryReleasesThePrefillBlocks(t *testing.T) {
	p := newPair(t, agentv1.Mode_MODE_PUSH, 1, 64, "--blocks-ttl", "500ms")
	src := alloc(t, p.P[0], 4)
	dst := alloc(t, p.D[0], 4)
	// Half the request is ready and paired with the registration; then decode aborts.
	if err := p.P[0].SourceReady(bg, "aborted", 0, src[:2], false); err != nil {
		t.Fatal(err)
	}
	if err := p.D[0].RegisterDestination(bg, "aborted", 1, dst, p.P[0].Self); err != nil {
		t.Fatal(err)
	}
	if err := p.D[0].Cancel(bg, "aborted", 1); err != nil {
		t.Fatal(err)
	}
	expect(t, wait(t, p.D[0], "aborted", 1), agentv1.Event_CANCEL_ACKED)
	if err := p.P[0].SourceReady(bg, "aborted", 2, src[2:], true); err != nil {
		t.Fatal(err)
	}
	// No retry comes: the prefill engine hears FAILED (attempt 0: the source's TTL).
	expect(t, wait(t, p.P[0], "aborted", 0), agentv1.Event_FAILED)
}

// The policy reaches the agent through RegisterEngine: an engine's own timeouts govern
// its requests, whatever the agent's flags say, so one DaemonSet serves namespaces with
// different policies.
func TestAnEnginesPolicyTimeoutsGovernItsRequests(t *testing.T) {
	flags := []string{"--lease", "60s", "--registration-timeout", "120s", "--blocks-ttl", "60s"}
	a, b := startAgent(t, "prefill-node", t.TempDir(), flags...), startAgent(t, "decode-node", t.TempDir(), flags...)
	l := testLayout(1, 64)
	start := func(ag *agentProc, id string, role agentv1.Role) *simengine.Engine {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		e, err := simengine.Start(ctx, simengine.Config{ID: id, Role: role, Mode: agentv1.Mode_MODE_PUSH, Layout: l, Socket: ag.Socket,
			Lease: 300 * time.Millisecond, RegistrationTimeout: time.Second, BlocksTTL: 300 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Stop)
		return e
	}
	P, D := start(a, "prefill-0.default", agentv1.Role_ROLE_PREFILL), start(b, "decode-0.default", agentv1.Role_ROLE_DECODE)
	began := time.Now()
	dst := alloc(t, D, 4)
	if err := D.RegisterDestination(bg, "silent", 1, dst, P.Self); err != nil {
		t.Fatal(err)
	}
	ev := wait(t, D, "silent", 1)
	expect(t, ev, agentv1.Event_FAILED)
	if !strings.Contains(ev.Reason, "300ms") {
		t.Errorf("failed for %q: the engine's 300 ms lease should have applied, not the agents' 60 s", ev.Reason)
	}
	if took := time.Since(began); took > 10*time.Second {
		t.Errorf("the registration failed after %s: the agents' lease applied, not the engine's", took)
	}
	// An engine asking for a registration timeout below its lease is refused, by name.
	cl, err := client.Dial(a.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	_, err = cl.API.RegisterEngine(bg, &agentv1.RegisterEngineRequest{EngineId: "odd", Role: agentv1.Role_ROLE_PREFILL, Mode: agentv1.Mode_MODE_PUSH, TpSize: 1,
		Layout: &agentv1.KVLayout{Layers: 1, BlockSize: 16, KvHeads: 8, HeadDim: 16, DtypeBytes: 2}, LeaseMillis: 5000, RegistrationTimeoutMillis: 1000})
	refused(t, "a registration timeout below the lease", err, codes.InvalidArgument, "registration_timeout_millis")
}

// TestACancelThatOvertakesItsReportLeavesNoSourceBehind: a prefill engine's Cancel (an
// RPC) can reach its agent before the engine's own report of the request (a doorbell
// record, or one a GPU event still holds back). The cancel is taken; the report that
// follows is refused, and so are a decode engine's registration and pull of the request,
// at once: nothing waits for a blocks TTL or a registration timeout, and no failure is
// counted for it.
func TestACancelThatOvertakesItsReportLeavesNoSourceBehind(t *testing.T) {
	l := testLayout(1, 64)
	for _, mode := range []agentv1.Mode{agentv1.Mode_MODE_PUSH, agentv1.Mode_MODE_PULL} {
		t.Run(mode.String(), func(t *testing.T) {
			A, B := startAgent(t, "prefill-node", t.TempDir()), startAgent(t, "decode-node", t.TempDir())
			P := engine(t, A, "prefill-0.default", agentv1.Role_ROLE_PREFILL, mode, 0, l)
			D := engine(t, B, "decode-0.default", agentv1.Role_ROLE_DECODE, mode, 0, l)
			src, dst := alloc(t, P, 4), alloc(t, D, 4)
			if err := P.Cancel(bg, "early", 1); err != nil {
				t.Fatalf("a cancel before the report: %v, want it taken", err)
			}
			if err := P.SourceReady(bg, "early", 0, src, true); status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("the report after its cancel: %v, want FailedPrecondition", err)
			}
			if mode == agentv1.Mode_MODE_PUSH {
				if err := D.RegisterDestination(bg, "early", 1, dst, P.Self); err != nil {
					t.Fatal(err)
				}
			} else if err := D.Pull(bg, "early", 1, P.Self, src, dst); err != nil {
				t.Fatal(err)
			}
			ev := wait(t, D, "early", 1)
			expect(t, ev, agentv1.Event_FAILED)
			if !strings.Contains(ev.Reason, "cancelled by its prefill engine") {
				t.Fatalf("the decode engine was told %q, want the cancel named", ev.Reason)
			}
			// The engines go on: a request after it is delivered.
			P.Cache.Fill("after", src)
			if mode == agentv1.Mode_MODE_PUSH {
				if err := D.RegisterDestination(bg, "after", 1, dst, P.Self); err != nil {
					t.Fatal(err)
				}
			}
			if err := P.SourceReady(bg, "after", 0, src, true); err != nil {
				t.Fatal(err)
			}
			if mode == agentv1.Mode_MODE_PULL {
				if err := D.Pull(bg, "after", 1, P.Self, src, dst); err != nil {
					t.Fatal(err)
				}
			}
			expect(t, wait(t, D, "after", 1), agentv1.Event_DELIVERED)
			if err := D.Cache.Verify("after", dst); err != nil {
				t.Fatal(err)
			}
			if n := A.Metric(t, `kvhandoff_agent_failures_total{reason="blocks_ttl"}`); n != 0 {
				t.Fatalf("%v blocks_ttl failures, want none", n)
			}
		})
	}
}
