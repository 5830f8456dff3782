package rendezvous

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"
)

var (
	t0  = time.Unix(1_000_000, 0)
	cfg = Config{Lease: 30 * time.Second, RegistrationTimeout: 480 * time.Second}
	dec = Engine{ID: "decode-0.ns", Epoch: 1}
	// whole is the one region of cfg's tables, which every whole-block part spans.
	whole = Span{0, 1}
)

func reg(att uint64, blocks ...uint32) Registration {
	return Registration{Request: "r1", Attempt: att, Decode: dec, Blocks: blocks}
}

// must(t)(call) fails the test when call returned an error, and returns its actions.
func must(t *testing.T) func([]Action, error) []Action {
	return func(acts []Action, err error) []Action {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return acts
	}
}

// expect compares actions, leaving out the timing fields of Transfers (their own test,
// TestTheFirstTransferMarksThePairing, checks them).
func expect(t *testing.T, got []Action, want ...Action) {
	t.Helper()
	if len(got) == 0 && len(want) == 0 {
		return
	}
	got = slices.Clone(got)
	for i, a := range got {
		if tr, ok := a.(Transfer); ok {
			tr.Paired, tr.SourceWait = false, 0
			got[i] = tr
		}
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("actions\n got %#v\nwant %#v", got, want)
	}
}

func TestPairsInEitherOrder(t *testing.T) {
	want := Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: whole, Src: []uint32{7, 8, 9}, Dst: []uint32{100, 101, 102}}

	regFirst := New(cfg)
	expect(t, must(t)(regFirst.Register(t0, reg(1, 100, 101, 102))))
	expect(t, must(t)(regFirst.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{7, 8, 9}, Final: true})), want)

	srcFirst := New(cfg)
	expect(t, must(t)(srcFirst.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{7, 8, 9}, Final: true})))
	expect(t, must(t)(srcFirst.Register(t0, reg(1, 100, 101, 102))), want)
}

func TestTheFirstTransferMarksThePairing(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{7}}))
	acts := must(t)(tb.Register(t0.Add(3*time.Second), reg(1, 100, 101)))
	if tr := acts[0].(Transfer); !tr.Paired || tr.SourceWait != 3*time.Second {
		t.Fatalf("first transfer: paired %v after %s, want paired after 3s", tr.Paired, tr.SourceWait)
	}
	acts = must(t)(tb.SourceReady(t0.Add(5*time.Second), Part{Request: "r1", Offset: 1, Blocks: []uint32{8}, Final: true}))
	if tr := acts[0].(Transfer); tr.Paired || tr.SourceWait != 0 {
		t.Fatalf("second transfer: paired %v after %s, want neither", tr.Paired, tr.SourceWait)
	}
}

func TestAFinishedSourceExpiresOneBlocksTTLAfterItLastHadNoRegistration(t *testing.T) {
	ttl := cfg
	ttl.BlocksTTL = 10 * time.Second
	tb := New(ttl)
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{7}, Final: true}))
	expect(t, tb.Expire(t0.Add(9*time.Second)))
	// A registration stops the clock; its cancel restarts it from the acknowledgement.
	must(t)(tb.Register(t0.Add(9*time.Second), reg(1, 100)))
	expect(t, tb.Expire(t0.Add(15*time.Second)))
	expect(t, must(t)(tb.Cancel(t0.Add(16*time.Second), "r1", 1)), CancelAcked{Request: "r1", Attempt: 1, Decode: dec})
	expect(t, tb.Expire(t0.Add(25*time.Second)))
	expect(t, tb.Expire(t0.Add(26*time.Second)), SourceExpired{Request: "r1", Reason: "no decode registration within the blocks TTL of 10s"})
	// The prefill engine frees the blocks: a late registration is refused, not left waiting.
	if _, err := tb.Register(t0.Add(27*time.Second), reg(2, 100)); !errors.Is(err, ErrSourceGone) {
		t.Fatalf("a registration after the source expired: %v, want ErrSourceGone", err)
	}
}

func TestADeclineFreesTheSourceAtOnceWhicheverComesFirst(t *testing.T) {
	ttl := cfg
	ttl.BlocksTTL = 10 * time.Second
	// The source first: it is dropped at the decline.
	tb := New(ttl)
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{7}, Final: true}))
	expect(t, must(t)(tb.Decline(t0, "r1")), SourceDeclined{Request: "r1"})
	expect(t, tb.Expire(t0.Add(11*time.Second)))

	// The decline first (a push decode engine finds its cache hit while prefill still
	// computes): the parts are dropped, and the final one is answered, once.
	tb = New(ttl)
	expect(t, must(t)(tb.Decline(t0, "r1")))
	expect(t, must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{7}})))
	expect(t, must(t)(tb.SourceReady(t0, Part{Request: "r1", Offset: 1, Blocks: []uint32{8}, Final: true})), SourceDeclined{Request: "r1"})
	expect(t, must(t)(tb.Decline(t0, "r1")))
	// The prefill engine's cancel (the router cancels a prefill leg once decode answered)
	// finds it known and has nothing left to do.
	if acts, known := tb.CancelSource(t0, "r1"); !known || len(acts) != 0 {
		t.Fatalf("cancelling a declined source: %v %v, want known and nothing to do", acts, known)
	}
	expect(t, tb.Expire(t0.Add(11*time.Second)))
	if _, err := tb.Register(t0.Add(11*time.Second), reg(1, 100, 101)); !errors.Is(err, ErrSourceGone) {
		t.Fatalf("a registration after a decline: %v, want ErrSourceGone", err)
	}
	// It is forgotten as a retired request is, a registration timeout and a lease after
	// the decline (here longer than the blocks TTL).
	tb.Expire(t0.Add(ttl.RegistrationTimeout + ttl.Lease))
	if len(tb.retired) != 0 || len(tb.reqs) != 0 {
		t.Fatalf("after its retention the table still holds %d retired and %d live requests", len(tb.retired), len(tb.reqs))
	}

	// A source whose parts had begun and not ended: the final part is answered.
	tb = New(ttl)
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{7}}))
	expect(t, must(t)(tb.Decline(t0, "r1")))
	expect(t, must(t)(tb.SourceReady(t0, Part{Request: "r1", Offset: 1, Blocks: []uint32{8}, Final: true})), SourceDeclined{Request: "r1"})
}

