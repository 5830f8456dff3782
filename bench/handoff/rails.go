package handoff

import (
	"context"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/kvhandoff/kvhandoff/transferagent/simengine"
)

// RailsGain is one TP rank's write throughput on one rail against two, in GB/s: the
// floor's plain endpoint pair, and the agent (as Throughput measures it, on the installed
// libfabric), each moving one rank's share of a request in one write per region.
type RailsGain struct {
	PairOneRailGBps         float64 `json:"pair_one_rail_gb_per_s"`
	PairTwoRailsGBps        float64 `json:"pair_two_rails_gb_per_s"`
	AgentOneRailGBps        float64 `json:"agent_one_rail_gb_per_s"`
	AgentTwoRailsGBps       float64 `json:"agent_two_rails_gb_per_s"`
	AgentWritesOneRailGBps  float64 `json:"agent_writes_one_rail_gb_per_s"`
	AgentWritesTwoRailsGBps float64 `json:"agent_writes_two_rails_gb_per_s"`
}

// MeasureRailsGain measures RailsGain for one rank of layout l, with Blocks the blocks of
// one request.
func MeasureRailsGain(ctx context.Context, sc Scenario, l simengine.Layout, cpus *unix.CPUSet) (*RailsGain, error) {
	g := &RailsGain{}
	n := l.Blocks * l.BlockBytes() * l.Regions()
	for _, x := range []struct {
		rails         int
		pair, agent   *float64
		agentWritesTo *float64
	}{{1, &g.PairOneRailGBps, &g.AgentOneRailGBps, &g.AgentWritesOneRailGBps}, {2, &g.PairTwoRailsGBps, &g.AgentTwoRailsGBps, &g.AgentWritesTwoRailsGBps}} {
		rate, err := pairThroughput(sc.Provider, x.rails, n, l.Regions(), cpus)
		if err != nil {
			return nil, err
		}
		*x.pair = rate / 1e9
		one := sc
		one.Rails = x.rails
		a, err := agentThroughput(ctx, one, nil, l)
		if err != nil {
			return nil, err
		}
		*x.agent, *x.agentWritesTo = a.endToEnd, a.writes
	}
	return g, nil
}

// pairThroughput is the median rate, in bytes/s, of n bytes in writes equal writes all in
// flight, signalled, over one endpoint pair of rails rails.
func pairThroughput(provider string, rails, n, writes int, cpus *unix.CPUSet) (float64, error) {
	w, err := newWirePair(provider, rails, n, cpus)
	if err != nil {
		return 0, err
	}
	defer w.close()
	if _, err := w.write(1<<20, 1<<20, 1); err != nil {
		return 0, err
	}
	var rates []float64
	for range 9 {
		d, err := w.write(n, (n+writes-1)/writes, writes)
		if err != nil {
			return 0, err
		}
		rates = append(rates, float64(n)/d.Seconds())
	}
	slices.Sort(rates)
	return rates[len(rates)/2], nil
}
