package realnode_test

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/realnode"
)

// The report's schedule: the test's phases, each for a fixed time, so that every
// configuration meets the same arrivals.
var schedule = []struct {
	phase realnode.Phase
	for_  time.Duration
}{{low, 40 * time.Second}, {prompts, 90 * time.Second}, {answers, 90 * time.Second}, {low, 60 * time.Second}}

// BenchmarkSteppedLoadAgainstStaticSplits is the report of docs/performance.md#autoscaling
// (a benchmark, not a test: make bench-autoscale). It runs the stepped schedule through
// the autoscaled pair, then through each static split of the same budget, each on a fresh
// real node, and reports per configuration the share of requests within both targets
// (TTFT, and the request's own p90 token gap), per phase, and for the autoscaled pair how
// long the pods took to settle after each step. KVHANDOFF_AUTOSCALE_REPORT names a folder
// for report.md and timeline.svg.
func BenchmarkSteppedLoadAgainstStaticSplits(b *testing.B) {
	configs := []struct {
		name            string
		prefill, decode int32 // 0: autoscaled
	}{{"autoscaled", 0, 0}, {"static 3+1", 3, 1}, {"static 2+2", 2, 2}, {"static 1+3", 1, 3}}
	var md strings.Builder
	fmt.Fprintf(&md, "| configuration | all | %s |\n|---|---%s|\n", strings.Join(phaseNames(), " | "), strings.Repeat("|---", len(phaseNames())))
	var auto *realnode.Load
	var autoStart time.Time
	for _, c := range configs {
		// A sub-benchmark each, so that each configuration's node stops (its Cleanup)
		// before the next starts: they would share the test's network namespace.
		b.Run(c.name, func(b *testing.B) {
			var n *realnode.Node
			if c.prefill == 0 {
				n = createAutoscaledPair(b)
			} else {
				n = createAutoscaledPair(b, func(d *kvv1.DecodePool) { d.Spec.Autoscaling, d.Spec.Replicas = nil, ptr.To(c.decode) })
				p := &kvv1.PrefillPool{}
				if err := n.Client.Get(bg, client.ObjectKey{Namespace: "default", Name: "push-prefill"}, p); err != nil {
					b.Fatal(err)
				}
				p.Spec.Replicas = ptr.To(c.prefill)
				if err := n.Client.Update(bg, p); err != nil {
					b.Fatal(err)
				}
				until(b, "the static split to run", 3*time.Minute, func() bool {
					_, pr := n.Pods("push-prefill", kvv1.RolePrefill)
					_, dr := n.Pods("push-decode", kvv1.RoleDecode)
					return pr == int(c.prefill) && dr == int(c.decode)
				})
			}
			start := time.Now()
			load, err := n.StartLoad("push", schedule[0].phase)
			if err != nil {
				b.Fatal(err)
			}
			for _, s := range schedule {
				load.Phase(s.phase)
				time.Sleep(s.for_) // the schedule is the benchmark's workload
			}
			load.Stop()
			within := attainment(load.Results())
			fmt.Fprintf(&md, "| %s | %s |", c.name, pct(within["all"]))
			for _, p := range phaseNames() {
				fmt.Fprintf(&md, " %s |", pct(within[p]))
			}
			md.WriteString("\n")
			if c.prefill == 0 {
				auto, autoStart = load, start
			}
		})
	}
	if auto == nil {
		b.Fatal("the autoscaled configuration did not run")
	}
	md.WriteString("\nAutoscaled: time for the engine pods to settle after each step (the last change of either pool's pod count within the phase):\n\n")
	at := autoStart
	for _, s := range schedule {
		settled := at
		var last [2]int
		for i, x := range auto.Samples() {
			if x.At.Before(at) || !x.At.Before(at.Add(s.for_)) {
				continue
			}
			if i == 0 || [2]int{x.PrefillPods, x.DecodePods} != last {
				settled = x.At
			}
			last = [2]int{x.PrefillPods, x.DecodePods}
		}
		fmt.Fprintf(&md, "- %s (%s): %s\n", s.phase.Name, s.for_, settled.Sub(at).Round(100*time.Millisecond))
		at = at.Add(s.for_)
	}
	b.Log("\n" + md.String())
	if dir := os.Getenv("KVHANDOFF_AUTOSCALE_REPORT"); dir != "" {
		if err := os.WriteFile(filepath.Join(dir, "report.md"), []byte(md.String()), 0o644); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "timeline.svg"), []byte(plot(auto, autoStart)), 0o644); err != nil {
			b.Fatal(err)
		}
	}
}

func phaseNames() []string {
	var out []string
	for _, s := range schedule {
		if !slices.Contains(out, s.phase.Name) {
			out = append(out, s.phase.Name)
		}
	}
	return out
}