func TestARegisteredRequestIsNotDeclined(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.Register(t0, reg(1, 100)))
	if _, err := tb.Decline(t0, "r1"); !errors.Is(err, ErrRegistered) {
		t.Fatalf("declining a registered request: %v, want ErrRegistered", err)
	}
	tr := Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: whole, Src: []uint32{7}, Dst: []uint32{100}}
	expect(t, must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{7}, Final: true})), tr)
	expect(t, writeAll(t, tb, 1, tr), Delivered{Request: "r1", Attempt: 1, Decode: dec})
	// Delivered, it is over: a late decline changes nothing, and the table still refuses
	// the attempt number it delivered.
	expect(t, must(t)(tb.Decline(t0, "r1")))
	if _, err := tb.Register(t0, reg(1, 100)); !errors.Is(err, ErrStaleAttempt) {
		t.Fatalf("the delivered attempt registered again after a decline: %v, want ErrStaleAttempt", err)
	}
}

func TestDeclinesOfUnknownRequestsAreBounded(t *testing.T) {
	ttl := cfg
	ttl.BlocksTTL = 10 * time.Second
	tb := New(ttl)
	for i := range maxDeclined {
		must(t)(tb.Decline(t0, fmt.Sprint("r", i)))
	}
	if _, err := tb.Decline(t0, "one more"); !errors.Is(err, ErrTooMany) {
		t.Fatalf("decline %d: %v, want ErrTooMany", maxDeclined+1, err)
	}
	tb.Expire(t0.Add(ttl.RegistrationTimeout + ttl.Lease))
	must(t)(tb.Decline(t0.Add(ttl.RegistrationTimeout+ttl.Lease), "one more"))
}

func TestPartsArriveInAnyOrderAndDeliveryWaitsForEveryWrite(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.Register(t0, reg(1, 100, 101, 102, 103)))
	expect(t, must(t)(tb.SourceReady(t0, Part{Request: "r1", Offset: 2, Blocks: []uint32{12, 13}, Final: true})),
		Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: whole, Src: []uint32{12, 13}, Dst: []uint32{102, 103}})
	// One merged write covers both blocks: accounting is in blocks, not writes.
	if err := tb.Posted("r1", 1, 2); err != nil {
		t.Fatal(err)
	}
	expect(t, must(t)(tb.SourceReady(t0, Part{Request: "r1", Offset: 0, Blocks: []uint32{10, 11}})),
		Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: whole, Src: []uint32{10, 11}, Dst: []uint32{100, 101}})
	if err := tb.Posted("r1", 1, 2); err != nil {
		t.Fatal(err)
	}
	expect(t, must(t)(tb.Completed(t0, "r1", 1, 2)))
	expect(t, must(t)(tb.Completed(t0, "r1", 1, 1)))
	expect(t, must(t)(tb.Completed(t0, "r1", 1, 1)), Delivered{Request: "r1", Attempt: 1, Decode: dec})
}

// Every block is written once per region: a first part whose writes all completed in
// every region must not count as the whole request (the agent's two-process test found
// this: delivery was signalled before the second part was written).
func TestDeliveryCountsEveryRegionOfEveryBlock(t *testing.T) {
	tb := New(Config{Lease: time.Hour, RegistrationTimeout: time.Hour, Regions: 4})
	must(t)(tb.Register(t0, reg(1, 100, 101, 102, 103)))
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Offset: 0, Blocks: []uint32{10, 11}}))
	for range 4 { // one merged write of both blocks per region
		if err := tb.Posted("r1", 1, 2); err != nil {
			t.Fatal(err)
		}
	}
	for range 4 {
		expect(t, must(t)(tb.Completed(t0, "r1", 1, 2)))
	}
	acts := must(t)(tb.SourceReady(t0, Part{Request: "r1", Offset: 2, Blocks: []uint32{12, 13}, Final: true}))
	expect(t, acts, Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: Span{0, 4}, Src: []uint32{12, 13}, Dst: []uint32{102, 103}})
	for range 4 {
		if err := tb.Posted("r1", 1, 2); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		expect(t, must(t)(tb.Completed(t0, "r1", 1, 2)))
	}
	expect(t, must(t)(tb.Completed(t0, "r1", 1, 2)), Delivered{Request: "r1", Attempt: 1, Decode: dec})
}

func TestNewAttemptSupersedesAndWaitsForTheOldOneToDrain(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{1, 2}, Final: true}))
	must(t)(tb.Register(t0, reg(1, 10, 11)))
	if err := tb.Posted("r1", 1, 2); err != nil {
		t.Fatal(err)
	}
	// The retry arrives while attempt 1's writes are in flight: nothing for attempt 2 yet.
	expect(t, must(t)(tb.Register(t0, reg(2, 20, 21))))
	if err := tb.Posted("r1", 1, 1); !errors.Is(err, ErrFenced) {
		t.Fatalf("posting for a superseded attempt: %v", err)
	}
	expect(t, must(t)(tb.Completed(t0, "r1", 1, 1)))
	expect(t, must(t)(tb.Completed(t0, "r1", 1, 1)),
		CancelAcked{Request: "r1", Attempt: 1, Decode: dec},
		Transfer{Request: "r1", Attempt: 2, Decode: dec, Regions: whole, Src: []uint32{1, 2}, Dst: []uint32{20, 21}})
}

