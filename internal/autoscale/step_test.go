package autoscale

import (
	"math/rand/v2"
	"testing"
)

func TestStepShrinksFirstAndGrowsIntoWhatWasFreed(t *testing.T) {
	tg := targets()
	tg.Budget = 4
	// From 3 prefill + 1 decode to 1 + 3: prefill shrinks at once, decode waits for its pods.
	next, waiting := Step(Sizes{1, 3}, Sizes{3, 1}, Sizes{3, 1}, tg)
	if next != (Sizes{1, 1}) || !waiting {
		t.Fatalf("first step %+v (waiting %v), want {1 1} waiting", next, waiting)
	}
	next, _ = Step(Sizes{1, 3}, next, Sizes{2, 1}, tg) // one prefill pod still terminating
	if next != (Sizes{1, 2}) {
		t.Fatalf("with 2 prefill pods left: %+v, want {1 2}", next)
	}
	next, waiting = Step(Sizes{1, 3}, next, Sizes{1, 2}, tg)
	if next != (Sizes{1, 3}) || waiting {
		t.Fatalf("with the prefill pods gone: %+v (waiting %v), want {1 3}", next, waiting)
	}
}

// Whatever the decisions and however slowly pods come and go, the accelerators that
// pods hold never exceed the budget (Dynamo: over budget mid-rebalance).
func TestStepNeverExceedsTheBudget(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	tg := targets()
	tg.Budget, tg.PrefillPerEngine, tg.DecodePerEngine = 16, 2, 4
	applied, pods := Sizes{2, 1}, Sizes{2, 1}
	for i := range 5000 {
		desired := Sizes{1 + rng.Int32N(6), 1 + rng.Int32N(3)}
		if f, _ := fitBudget(desired, desired, tg); f != desired {
			desired = f
		}
		applied, _ = Step(desired, applied, pods, tg)
		// Pods move towards applied one at a time, in either role, or not at all.
		for _, p := range []*int32{&pods.Prefill, &pods.Decode} {
			target := applied.Prefill
			if p == &pods.Decode {
				target = applied.Decode
			}
			if rng.IntN(2) == 0 {
				switch {
				case *p < target:
					*p++
				case *p > target:
					*p--
				}
			}
		}
		if cost := pods.Prefill*tg.PrefillPerEngine + pods.Decode*tg.DecodePerEngine; cost > tg.Budget {
			t.Fatalf("step %d: pods %+v hold %d accelerators, over the budget %d", i, pods, cost, tg.Budget)
		}
	}
}
