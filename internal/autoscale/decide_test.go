package autoscale

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)

func targets() Targets {
	return Targets{TTFT: time.Second, ITL: 50 * time.Millisecond, TTFTPercentile: 0.9, ITLPercentile: 0.9,
		Prefill: Range{1, 8}, Decode: Range{1, 8}, Budget: 10, PrefillPerEngine: 1, DecodePerEngine: 1, Stabilization: time.Minute}
}

// prompts is a window of rate prompt tokens/s in prompts of 1000 tokens, prefilled at
// 10,000 tokens/s per engine, over 30 s.
func prompts(rate float64) Window {
	return Window{Span: 30 * time.Second, Complete: true, PromptTokens: rate * 30, Requests: rate * 30 / 1000,
		PrefillTokens: 100_000, PrefillBusy: 10}
}

// learnedITL is a decode engine whose gap is 10 ms + 5 ms per stream.
var learnedITL = []ITLPoint{{2, 20 * time.Millisecond}, {4, 30 * time.Millisecond}, {6, 40 * time.Millisecond}}

func TestDecide(t *testing.T) {
	old := []Recommendation{{At: t0.Add(-2 * time.Minute), Sizes: Sizes{4, 4}}}
	cases := []struct {
		name   string
		in     Input
		want   Sizes
		reason string
		says   string
	}{
		{
			name:   "idle load scales both roles to their minimums (Dynamo: never scaled down)",
			in:     Input{Current: Sizes{4, 4}, Window: Window{Span: 30 * time.Second, Complete: true}, State: State{History: old}},
			want:   Sizes{1, 1},
			reason: ScaledDown,
		},
		{
			name: "idle load waits out the stabilization window",
			in: Input{Current: Sizes{4, 4}, Window: Window{Span: 30 * time.Second, Complete: true},
				State: State{History: []Recommendation{{At: t0.Add(-30 * time.Second), Sizes: Sizes{4, 3}}}}},
			want: Sizes{4, 3}, reason: ScaledDown, says: "waits out the 1m0s stabilization window",
		},
		{
			name: "a manager without history waits a whole window before scaling down",
			in:   Input{Current: Sizes{4, 4}, Window: Window{Span: 30 * time.Second, Complete: true}},
			want: Sizes{4, 4}, reason: WithinTargets,
		},
		{
			name:   "a metrics outage holds (Dynamo: scaled to zero on missing metrics)",
			in:     Input{Current: Sizes{3, 5}, State: State{History: old}},
			want:   Sizes{3, 5},
			reason: MetricsUnavailable, says: "no router reported",
		},
		{
			name:   "a router missing from the window holds: its requests would look like a drop",
			in:     Input{Current: Sizes{3, 5}, Window: Window{Span: 30 * time.Second, Complete: false}, State: State{History: old}},
			want:   Sizes{3, 5},
			reason: MetricsUnavailable, says: "missing",
		},
		{
			// A 1000-token prompt takes 0.1 s; p90 of M/M/1 at ρ is 0.1·ln 10/(1−ρ) ≤ 1 s
			// allows ρ = 0.77; 20,000 tokens/s at 10,000 × 0.77 per engine needs 2.6 → 3.
			name: "prompt tokens size prefill against the measured rate and the TTFT target",
			in:   Input{Current: Sizes{1, 1}, Window: prompts(20_000)},
			want: Sizes{3, 1}, reason: ScaledUp, says: "20000 prompt tokens/s at 10000 tokens/s per prefill engine, planned at 77% busy",
		},
		{
			name: "prefill without a measured rate holds, then learns it",
			in:   Input{Current: Sizes{2, 1}, Window: Window{Span: 30 * time.Second, Complete: true, PromptTokens: 600_000, Requests: 600}},
			want: Sizes{2, 1}, reason: WithinTargets, says: "no prefill rate measured yet",
		},
		{
			// (50 − 10) ms / 5 ms per stream × 0.9 headroom = 7.2 streams per engine; 30 → 5.
			name: "decode streams size decode against the fitted token gap",
			in: Input{Current: Sizes{1, 2}, Window: Window{Span: 30 * time.Second, Complete: true, DecodeInFlight: 30},
				State: State{ITL: learnedITL}},
			want: Sizes{1, 5}, reason: ScaledUp, says: "allows 7.2 per engine",
		},
		{
			name: "a measured TTFT over the target adds an engine where the model says enough",
			in: Input{Current: Sizes{3, 1}, Window: func() Window {
				w := prompts(20_000)
				w.TTFT, w.TTFTSamples = 3*time.Second, 100
				return w
			}()},
			// Measured 3 s where the model says 0.69 s at 3 engines: the correction
			// (halfway to 4.3×, kept within 4) plans engines at 38% busy instead of 77%.
			want: Sizes{6, 1}, reason: ScaledUp, says: "planned at 38% busy",
		},
		{
			name: "cold-start samples: a few slow requests do not count as a measurement (Dynamo: inflated by cold starts)",
			in: Input{Current: Sizes{3, 1}, Window: func() Window {
				w := prompts(20_000)
				w.TTFT, w.TTFTSamples = 30*time.Second, 5
				return w
			}()},
			want: Sizes{3, 1}, reason: WithinTargets,
		},
		{
			name: "a measured TTFT over the target adds an engine where even the corrected model says enough",
			in: Input{Current: Sizes{3, 1}, Window: func() Window {
				w := prompts(20_000)
				w.TTFT, w.TTFTSamples = 1100*time.Millisecond, 100
				return w
			}(), State: State{TTFTCorrection: 0.5}},
			want: Sizes{4, 1}, reason: ScaledUp, says: "TTFT p90 1.1s over the target 1s",
		},
		{
			name:   "needs beyond maxReplicas stop at them",
			in:     Input{Current: Sizes{1, 1}, Window: prompts(200_000)},
			want:   Sizes{8, 1},
			reason: AtMaxReplicas, says: "maxReplicas are 8 and 8",
		},
		{
			name: "the budget caps the pair, each role keeping its share of its need",
			in: Input{Current: Sizes{1, 1}, Window: func() Window {
				w := prompts(60_000)  // 8 prefill engines
				w.DecodeInFlight = 43 // 6 decode engines
				return w
			}(), State: State{ITL: learnedITL}},
			want: Sizes{6, 4}, reason: BudgetExhausted, says: "the budget is 10",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.in.Now, c.in.Targets = t0, targets()
			d := Decide(c.in)
			if d.Desired != c.want || d.Reason != c.reason || !strings.Contains(d.Message, c.says) {
				t.Fatalf("got %+v %s %q; want %+v %s containing %q", d.Desired, d.Reason, d.Message, c.want, c.reason, c.says)
			}
			tg := targets()
			if cost := d.Desired.Prefill*tg.PrefillPerEngine + d.Desired.Decode*tg.DecodePerEngine; cost > tg.Budget {
				t.Fatalf("%+v costs %d accelerators, over the budget %d", d.Desired, cost, tg.Budget)
			}
		})
	}
}

