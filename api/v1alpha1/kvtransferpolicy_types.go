package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TransferMode says which side drives the KV handoff.
// +kubebuilder:validation:Enum=Push;Pull
type TransferMode string

const (
	// TransferPush: decode registers its destination memory while prefill still runs, and
	// prefill writes the KV into it as soon as it is done (NixlPushConnector). Lowest
	// time-to-first-token under load; no bidirectional KV.
	TransferPush TransferMode = "Push"
	// TransferPull: after prefill, decode reads the KV from prefill's memory (NixlConnector).
	// Lets the router pick the decode engine late and supports bidirectional KV.
	TransferPull TransferMode = "Pull"
)

// TransferExecutor says which program moves the KV bytes.
// +kubebuilder:validation:Enum=Engine;Agent
type TransferExecutor string

const (
	// ExecutorEngine: vLLM's NIXL connector inside the engine moves the KV.
	ExecutorEngine TransferExecutor = "Engine"
	// ExecutorAgent: the kvhandoff transfer agent on each node moves the KV; engines talk to
	// it over a node-local socket.
	ExecutorAgent TransferExecutor = "Agent"
)

// TransferBackend is the communication library under the connector.
// +kubebuilder:validation:Enum=Libfabric;UCX
type TransferBackend string

const (
	// BackendLibfabric is libfabric (NIXL's LIBFABRIC backend); the right choice on EFA.
	BackendLibfabric TransferBackend = "Libfabric"
	// BackendUCX is UCX (NIXL's UCX backend). Over EFA it runs at about TCP speed.
	BackendUCX TransferBackend = "UCX"
)

// FabricProvider is the libfabric provider the engines' KV traffic uses.
// +kubebuilder:validation:Enum=efa;tcp;shm
type FabricProvider string

const (
	// ProviderEFA is AWS Elastic Fabric Adapter: RDMA between nodes of one subnet.
	ProviderEFA FabricProvider = "efa"
	// ProviderTCP is libfabric over TCP sockets (tcp;ofi_rxm): any network, for development.
	ProviderTCP FabricProvider = "tcp"
	// ProviderSHM is libfabric shared memory: prefill and decode on the same node only.
	ProviderSHM FabricProvider = "shm"
)

// LoadFailurePolicy says what a decode engine does when KV for a request cannot be loaded.
// +kubebuilder:validation:Enum=Fail;Recompute
type LoadFailurePolicy string

const (
	// LoadFailureFail fails the request with an error the client sees: a transfer
	// problem shows at once, in the request and in the engines' failure counts.
	LoadFailureFail LoadFailurePolicy = "Fail"
	// LoadFailureRecompute runs the prefill again on the decode engine: the request
	// succeeds, at the cost of a whole prefill on decode (slowing its other requests),
	// and a transfer that keeps failing shows only as slower time-to-first-token.
	LoadFailureRecompute LoadFailurePolicy = "Recompute"
)

// HandoffFailurePolicy says what a DecodePool's router does with a request whose prefill
// side cannot serve it.
// +kubebuilder:validation:Enum=Fail;ServeOnDecode
type HandoffFailurePolicy string

const (
	// HandoffFailureFail answers the request with a named error: 502 naming the prefill
	// engine that failed, or 503 naming what is missing.
	HandoffFailureFail HandoffFailurePolicy = "Fail"
	// HandoffFailureServeOnDecode serves the request on a decode engine alone, which
	// prefills it itself (aggregated serving): the client gets its answer, later, and the
	// decode engine's other requests slow down meanwhile. Every such request is counted
	// (kvhandoff_router_fallbacks_total) and logged with its id.
	HandoffFailureServeOnDecode HandoffFailurePolicy = "ServeOnDecode"
)

// SameNodePolicy says whether a decode engine may run on a node that runs a prefill engine
// of its pair.
// +kubebuilder:validation:Enum=Forbid;Allow;Prefer
type SameNodePolicy string

const (
	// SameNodeForbid keeps decode engines off the nodes of their prefill engines when the
	// fabric is efa, which has no intra-host loopback. tcp and shm place no such rule.
	SameNodeForbid SameNodePolicy = "Forbid"
	// SameNodeAllow lets the scheduler put decode beside prefill; the transfer agent moves
	// such pairs' KV between the GPUs of the node with CUDA IPC (NVLink on P5en).
	SameNodeAllow SameNodePolicy = "Allow"
	// SameNodePrefer asks the scheduler to put decode beside prefill where it can: a P5en's
	// NVLink moves KV about eight times faster than its GPU's EFA NICs.
	SameNodePrefer SameNodePolicy = "Prefer"
)

