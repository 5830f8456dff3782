package load

import (
	"testing"
	"time"
)

var t0 = time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)

func TestRecorderIntegratesLegsInFlight(t *testing.T) {
	r := NewRecorder()
	a := r.Leg(false, "p0", t0)
	b := r.Leg(false, "p0", t0.Add(time.Second))
	a(t0.Add(2*time.Second), 1000)
	b(t0.Add(3*time.Second), 500)
	r.Leg(true, "d0", t0.Add(3*time.Second)) // still in flight at the report
	rep := r.Report(t0.Add(5 * time.Second))
	p := rep.Prefill["p0"]
	if p.Tokens != 1500 || p.Busy != 3 || p.InFlight != 4 {
		t.Fatalf("prefill p0 %+v; want 1500 tokens, 3 s busy, 4 leg-seconds", p)
	}
	if d := rep.Decode["d0"]; d.Busy != 2 || d.InFlight != 2 {
		t.Fatalf("decode d0 %+v; want the open leg counted up to the report: 2 s", d)
	}
}

func TestHistogramQuantile(t *testing.T) {
	var h Histogram
	for i := 1; i <= 100; i++ {
		h.Observe(time.Duration(i)*10*time.Millisecond, 1)
	}
	// 10 ms … 1 s evenly: p90 is 900 ms, within a √2 bucket's interpolation.
	if q := h.Quantile(0.9); q < 800*time.Millisecond || q > time.Second {
		t.Fatalf("p90 %s; want about 900ms", q)
	}
	if q := (Histogram{}).Quantile(0.9); q != 0 {
		t.Fatalf("empty p90 %s", q)
	}
}
