package landing

import (
	"errors"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"
)

var (
	t0  = time.Unix(1_000_000, 0)
	cfg = Config{Lease: 30 * time.Second, RegistrationTimeout: 480 * time.Second, Tick: time.Second}
	k1  = Key{Request: "r1", Attempt: 1}
)

type peer struct{ name string }

var prefillAgent = &peer{"prefill-agent"}

func expect(t *testing.T, got []Action, want ...Action) {
	t.Helper()
	if len(got) == 0 && len(want) == 0 {
		return
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("actions\n got %#v\nwant %#v", got, want)
	}
}

func register(t *testing.T, tb *Table[*peer], k Key) uint32 {
	t.Helper()
	tok, err := tb.Register(t0, k, "prefill-0/0", prefillAgent, 4)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func TestADeliverySignalReportsDelivered(t *testing.T) {
	tb := New[*peer](cfg)
	tok := register(t, tb, k1)
	tb.Writing(k1, prefillAgent)
	tb.Writing(k1, prefillAgent) // said twice: still one destination being written
	if !tb.Hot() {
		t.Fatal("a destination being written is not hot")
	}
	expect(t, tb.Signal(SignalData(tok, false)), Report{Key: k1, Kind: Delivered, Blocks: 4})
	if tb.Hot() {
		t.Fatal("still hot after the delivery")
	}
	expect(t, tb.Signal(SignalData(tok, false))) // reported once
}

// A cancel is acknowledged only when both the prefill agent's answer and its fence
// signal (which follows every write it posted) have arrived, in either order.
func TestACancelIsAcknowledgedOnlyAfterTheFenceSignalInEitherOrder(t *testing.T) {
	for _, fenceFirst := range []bool{false, true} {
		tb := New[*peer](cfg)
		tok := register(t, tb, k1)
		acts, ok := tb.Cancel(t0, k1)
		expect(t, acts, SendCancel[*peer]{Key: k1, Peer: prefillAgent, Source: "prefill-0/0"})
		if !ok {
			t.Fatal("cancel: not outstanding")
		}
		acked := Report{Key: k1, Kind: CancelAcked}
		if fenceFirst {
			expect(t, tb.Signal(SignalData(tok, true)))
			expect(t, tb.Outcome(t0, k1, prefillAgent, true, "", true), acked)
		} else {
			expect(t, tb.Outcome(t0, k1, prefillAgent, true, "", true))
			expect(t, tb.Signal(SignalData(tok, true)), acked)
		}
		// A late delivery signal of the same token reports nothing more.
		expect(t, tb.Signal(SignalData(tok, false)))
	}
}

func TestAnOutcomeWithoutWritesNeedsNoFence(t *testing.T) {
	tb := New[*peer](cfg)
	register(t, tb, k1)
	expect(t, tb.Outcome(t0, k1, prefillAgent, false, "lease expired", false), Report{Key: k1, Kind: Failed, Code: "prefill_failed", Reason: "lease expired"})
}

func TestOutcomesFromAnotherConnectionAreIgnored(t *testing.T) {
	tb := New[*peer](cfg)
	register(t, tb, k1)
	expect(t, tb.Outcome(t0, k1, &peer{"impostor"}, true, "", false))
	if tb.Idle() {
		t.Fatal("the registration was dropped by a stranger's message")
	}
}

// A lost prefill agent may still have writes on their way: its destinations fail only
// after the quarantine, never at once.
func TestALostPrefillAgentsDestinationsFailAfterTheQuarantine(t *testing.T) {
	tb := New[*peer](cfg)
	register(t, tb, k1)
	expect(t, tb.PeerLost(t0, prefillAgent, true, "gone"))
	q := QuarantineFor(cfg.Lease, cfg.Tick)
	expect(t, tb.Expire(t0.Add(q-time.Millisecond)))
	acts := tb.Expire(t0.Add(q))
	if r, ok := acts[0].(Report); len(acts) != 1 || !ok || r.Kind != Failed || r.Code != "peer_lost" {
		t.Fatalf("after the quarantine: %#v", acts)
	}
}

// A connection that never got through its handshake carried no registration: the prefill
// agent knows nothing of the blocks, so waiting out a quarantine would only delay the
// engine.
func TestAnUnreachablePrefillAgentsDestinationsFailAtOnce(t *testing.T) {
	tb := New[*peer](cfg)
	register(t, tb, k1)
	acts := tb.PeerLost(t0, prefillAgent, false, "connection refused")
	if r, ok := acts[0].(Report); len(acts) != 1 || !ok || r.Kind != Failed || r.Code != "peer_unreachable" {
		t.Fatalf("an unreachable agent: %#v", acts)
	}
	if !tb.Idle() {
		t.Fatal("the destination is still outstanding")
	}
}

func TestADestinationThatHearsNothingFailsAfterTheTimeoutAndAQuarantine(t *testing.T) {
	tb := New[*peer](cfg)
	register(t, tb, k1)
	end := t0.Add(cfg.RegistrationTimeout + QuarantineFor(cfg.Lease, cfg.Tick))
	expect(t, tb.Expire(end.Add(-time.Millisecond)))
	if acts := tb.Expire(end); len(acts) != 1 || acts[0].(Report).Code != "no_outcome" {
		t.Fatalf("at the deadline: %#v", acts)
	}
}

func TestRegistrationsOfAnOlderOrTheSameAttemptAreRefused(t *testing.T) {
	tb := New[*peer](cfg)
	register(t, tb, Key{"r1", 2})
	if _, err := tb.Register(t0, Key{"r1", 2}, "p", prefillAgent, 1); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("the same attempt: %v", err)
	}
	if _, err := tb.Register(t0, Key{"r1", 1}, "p", prefillAgent, 1); !errors.Is(err, ErrStale) {
		t.Fatalf("an older attempt: %v", err)
	}
}