// Noisy load around a steady level settles once and then holds: scale-ups follow the
// peaks, and the stabilization window keeps the troughs from taking engines away.
func TestNoisyLoadDoesNotFlap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	cur, st := Sizes{1, 1}, State{ITL: learnedITL}
	changes := 0
	for i := range 200 {
		// ±15% from window to window, around a load that sits near a size boundary
		// (22,000 tokens/s needs 2.86 prefill engines; 20 streams 2.8 decode engines).
		noise := 0.85 + 0.3*rng.Float64()
		w := prompts(22_000 * noise)
		w.DecodeInFlight = 20 * noise
		d := Decide(Input{Now: t0.Add(time.Duration(i) * 15 * time.Second), Targets: targets(), Current: cur, Window: w, State: st})
		if d.Desired != cur {
			changes++
			if i > 10 {
				t.Fatalf("decision %d changed %+v to %+v: %s", i, cur, d.Desired, d.Message)
			}
		}
		cur, st = d.Desired, d.State
	}
	if changes == 0 || changes > 2 {
		t.Fatalf("%d size changes; want the first scale-up(s) only", changes)
	}
}

// A load that rises and falls is followed both ways, the fall after the stabilization window.
func TestFollowsLoadUpAndDown(t *testing.T) {
	cur, st := Sizes{1, 1}, State{ITL: learnedITL}
	at := t0
	run := func(rate float64, streams float64, n int) {
		for range n {
			w := prompts(rate)
			w.DecodeInFlight = streams
			d := Decide(Input{Now: at, Targets: targets(), Current: cur, Window: w, State: st})
			cur, st = d.Desired, d.State
			at = at.Add(15 * time.Second)
		}
	}
	run(20_000, 30, 4)
	if cur != (Sizes{3, 5}) {
		t.Fatalf("high load: %+v, want {3 5}", cur)
	}
	run(5_000, 5, 3) // 45 s: within the 60 s window
	if cur != (Sizes{3, 5}) {
		t.Fatalf("30 s into low load: %+v, want {3 5} still", cur)
	}
	run(5_000, 5, 4)
	if cur != (Sizes{1, 1}) {
		t.Fatalf("after the stabilization window: %+v, want {1 1}", cur)
	}
}
