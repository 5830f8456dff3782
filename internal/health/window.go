// Package health turns a component's own Prometheus counters into a small report of what
// is wrong with its KV transfers (Report, one type for agents and routers). An agent
// publishes its report as an annotation on its node only when it changes (Publisher); a
// router serves its report on GET /health/transfer, which the manager polls. The manager
// reads both into the pools' TransferHealthy condition, so the condition and the alerts
// are computed from the same series, and a component that sees nothing new writes
// nothing.
package health

import (
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Window keeps the counters of a Gatherer over the last Span, sampled by Observe, and
// answers how much each grew in that time.
type Window struct {
	Gatherer prometheus.Gatherer
	// Span is how far back Increase looks.
	Span    time.Duration
	samples []sample
}

type sample struct {
	at     time.Time
	series map[string]float64 // by seriesKey
}

// Observe samples every counter (and every histogram's count) now, and forgets samples
// no longer needed to look Span back from now.
func (w *Window) Observe(now time.Time) error {
	mfs, err := w.Gatherer.Gather()
	if err != nil {
		return err
	}
	s := sample{at: now, series: map[string]float64{}}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch {
			case m.GetCounter() != nil:
				s.series[seriesKey(mf.GetName(), m.GetLabel())] = m.GetCounter().GetValue()
			case m.GetHistogram() != nil:
				s.series[seriesKey(mf.GetName()+"_count", m.GetLabel())] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	w.samples = append(w.samples, s)
	// Keep the newest sample at or before now-Span: it is the window's baseline.
	start := now.Add(-w.Span)
	drop := 0
	for drop+1 < len(w.samples) && !w.samples[drop+1].at.After(start) {
		drop++
	}
	w.samples = w.samples[drop:]
	return nil
}

// Increase sums, over the series of the named counter whose labels match (nil matches
// all), how much each grew from the window's first sample to its last. A series that
// appeared within the window counts from zero, as Prometheus' increase() would once it
// has seen it; a counter that went down was reset and counts from zero too.
func (w *Window) Increase(name string, match func(labels map[string]string) bool) float64 {
	if len(w.samples) < 2 {
		return 0
	}
	first, last := w.samples[0].series, w.samples[len(w.samples)-1].series
	total := 0.0
	for key, v := range last {
		n, labels := parseKey(key)
		if n != name || (match != nil && !match(labels)) {
			continue
		}
		if before, ok := first[key]; ok && before <= v {
			v -= before
		}
		total += v
	}
	return total
}

// Labels returns the values of label among the series of the named counter that grew
// in the window, sorted: which reasons, which kinds.
func (w *Window) Labels(name, label string) []string {
	if len(w.samples) < 2 {
		return nil
	}
	first, last := w.samples[0].series, w.samples[len(w.samples)-1].series
	var out []string
	for key, v := range last {
		n, labels := parseKey(key)
		if n != name || v <= first[key] {
			continue
		}
		if value := labels[label]; !slices.Contains(out, value) {
			out = append(out, value)
		}
	}
	slices.Sort(out)
	return out
}

// seriesKey is name{k=v,...} with the labels in the order Gather sorts them.
func seriesKey(name string, labels []*dto.LabelPair) string {
	var b strings.Builder
	b.WriteString(name)
	for _, l := range labels {
		b.WriteString("\x00" + l.GetName() + "\x01" + l.GetValue())
	}
	return b.String()
}

func parseKey(key string) (string, map[string]string) {
	parts := strings.Split(key, "\x00")
	labels := make(map[string]string, len(parts)-1)
	for _, p := range parts[1:] {
		k, v, _ := strings.Cut(p, "\x01")
		labels[k] = v
	}
	return parts[0], labels
}