func TestCancelIsAcknowledgedOnlyAfterInFlightWritesDrain(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.Register(t0, reg(1, 10, 11, 12)))
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{1, 2, 3}, Final: true}))
	if err := tb.Posted("r1", 1, 3); err != nil {
		t.Fatal(err)
	}
	expect(t, must(t)(tb.Cancel(t0, "r1", 1)))
	if err := tb.Posted("r1", 1, 1); !errors.Is(err, ErrFenced) {
		t.Fatalf("posting after cancel: %v", err)
	}
	expect(t, must(t)(tb.Completed(t0, "r1", 1, 2)))
	expect(t, must(t)(tb.Completed(t0, "r1", 1, 1)), CancelAcked{Request: "r1", Attempt: 1, Decode: dec})
	if _, err := tb.Cancel(t0, "r1", 1); !errors.Is(err, ErrUnknown) { // acknowledged and forgotten
		t.Fatalf("a cancel after the acknowledgement: %v", err)
	}
}

func TestWithdrawnAdmissionsNeitherDeliverNorBlockTheAcknowledgement(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.Register(t0, reg(1, 10, 11)))
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{1, 2}, Final: true}))
	if err := tb.Posted("r1", 1, 2); err != nil {
		t.Fatal(err)
	}
	expect(t, must(t)(tb.Withdraw(t0, "r1", 1, 2))) // not posted: nothing delivered
	if err := tb.Posted("r1", 1, 2); err != nil {
		t.Fatal(err)
	}
	must(t)(tb.Cancel(t0, "r1", 1))
	expect(t, must(t)(tb.Withdraw(t0, "r1", 1, 2)), CancelAcked{Request: "r1", Attempt: 1, Decode: dec})
}

func TestLeaseExpiresWithoutHeartbeatAndFailsAfterDrain(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.Register(t0, reg(1, 10)))
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{1}, Final: true}))
	if err := tb.Posted("r1", 1, 1); err != nil {
		t.Fatal(err)
	}
	if err := tb.Heartbeat(t0.Add(20*time.Second), "r1", 1); err != nil {
		t.Fatal(err)
	}
	expect(t, tb.Expire(t0.Add(49*time.Second))) // renewed until 50 s
	expect(t, tb.Expire(t0.Add(50*time.Second))) // fenced, one write in flight
	if err := tb.Posted("r1", 1, 1); !errors.Is(err, ErrFenced) {
		t.Fatalf("posting after expiry: %v", err)
	}
	acts := must(t)(tb.Completed(t0, "r1", 1, 1))
	if f, ok := acts[0].(Failed); len(acts) != 1 || !ok || f.Attempt != 1 {
		t.Fatalf("after drain: %#v", acts)
	}
}

// After a Failed the prefill engine frees the request's blocks: a retried attempt must
// not be paired with them (it would be delivered whatever they hold by then).
func TestARetryAfterAFailureIsNotPairedWithTheFreedSource(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.Register(t0, reg(1, 10, 11)))
	acts := must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{1, 2}, Final: true}))
	if len(acts) != 1 {
		t.Fatalf("pairing: %#v", acts)
	}
	if err := tb.Posted("r1", 1, 2); err != nil {
		t.Fatal(err)
	}
	expect(t, tb.Expire(t0.Add(30*time.Second))) // the lease ends with both writes in flight
	acts = must(t)(tb.Completed(t0, "r1", 1, 2))
	if _, ok := acts[0].(Failed); len(acts) != 1 || !ok {
		t.Fatalf("after drain: %#v", acts)
	}
	// Decode retries; the prefill engine has freed blocks 1 and 2: the retry is refused
	// rather than paired with them, and so is a late part of the failed request.
	if _, err := tb.Register(t0.Add(31*time.Second), reg(2, 20, 21)); !errors.Is(err, ErrSourceGone) {
		t.Fatalf("a retry after the failure: %v, want ErrSourceGone", err)
	}
	if _, err := tb.SourceReady(t0, Part{Request: "r1", Offset: 2, Blocks: []uint32{3}}); !errors.Is(err, ErrSourceGone) {
		t.Fatalf("a late part of the failed request: %v, want ErrSourceGone", err)
	}
	// The table dropped the request, remembering the failure until no registration from
	// before it can arrive (the registration timeout and a lease); then the id is free.
	retention := cfg.RegistrationTimeout + cfg.Lease
	tb.Expire(t0.Add(retention - time.Second))
	if _, err := tb.Register(t0.Add(retention-time.Second), reg(2, 20, 21)); !errors.Is(err, ErrSourceGone) {
		t.Fatalf("a retry just before the retention ends: %v, want ErrSourceGone", err)
	}
	tb.Expire(t0.Add(retention))
	expect(t, must(t)(tb.Register(t0.Add(retention), reg(2, 20, 21))))
	expect(t, must(t)(tb.SourceReady(t0.Add(retention), Part{Request: "r1", Blocks: []uint32{7, 8}, Final: true})),
		Transfer{Request: "r1", Attempt: 2, Decode: dec, Regions: whole, Src: []uint32{7, 8}, Dst: []uint32{20, 21}})
	if _, err := tb.Register(t0.Add(retention), reg(1, 30, 31)); !errors.Is(err, ErrStaleAttempt) {
		t.Fatalf("attempt 1 again: %v, want ErrStaleAttempt", err)
	}
}

// A cancel (decode preempted the request) keeps the source: the prefill engine was not
// told, and the retry takes the same blocks.
func TestARetryAfterACancelIsPairedWithTheSameSource(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{1, 2}, Final: true}))
	must(t)(tb.Register(t0, reg(1, 10, 11)))
	must(t)(tb.Cancel(t0, "r1", 1))
	expect(t, must(t)(tb.Register(t0, reg(2, 20, 21))),
		Transfer{Request: "r1", Attempt: 2, Decode: dec, Regions: whole, Src: []uint32{1, 2}, Dst: []uint32{20, 21}})
}

