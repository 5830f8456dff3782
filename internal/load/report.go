// Package load is what a router measures of the load it routes, for the manager's
// autoscaler: a Recorder in the router counts prompt tokens, legs in flight and
// latencies per engine since the router started, and serves them as a Report (GET /load
// on the admin port), whose format this package is. The manager's side, the reports
// over a window, is package autoscale's (Series, Measure). Counts only grow, so a missed
// poll loses nothing and a restarted router (a new Boot) is told apart.
package load

import (
	"fmt"
	"math"
	"sort"
	"strings"
	"time"
)

// Report is a router's counts since it started.
type Report struct {
	// Boot names the router process: counts restart from zero under a new one.
	Boot string `json:"boot"`
	// Requests and PromptTokens are the requests that arrived, and their prompts' tokens.
	Requests     uint64 `json:"requests"`
	PromptTokens uint64 `json:"promptTokens"`
	// Prefill and Decode are per engine id.
	Prefill map[string]Engine `json:"prefill,omitempty"`
	Decode  map[string]Engine `json:"decode,omitempty"`
	// TTFT is the time to first byte of served requests, by PairKey of their engines.
	TTFT map[string]Histogram `json:"ttft,omitempty"`
}

// MaxReportBytes bounds a report the manager reads: a router reports per engine and per
// pair of engines, about 330 bytes each, so this holds pools of about 50 × 50 engines.
const MaxReportBytes = 1 << 20

// Restrict checks that r is shaped as a router's report and keeps of it only the engines
// of prefill and decode (by engine id) and their pairs: what a router of the pools can
// report. Anyone who can run a pod that the manager polls (a pool author chooses the
// router image) could otherwise make the manager hold a key per name it makes up. An
// engine gone from the pools is dropped with the rest; it returns how many keys it
// dropped.
func (r *Report) Restrict(prefill, decode map[string]bool) (dropped int, err error) {
	if r.Boot == "" || len(r.Boot) > 64 {
		return 0, fmt.Errorf("boot %.64q: 1 to 64 characters", r.Boot)
	}
	engines := func(m map[string]Engine, known map[string]bool) error {
		for id, e := range m {
			if !known[id] {
				delete(m, id)
				dropped++
				continue
			}
			if !finite(e.Busy) || !finite(e.InFlight) {
				return fmt.Errorf("engine %s: busy %v, inFlight %v: must be finite and not negative", id, e.Busy, e.InFlight)
			}
			if err := e.ITL.valid(); err != nil {
				return fmt.Errorf("engine %s itl: %w", id, err)
			}
		}
		return nil
	}
	if err := engines(r.Prefill, prefill); err != nil {
		return dropped, err
	}
	if err := engines(r.Decode, decode); err != nil {
		return dropped, err
	}
	for k, h := range r.TTFT {
		p, d, ok := strings.Cut(k, " ")
		if !ok || (p != "" && !prefill[p]) || !decode[d] {
			delete(r.TTFT, k)
			dropped++
			continue
		}
		if err := h.valid(); err != nil {
			return dropped, fmt.Errorf("ttft %q: %w", k, err)
		}
	}
	return dropped, nil
}

func finite(f float64) bool { return !math.IsNaN(f) && !math.IsInf(f, 0) && f >= 0 }

// valid: no counts, or one per bucket and one above the last.
func (h Histogram) valid() error {
	if len(h) != 0 && len(h) != len(Buckets)+1 {
		return fmt.Errorf("%d counts, want %d", len(h), len(Buckets)+1)
	}
	return nil
}

// Engine is one engine's legs as one router saw them.
type Engine struct {
	// Tokens are the prompt tokens of the prefill legs that completed.
	Tokens uint64 `json:"tokens,omitempty"`
	// Busy is the seconds the engine had at least one leg in flight.
	Busy float64 `json:"busy,omitempty"`
	// InFlight is the leg-seconds in flight (its mean over a window is the mean
	// concurrency). A decode leg counts from its first token to its last.
	InFlight float64 `json:"inFlight,omitempty"`
	// ITL are the gaps between a decode engine's streamed tokens.
	ITL Histogram `json:"itl,omitempty"`
}

// PairKey names the engines a request was served by ("" prefill: decode alone).
func PairKey(prefill, decode string) string { return prefill + " " + decode }

// Histogram counts latencies in Buckets; the last count is above the last bound.
type Histogram []uint64

// Buckets are the histograms' upper bounds: 250 µs × √2ᵏ, up to about 4 minutes.
var Buckets = func() []float64 {
	b := make([]float64, 41)
	for k := range b {
		b[k] = 250e-6 * math.Pow(math.Sqrt2, float64(k))
	}
	return b
}()

// Observe counts one latency.
func (h *Histogram) Observe(d time.Duration, n uint64) {
	if len(*h) == 0 {
		*h = make(Histogram, len(Buckets)+1)
	}
	(*h)[sort.SearchFloat64s(Buckets, d.Seconds())] += n // the first bound ≥ d
}

// Count is how many latencies were observed.
func (h Histogram) Count() uint64 {
	var n uint64
	for _, c := range h {
		n += c
	}
	return n
}

// Add adds o's counts into h.
func (h *Histogram) Add(o Histogram) { h.add(o, 1) }

// Sub takes o's counts off h, never below zero.
func (h *Histogram) Sub(o Histogram) { h.add(o, -1) }

func (h *Histogram) add(o Histogram, sign int) {
	if len(o) == 0 {
		return
	}
	if len(*h) == 0 {
		*h = make(Histogram, len(Buckets)+1)
	}
	for i := range min(len(*h), len(o)) {
		if sign < 0 {
			(*h)[i] -= min((*h)[i], o[i])
		} else {
			(*h)[i] += o[i]
		}
	}
}

// Quantile is the latency below which a fraction q of the observations fall,
// interpolated within its bucket as Prometheus' histogram_quantile does; 0 when empty.
func (h Histogram) Quantile(q float64) time.Duration {
	total := h.Count()
	if total == 0 {
		return 0
	}
	rank := q * float64(total)
	var seen float64
	for i, c := range h {
		if c == 0 || seen+float64(c) < rank {
			seen += float64(c)
			continue
		}
		lo := 0.0
		if i > 0 {
			lo = Buckets[i-1]
		}
		if i == len(Buckets) {
			return time.Duration(lo * float64(time.Second))
		}
		f := (rank - seen) / float64(c)
		return time.Duration((lo + f*(Buckets[i]-lo)) * float64(time.Second))
	}
	return time.Duration(Buckets[len(Buckets)-1] * float64(time.Second))
}
