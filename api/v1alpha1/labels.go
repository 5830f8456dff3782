package v1alpha1

// Labels and annotations kvhandoff puts on the objects it manages. Routers, dashboards and
// the other kvhandoff programs select on them, so they are part of the API.
const (
	// LabelPool is the name of the pool an engine workload or pod belongs to, and on a
	// router pod the DecodePool it routes to; select engines with LabelRole beside it.
	LabelPool = "kvhandoff.io/pool"
	// LabelRole is the engine's role: prefill or decode.
	LabelRole = "kvhandoff.io/role"
	// LabelCompatHash identifies what must match for two engines to exchange KV: model,
	// KV-cache dtype, transfer mode, connector and image. A router pairs prefill and decode
	// pods whose values are equal.
	LabelCompatHash = "kvhandoff.io/compat-hash"
	// LabelTensorParallelSize and LabelPipelineParallelSize on an engine pod are the
	// parallelism it runs with; status reads them from the pod, so a rollout never
	// advertises an old pod with a new pool's sizes.
	LabelTensorParallelSize   = "kvhandoff.io/tensor-parallel-size"
	LabelPipelineParallelSize = "kvhandoff.io/pipeline-parallel-size"
	// LabelExecutor is on engine pods of a policy with executor Agent: their KV side
	// channel is the transfer agent of their node, which status reports as agent.
	LabelExecutor = "kvhandoff.io/executor"
	// LabelAgentReady marks a node whose transfer agent is serving. Engines of a policy with
	// executor Agent are scheduled only onto such nodes.
	LabelAgentReady = "kvhandoff.io/agent-ready"
	// LabelPrivilegedEngines on a Namespace lets KVTransferPolicies there run privileged
	// engines (fabric.privileged). A privileged engine owns its node, so the choice is the
	// cluster administrator's, who alone labels namespaces, not the policy author's.
	LabelPrivilegedEngines = "kvhandoff.io/privileged-engines"
	// AnnotationAgentAddress on a node labelled agent-ready is the host:port its agent's
	// peers reach it at. Agents dial no other address: an engine naming any other host or
	// port gets a refusal, never a connection attempt.
	AnnotationAgentAddress = "kvhandoff.io/agent-address"
	// AnnotationAgentHealth on a node is its transfer agent's report of its transfers
	// (JSON: the provider it opened, the engines with a session, a TransferHealthy reason
	// and message). The agent writes it only when it changes; the manager reads it into
	// the pools' TransferHealthy condition.
	AnnotationAgentHealth = "kvhandoff.io/agent-health"
	// LabelRouter on a router's objects and pods names the DecodePool it routes to. Router
	// pods carry the pool label too (never the role label), so they are never taken for
	// engines.
	LabelRouter = "kvhandoff.io/router"
	// LabelEndpointPicker on an endpoint picker's objects and pods names the DecodePool it
	// picks for (gateway.inferencePool).
	LabelEndpointPicker = "kvhandoff.io/endpoint-picker"

	// LabelKVEventsPort on an engine pod is the port its kv-events sidecar serves the keys
	// of the blocks its engine holds on (routing prefixSource KVEvents); routers follow it.
	LabelKVEventsPort = "kvhandoff.io/kv-events-port"

	// AnnotationPolicyHash on an engine pod template is the hash of the policy spec the pod
	// was rendered from, so that any policy change rolls both pools.
	AnnotationPolicyHash = "kvhandoff.io/policy-hash"
	// AnnotationRenderedHash on an engine workload is the hash of what the manager rendered;
	// the manager skips the apply when it and the live object agree.
	AnnotationRenderedHash = "kvhandoff.io/rendered-hash"
)

// Role is what an engine does in a prefill/decode pair.
type Role string

const (
	// RolePrefill engines process prompts and produce KV.
	RolePrefill Role = "prefill"
	// RoleDecode engines receive KV and generate tokens.
	RoleDecode Role = "decode"
)