// Once a cancelled attempt has drained, its number must not come back: the writer may
// still hold its queued writes, and Posted would admit them under the new registration.
func TestAnAttemptNumberIsNeverReusedAfterItDrained(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{1, 2}, Final: true}))
	must(t)(tb.Register(t0, reg(2, 10, 11)))
	expect(t, must(t)(tb.Cancel(t0, "r1", 2)), CancelAcked{Request: "r1", Attempt: 2, Decode: dec})
	for _, att := range []uint64{1, 2} {
		if _, err := tb.Register(t0, reg(att, 20, 21)); !errors.Is(err, ErrStaleAttempt) {
			t.Errorf("attempt %d after attempt 2 drained: %v, want ErrStaleAttempt", att, err)
		}
	}
	if err := tb.Posted("r1", 2, 1); err == nil {
		t.Error("a queued write of the cancelled attempt was admitted")
	}
	expect(t, must(t)(tb.Register(t0, reg(3, 20, 21))), Transfer{Request: "r1", Attempt: 3, Decode: dec, Regions: whole,
		Src: []uint32{1, 2}, Dst: []uint32{20, 21}})
}

func TestRegistrationTimesOutWhenPrefillNeverFinishes(t *testing.T) {
	tb := New(Config{Lease: time.Hour, RegistrationTimeout: 480 * time.Second})
	must(t)(tb.Register(t0, reg(1, 10, 11)))
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{1}})) // not final
	acts := tb.Expire(t0.Add(480 * time.Second))
	if f, ok := acts[0].(Failed); !ok || f.Reason == "" {
		t.Fatalf("%#v", acts)
	}
}

func TestProtocolViolationsAreRefusedAndChangeNothing(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.Register(t0, reg(2, 10, 11)))
	for name, err := range map[string]error{
		"older attempt": second(tb.Register(t0, reg(1, 10, 11))),
		"same attempt":  second(tb.Register(t0, reg(2, 10, 11))),
		"no blocks":     second(tb.Register(t0, Registration{Request: "r1", Attempt: 3, Decode: dec})),
		"past the end":  second(tb.SourceReady(t0, Part{Request: "r1", Offset: 1, Blocks: []uint32{5, 6}})),
		"negative":      second(tb.SourceReady(t0, Part{Request: "r1", Offset: -1, Blocks: []uint32{5}})),
		"over-complete": second(tb.Completed(t0, "r1", 2, 1)),
		"unknown":       tb.Posted("r9", 1, 1),
	} {
		if err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{1}}))
	if _, err := tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{1}}); !errors.Is(err, ErrBadBlocks) {
		t.Errorf("a position reported twice: %v", err)
	}
}

func second(_ []Action, err error) error { return err }

func TestRestartedEngineDropsOlderEpochs(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.Register(t0, reg(1, 10)))
	acts := tb.EngineRestarted(t0, Engine{ID: dec.ID, Epoch: 2})
	if f, ok := acts[0].(Failed); len(acts) != 1 || !ok || f.Reason != "decode engine restarted" {
		t.Fatalf("%#v", acts)
	}
	if _, err := tb.Register(t0, Registration{Request: "r2", Attempt: 1, Decode: dec, Blocks: []uint32{1}}); !errors.Is(err, ErrStaleEpoch) {
		t.Fatalf("registration from the old epoch: %v", err)
	}
}