// attainment is, overall and per phase, the share of requests answered within both
// targets: TTFT, and the p90 of the request's own token gaps.
func attainment(results []realnode.Result) map[string]float64 {
	ok, all := map[string]int{}, map[string]int{}
	for _, r := range results {
		good := !r.Failed() && r.TTFT <= targetTTFT && realnode.P90(r.Gaps) <= targetITL
		for _, k := range []string{"all", r.Phase} {
			all[k]++
			if good {
				ok[k]++
			}
		}
	}
	out := map[string]float64{}
	for k, n := range all {
		out[k] = float64(ok[k]) / float64(n)
	}
	return out
}

func pct(f float64) string { return fmt.Sprintf("%.1f%%", 100*f) }

// plot draws the autoscaled run: offered prompt tokens a second and decode streams, the
// engine pods of each role, and every request's TTFT against its target.
func plot(l *realnode.Load, start time.Time) string {
	const w, h, left, panel = 900.0, 600.0, 60.0, 170.0
	results, samples := l.Results(), l.Samples()
	span := 0.0
	for _, s := range samples {
		span = math.Max(span, s.At.Sub(start).Seconds())
	}
	x := func(t time.Time) float64 { return left + (w-left-20)*t.Sub(start).Seconds()/span }
	var svg strings.Builder
	fmt.Fprintf(&svg, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="11">`+"\n", w, h)
	svg.WriteString(`<rect width="100%" height="100%" fill="white"/>` + "\n")
	axis := func(top float64, title string, max float64, unit string) func(v float64) float64 {
		fmt.Fprintf(&svg, `<text x="%.0f" y="%.0f" font-weight="bold">%s</text>`+"\n", left, top-6, title)
		fmt.Fprintf(&svg, `<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="#999"/>`+"\n", left, top+panel-30, w-20, top+panel-30)
		fmt.Fprintf(&svg, `<text x="4" y="%.0f">%.4g%s</text><text x="4" y="%.0f">0</text>`+"\n", top+10, max, unit, top+panel-30)
		return func(v float64) float64 { return top + (panel-30)*(1-v/max) }
	}
	// Offered load: prompt tokens a second over 5-second bins, from the arrivals.
	bins := map[int]float64{}
	for _, r := range results {
		p := phaseOf(r.Phase)
		bins[int(r.At.Sub(start).Seconds())/5] += float64(p.Prompt) / 5
	}
	peak := 1.0
	for _, v := range bins {
		peak = math.Max(peak, v)
	}
	y := axis(30, "offered prompt words a second (5 s bins)", peak, "")
	var pts []string
	for i := 0; float64(i*5) <= span; i++ {
		pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(start.Add(time.Duration(i*5)*time.Second)), y(bins[i])))
	}
	fmt.Fprintf(&svg, `<polyline fill="none" stroke="#555" points="%s"/>`+"\n", strings.Join(pts, " "))
	// Engine pods, terminating ones included.
	y = axis(30+panel, "engine pods: prefill (blue), decode (orange); budget 4 (dashed)", 4.5, "")
	for _, role := range []struct {
		color string
		of    func(realnode.Sample) int
	}{{"#1f77b4", func(s realnode.Sample) int { return s.PrefillPods }}, {"#ff7f0e", func(s realnode.Sample) int { return s.DecodePods }}} {
		pts = pts[:0]
		for _, s := range samples {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(s.At), y(float64(role.of(s)))))
		}
		fmt.Fprintf(&svg, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", role.color, strings.Join(pts, " "))
	}
	fmt.Fprintf(&svg, `<line x1="%.0f" y1="%.1f" x2="%.0f" y2="%.1f" stroke="#c00" stroke-dasharray="4"/>`+"\n", left, y(4), w-20, y(4))
	// Every request's TTFT, log scale, against the target.
	lo, hi := math.Log10(0.01), math.Log10(60)
	y = axis(30+2*panel, "TTFT of each request, s (log; target dashed; failures red)", 60, " s")
	ly := func(s float64) float64 { return y(60 * (math.Log10(math.Max(s, 0.01)) - lo) / (hi - lo)) }
	for _, r := range results {
		color := "#2ca02c"
		if r.Failed() {
			color = "#d62728"
		}
		fmt.Fprintf(&svg, `<circle cx="%.1f" cy="%.1f" r="1.5" fill="%s"/>`+"\n", x(r.At), ly(r.TTFT.Seconds()), color)
	}
	fmt.Fprintf(&svg, `<line x1="%.0f" y1="%.1f" x2="%.0f" y2="%.1f" stroke="#c00" stroke-dasharray="4"/>`+"\n", left, ly(targetTTFT.Seconds()), w-20, ly(targetTTFT.Seconds()))
	// Phase boundaries.
	at := start
	for _, s := range schedule {
		fmt.Fprintf(&svg, `<line x1="%.1f" y1="20" x2="%.1f" y2="%.0f" stroke="#ccc"/><text x="%.1f" y="%.0f">%s</text>`+"\n",
			x(at), x(at), h-20, x(at)+3, h-6, s.phase.Name)
		at = at.Add(s.for_)
	}
	svg.WriteString("</svg>\n")
	return svg.String()
}

func phaseOf(name string) realnode.Phase {
	for _, s := range schedule {
		if s.phase.Name == name {
			return s.phase
		}
	}
	return realnode.Phase{}
}
