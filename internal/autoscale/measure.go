package autoscale

import (
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/load"
)

// Series is one router's load reports over time, as the manager polled them.
type Series struct {
	samples []sample
}

type sample struct {
	at time.Time
	r  load.Report
}

// Add keeps r, read at at, and forgets what a window of span back from at no longer
// needs. A report of a new Boot starts
// the series over: the old process's counts are not comparable.
func (s *Series) Add(at time.Time, r load.Report, span time.Duration) {
	if n := len(s.samples); n > 0 && s.samples[n-1].r.Boot != r.Boot {
		s.samples = nil
	}
	s.samples = append(s.samples, sample{at, r})
	drop := 0
	for drop+1 < len(s.samples) && !s.samples[drop+1].at.After(at.Add(-span)) {
		drop++
	}
	s.samples = s.samples[drop:]
}

// Growth is how much the counts grew over the last span (from the newest sample at or
// before span ago, or the first, to the last), and over how long.
func (s *Series) Growth(span time.Duration) (load.Report, time.Duration) {
	if len(s.samples) < 2 {
		return load.Report{}, 0
	}
	last := s.samples[len(s.samples)-1]
	first := s.samples[0]
	for _, x := range s.samples[1:] {
		if x.at.After(last.at.Add(-span)) {
			break
		}
		first = x
	}
	return diff(last.r, first.r), last.at.Sub(first.at)
}

func diff(a, b load.Report) load.Report {
	out := load.Report{Boot: a.Boot, Requests: a.Requests - min(a.Requests, b.Requests), PromptTokens: a.PromptTokens - min(a.PromptTokens, b.PromptTokens),
		Prefill: diffEngines(a.Prefill, b.Prefill), Decode: diffEngines(a.Decode, b.Decode), TTFT: map[string]load.Histogram{}}
	for k, h := range a.TTFT {
		var d load.Histogram
		d.Add(h)
		d.Sub(b.TTFT[k])
		out.TTFT[k] = d
	}
	return out
}

func diffEngines(a, b map[string]load.Engine) map[string]load.Engine {
	out := make(map[string]load.Engine, len(a))
	for id, e := range a {
		o := b[id]
		d := load.Engine{Tokens: e.Tokens - min(e.Tokens, o.Tokens), Busy: max(e.Busy-o.Busy, 0), InFlight: max(e.InFlight-o.InFlight, 0)}
		d.ITL.Add(e.ITL)
		d.ITL.Sub(o.ITL)
		out[id] = d
	}
	return out
}

// Measure sums the routers' growth over a window into the autoscaler's input. Latency
// counts only where warm says every engine involved is past its warmup (a new engine's
// first requests pay for compilation and empty caches); load counts everywhere. complete
// is false when a router that should have reported is missing.
func Measure(growth []load.Report, span time.Duration, complete bool, warm func(engine string) bool, ttftQ, itlQ float64) Window {
	w := Window{Span: span, Complete: complete}
	if span <= 0 {
		return w
	}
	var ttft, itl load.Histogram
	active := map[string]bool{}
	for _, g := range growth {
		w.Requests += float64(g.Requests)
		w.PromptTokens += float64(g.PromptTokens)
		for id, e := range g.Prefill {
			if warm(id) {
				w.PrefillTokens += float64(e.Tokens)
				w.PrefillBusy += e.Busy
			}
		}
		for id, e := range g.Decode {
			w.DecodeInFlight += e.InFlight / span.Seconds()
			if e.InFlight > 0 {
				active[id] = true
			}
			if warm(id) {
				itl.Add(e.ITL)
			}
		}
		for k, h := range g.TTFT {
			p, d, _ := strings.Cut(k, " ")
			if (p == "" || warm(p)) && warm(d) {
				ttft.Add(h)
			}
		}
	}
	w.DecodeEngines = int32(len(active))
	w.TTFT, w.TTFTSamples = ttft.Quantile(ttftQ), int(ttft.Count())
	w.ITL, w.ITLSamples = itl.Quantile(itlQ), int(itl.Count())
	return w
}
