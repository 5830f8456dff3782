package agent_test

import (
	"fmt"
	"testing"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// TestAPairOnOneNodeHandsOverThroughItsOwnAgent: a prefill and a decode engine served by
// the same agent (one node) hand over through it, push and pull, with the same protocol
// as between nodes, carried over an in-process pipe instead of a TCP connection.
func TestAPairOnOneNodeHandsOverThroughItsOwnAgent(t *testing.T) {
	for _, mode := range []agentv1.Mode{agentv1.Mode_MODE_PUSH, agentv1.Mode_MODE_PULL} {
		t.Run(mode.String(), func(t *testing.T) {
			dir := t.TempDir()
			a := startAgent(t, "node", dir)
			p := &pair{layout: testLayout(1, 128), dirA: dir, dirB: dir, mode: mode, A: a, B: a}
			p.P = append(p.P, engine(t, a, "prefill-0.default", agentv1.Role_ROLE_PREFILL, mode, 0, p.layout))
			p.D = append(p.D, engine(t, a, "decode-0.default", agentv1.Role_ROLE_DECODE, mode, 0, p.layout))
			for i := range 4 {
				handOver(t, p, fmt.Sprintf("one-node-%d", i))
			}
			if got := a.Metric(t, "kvhandoff_agent_peer_connections"); got != 2 {
				t.Fatalf("%v peer connections, want the pipe's two ends and no TCP connection", got)
			}
		})
	}
}
