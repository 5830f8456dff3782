// Package autoscale decides how many prefill and decode engines a pair needs to meet its
// TTFT and ITL targets within an accelerator budget. Decide is a pure function of the
// routers' measurements over a window, what was learned from earlier windows (State) and
// the targets; Step turns its decision into sizes that never exceed the budget while pods
// of a shrinking role are still going. The manager feeds both from the routers' load
// reports (package load) and applies Step's sizes to the pools' StatefulSets.
package autoscale

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

// Sizes are replicas of the two roles.
type Sizes struct{ Prefill, Decode int32 }

// Range bounds one role's replicas.
type Range struct{ Min, Max int32 }

// Targets are a pair's objectives and limits (the DecodePool's spec.autoscaling).
type Targets struct {
	TTFT, ITL time.Duration
	// TTFTPercentile and ITLPercentile are in (0, 1): 0.9 for p90.
	TTFTPercentile, ITLPercentile float64
	Prefill, Decode               Range
	// Budget is the accelerators both roles may hold; PrefillPerEngine and
	// DecodePerEngine are each role's accelerators per engine.
	Budget                            int32
	PrefillPerEngine, DecodePerEngine int32
	// Stabilization is how long a scale-down waits (the largest recommendation over it wins).
	Stabilization time.Duration
}

// Cost is the accelerators sizes s take: what Budget bounds.
func (t Targets) Cost(s Sizes) int32 {
	return s.Prefill*t.PrefillPerEngine + s.Decode*t.DecodePerEngine
}

// Window is what the routers measured over one window, latency from warm engines only
// (Measure drops samples of engines younger than the warmup).
type Window struct {
	// Span is the window's length; 0 means no measurement.
	Span time.Duration
	// Complete is false when a router that should have reported did not: its traffic is
	// missing from the counts, which would look like a drop in load.
	Complete bool
	// PromptTokens and Requests arrived over the window.
	PromptTokens, Requests float64
	// PrefillTokens were prefilled by warm engines over PrefillBusy seconds (the sum over
	// engines of the time each had a prefill in flight).
	PrefillTokens, PrefillBusy float64
	// DecodeInFlight is the mean number of decode streams in flight, all engines;
	// DecodeEngines the number of decode engines that carried them.
	DecodeInFlight float64
	DecodeEngines  int32
	// TTFT and ITL are the latencies at the targets' percentiles, with their sample counts.
	TTFT, ITL               time.Duration
	TTFTSamples, ITLSamples int
}

// State is what the autoscaler learned from earlier windows; the zero State knows nothing.
type State struct {
	// PrefillRate is the tokens per second one prefill engine was measured to prefill.
	PrefillRate float64
	// TTFTCorrection is measured over modelled TTFT (1 when the model is right), kept
	// within [0.5, 4].
	TTFTCorrection float64
	// ITL are recent (decode streams per engine, inter-token latency) points, newest last.
	ITL []ITLPoint
	// History are recent recommendations, newest last, for stabilization.
	History []Recommendation
}

// ITLPoint is one window's decode load and token gap.
type ITLPoint struct {
	PerEngine float64
	ITL       time.Duration
}

// Recommendation is what one decision recommended, before stabilization.
type Recommendation struct {
	At    time.Time
	Sizes Sizes
}

// Input is one decision's input.
type Input struct {
	Now     time.Time
	Targets Targets
	// Current is the pair's current desired sizes (the last decision's).
	Current Sizes
	Window  Window
	State   State
}

// Decision is Decide's answer.
type Decision struct {
	Desired Sizes
	// Reason is an Autoscaling condition reason of package v1alpha1; Message the numbers.
	Reason, Message string
	State           State
}

// Condition reasons, the v1alpha1 constants' values (this package imports no API types).
const (
	WithinTargets      = "WithinTargets"
	ScaledUp           = "ScaledUp"
	ScaledDown         = "ScaledDown"
	BudgetExhausted    = "BudgetExhausted"
	AtMaxReplicas      = "AtMaxReplicas"
	MetricsUnavailable = "MetricsUnavailable"
)

