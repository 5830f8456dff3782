package handoff

import (
	"fmt"
	"io"
	"strings"

	"github.com/kvhandoff/kvhandoff/bench/report"
)

// Markdown writes the report's table.
func (r *Report) Markdown(w io.Writer) {
	fmt.Fprintf(w, "Provider `%s`, measured %.2f GB/s over one endpoint pair and %.2f GB/s over %d pairs at once; offered load %.0f%% of the "+
		"latter; TP %d; prefill %.1f ms per request.\n",
		r.Provider, r.BandwidthGBps, r.BandwidthTPGBps, r.TP, r.OfferedLoad*100, r.TP, r.PrefillMs)
	fmt.Fprintf(w, "KV layout (scaled): %s.\n", r.Layout)
	if r.AgentCPUs != "" {
		fmt.Fprintf(w, "The agents, the floors' threads and fi_rma_bw ran on CPUs %s; the simulated engines, which produce and check the KV, on "+
			"the others.\n", r.AgentCPUs)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| mode | QPS | prompt tokens | MB/request | TTFT p50 / p90 / p99 (ms) | handoff p50 / p90 / p99 (ms) | wire floor, TP pairs "+
		"(ms) | coordination overhead p50 / p99 (ms) | wire floor, one pair (ms) | descriptors/request | verified | failed |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, m := range r.Results {
		fmt.Fprintf(w, "| %s | %.0f | %d | %.1f | %.1f / %.1f / %.1f | %.1f / %.1f / %.1f | %.1f | %.1f / %.1f | %.1f | %.0f | %d | %d |\n",
			m.Mode, m.QPS, m.PromptTokens, float64(m.BytesPerRequest)/1e6,
			m.TTFT.P50, m.TTFT.P90, m.TTFT.P99, m.Handoff.P50, m.Handoff.P90, m.Handoff.P99,
			m.WireFloorMs, m.CoordinationOverhead.P50, m.CoordinationOverhead.P99, m.WireFloorOnePairMs,
			m.DescriptorsPerRequest, m.VerifiedRequests, m.FailedRequests)
	}
	fmt.Fprintf(w, "\nWire floor: the median of %d rounds (p90 %.1f ms, slowest %.1f ms) of the request's bytes over %d endpoint pairs at once "+
		"(each rank's share on its own pair, in as many writes as the handoff posts: one per region), each side of each pair polled by its own "+
		"thread, signalled, measured in this run; the one-pair figure is context. ", 31, r.WireFloorRounds.P90, r.WireFloorRounds.P99, r.TP)
	if len(r.Results) > 0 {
		fmt.Fprintf(w, "Measured again while the simulated engines' CPU work (each request's KV produced and checked on every rank, at the run's "+
			"rate) ran beside it, the floor was %.1f ms.\n", r.Results[0].WireFloorUnderEngineLoadMs)
	}
	for _, m := range r.Results {
		fmt.Fprintf(w, "%s: %d of %d handoffs overlapped no other; their coordination overhead p50 / p99 %.1f / %.1f ms, the others' (sharing the "+
			"wire with another handoff) %.1f / %.1f ms. The last rank had the KV %.1f / %.1f ms (p50 / p99) after the first.\n",
			m.Mode, m.HandoffsAlone, m.VerifiedRequests, m.CoordinationOverheadAlone.P50, m.CoordinationOverheadAlone.P99,
			m.CoordinationOverheadOverlapped.P50, m.CoordinationOverheadOverlapped.P99, m.RankSpread.P50, m.RankSpread.P99)
	}
	fmt.Fprintf(w, "Push and pull ran on the same seeded arrival sequence. Push handoff p50 is %.2f× the wire floor (target ≤ 1.25×); pull's p50 "+
		"is %+.1f ms from push's.\n", r.PushOverFloorP50, r.PullMinusPushP50)
	for _, m := range r.Results {
		if m.LayerGroups > 1 {
			fmt.Fprintf(w, "%s reports each request in %d layer groups as the modelled layers finish, and the agents write each group while the "+
				"next computes; what is left at prefill end is the last group, whose TP-pairs floor is %.1f ms, and its coordination overhead is "+
				"measured from that floor. Its handoff p50 is %.1f× below whole-request push's (target ≥ 4×).\n",
				m.Mode, m.LayerGroups, m.WireFloorLastGroupMs, r.PushOverLayeredP50)
		}
	}
	if t := r.Throughput; t != nil {
		fmt.Fprintf(w, "Write throughput, one rank, windows of %d writes of %d bytes (one request's share) on libfabric %s: the agent %.2f GB/s "+
			"(SourceReady to DELIVERED; its writes alone, pairing to the last completion, %.2f GB/s), fabtests' fi_rma_bw %.2f GB/s: %.2f× "+
			"(target ≥ 0.95×). The agent on the installed libfabric %s: %.2f GB/s. Busy CPU time of the whole machine (%d CPUs) per GB moved: "+
			"the agent %.2f s, fi_rma_bw sleeping in the provider as the agents do (-c sread, %.2f GB/s) %.2f s.\n",
			t.Window, t.MessageBytes, t.Libfabric, t.AgentGBps, t.AgentWritesGBps, t.FiRmaBwGBps, t.AgentOverFiRmaBw, t.Installed,
			t.AgentInstalledGBps, t.CPUs, t.AgentCPUPerGB, t.FiRmaBwSreadGBps, t.FiRmaBwSreadCPUPerGB)
	}
	if g := r.RailsGain; g != nil {
		fmt.Fprintf(w, "One rank's share of a request (one write per region), on one rail against two (--rails 2: two endpoints, which on loopback "+
			"share the one interface): a plain endpoint pair %.2f against %.2f GB/s (%.2f×); the agent %.2f against %.2f GB/s (%.2f×; its writes "+
			"alone %.2f against %.2f GB/s).\n",
			g.PairOneRailGBps, g.PairTwoRailsGBps, g.PairTwoRailsGBps/g.PairOneRailGBps, g.AgentOneRailGBps, g.AgentTwoRailsGBps,
			g.AgentTwoRailsGBps/g.AgentOneRailGBps, g.AgentWritesOneRailGBps, g.AgentWritesTwoRailsGBps)
	}
	var failed []string
	if r.Throughput != nil {
		failed = append(failed, r.Throughput.FailedRequests...)
	}
	if r.RailsGain != nil {
		failed = append(failed, r.RailsGain.FailedRequests...)
	}
	if len(failed) > 0 {
		fmt.Fprintf(w, "The throughput measurements left out %d request(s) the agents reported failed: %s.\n", len(failed), strings.Join(failed, "; "))
	}

	if r.Rails > 1 {
		fmt.Fprintf(w, "Every engine rank's agent session, and every floor pair, ran on %d rails.\n", r.Rails)
	}
	if r.LeakedRanks > 0 {
		fmt.Fprintf(w, "%d ranks' blocks were held back because an agent never answered for them.\n", r.LeakedRanks)
	}
}

// Write saves handoff.json and handoff.png into dir.
func (r *Report) Write(dir string) error {
	series := make([]report.Series, len(r.Results))
	for i, m := range r.Results {
		series[i] = report.Series{Name: m.Mode, Values: m.handoffs, P50: m.Handoff.P50}
	}
	return report.Save(dir, "handoff", r,
		fmt.Sprintf("Handoff latency CDF, %s, %.0f QPS, %d-token prompts, TP %d", r.Provider, r.Results[0].QPS, r.Results[0].PromptTokens, r.TP),
		"handoff overhead: prefill end -> decode ready (ms)", series, report.Marker{Name: "wire floor", X: r.Results[0].WireFloorMs})
}
