package serving

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"

	"github.com/kvhandoff/kvhandoff/bench/report"
)

// Markdown writes the report's table.
func (r *Report) Markdown(w io.Writer) {
	fmt.Fprintf(w, "Router + simulated engines + two transfer agents (`%s`, %.2f GB/s measured), %s; %.0f QPS Poisson, %d-token prompts, TP %d, "+
		"%.1f MB of KV per request (%.0f%% of the measured bandwidth), prefill %.1f ms; %d arrivals per mode, the same for both.\n\n",
		r.Provider, r.BandwidthGBps, r.Machine, r.QPS, r.PromptTokens, r.TP, float64(r.BytesPerRequest)/1e6, r.OfferedLoad*100, r.PrefillMs, r.ArrivalsPerMode)
	fmt.Fprintln(w, "| mode | TTFT p50 / p90 / p99 (ms) | router-added p50 / p99 (ms) | prefill leg p50 (ms) | decode leg to first byte p50 (ms) | outcomes |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|")
	for _, m := range r.Results {
		fmt.Fprintf(w, "| %s | %.1f / %.1f / %.1f | %.3f / %.3f | %.1f | %.1f | %s |\n", m.Mode, m.TTFT.P50, m.TTFT.P90, m.TTFT.P99,
			m.RouterAdded.P50, m.RouterAdded.P99, m.PrefillLeg.P50, m.DecodeLeg.P50, outcomes(m.Outcomes))
	}
	fmt.Fprintf(w, "\nPull's TTFT p50 is %+.1f ms from push's on the same arrivals. Targets: router-added p50 ≤ 1 ms, p99 ≤ 5 ms.\n", r.PullMinusPushTTFTP50)
}

// Write saves serving.json and serving.png into dir.
func (r *Report) Write(dir string) error {
	series := make([]report.Series, len(r.Results))
	for i, m := range r.Results {
		series[i] = report.Series{Name: m.Mode, Values: m.ttfts, P50: m.TTFT.P50}
	}
	return report.Save(dir, "serving", r,
		fmt.Sprintf("TTFT through the router, %s, %.0f QPS, %d-token prompts, TP %d, %s", r.Provider, r.QPS, r.PromptTokens, r.TP, r.Machine),
		"time to first token at the client (ms)", series)
}

// outcomes lists a mode's outcomes by name: "ok 167, http_502 2".
func outcomes(m map[string]int) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}
