package simengine

import (
	"math"
	"testing"
	"time"
)

func TestPrefillFollowsTheMeasuredCurve(t *testing.T) {
	for tokens, want := range map[int]time.Duration{
		2048: 180 * time.Millisecond, 4096: 389 * time.Millisecond,
		8192: 892 * time.Millisecond, 16384: 2027 * time.Millisecond,
		1024: 90 * time.Millisecond, 6144: 640500 * time.Microsecond,
	} {
		if got := (Prefill{TP: 1}).Time(tokens); got != want {
			t.Errorf("%d tokens at TP1: %v, want %v", tokens, got, want)
		}
	}
	// TP8 at 16k: compute ÷ 8 plus the all-reduce (DESIGN §2: 250–300 ms of it).
	if got, want := (Prefill{TP: 8}).Time(16384), 2027*time.Millisecond/8+275*time.Millisecond; got != want {
		t.Errorf("16k tokens at TP8: %v, want %v", got, want)
	}
	if got := (Prefill{TP: 8, Speedup: 2}).Time(16384); got != ((Prefill{TP: 8}).Time(16384))/2 {
		t.Errorf("a 2× speedup gives %v", got)
	}
	if (Prefill{TP: 1}).Time(32768) <= 2*(Prefill{TP: 1}).Time(16384)-time.Second {
		t.Error("past the curve, time must keep growing at least along the last segment")
	}
}

func TestSpeedupForPutsPrefillAtTheAskedUtilisation(t *testing.T) {
	// The default benchmark scenario: one TP8 prefill engine, 8 QPS of 16k-token prompts.
	s := SpeedupFor(8, 1, 8, 16384, 0.65)
	busy := (Prefill{TP: 8, Speedup: s}).Time(16384).Seconds() * 8
	if math.Abs(busy-0.65) > 0.001 {
		t.Errorf("speedup %.2f leaves the engine %.3f busy, want 0.65", s, busy)
	}
	if s < 6.4 || s > 6.6 {
		t.Errorf("speedup %.2f, want about 6.5 (528 ms × 8 QPS / 0.65)", s)
	}
}