// TestInvariantsUnderRandomInterleavings drives the table with random events — retries,
// retries after a failure, the same or a lower attempt registered again, cancels, lease
// and TTL expiry with writes in flight, engine restarts, Forget at any time — and checks
// the protocol's invariants against an independent model of in-flight writes:
//   - no write is admitted for an attempt after it was fenced;
//   - no transfer reads source blocks the prefill engine has freed;
//   - CancelAcked and Failed come only when the attempt has nothing in flight;
//   - every attempt ends at most once, and a Delivered attempt had every position written once;
//   - a refused registration changes nothing, and a source expires only with no attempt left.
func TestInvariantsUnderRandomInterleavings(t *testing.T) {
	for seed := range uint64(500) {
		rng := rand.New(rand.NewPCG(seed, 7))
		ttl := cfg
		ttl.BlocksTTL = 50 * time.Second
		tb := New(ttl)
		epoch := uint64(1)
		now := t0
		const n = 6
		inFlight := map[uint64]int{}
		pendingPositions := map[uint64]int{} // positions handed to the writer, not yet posted
		fencedAt := map[uint64]bool{}
		ended := map[uint64]bool{}
		written := map[uint64]map[uint32]bool{}
		attempt := uint64(0)
		nextPos := 0
		// gen counts the prefill engine's sources of the request: after a Failed, a
		// delivery or an expired source it frees its blocks and, once the agent forgot the
		// request, reports new ones (ids gen*1000+position). A transfer from any other
		// generation reads freed blocks.
		gen := uint32(1)
		lastEnd := now // the table may drop the request at an attempt's end
		failedGen := uint32(0)
		retention := ttl.RegistrationTimeout + ttl.Lease
		freed := func() {
			gen++
			nextPos = 0
		}
		check := func(acts []Action) {
			for _, a := range acts {
				switch a := a.(type) {
				case Transfer:
					for _, src := range a.Src {
						if src/1000 != gen {
							t.Fatalf("seed %d: attempt %d written from block %d of source %d; the prefill engine freed it (now at source %d)", seed,
								a.Attempt, src, src/1000, gen)
						}
					}
					for _, d := range a.Dst {
						if written[a.Attempt][d] {
							t.Fatalf("seed %d: block %d of attempt %d handed out twice", seed, d, a.Attempt)
						}
						written[a.Attempt][d] = true
					}
					pendingPositions[a.Attempt] += len(a.Dst)
				case CancelAcked, Failed:
					var att uint64
					if c, ok := a.(CancelAcked); ok {
						att = c.Attempt
					} else {
						att = a.(Failed).Attempt
					}
					if inFlight[att] != 0 {
						t.Fatalf("seed %d: attempt %d acknowledged with %d writes in flight", seed, att, inFlight[att])
					}
					if ended[att] {
						t.Fatalf("seed %d: attempt %d ended twice", seed, att)
					}
					ended[att], fencedAt[att] = true, true
					if _, failed := a.(Failed); failed {
						// The prefill engine frees its blocks and may report anew (after
						// the table's retention, or refused until then).
						failedGen = gen
						freed()
					}
					lastEnd = now
				case Delivered:
					if ended[a.Attempt] || len(written[a.Attempt]) != n || inFlight[a.Attempt] != 0 {
						t.Fatalf("seed %d: delivered attempt %d with %d of %d blocks, %d in flight", seed, a.Attempt,
							len(written[a.Attempt]), n, inFlight[a.Attempt])
					}
					ended[a.Attempt] = true
					lastEnd = now
					freed()
				case SourceExpired:
					failedGen = gen
					for att := uint64(1); att <= attempt; att++ {
						if !ended[att] {
							t.Fatalf("seed %d: the source expired while attempt %d had not ended", seed, att)
						}
					}
					lastEnd = now
					freed()
				}
			}
		}
		for step := 0; step < 80; step++ {
			switch rng.IntN(11) {
			case 0: // decode registers (a retry when one exists)
				attempt++
				written[attempt] = map[uint32]bool{}
				blocks := make([]uint32, n)
				for i := range blocks {
					blocks[i] = uint32(100*attempt) + uint32(i)
				}
				acts, err := tb.Register(now, Registration{Request: "r", Attempt: attempt, Decode: Engine{ID: dec.ID, Epoch: epoch}, Blocks: blocks})
				if errors.Is(err, ErrSourceGone) {
					attempt-- // refused: the failed attempt is still draining
					continue
				}
				if err != nil {
					t.Fatalf("seed %d: %v", seed, err)
				}
				if attempt > 1 && !ended[attempt-1] {
					fencedAt[attempt-1] = true
				}
				if attempt > 1 && ended[attempt-1] {
					fencedAt[attempt-1] = true // delivered: no further writes either way
				}
				check(acts)
			case 1: // prefill finishes some positions
				if nextPos < n {
					k := 1 + rng.IntN(n-nextPos)
					blocks := make([]uint32, k)
					for i := range blocks {
						blocks[i] = gen*1000 + uint32(nextPos+i)
					}
					acts, err := tb.SourceReady(now, Part{Request: "r", Offset: nextPos, Blocks: blocks, Final: nextPos+k == n})
					if errors.Is(err, ErrSourceGone) {
						continue // the request failed and is draining; the engine hears of it
					}
					check(must(t)(acts, err))
					nextPos += k
				}
			case 2, 3: // the writer posts what it was handed
				for att, k := range pendingPositions {
					if k == 0 {
						continue
					}
					err := tb.Posted("r", att, k)
					if fencedAt[att] {
						if err == nil {
							t.Fatalf("seed %d: a write was admitted for fenced attempt %d", seed, att)
						}
						pendingPositions[att] = 0
						continue
					}
					if err != nil {
						t.Fatalf("seed %d: %v", seed, err)
					}
					inFlight[att] += k
					pendingPositions[att] = 0
				}
			case 4: // some writes complete
				for att, k := range inFlight {
					if k > 0 {
						done := 1 + rng.IntN(k)
						inFlight[att] -= done
						check(must(t)(tb.Completed(now, "r", att, done)))
					}
				}
			case 5: // decode cancels, or time passes and the watchdog runs
				if rng.IntN(2) == 0 && attempt > 0 && !ended[attempt] {
					acts, err := tb.Cancel(now, "r", attempt)
					if err == nil {
						fencedAt[attempt] = true
					}
					check(acts)
				} else {
					now = now.Add(time.Duration(rng.IntN(40)) * time.Second)
					acts := tb.Expire(now)
					for _, a := range acts {
						if f, ok := a.(Failed); ok {
							fencedAt[f.Attempt] = true
						}
					}
					// Expire fences even when the Failed comes later, after drain: learn
					// which attempts it fenced by probing with a zero-write admission.
					for att := uint64(1); att <= attempt; att++ {
						if !ended[att] && errors.Is(tb.Posted("r", att, 0), ErrFenced) {
							fencedAt[att] = true
						}
					}
					check(acts)
				}
			case 6:
				if attempt > 0 && !fencedAt[attempt] {
					_ = tb.Heartbeat(now, "r", attempt)
				}
			case 7: // the same or a lower attempt again (a confused or replayed decode)
				if attempt == 0 || !now.Before(lastEnd.Add(retention)) {
					continue // the id may have been retired and forgotten: a new request then
				}
				again := 1 + uint64(rng.IntN(int(attempt)))
				acts, err := tb.Register(now, Registration{Request: "r", Attempt: again, Decode: Engine{ID: dec.ID, Epoch: epoch},
					Blocks: []uint32{9000, 9001, 9002, 9003, 9004, 9005}})
				if err == nil || len(acts) > 0 {
					t.Fatalf("seed %d: attempt %d registered again (latest %d): %v, %v", seed, again, attempt, acts, err)
				}
			case 8: // the decode engine restarts: its older incarnation's attempts are fenced
				epoch++
				for att := uint64(1); att <= attempt; att++ {
					fencedAt[att] = true
				}
				check(tb.EngineRestarted(now, Engine{ID: dec.ID, Epoch: epoch}))
			case 9: // the prefill engine cancels the request
				acts, found := tb.CancelSource(now, "r")
				if !found {
					continue // nothing of it reached the table (or it is over): nothing to free
				}
				for att := uint64(1); att <= attempt; att++ {
					fencedAt[att] = true
				}
				check(acts)
				failedGen, lastEnd = gen, now
				freed()
			case 10: // a part the prefill engine sent before it heard of a failure arrives late
				if failedGen == 0 || !now.Before(lastEnd.Add(retention)) {
					continue
				}
				acts, err := tb.SourceReady(now, Part{Request: "r", Blocks: []uint32{failedGen * 1000}})
				if err == nil {
					check(acts) // a transfer reading the freed block fails the test
				}
			}
		}
	}
}

