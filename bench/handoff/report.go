package handoff

import (
	"fmt"
	"io"
	"path/filepath"

	"github.com/kvhandoff/kvhandoff/bench/report"
)

// Markdown writes the report's table.
func (r *Report) Markdown(w io.Writer) {
	fmt.Fprintf(w, "Provider `%s`, measured %.2f GB/s over one endpoint pair and %.2f GB/s over %d pairs at once; offered load %.0f%% of the latter; TP %d; prefill %.1f ms per request.\n",
		r.Provider, r.BandwidthGBps, r.BandwidthTPGBps, r.TP, r.OfferedLoad*100, r.TP, r.PrefillMs)
	fmt.Fprintf(w, "KV layout (scaled): %s.\n\n", r.Layout)
	fmt.Fprintln(w, "| mode | QPS | prompt tokens | MB/request | TTFT p50 / p90 / p99 (ms) | handoff p50 / p90 / p99 (ms) | wire floor, TP pairs (ms) | coordination overhead p50 / p99 (ms) | wire floor, one pair (ms) | descriptors/request | verified | failed |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, m := range r.Results {
		fmt.Fprintf(w, "| %s | %.0f | %d | %.1f | %.1f / %.1f / %.1f | %.1f / %.1f / %.1f | %.1f | %.1f / %.1f | %.1f | %.0f | %d | %d |\n",
			m.Mode, m.QPS, m.PromptTokens, float64(m.BytesPerRequest)/1e6,
			m.TTFT.P50, m.TTFT.P90, m.TTFT.P99, m.Handoff.P50, m.Handoff.P90, m.Handoff.P99,
			m.WireFloorMs, m.CoordinationOverhead.P50, m.CoordinationOverhead.P99, m.WireFloorOnePairMs,
			m.DescriptorsPerRequest, m.VerifiedRequests, m.FailedRequests)
	}
	fmt.Fprintf(w, "\nWire floor: the request's bytes over %d endpoint pairs at once (each rank's share on its own pair), signalled, measured in this run; the one-pair figure is context.\n", r.TP)
	fmt.Fprintf(w, "Push and pull ran on the same seeded arrival sequence. Push handoff p50 is %.2f× the wire floor (target ≤ 1.25×); pull's p50 is %+.1f ms from push's.\n", r.PushOverFloorP50, r.PullMinusPushP50)
	if r.LeakedRanks > 0 {
		fmt.Fprintf(w, "%d ranks' blocks were held back because an agent never answered for them.\n", r.LeakedRanks)
	}
}

// Write saves handoff.json and handoff.png into dir.
func (r *Report) Write(dir string) error {
	if err := report.SaveJSON(dir, "handoff.json", r); err != nil {
		return err
	}
	series := make([]report.Series, len(r.Results))
	for i, m := range r.Results {
		series[i] = report.Series{Name: m.Mode, Values: m.handoffs, P50: m.Handoff.P50}
	}
	return report.CDF(filepath.Join(dir, "handoff.png"),
		fmt.Sprintf("Handoff latency CDF, %s, %.0f QPS, %d-token prompts, TP %d", r.Provider, r.Results[0].QPS, r.Results[0].PromptTokens, r.TP),
		"handoff overhead: prefill end -> decode ready (ms)", series, report.Marker{Name: "wire floor", X: r.Results[0].WireFloorMs})
}
