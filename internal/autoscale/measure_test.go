package autoscale

import (
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/load"
)

func TestSeriesGrowthAndRestart(t *testing.T) {
	var s Series
	s.Add(t0, load.Report{Boot: "a", Requests: 10, PromptTokens: 1000}, time.Minute)
	s.Add(t0.Add(30*time.Second), load.Report{Boot: "a", Requests: 40, PromptTokens: 4000}, time.Minute)
	s.Add(t0.Add(90*time.Second), load.Report{Boot: "a", Requests: 100, PromptTokens: 9000}, time.Minute)
	g, span := s.Growth(time.Minute)
	if g.Requests != 60 || g.PromptTokens != 5000 || span != time.Minute {
		t.Fatalf("growth %d requests, %d tokens over %s; want 60, 5000 over 1m (the sample a window back is the baseline)", g.Requests, g.PromptTokens, span)
	}
	s.Add(t0.Add(100*time.Second), load.Report{Boot: "b", Requests: 3}, time.Minute)
	if _, span := s.Growth(time.Minute); span != 0 {
		t.Fatalf("a restarted router's first report gives growth over %s; want none", span)
	}
	s.Add(t0.Add(110*time.Second), load.Report{Boot: "b", Requests: 8}, time.Minute)
	if g, _ := s.Growth(time.Minute); g.Requests != 5 {
		t.Fatalf("growth after a restart %d; want 5 (counted within the new process)", g.Requests)
	}
}

// A new engine's slow first requests are not counted as the pool's latency; its load is.
func TestMeasureIgnoresColdEngines(t *testing.T) {
	r := load.NewRecorder()
	for range 100 {
		r.Arrived(1000)
		r.TTFT("p0", "d0", 200*time.Millisecond)
		r.TTFT("p1", "d0", 30*time.Second) // p1 just started
		r.Gaps("d0", 20*time.Millisecond, 10)
		r.Gaps("d1", 2*time.Second, 10) // d1 just started
	}
	r.Leg(false, "p0", t0)(t0.Add(2*time.Second), 40_000)
	r.Leg(false, "p1", t0)(t0.Add(10*time.Second), 1_000)
	r.Leg(true, "d1", t0)
	g := diff(r.Report(t0.Add(10*time.Second)), load.Report{})
	warm := func(id string) bool { return id != "p1" && id != "d1" }
	w := Measure([]load.Report{g}, 10*time.Second, true, warm, 0.9, 0.9)
	if w.TTFT > 300*time.Millisecond || w.TTFTSamples != 100 {
		t.Fatalf("TTFT p90 %s over %d samples; want the warm pair's 200ms over 100", w.TTFT, w.TTFTSamples)
	}
	if w.ITL > 30*time.Millisecond || w.ITLSamples != 1000 {
		t.Fatalf("ITL p90 %s over %d; want the warm engine's 20ms over 1000", w.ITL, w.ITLSamples)
	}
	if w.PrefillTokens != 40_000 || w.PrefillBusy != 2 {
		t.Fatalf("prefill rate from %v tokens over %v s; want the warm engine's 40000 over 2", w.PrefillTokens, w.PrefillBusy)
	}
	if w.PromptTokens != 100_000 || w.DecodeInFlight != 1 || w.DecodeEngines != 1 {
		t.Fatalf("load %v tokens, %v streams on %d engines; want every engine's: 100000, 1 on 1", w.PromptTokens, w.DecodeInFlight, w.DecodeEngines)
	}
}
