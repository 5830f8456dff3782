package handoff

import (
	"context"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/kvhandoff/kvhandoff/test/simengine"
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
	// FailedRequests are the agents' requests that failed, with their reasons (left out
	// of the rates).
	FailedRequests []string `json:"failed_requests,omitempty"`
}

// MeasureRailsGain measures RailsGain for one rank of layout l, with Blocks the blocks of
// one request: the pair's writes are the agent's (one per region, all in flight).
func MeasureRailsGain(ctx context.Context, sc Scenario, l simengine.Layout, cpus *unix.CPUSet) (*RailsGain, error) {
	n := l.Blocks * l.BlockBytes() * l.Regions()
	measure := func(rails int) (pair float64, agent agentRate, err error) {
		d, err := medianWrite(sc.Provider, rails, n, (n+l.Regions()-1)/l.Regions(), l.Regions(), 9, cpus)
		if err != nil {
			return 0, agent, err
		}
		sc := sc
		sc.Rails = rails
		if agent, err = agentThroughput(ctx, sc, nil, l); err != nil {
			err = fmt.Errorf("the agent on %d rails: %w", rails, err)
		}
		return float64(n) / d.Seconds() / 1e9, agent, err
	}
	pair1, agent1, err := measure(1)
	if err != nil {
		return nil, err
	}
	pair2, agent2, err := measure(2)
	if err != nil {
		return nil, err
	}
	return &RailsGain{
		PairOneRailGBps: pair1, PairTwoRailsGBps: pair2,
		AgentOneRailGBps: agent1.endToEnd, AgentTwoRailsGBps: agent2.endToEnd,
		AgentWritesOneRailGBps: agent1.writes, AgentWritesTwoRailsGBps: agent2.writes,
		FailedRequests: append(agent1.failed, agent2.failed...),
	}, nil
}
