package main

import (
	"testing"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/render"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// The simulated engine registers with its policy's timeouts, read from the
// --kv-transfer-config the manager renders, as the connector does. Registered with the
// agent's defaults (minutes), a request a fault stranded stayed held long after the
// policy's lease and TTL (the fault suite found it).
func TestTheEngineRegistersWithItsPolicysTimeouts(t *testing.T) {
	policy := &kvv1.KVTransferPolicySpec{Mode: kvv1.TransferPush, Executor: kvv1.ExecutorAgent, Backend: kvv1.BackendLibfabric,
		LeaseSeconds: 5, RegistrationTimeoutSeconds: 20, BlocksTTLSeconds: 40}
	spec := &kvv1.EngineSpec{Accelerator: kvv1.AcceleratorSpec{Type: kvv1.AcceleratorNvidiaGPU, Count: 1}}
	o := options{tp: 2, blockSize: 16, kvConfig: render.KVTransferConfig(kvv1.RoleDecode, spec, policy, 0)}
	c, err := engineConfig(o)
	if err != nil {
		t.Fatal(err)
	}
	if c.Lease != 5*time.Second || c.RegistrationTimeout != 20*time.Second || c.BlocksTTL != 40*time.Second {
		t.Errorf("timeouts %v, %v, %v; the policy's are 5s, 20s, 40s", c.Lease, c.RegistrationTimeout, c.BlocksTTL)
	}
	if c.Role != agentv1.Role_ROLE_DECODE || c.Mode != agentv1.Mode_MODE_PUSH || c.Socket != render.AgentSocket || c.Layout.TP != 2 {
		t.Errorf("registers as %v %v at %q with TP %d", c.Role, c.Mode, c.Socket, c.Layout.TP)
	}
	o.kvConfig = `{"engine_id":"e","kv_connector_extra_config":{"mode":"push","socket":"/s"}}`
	if _, err := engineConfig(o); err == nil {
		t.Error("a config naming no role was taken")
	}
}
