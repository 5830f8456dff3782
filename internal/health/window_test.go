package health

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestWindowCountsOnlyWhatGrewWithinIt(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "x_total", Help: "x"}, []string{"reason"})
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "y_seconds", Help: "y"}, []string{"stage"})
	reg.MustRegister(c, h)
	w := &Window{Gatherer: reg, Span: time.Minute}
	t0 := time.Unix(1000, 0)
	c.WithLabelValues("old").Add(5)
	observe := func(at time.Time) {
		if err := w.Observe(at); err != nil {
			t.Fatal(err)
		}
	}
	observe(t0)
	c.WithLabelValues("old").Add(2)
	c.WithLabelValues("new").Add(3) // appears within the window: counts from zero
	h.WithLabelValues("wire").Observe(1)
	observe(t0.Add(30 * time.Second))
	if got := w.Increase("x_total", nil); got != 5 {
		t.Errorf("increase of x_total: %v, want 5", got)
	}
	if got := w.Increase("x_total", func(l map[string]string) bool { return l["reason"] == "new" }); got != 3 {
		t.Errorf("increase of x_total{reason=new}: %v, want 3", got)
	}
	if got := w.Increase("y_seconds_count", nil); got != 1 {
		t.Errorf("increase of y_seconds_count: %v, want 1", got)
	}
	if got := w.Labels("x_total", "reason"); len(got) != 2 || got[0] != "new" || got[1] != "old" {
		t.Errorf("labels: %v", got)
	}
	// Two minutes on with nothing new: the window forgot the growth.
	observe(t0.Add(2 * time.Minute))
	observe(t0.Add(150 * time.Second))
	if got := w.Increase("x_total", nil); got != 0 {
		t.Errorf("increase after the window passed: %v, want 0", got)
	}
	if len(w.samples) > 3 {
		t.Errorf("the window keeps %d samples", len(w.samples))
	}
}

// A report is written when it changes, not when it stays the same, not more often than
// MinInterval, and again after a failed write.
func TestPublisherWritesOnlyChanges(t *testing.T) {
	var writes []string
	fail := false
	p := &Publisher{Log: slog.New(slog.DiscardHandler), Write: func(_ context.Context, v string) error {
		if fail {
			return errors.New("refused")
		}
		writes = append(writes, v)
		return nil
	}}
	ctx := context.Background()
	ok := Report{Provider: "efa", Engines: []string{"b", "a"}}
	if !p.Tick(ctx, ok) || p.Tick(ctx, ok) || p.Tick(ctx, Report{Provider: "efa", Engines: []string{"a", "b"}}) {
		t.Fatalf("writes %q", writes)
	}
	fail = true
	bad := Report{Provider: "efa", Problem: "TransferFailures"}
	if p.Tick(ctx, bad) {
		t.Fatal("a failed write counted as written")
	}
	fail = false
	if !p.Tick(ctx, bad) {
		t.Fatal("the report was not written again after a failed write")
	}
	if len(writes) != 2 || writes[0] != `{"provider":"efa","engines":["a","b"]}` {
		t.Errorf("writes %q", writes)
	}
	p.MinInterval = time.Hour
	if p.Tick(ctx, ok) {
		t.Error("written within MinInterval of the last write")
	}
	if r, ok := Parse(writes[1]); !ok || r.Problem != "TransferFailures" {
		t.Errorf("Parse(%q) = %+v, %v", writes[1], r, ok)
	}
	if _, ok := Parse("not json"); ok {
		t.Error("Parse accepted a value that is not a report")
	}
}