// FabricSpec is the network the KV travels over and what engine pods need for it.
//
// +kubebuilder:validation:XValidation:rule="!has(self.hugepages2Mi) || quantity(string(self.hugepages2Mi)).isGreaterThan(quantity('0'))",message="fabric.hugepages2Mi must be greater than zero when set; omit it for no hugepages"
type FabricSpec struct {
	// provider is the libfabric provider: efa (AWS EFA, production), tcp or shm (development).
	// +kubebuilder:default=efa
	// +optional
	Provider FabricProvider `json:"provider,omitempty"`

	// efaPerAccelerator is the number of EFA interfaces each accelerator gets. 0 takes it
	// from the instance type (p5en.48xlarge 2 per GPU, p5.48xlarge 4, trn2.48xlarge 1 per
	// Neuron device, trn1.32xlarge 1 per 2 devices). Used only with provider efa.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=32
	// +kubebuilder:default=0
	// +optional
	EFAPerAccelerator int32 `json:"efaPerAccelerator,omitempty"`

	// gpuDirect lets the NIC read and write accelerator memory directly
	// (FI_EFA_USE_DEVICE_RDMA=1). Without it KV is staged through host memory.
	// +kubebuilder:default=true
	// +optional
	GPUDirect *bool `json:"gpuDirect,omitempty"`

	// hugepages2Mi is the amount of 2 MiB hugepages each engine pod requests (some EFA
	// stacks need them for registered buffers). Unset requests none.
	// +optional
	Hugepages2Mi *resource.Quantity `json:"hugepages2Mi,omitempty"`

	// privileged runs engine containers privileged. false grants only IPC_LOCK, which is
	// what memory registration needs; some older EFA stacks need more. A privileged
	// engine owns its node, so the manager honours it only in namespaces the cluster's
	// administrators labelled kvhandoff.io/privileged-engines=true; elsewhere the pools
	// report PrivilegedNotAllowed.
	// +kubebuilder:default=false
	// +optional
	Privileged bool `json:"privileged,omitempty"`
}

