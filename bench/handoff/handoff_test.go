package handoff

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/bench/workload"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
)

var agentBin string

func TestMain(m *testing.M) { os.Exit(agentproc.RunTests(m, &agentBin)) }

// An overloaded benchmark must finish and account for every request, in every mode
// (push, push-layered in four groups, pull). 50 QPS into caches
// of two requests, with timeouts shorter than a request takes, make push registrations
// and sources expire and pull holds run out; every failed request's blocks must come
// back (after the agent's answer), or the requests behind it wait for blocks forever — as
// the benchmark did before, hanging with 163 goroutines parked in AllocateWait.
func TestAnOverloadedRunFinishesAndReturnsEveryBlock(t *testing.T) {
	var log strings.Builder
	sc := Scenario{
		Load: workload.Load{Provider: "tcp;ofi_rxm", QPS: 50, PromptTokens: 2048, TP: 2, Duration: time.Second,
			Utilisation: 0.65, CacheRequests: 2, Seed: 3},
		LoadFraction: 0.5, LayerGroups: 4,
		// A registration timeout near one prefill's time and a hold TTL shorter than a
		// pull's round trip: many requests must fail, on both sides and in both modes.
		Lease: 20 * time.Millisecond, RegistrationTimeout: 20 * time.Millisecond, BlocksTTL: 5 * time.Millisecond,
		Env: workload.Env{AgentBin: agentBin, WorkDir: t.TempDir(), Log: &log},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	rep, err := Run(ctx, sc)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	for _, r := range rep.Results {
		if r.Arrivals == 0 || r.VerifiedRequests+r.FailedRequests != r.Arrivals {
			t.Errorf("%s: %d arrivals, %d verified, %d failed: requests went missing", r.Mode, r.Arrivals, r.VerifiedRequests, r.FailedRequests)
		}
		if r.UnreturnedBlocks != 0 {
			t.Errorf("%s: %d blocks never came back to the engines' pools", r.Mode, r.UnreturnedBlocks)
		}
		if r.FailedRequests == 0 {
			t.Errorf("%s: nothing failed: the scenario did not overload the agents, so it tests nothing\n%s", r.Mode, log.String())
		}
	}
	if g := rep.RailsGain; g != nil && len(g.FailedRequests) > 0 {
		t.Logf("the rails measurement left out requests the agents reported failed: %v", g.FailedRequests)
	}
	if rep.LeakedRanks != 0 {
		t.Errorf("%d ranks' blocks were held back: an agent never answered", rep.LeakedRanks)
	}
}

func TestAHandoffOverlapsOnlyAnotherThatSharesAnInstant(t *testing.T) {
	at := func(ms int) time.Time { return time.Unix(0, 0).Add(time.Duration(ms) * time.Millisecond) }
	spans := [][2]time.Time{{at(0), at(10)}, {at(5), at(15)}, {at(15), at(20)}, {at(30), at(40)}}
	for i, want := range []bool{true, true, false, false} {
		if got := overlaps(spans, i); got != want {
			t.Errorf("span %d overlaps another: %v, want %v", i, got, want)
		}
	}
}