// layered is a table of four regions (two layers' K and V), reported in two layer groups.
func layered() *Table {
	return New(Config{Lease: time.Hour, RegistrationTimeout: time.Hour, Regions: 4})
}

// group reports one layer group (regions lo..hi-1) of blocks 10 and 11.
func group(tb *Table, lo, hi int, final bool) ([]Action, error) {
	return tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{10, 11}, Regions: Span{lo, hi}, Final: final})
}

// writeAll posts and completes every block-region a transfer covers, as the writer does.
func writeAll(t *testing.T, tb *Table, att uint64, tr Transfer) []Action {
	t.Helper()
	n := len(tr.Src) * (tr.Regions.Hi - tr.Regions.Lo)
	if err := tb.Posted("r1", att, n); err != nil {
		t.Fatal(err)
	}
	return must(t)(tb.Completed(t0, "r1", att, n))
}

// Layer-streamed push: each group is written as it is reported, in order, and decode is
// told only once every group has landed.
func TestLayerGroupsAreWrittenAsTheyArriveAndDeliveredOnlyWhenAllLanded(t *testing.T) {
	tb := layered()
	must(t)(tb.Register(t0, reg(1, 100, 101)))
	first := Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: Span{0, 2}, Src: []uint32{10, 11}, Dst: []uint32{100, 101}}
	acts := must(t)(group(tb, 0, 2, false))
	expect(t, acts, first)
	expect(t, writeAll(t, tb, 1, first)) // the first group landed: not delivered
	second := Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: Span{2, 4}, Src: []uint32{10, 11}, Dst: []uint32{100, 101}}
	expect(t, must(t)(group(tb, 2, 4, true)), second)
	expect(t, writeAll(t, tb, 1, second), Delivered{Request: "r1", Attempt: 1, Decode: dec})
}

// Groups reported before the registration go out in the order they were reported, one
// transfer per group.
func TestGroupsReportedBeforeTheRegistrationGoOutInOrder(t *testing.T) {
	tb := layered()
	must(t)(group(tb, 2, 4, false))
	must(t)(group(tb, 0, 2, true))
	expect(t, must(t)(tb.Register(t0, reg(1, 100, 101))),
		Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: Span{2, 4}, Src: []uint32{10, 11}, Dst: []uint32{100, 101}},
		Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: Span{0, 2}, Src: []uint32{10, 11}, Dst: []uint32{100, 101}})
}

// A cancel between two groups: the later group is not written into the cancelled
// attempt, and a retry is handed every group, the one written before included.
func TestACancelBetweenGroupsWritesNoLaterGroupAndARetryGetsThemAll(t *testing.T) {
	tb := layered()
	must(t)(tb.Register(t0, reg(1, 100, 101)))
	acts := must(t)(group(tb, 0, 2, false))
	writeAll(t, tb, 1, acts[0].(Transfer))
	expect(t, must(t)(tb.Cancel(t0, "r1", 1)), CancelAcked{Request: "r1", Attempt: 1, Decode: dec})
	expect(t, must(t)(group(tb, 2, 4, true))) // no live attempt: kept for a retry
	g1 := Transfer{Request: "r1", Attempt: 2, Decode: dec, Regions: Span{0, 2}, Src: []uint32{10, 11}, Dst: []uint32{20, 21}}
	g2 := Transfer{Request: "r1", Attempt: 2, Decode: dec, Regions: Span{2, 4}, Src: []uint32{10, 11}, Dst: []uint32{20, 21}}
	expect(t, must(t)(tb.Register(t0, reg(2, 20, 21))), g1, g2)
	expect(t, writeAll(t, tb, 2, g1))
	expect(t, writeAll(t, tb, 2, g2), Delivered{Request: "r1", Attempt: 2, Decode: dec})
}

// A retry registered while the first group's writes are in flight waits for them to
// drain, then is handed that group and the later ones.
func TestARetryAfterAGroupWasWrittenWaitsForItToDrain(t *testing.T) {
	tb := layered()
	must(t)(tb.Register(t0, reg(1, 100, 101)))
	if err := tb.Posted("r1", 1, 4); err != nil { // the first group, in flight
		t.Fatal(err)
	}
	must(t)(group(tb, 0, 2, false))
	expect(t, must(t)(tb.Register(t0, reg(2, 20, 21))))
	g1 := Transfer{Request: "r1", Attempt: 2, Decode: dec, Regions: Span{0, 2}, Src: []uint32{10, 11}, Dst: []uint32{20, 21}}
	expect(t, must(t)(tb.Completed(t0, "r1", 1, 4)), CancelAcked{Request: "r1", Attempt: 1, Decode: dec}, g1)
	g2 := Transfer{Request: "r1", Attempt: 2, Decode: dec, Regions: Span{2, 4}, Src: []uint32{10, 11}, Dst: []uint32{20, 21}}
	expect(t, must(t)(group(tb, 2, 4, true)), g2)
	writeAll(t, tb, 2, g1)
	expect(t, writeAll(t, tb, 2, g2), Delivered{Request: "r1", Attempt: 2, Decode: dec})
}

// Groups that overlap, move a position to another block, or name regions the engine does
// not have are refused whole, and the table is unchanged.
func TestBadLayerGroupsAreRefusedAndChangeNothing(t *testing.T) {
	tb := layered()
	must(t)(tb.Register(t0, reg(1, 100, 101)))
	acts := must(t)(group(tb, 0, 2, false))
	for name, err := range map[string]error{
		"overlapping":   second(group(tb, 1, 3, false)),
		"moved block":   second(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{10, 12}, Regions: Span{2, 4}})),
		"past the end":  second(group(tb, 2, 5, false)),
		"empty":         second(group(tb, 2, 2, false)),
		"whole blocks":  second(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{10, 11}})), // regions 0, 1 again
		"negative span": second(group(tb, -1, 2, false)),
	} {
		if !errors.Is(err, ErrBadBlocks) {
			t.Errorf("%s: %v, want ErrBadBlocks", name, err)
		}
	}
	// Nothing of the refused parts was recorded: the second group is still whole.
	writeAll(t, tb, 1, acts[0].(Transfer))
	g2 := must(t)(group(tb, 2, 4, true))
	expect(t, writeAll(t, tb, 1, g2[0].(Transfer)), Delivered{Request: "r1", Attempt: 1, Decode: dec})
}