// KVTransferPolicySpec says how KV moves from prefill to decode.
//
// +kubebuilder:validation:XValidation:rule="!(self.mode == 'Push' && self.bidirectional)",message="mode: Push does not support bidirectional KV (bidirectional: true): push writes only from prefill into decode; use mode: Pull to send KV back to prefill"
// +kubebuilder:validation:XValidation:rule="self.registrationTimeoutSeconds >= self.leaseSeconds",message="registrationTimeoutSeconds must be greater than or equal to leaseSeconds: a registration must be able to outlive one lease period"
// +kubebuilder:validation:XValidation:rule="self.executor != 'Agent' || self.backend == 'Libfabric'",message="executor: Agent moves KV with the kvhandoff transfer agent, which speaks libfabric only; set backend: Libfabric or executor: Engine"
// +kubebuilder:validation:XValidation:rule="self.sameNode == 'Forbid' || self.executor == 'Agent'",message="sameNode: Allow and Prefer need executor: Agent: pairs on one node move KV through the kvhandoff transfer agent's CUDA IPC transport; set executor: Agent or sameNode: Forbid"
// +kubebuilder:validation:XValidation:rule="!self.layerStreaming || (self.mode == 'Push' && self.executor == 'Agent')",message="layerStreaming needs mode: Push and executor: Agent: the kvhandoff connector streams each layer into a push registration as it is computed; a pull reads whole blocks after prefill, and vLLM's own connectors do not stream layers"
type KVTransferPolicySpec struct {
	// mode is Push (decode pre-registers memory, prefill writes into it) or Pull (decode
	// reads from prefill after prefill finishes).
	// +required
	Mode TransferMode `json:"mode"`

	// executor is the program that moves the KV: Engine (vLLM's NIXL connector) or Agent
	// (the kvhandoff transfer agent on each node).
	// +kubebuilder:default=Engine
	// +optional
	Executor TransferExecutor `json:"executor,omitempty"`

	// backend is the communication library: Libfabric or UCX.
	// +kubebuilder:default=Libfabric
	// +optional
	Backend TransferBackend `json:"backend,omitempty"`

	// fabric is the network the KV travels over and what engine pods need for it.
	// +kubebuilder:default={}
	// +optional
	Fabric FabricSpec `json:"fabric,omitempty"`

	// leaseSeconds is how long decode memory registered for a request (push) or prefill
	// blocks held for a request (pull) stay reserved without a heartbeat
	// (vLLM kv_lease_duration).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=3600
	// +kubebuilder:default=30
	// +optional
	LeaseSeconds int32 `json:"leaseSeconds,omitempty"`

	// registrationTimeoutSeconds is how long a push registration waits for prefill to finish
	// before it is dropped (vLLM push_registration_timeout).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=86400
	// +kubebuilder:default=480
	// +optional
	RegistrationTimeoutSeconds int32 `json:"registrationTimeoutSeconds,omitempty"`

	// blocksTTLSeconds is how long a prefill engine holds a finished request's KV blocks
	// for its decode engine (a push registration to meet them, or a pull to read them)
	// before it frees them; the connector's decoder_kv_blocks_ttl.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=86400
	// +kubebuilder:default=480
	// +optional
	BlocksTTLSeconds int32 `json:"blocksTTLSeconds,omitempty"`

	// loadFailurePolicy is what decode does when a request's KV cannot be loaded (vLLM's
	// kv_load_failure_policy): Fail the request, the default, so a failing transfer is
	// seen; or Recompute the prefill on the decode engine, which serves the request but
	// costs decode a whole prefill and can hide a transfer that keeps failing (vLLM made
	// fail its own default for that reason).
	// +kubebuilder:default=Fail
	// +optional
	LoadFailurePolicy LoadFailurePolicy `json:"loadFailurePolicy,omitempty"`

	// handoffFailurePolicy is what the router does with a request whose prefill leg failed
	// on every engine tried, or that arrives while its DecodePool's PrefillPool has no
	// ready engine: Fail it with a named error, the default, or ServeOnDecode, serving it
	// on a decode engine alone. It concerns only the router: changing it rolls no engine.
	// +kubebuilder:default=Fail
	// +optional
	HandoffFailurePolicy HandoffFailurePolicy `json:"handoffFailurePolicy,omitempty"`

	// handoffFailureLimitPercent is the share of a DecodePool's requests, over the router's
	// health window (healthWindowSeconds), whose handoff may fail — answered with an
	// error, or served on decode alone under ServeOnDecode — before the pool reports
	// TransferHealthy False (HandoffFailures) and Degraded. It concerns only the router:
	// changing it rolls no engine.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=5
	// +optional
	HandoffFailureLimitPercent *int32 `json:"handoffFailureLimitPercent,omitempty"`

	// healthWindowSeconds is how far back a DecodePool's router looks when it checks its
	// failed handoffs against handoffFailureLimitPercent: a pool reports HandoffFailures as
	// soon as the failures within the window pass the limit, and is TransferHealthy again
	// once they have aged out of it. Shorter reports recovery sooner, and a single burst
	// of failures weighs more. It concerns only the router: changing it rolls no engine.
	// +kubebuilder:validation:Minimum=10
	// +kubebuilder:validation:Maximum=3600
	// +kubebuilder:default=60
	// +optional
	HealthWindowSeconds *int32 `json:"healthWindowSeconds,omitempty"`

	// routing is how the routers and the gateway's endpoint picker choose a request's
	// engines: decode by load alone (the default) or by prefix-cache overlap and load,
	// and which requests skip prefill. It concerns only the routers: changing it rolls no
	// engine.
	// +kubebuilder:default={}
	// +optional
	Routing *RoutingSpec `json:"routing,omitempty"`

	// bidirectional lets KV also flow from decode back to prefill. Pull mode only.
	// +kubebuilder:default=false
	// +optional
	Bidirectional bool `json:"bidirectional,omitempty"`

	// layerStreaming has prefill engines report each layer's KV to the transfer agent as
	// the forward pass computes it, so the agent writes a layer while later ones compute
	// and only the last is left to move when prefill ends. Push with executor Agent only.
	// +kubebuilder:default=false
	// +optional
	LayerStreaming bool `json:"layerStreaming,omitempty"`

	// sameNode says whether a decode engine may share a node with a prefill engine of its
	// pair: Forbid (with provider efa, decode pods keep off prefill's nodes), Allow (no such
	// rule) or Prefer (decode pods are placed beside prefill where they fit). Allow and
	// Prefer need executor Agent, which moves those pairs' KV over NVLink with CUDA IPC;
	// their engine pods share the host's PID namespace, which CUDA IPC needs.
	// +kubebuilder:default=Forbid
	// +optional
	SameNode SameNodePolicy `json:"sameNode,omitempty"`
}

// KVTransferPolicyStatus is the observed state of a KVTransferPolicy.
type KVTransferPolicyStatus struct {
	// observedGeneration is the metadata.generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// conditions describe the policy's state.
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// KVTransferPolicy says how KV moves from a PrefillPool to a DecodePool: push or pull,
// fabric, leases and timeouts, failure policy. Both pools of a pair reference one policy.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=kvtp,categories=kvhandoff
// +kubebuilder:printcolumn:name="Mode",type=string,JSONPath=`.spec.mode`
// +kubebuilder:printcolumn:name="Executor",type=string,JSONPath=`.spec.executor`
// +kubebuilder:printcolumn:name="Backend",type=string,JSONPath=`.spec.backend`
// +kubebuilder:printcolumn:name="Provider",type=string,JSONPath=`.spec.fabric.provider`
// +kubebuilder:printcolumn:name="Lease",type=integer,JSONPath=`.spec.leaseSeconds`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type KVTransferPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec says how KV moves.
	// +required
	Spec KVTransferPolicySpec `json:"spec"`

	// status is the observed state of the policy.
	// +optional
	Status KVTransferPolicyStatus `json:"status,omitempty"`
}

// KVTransferPolicyList is a list of KVTransferPolicy.
//
// +kubebuilder:object:root=true
type KVTransferPolicyList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []KVTransferPolicy `json:"items"`
}