// Tuning constants; docs/operations.md#autoscaling explains each.
const (
	// minBusy is the least prefill busy time (seconds) a window needs to measure a rate.
	minBusy = 1.0
	// minSamples is the least latency samples a window needs to be compared with a target.
	minSamples = 20
	// weight is the weight of a new window in the learned rate and correction.
	weight = 0.5
	// maxUtilisation caps how busy a prefill engine may be planned: queues grow without
	// bound near 1.
	maxUtilisation = 0.85
	// decodeHeadroom is the share of the ITL-bound concurrency planned for.
	decodeHeadroom = 0.9
	// itlPoints is how many ITL points the decode model is fitted to.
	itlPoints = 16
	// hysteresis is the extra load a smaller size must still carry before a role shrinks.
	hysteresis = 0.2
)

// Decide is the pair's size for the window, and what it learned. Idle load takes both
// roles to their minimums; a window without measurements (or with a router missing) holds
// the current sizes; scale-ups are immediate and scale-downs wait out the stabilization
// window; the budget is never exceeded.
func Decide(in Input) Decision {
	t, w, st := in.Targets, in.Window, in.State
	st.ITL, st.History = slices.Clone(st.ITL), slices.Clone(st.History)
	if st.TTFTCorrection == 0 {
		st.TTFTCorrection = 1
	}
	if w.Span <= 0 || !w.Complete {
		why := "no router reported over the window"
		if w.Span > 0 {
			why = "a router's report is missing from the window: its requests would look like a drop in load"
		}
		return Decision{Desired: in.Current, Reason: MetricsUnavailable, State: st,
			Message: fmt.Sprintf("holding prefill %d, decode %d: %s", in.Current.Prefill, in.Current.Decode, why)}
	}
	learn(in, &st)
	prefill, pNote := recommend(in.Current.Prefill, func(scale float64) (int32, string) { return needPrefill(in, st, scale) })
	decode, dNote := recommend(in.Current.Decode, func(scale float64) (int32, string) { return needDecode(in, st, scale) })
	notes := []string{pNote, dNote}

	want := Sizes{clamp(prefill, t.Prefill), clamp(decode, t.Decode)}
	reason := ""
	if prefill > t.Prefill.Max || decode > t.Decode.Max {
		reason = AtMaxReplicas
		notes = append(notes, fmt.Sprintf("needs prefill %d, decode %d; maxReplicas are %d and %d", prefill, decode, t.Prefill.Max, t.Decode.Max))
	}
	if fitted, cut := fitBudget(want, Sizes{prefill, decode}, t); cut {
		reason = BudgetExhausted
		notes = append(notes, fmt.Sprintf("prefill %d and decode %d need %d accelerators, the budget is %d",
			want.Prefill, want.Decode, t.Cost(want), t.Budget))
		want = fitted
	}

	// Stabilization: a role shrinks only to the largest size recommended over the window.
	// Without history (a manager that just started) the current sizes count as one.
	if len(st.History) == 0 {
		st.History = append(st.History, Recommendation{At: in.Now, Sizes: in.Current})
	}
	st.History = append(st.History, Recommendation{At: in.Now, Sizes: want})
	cut := in.Now.Add(-t.Stabilization)
	st.History = slices.DeleteFunc(st.History, func(r Recommendation) bool { return r.At.Before(cut) })
	out := want
	for _, r := range st.History {
		out.Prefill = max(out.Prefill, min(r.Sizes.Prefill, in.Current.Prefill))
		out.Decode = max(out.Decode, min(r.Sizes.Decode, in.Current.Decode))
	}
	// Stabilizing one role's scale-down may hold accelerators another's scale-up needs:
	// the budget wins, and the growing role waits.
	if fitted, c := fitBudget(out, out, t); c {
		out = fitted
	}
	if reason == "" {
		switch {
		case out.Prefill > in.Current.Prefill || out.Decode > in.Current.Decode:
			reason = ScaledUp
		case out.Prefill < in.Current.Prefill || out.Decode < in.Current.Decode:
			reason = ScaledDown
		default:
			reason = WithinTargets
		}
	}
	if out != want {
		notes = append(notes, fmt.Sprintf("scale-down to prefill %d, decode %d waits out the %s stabilization window", want.Prefill, want.Decode, t.Stabilization))
	}
	return Decision{Desired: out, Reason: reason, State: st,
		Message: fmt.Sprintf("prefill %d→%d, decode %d→%d: %s", in.Current.Prefill, out.Prefill, in.Current.Decode, out.Decode, join(notes))}
}

