package agent_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/agent"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/test/simengine"
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

// TestRanksOpenTheNICsTheyName: a rank naming its NICs (RegisterEngine's fabric_domains)
// gets one rail on each, whatever the agent's --rails, and a handoff between two such ranks
// uses both; NICs the provider lacks, named twice, or too many are refused by field.
func TestRanksOpenTheNICsTheyName(t *testing.T) {
	const prov = "tcp;ofi_rxm"
	have, err := fabric.Domains(prov)
	if err != nil {
		t.Fatal(err)
	}
	nics := []string{have[len(have)-1], have[0]} // two NICs where the host has two (lo, eth0)
	p := &pair{layout: testLayout(1, 256), dirA: t.TempDir(), dirB: t.TempDir(), mode: agentv1.Mode_MODE_PUSH}
	p.A = startAgent(t, "prefill-node", p.dirA, "--provider", prov)
	p.B = startAgent(t, "decode-node", p.dirB, "--provider", prov)
	start := func(a *agentProc, id string, role agentv1.Role, domains []string) (*simengine.Engine, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		e, err := simengine.Start(ctx, simengine.Config{ID: id, Role: role, Mode: p.mode, Layout: p.layout, Socket: a.Socket, FabricDomains: domains})
		if err == nil {
			t.Cleanup(e.Stop)
		}
		return e, err
	}
	for _, c := range []struct {
		domains []string
		want    string
	}{
		{[]string{have[0], "no-such-nic"}, `fabric_domains[1]: "no-such-nic" is not a domain of provider tcp;ofi_rxm`},
		{[]string{have[0], have[0]}, "fabric_domains[1]: " + fmt.Sprintf("%q", have[0]) + " is named twice"},
		{slices.Repeat([]string{have[0]}, 17), "fabric_domains: names 17 domains; a rank has at most 16 rails"},
	} {
		if _, err := start(p.A, "refused-0.default", agentv1.Role_ROLE_PREFILL,
			c.domains); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), c.want) {
			t.Errorf("fabric_domains %v: %v, want InvalidArgument containing %q", c.domains, err, c.want)
		}
	}
	P, err := start(p.A, "prefill-0.default", agentv1.Role_ROLE_PREFILL, nics)
	if err != nil {
		t.Fatal(err)
	}
	D, err := start(p.B, "decode-0.default", agentv1.Role_ROLE_DECODE, nics)
	if err != nil {
		t.Fatal(err)
	}
	p.P, p.D = append(p.P, P), append(p.D, D)
	for i := range 8 {
		handOver(t, p, fmt.Sprintf("nics-%d", i))
	}
	until(t, "both NICs to have carried bytes", func() bool {
		return p.A.Metric(t, fmt.Sprintf(railBytes, 0)) > 0 && p.A.Metric(t, fmt.Sprintf(railBytes, 1)) > 0
	})
}
