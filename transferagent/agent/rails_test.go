package agent_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/transferagent/agent"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// handOver moves one verified request from prefill rank 0 to decode rank 0 of p.
func handOver(t *testing.T, p *pair, req string) {
	t.Helper()
	src, dst := alloc(t, p.P[0], 24), alloc(t, p.D[0], 24)
	p.P[0].Cache.Fill(req, src)
	if p.mode == agentv1.Mode_MODE_PUSH {
		if err := p.D[0].RegisterDestination(bg, req, 1, dst, p.P[0].Self); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.P[0].SourceReady(bg, req, 0, src, true); err != nil {
		t.Fatal(err)
	}
	if p.mode == agentv1.Mode_MODE_PULL {
		if err := p.D[0].Pull(bg, req, 1, p.P[0].Self, src, dst); err != nil {
			t.Fatal(err)
		}
	}
	expect(t, wait(t, p.D[0], req, 1), agentv1.Event_DELIVERED)
	if err := p.D[0].Cache.Verify(req, dst); err != nil {
		t.Fatal(err)
	}
}

const railBytes = `kvhandoff_agent_rail_bytes_total{rail="%d"}`

// TestTwoRailsSplitAPushAndAPull: with two rails on both agents, a push's writes (the
// prefill agent's) and a pull's reads (the decode agent's) go over both endpoints, and
// every byte lands: the signal on rail 0 does not overtake writes on rail 1.
func TestTwoRailsSplitAPushAndAPull(t *testing.T) {
	for _, mode := range []agentv1.Mode{agentv1.Mode_MODE_PUSH, agentv1.Mode_MODE_PULL} {
		t.Run(mode.String(), func(t *testing.T) {
			p := newPair(t, mode, 1, 256, "--rails", "2", "--provider", "tcp;ofi_rxm") // rails are NICs: not shm
			mover := p.A
			if mode == agentv1.Mode_MODE_PULL {
				mover = p.B
			}
			for i := range 8 {
				handOver(t, p, fmt.Sprintf("rails-%d", i))
			}
			until(t, "both rails to have carried bytes", func() bool {
				return mover.Metric(t, fmt.Sprintf(railBytes, 0)) > 0 && mover.Metric(t, fmt.Sprintf(railBytes, 1)) > 0
			})
		})
	}
}

// TestAgentsWithDifferentRailsUseTheRailsTheyShare: an agent of two rails and one of one
// (a rolling change of --rails) hand over through the rail both have, either way round.
func TestAgentsWithDifferentRailsUseTheRailsTheyShare(t *testing.T) {
	for _, prefillRails := range []string{"2", "1"} {
		decodeRails := map[string]string{"2": "1", "1": "2"}[prefillRails]
		t.Run("prefill "+prefillRails+" decode "+decodeRails, func(t *testing.T) {
			p := &pair{layout: testLayout(1, 128), dirA: t.TempDir(), dirB: t.TempDir(), mode: agentv1.Mode_MODE_PUSH}
			p.A = startAgent(t, "prefill-node", p.dirA, "--rails", prefillRails, "--provider", "tcp;ofi_rxm")
			p.B = startAgent(t, "decode-node", p.dirB, "--rails", decodeRails, "--provider", "tcp;ofi_rxm")
			p.P = append(p.P, engine(t, p.A, "prefill-0.default", agentv1.Role_ROLE_PREFILL, p.mode, 0, p.layout))
			p.D = append(p.D, engine(t, p.B, "decode-0.default", agentv1.Role_ROLE_DECODE, p.mode, 0, p.layout))
			for i := range 3 {
				handOver(t, p, fmt.Sprintf("mixed-%d", i))
			}
			until(t, "rail 0's bytes to be counted", func() bool { return p.A.Metric(t, fmt.Sprintf(railBytes, 0)) > 0 })
			if b := p.A.Metric(t, fmt.Sprintf(railBytes, 1)); b != 0 {
				t.Fatalf("rail 1 carried %v bytes, but only one agent has it", b)
			}
		})
	}
}

func TestRailsOutsideTheirRangeAreRefused(t *testing.T) {
	for _, n := range []int{-1, 17} {
		_, err := agent.New(agent.Config{Provider: provider(), Token: []byte("0123456789abcdef"), Rails: n})
		if err == nil || !strings.Contains(err.Error(), "rails: ") {
			t.Errorf("--rails %d: %v, want an error naming rails", n, err)
		}
	}
}