// learn updates what the window teaches: the prefill rate of one engine, how far the
// measured TTFT ran over the queueing model, and a (streams per engine, gap) point.
func learn(in Input, st *State) {
	w, t := in.Window, in.Targets
	if w.PrefillBusy >= minBusy && w.PrefillTokens > 0 {
		st.PrefillRate = ewma(st.PrefillRate, w.PrefillTokens/w.PrefillBusy)
	}
	if st.PrefillRate > 0 && w.PromptTokens > 0 && in.Current.Prefill > 0 && w.TTFTSamples >= minSamples {
		offered := w.PromptTokens / w.Span.Seconds()
		service := w.PromptTokens / max(w.Requests, 1) / st.PrefillRate
		if rho := offered / (st.PrefillRate * float64(in.Current.Prefill)); rho < maxUtilisation {
			modelled := service * math.Log(1/(1-t.TTFTPercentile)) / (1 - rho)
			st.TTFTCorrection = math.Min(4, math.Max(0.5, ewma(st.TTFTCorrection, w.TTFT.Seconds()/modelled)))
		}
	}
	if w.ITLSamples >= minSamples && w.DecodeEngines > 0 && w.DecodeInFlight > 0 {
		st.ITL = append(st.ITL, ITLPoint{PerEngine: w.DecodeInFlight / float64(w.DecodeEngines), ITL: w.ITL})
		if len(st.ITL) > itlPoints {
			st.ITL = st.ITL[len(st.ITL)-itlPoints:]
		}
	}
}

// recommend is a role's size: need at the measured load where that is at least the
// current size, and otherwise no smaller than need at hysteresis more load, so a load
// that wavers around a boundary does not take an engine away and give it back.
func recommend(current int32, need func(scale float64) (int32, string)) (int32, string) {
	n, note := need(1)
	if n >= current {
		return n, note
	}
	h, _ := need(1 + hysteresis)
	return max(n, min(current, h)), note
}

// needPrefill sizes prefill from the prompt tokens offered (times scale) against one
// engine's rate. An engine prefilling a mean prompt in S seconds at utilisation ρ answers
// a fraction q of requests within S·ln(1/(1−q))/(1−ρ) (the M/M/1 sojourn time), so
// meeting TTFT at q allows ρ ≤ 1 − c·S·ln(1/(1−q))/TTFT, c being how far measurements ran
// over that model.
func needPrefill(in Input, st State, scale float64) (int32, string) {
	w, t := in.Window, in.Targets
	offered := scale * w.PromptTokens / w.Span.Seconds()
	if offered == 0 {
		return 0, "no prompts"
	}
	if st.PrefillRate == 0 {
		return in.Current.Prefill, fmt.Sprintf("%.0f prompt tokens/s, no prefill rate measured yet", offered)
	}
	service := w.PromptTokens / max(w.Requests, 1) / st.PrefillRate
	tail := math.Log(1 / (1 - t.TTFTPercentile))
	rho := math.Min(maxUtilisation, 1-st.TTFTCorrection*service*tail/t.TTFT.Seconds())
	note := fmt.Sprintf("%.0f prompt tokens/s at %.0f tokens/s per prefill engine, planned at %.0f%% busy", offered, st.PrefillRate, 100*rho)
	if rho < 0.05 {
		// The target is below one prompt's own prefill time: no number of engines meets
		// it; plan for a short queue.
		rho = 0.05
		note = fmt.Sprintf("%.0f prompt tokens/s; the TTFT target %s is below a mean prompt's prefill time %s", offered, t.TTFT, seconds(service))
	}
	n := int32(math.Ceil(offered / (st.PrefillRate * rho)))
	if w.TTFTSamples >= minSamples && w.TTFT > t.TTFT && n <= in.Current.Prefill {
		n = in.Current.Prefill + 1
		note += fmt.Sprintf("; TTFT p%.0f %s over the target %s", 100*t.TTFTPercentile, w.TTFT.Round(time.Millisecond), t.TTFT)
	}
	return n, note
}