func TestAPullIsTrustedOnlyWhenItsReadsFinishWithinTheLease(t *testing.T) {
	for _, late := range []bool{false, true} {
		tb := New[*peer](cfg)
		if err := tb.Pull(t0, k1, "prefill-0/0", prefillAgent, []uint32{1}, []uint32{2}); err != nil {
			t.Fatal(err)
		}
		g, _ := tb.Granted(t0.Add(time.Second), k1, prefillAgent, 10*time.Second)
		if g == nil || g.Wait != time.Second {
			t.Fatalf("grant: %#v", g)
		}
		tb.Planned(k1, 1, 4096)
		tb.Posted(k1)
		done := t0.Add(10 * time.Second) // the lease counts from the pull, not the grant
		if late {
			done = done.Add(time.Millisecond)
		}
		acts := tb.ReadDone(done, k1, nil)
		rel, rep := acts[0].(SendRelease[*peer]), acts[1].(Report)
		if late != rel.Failed || late != (rep.Kind == Failed) {
			t.Fatalf("late %v: %#v", late, acts)
		}
	}
}

// A cancelled pull drops its queued reads and is acknowledged only once the reads in
// flight completed.
func TestACancelledPullIsAcknowledgedAfterItsReadsInFlight(t *testing.T) {
	tb := New[*peer](cfg)
	if err := tb.Pull(t0, k1, "prefill-0/0", prefillAgent, []uint32{1, 2, 3}, []uint32{4, 5, 6}); err != nil {
		t.Fatal(err)
	}
	tb.Granted(t0, k1, prefillAgent, 10*time.Second)
	tb.Planned(k1, 3, 3*4096)
	tb.Posted(k1)
	acts, _ := tb.Cancel(t0, k1)
	expect(t, acts, DropReads{k1})
	expect(t, tb.Dropped(t0, k1, 2))
	expect(t, tb.ReadDone(t0, k1, nil),
		SendRelease[*peer]{Key: k1, Peer: prefillAgent, Source: "prefill-0/0", Failed: true},
		Report{Key: k1, Kind: CancelAcked, Pull: true})
}