// Region sets span several words for Qwen3's 128 regions and more: overlaps are found
// across word boundaries, and groups that tile the regions deliver.
func TestLayerGroupsAcrossWordBoundaries(t *testing.T) {
	tb := New(Config{Lease: time.Hour, RegistrationTimeout: time.Hour, Regions: 130})
	must(t)(tb.Register(t0, reg(1, 100)))
	part := func(lo, hi int, final bool) ([]Action, error) {
		return tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{10}, Regions: Span{lo, hi}, Final: final})
	}
	var writes []Transfer
	for _, g := range []Span{{60, 70}, {0, 60}} {
		writes = append(writes, must(t)(part(g.Lo, g.Hi, false))[0].(Transfer))
	}
	for _, g := range []Span{{65, 66}, {63, 64}, {69, 129}, {0, 1}} {
		if _, err := part(g.Lo, g.Hi, false); !errors.Is(err, ErrBadBlocks) {
			t.Errorf("regions %d..%d overlap what was reported: %v", g.Lo, g.Hi, err)
		}
	}
	writes = append(writes, must(t)(part(70, 130, true))[0].(Transfer))
	var acts []Action
	for _, w := range writes {
		acts = writeAll(t, tb, 1, w)
	}
	expect(t, acts, Delivered{Request: "r1", Attempt: 1, Decode: dec})
}

// BenchmarkPairedSourceReady16k is a push's SourceReady when decode registered first: the
// source recorded and the transfer handed to the writer.
func BenchmarkPairedSourceReady16k(b *testing.B) {
	src, dst := make([]uint32, 1024), make([]uint32, 1024)
	for i := range src {
		src[i], dst[i] = uint32(i), uint32(4096+i)
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		tb := New(Config{Lease: time.Hour, RegistrationTimeout: time.Hour, Regions: 128})
		if _, err := tb.Register(t0, Registration{Request: "r", Attempt: 1, Decode: dec, Blocks: dst}); err != nil {
			b.Fatal(err)
		}
		acts, err := tb.SourceReady(t0, Part{Request: "r", Blocks: src, Final: true})
		if err != nil || len(acts) != 1 {
			b.Fatal(acts, err)
		}
	}
}

// BenchmarkSourceReady16k records a 16k-token request's source (1024 blocks, Qwen3-32B's
// 128 regions) in one part, as a prefill rank's pump does for every request.
func BenchmarkSourceReady16k(b *testing.B) {
	blocks := make([]uint32, 1024)
	for i := range blocks {
		blocks[i] = uint32(i)
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		tb := New(Config{Lease: time.Hour, RegistrationTimeout: time.Hour, Regions: 128})
		if _, err := tb.SourceReady(t0, Part{Request: "r", Blocks: blocks, Final: true}); err != nil {
			b.Fatal(err)
		}
	}
}

// The attack: a part far into its request (offset 2^19-1, a few bytes on the wire) made
// the table hold 2^19 positions, and registrations of 2^18 blocks a megabyte each, for
// as long as their timeouts. The table holds at most MaxPositions in all, refuses what
// goes beyond, and counts what it gives back as its requests end.
func TestTheTableHoldsAtMostItsPositions(t *testing.T) {
	c := cfg
	c.MaxPositions, c.BlocksTTL = 100, time.Minute
	tb := New(c)
	must(t)(tb.SourceReady(t0, Part{Request: "far", Offset: 99, Blocks: []uint32{7}}))
	if tb.held != 100 {
		t.Fatalf("a part at offset 99 holds %d positions, want 100", tb.held)
	}
	if _, err := tb.SourceReady(t0, Part{Request: "next", Blocks: []uint32{1}}); !errors.Is(err, ErrOverBudget) {
		t.Fatalf("a part over the budget: %v, want ErrOverBudget", err)
	}
	big := Registration{Request: "big", Attempt: 1, Decode: dec, Blocks: make([]uint32, 50)}
	if _, err := tb.Register(t0, big); !errors.Is(err, ErrOverBudget) {
		t.Fatalf("a registration over the budget: %v, want ErrOverBudget", err)
	}
	if len(tb.reqs) != 1 {
		t.Fatalf("refused calls left %d requests in the table, want the one", len(tb.reqs))
	}
	tb.CancelSource(t0, "far")
	if tb.held != 0 || len(tb.reqs) != 0 {
		t.Fatalf("after the request ended the table holds %d positions in %d requests, want none", tb.held, len(tb.reqs))
	}
	must(t)(tb.Register(t0, big))
	if tb.held != 50 {
		t.Fatalf("a registration of 50 blocks holds %d positions, want 50", tb.held)
	}
}

// A registration cancelled before any of its request's source came leaves nothing
// behind but its attempt number: before, such requests stayed in the table for good.
func TestACancelledRegistrationWithoutSourceIsForgotten(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.Register(t0, reg(1, 5, 6)))
	expect(t, must(t)(tb.Cancel(t0, "r1", 1)), CancelAcked{Request: "r1", Attempt: 1, Decode: dec})
	if len(tb.reqs) != 0 || tb.held != 0 {
		t.Fatalf("%d requests holding %d positions after the cancel, want none", len(tb.reqs), tb.held)
	}
	if _, err := tb.Register(t0, reg(1, 5, 6)); !errors.Is(err, ErrStaleAttempt) {
		t.Fatalf("attempt 1 again: %v, want ErrStaleAttempt", err)
	}
	if len(tb.reqs) != 0 {
		t.Fatal("a refused registration left its request in the table")
	}
	tb.Expire(t0.Add(cfg.RegistrationTimeout + cfg.Lease))
	if len(tb.retired) != 0 {
		t.Fatalf("the cancelled attempt is remembered past the registration timeout and a lease")
	}
}

