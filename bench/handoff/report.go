package handoff

import (
	"fmt"
	"io"
	"path/filepath"

	"github.com/kvhandoff/kvhandoff/bench/report"
)

// Markdown writes the report's table.
func (r *Report) Markdown(w io.Writer) {
	fmt.Fprintf(w, "Provider `%s`, measured %.2f GB/s; offered load %.0f%% of it; TP %d; prefill %.1f ms per request.\n", r.Provider, r.BandwidthGBps, r.OfferedLoad*100, r.TP, r.PrefillMs)
	fmt.Fprintf(w, "KV layout (scaled): %s.\n\n", r.Layout)
	fmt.Fprintln(w, "| mode | QPS | prompt tokens | MB/request | TTFT p50 / p90 / p99 (ms) | handoff p50 / p90 / p99 (ms) | wire floor (ms) | descriptors/request | verified | failed |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|")
	for _, m := range r.Results {
		fmt.Fprintf(w, "| %s | %.0f | %d | %.1f | %.1f / %.1f / %.1f | %.1f / %.1f / %.1f | %.1f | %.0f | %d | %d |\n",
			m.Mode, m.QPS, m.PromptTokens, float64(m.BytesPerRequest)/1e6,
			m.TTFT.P50, m.TTFT.P90, m.TTFT.P99, m.Handoff.P50, m.Handoff.P90, m.Handoff.P99,
			m.WireFloorMs, m.DescriptorsPerRequest, m.VerifiedRequests, m.FailedRequests)
	}
	fmt.Fprintf(w, "\nWire floor: one endpoint pair; the same bytes over %d pairs at once took %.1f ms.\n", r.TP, r.WireFloorTPMs)
	fmt.Fprintf(w, "Push handoff p50 is %.2f× the wire floor (target ≤ 1.25×); pull's p50 is %+.1f ms from push's.\n", r.PushOverFloorP50, r.PullMinusPushP50)
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