// TestInvariantsUnderRandomInterleavings drives push destinations and pulls with random
// events and checks, against a model of what the prefill side has posted:
//   - an attempt is reported at most once;
//   - a push attempt whose prefill agent posted writes is reported CANCEL_ACKED or FAILED
//     only after its fence signal, or after the quarantine once the agent was lost;
//   - a pull is reported only with no read in flight, and DELIVERED only if its reads
//     finished within its lease.
func TestInvariantsUnderRandomInterleavings(t *testing.T) {
	const pullLease = 5 * time.Second
	total := 0
	for seed := range uint64(500) {
		rng := rand.New(rand.NewPCG(seed, 11))
		tb := New[*peer](cfg)
		now := t0
		tokens := map[Key]uint32{}
		wrote := map[Key]bool{}  // the prefill agent posted writes: a fence signal follows any outcome
		fenced := map[Key]bool{} // the fence signal arrived
		lostAt := map[Key]time.Time{}
		reported := map[Key]bool{}
		inFlight := map[Key]int{}
		queued := map[Key]int{}
		leaseEnd := map[Key]time.Time{}
		readsDoneAt := map[Key]time.Time{}
		var keys []Key
		delivered := 0
		next := uint64(0)
		var check func(acts []Action)
		check = func(acts []Action) {
			for _, a := range acts {
				switch a := a.(type) {
				case DropReads:
					n := queued[a.Key]
					queued[a.Key] = 0
					check(tb.Dropped(now, a.Key, n))
				case Report:
					if reported[a.Key] {
						t.Fatalf("seed %d: %v reported twice", seed, a.Key)
					}
					reported[a.Key] = true
					if a.Pull {
						if inFlight[a.Key] != 0 {
							t.Fatalf("seed %d: pull %v reported with %d reads in flight", seed, a.Key, inFlight[a.Key])
						}
						if a.Kind == Delivered {
							delivered++
						}
						if a.Kind == Delivered && readsDoneAt[a.Key].After(leaseEnd[a.Key]) {
							t.Fatalf("seed %d: pull %v delivered with reads after its lease", seed, a.Key)
						}
						continue
					}
					quarantined := !lostAt[a.Key].IsZero() && !now.Before(lostAt[a.Key].Add(QuarantineFor(cfg.Lease, cfg.Tick)))
					if a.Kind != Delivered && wrote[a.Key] && !fenced[a.Key] && !quarantined && a.Code != "no_outcome" {
						t.Fatalf("seed %d: push %v reported %v before its fence signal", seed, a.Key, a.Kind)
					}
				}
			}
		}
		for step := 0; step < 120; step++ {
			switch rng.IntN(11) {
			case 0: // a new push registration or pull
				next++
				k := Key{Request: "r", Attempt: next}
				keys = append(keys, k)
				if rng.IntN(2) == 0 {
					tok, err := tb.Register(now, k, "p", prefillAgent, 2)
					if err != nil {
						t.Fatal(err)
					}
					tokens[k] = tok
				} else if err := tb.Pull(now, k, "p", prefillAgent, []uint32{1, 2}, []uint32{3, 4}); err != nil {
					t.Fatal(err)
				} else {
					leaseEnd[k] = now.Add(pullLease)
				}
			case 1: // the prefill side acts on a push: writes, then a delivery or an outcome
				if len(keys) == 0 {
					continue
				}
				k := keys[rng.IntN(len(keys))]
				tok, push := tokens[k]
				if !push {
					continue
				}
				switch rng.IntN(4) {
				case 0:
					wrote[k] = true
				case 1:
					check(tb.Signal(SignalData(tok, false)))
				case 2:
					check(tb.Outcome(now, k, prefillAgent, rng.IntN(2) == 0, "x", wrote[k]))
				case 3:
					if wrote[k] {
						fenced[k] = true
						check(tb.Signal(SignalData(tok, true)))
					}
				}
			case 2: // the prefill agent grants a pull, and its reads get planned
				if len(keys) == 0 {
					continue
				}
				k := keys[rng.IntN(len(keys))]
				if _, push := tokens[k]; push {
					continue
				}
				g, acts := tb.Granted(now, k, prefillAgent, pullLease)
				check(acts)
				if g != nil {
					tb.Planned(k, 3, 3)
					queued[k] = 3
				}
			case 3, 9, 10: // reads are posted and complete
				for k, n := range queued {
					if n > 0 && rng.IntN(2) == 0 {
						queued[k]--
						inFlight[k]++
						tb.Posted(k)
					}
				}
				for k, n := range inFlight {
					if n > 0 && rng.IntN(2) == 0 {
						inFlight[k]--
						readsDoneAt[k] = now
						check(tb.ReadDone(now, k, nil))
					}
				}
			case 4: // the engine cancels
				if len(keys) > 0 {
					acts, _ := tb.Cancel(now, keys[rng.IntN(len(keys))])
					check(acts)
				}
			case 5: // the prefill agent's connection is lost
				for _, k := range keys {
					if lostAt[k].IsZero() {
						lostAt[k] = now
					}
				}
				check(tb.PeerLost(now, prefillAgent, true, "lost"))
			case 6: // time passes (reads may complete before the watchdog runs)
				now = now.Add(time.Duration(rng.IntN(4000)) * time.Millisecond)
			case 7: // the watchdog
				check(tb.Expire(now))
			case 8: // a read fails
				for k, n := range inFlight {
					if n > 0 {
						inFlight[k]--
						check(tb.ReadDone(now, k, errors.New("remote access error")))
						break
					}
				}
			}
		}
		total += delivered
	}
	if total == 0 {
		t.Fatal("no pull was ever delivered: the interleavings do not reach the lease rule")
	}
}

// Word that a delivery signal was posted, and no signal: after the grace the prefill
// agent is asked again, and again a grace later, until the signal comes (once). Another
// peer's word counts for nothing.
func TestAPostedSignalThatDoesNotArriveIsAskedForAgain(t *testing.T) {
	tb := New[*peer](cfg)
	tok := register(t, tb, k1)
	tb.Signalled(t0, k1, &peer{"someone-else"})
	expect(t, tb.Expire(t0.Add(time.Second)))
	tb.Signalled(t0, k1, prefillAgent)
	expect(t, tb.Expire(t0.Add(ResignalGrace/2)))
	ask := SendResignal[*peer]{Key: k1, Peer: prefillAgent, Source: "prefill-0/0"}
	expect(t, tb.Expire(t0.Add(ResignalGrace)), ask)
	expect(t, tb.Expire(t0.Add(ResignalGrace*3/2)))
	expect(t, tb.Expire(t0.Add(2*ResignalGrace)), ask)
	expect(t, tb.Signal(SignalData(tok, false)), Report{Key: k1, Kind: Delivered, Blocks: 4})
	expect(t, tb.Expire(t0.Add(3*ResignalGrace)))
}