// Abandon fails a cancelled attempt's request and drops its source, but only for the
// engine that registered the latest attempt, and never a delivered one.
func TestAbandonFailsOnlyTheLatestAttemptOfItsEngine(t *testing.T) {
	c := cfg
	c.BlocksTTL = time.Minute
	tb := New(c)
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{10, 11}, Final: true}))
	must(t)(tb.Register(t0, reg(1, 5, 6)))
	must(t)(tb.Cancel(t0, "r1", 1))
	if acts := tb.Abandon(t0, "r1", 1, "another-decode"); len(acts) != 0 {
		t.Fatalf("another engine's abandon: %v", acts)
	}
	if acts := tb.Abandon(t0, "r1", 2, dec.ID); len(acts) != 0 {
		t.Fatalf("an abandon of an attempt never registered: %v", acts)
	}
	expect(t, tb.Abandon(t0, "r1", 1, dec.ID), Failed{Request: "r1", Attempt: 1, Decode: Engine{ID: dec.ID}, Code: CodeEngineGone,
		Reason: "the decode engine ended before the transfer finished"})
	if _, err := tb.Register(t0, reg(2, 5, 6)); !errors.Is(err, ErrSourceGone) {
		t.Fatalf("a registration after the abandon: %v, want ErrSourceGone", err)
	}
	if tb.held != 0 {
		t.Fatalf("the abandoned request still holds %d positions", tb.held)
	}
}

// tail is a registration of positions first… only: decode's prefix cache holds the rest.
func tail(att uint64, first int, blocks ...uint32) Registration {
	r := reg(att, blocks...)
	r.First = first
	return r
}

// A registration of a tail pairs only the positions from its first on, whichever half
// comes first and however the source is split into parts, and delivers once those are
// written: the prefix decode holds is never written.
func TestATailRegistrationWritesOnlyTheTail(t *testing.T) {
	want := Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: whole, Src: []uint32{12, 13}, Dst: []uint32{100, 101}}

	regFirst := New(cfg)
	expect(t, must(t)(regFirst.Register(t0, tail(1, 2, 100, 101))))
	expect(t, must(t)(regFirst.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{10, 11, 12, 13}, Final: true})), want)
	expect(t, writeAll(t, regFirst, 1, want), Delivered{Request: "r1", Attempt: 1, Decode: dec})

	srcFirst := New(cfg)
	must(t)(srcFirst.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{10, 11, 12, 13}, Final: true}))
	expect(t, must(t)(srcFirst.Register(t0, tail(1, 2, 100, 101))), want)
	expect(t, writeAll(t, srcFirst, 1, want), Delivered{Request: "r1", Attempt: 1, Decode: dec})

	// Parts across the boundary: the head part writes nothing, the one across it its tail.
	parts := New(cfg)
	must(t)(parts.Register(t0, tail(1, 2, 100, 101)))
	expect(t, must(t)(parts.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{10}})))
	acts := must(t)(parts.SourceReady(t0, Part{Request: "r1", Offset: 1, Blocks: []uint32{11, 12}}))
	first := Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: whole, Src: []uint32{12}, Dst: []uint32{100}}
	expect(t, acts, first)
	expect(t, writeAll(t, parts, 1, first))
	last := Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: whole, Src: []uint32{13}, Dst: []uint32{101}}
	expect(t, must(t)(parts.SourceReady(t0, Part{Request: "r1", Offset: 3, Blocks: []uint32{13}, Final: true})), last)
	expect(t, writeAll(t, parts, 1, last), Delivered{Request: "r1", Attempt: 1, Decode: dec})
}

// Layer-streamed push of a tail: every group writes the tail's positions only.
func TestLayerGroupsOfATailWriteOnlyTheTail(t *testing.T) {
	tb := layered()
	must(t)(tb.Register(t0, tail(1, 1, 101)))
	first := Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: Span{0, 2}, Src: []uint32{11}, Dst: []uint32{101}}
	expect(t, must(t)(group(tb, 0, 2, false)), first)
	expect(t, writeAll(t, tb, 1, first))
	second := Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: Span{2, 4}, Src: []uint32{11}, Dst: []uint32{101}}
	expect(t, must(t)(group(tb, 2, 4, true)), second)
	expect(t, writeAll(t, tb, 1, second), Delivered{Request: "r1", Attempt: 1, Decode: dec})
}

// A tail that ends before the source's last position, a part past the tail's end, and a
// negative first position are refused and change nothing.
func TestATailThatDoesNotCoverTheSourceIsRefused(t *testing.T) {
	tb := New(cfg)
	must(t)(tb.SourceReady(t0, Part{Request: "r1", Blocks: []uint32{10, 11, 12, 13}, Final: true}))
	if _, err := tb.Register(t0, tail(1, 2, 100)); !errors.Is(err, ErrBadBlocks) {
		t.Fatalf("a tail of positions 2..2 for 4 source positions: %v, want ErrBadBlocks", err)
	}
	if _, err := tb.Register(t0, tail(1, -1, 100, 101, 102, 103, 104)); !errors.Is(err, ErrBadBlocks) {
		t.Fatalf("first position -1: %v, want ErrBadBlocks", err)
	}
	want := Transfer{Request: "r1", Attempt: 1, Decode: dec, Regions: whole, Src: []uint32{12, 13}, Dst: []uint32{100, 101}}
	expect(t, must(t)(tb.Register(t0, tail(1, 2, 100, 101))), want)

	early := New(cfg)
	must(t)(early.Register(t0, tail(1, 2, 100, 101)))
	if _, err := early.SourceReady(t0, Part{Request: "r1", Offset: 3, Blocks: []uint32{13, 14}}); !errors.Is(err, ErrBadBlocks) {
		t.Fatalf("a part of positions 3..4 for a tail ending at 3: %v, want ErrBadBlocks", err)
	}
}