// needDecode sizes decode from the streams in flight (times scale) against the streams
// per engine at which the token gap meets the ITL target, from a line fitted to recent
// windows' (streams per engine, gap) points; with too few, gaps are taken as
// proportional to streams.
func needDecode(in Input, st State, scale float64) (int32, string) {
	w, t := in.Window, in.Targets
	streams := scale * w.DecodeInFlight
	if streams <= 0 {
		return 0, "no decode streams"
	}
	if len(st.ITL) == 0 {
		return in.Current.Decode, fmt.Sprintf("%.1f decode streams, no token gaps measured yet", streams)
	}
	a, b := fitITL(st.ITL)
	perEngine := (t.ITL.Seconds() - a) / b * decodeHeadroom
	note := fmt.Sprintf("%.1f decode streams; the ITL target allows %.1f per engine", streams, perEngine)
	if perEngine < 1 {
		perEngine = 1
		note = fmt.Sprintf("%.1f decode streams; the ITL target %s is below one stream's token gap", streams, t.ITL)
	}
	n := int32(math.Ceil(streams / perEngine))
	if w.ITLSamples >= minSamples && w.ITL > t.ITL && n <= in.Current.Decode {
		n = in.Current.Decode + 1
		note += fmt.Sprintf("; ITL p%.0f %s over the target %s", 100*t.ITLPercentile, w.ITL.Round(time.Microsecond), t.ITL)
	}
	return n, note
}

// fitITL fits gap = a + b·streams by least squares; where the points do not spread over
// streams (or the slope comes out flat or negative), a = 0 and b is the mean gap per stream.
func fitITL(points []ITLPoint) (a, b float64) {
	var sx, sy, sxx, sxy float64
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, p := range points {
		x, y := p.PerEngine, p.ITL.Seconds()
		sx, sy, sxx, sxy = sx+x, sy+y, sxx+x*x, sxy+x*y
		lo, hi = math.Min(lo, x), math.Max(hi, x)
	}
	n := float64(len(points))
	if len(points) >= 3 && hi-lo >= 0.25*sx/n {
		b = (n*sxy - sx*sy) / (n*sxx - sx*sx)
		a = (sy - b*sx) / n
		if b > 0 && a >= 0 {
			return a, b
		}
	}
	return 0, sy / math.Max(sx, 1e-9)
}

// fitBudget shrinks want until it fits the budget, taking each engine from the role that
// stays better served (the larger share of its need), never below a minimum.
func fitBudget(want, need Sizes, t Targets) (Sizes, bool) {
	cost := t.Cost
	cut := false
	for cost(want) > t.Budget {
		pShare := float64(want.Prefill-1) / float64(max(need.Prefill, 1))
		dShare := float64(want.Decode-1) / float64(max(need.Decode, 1))
		switch {
		case want.Prefill > t.Prefill.Min && (pShare >= dShare || want.Decode <= t.Decode.Min):
			want.Prefill--
		case want.Decode > t.Decode.Min:
			want.Decode--
		default:
			return want, cut // the minimums exceed the budget: validation refuses that
		}
		cut = true
	}
	return want, cut
}

func clamp(n int32, r Range) int32 { return min(max(n, r.Min), r.Max) }

func ewma(old, sample float64) float64 {
	if old == 0 {
		return sample
	}
	return (1-weight)*old + weight*sample
}

func seconds(s float64) time.Duration {
	return time.Duration(s * float64(time.Second)).Round(time.Millisecond)
}

func join(notes []string) string {
	return strings.Join(slices.DeleteFunc(notes, func(s string) bool { return s == "" }), "; ")
}
