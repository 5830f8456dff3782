package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// AcceleratorType names the kind of accelerator an engine runs on.
// +kubebuilder:validation:Enum=NvidiaGPU;Neuron;CPU
type AcceleratorType string

const (
	// AcceleratorNvidiaGPU is an NVIDIA GPU, requested as nvidia.com/gpu.
	AcceleratorNvidiaGPU AcceleratorType = "NvidiaGPU"
	// AcceleratorNeuron is an AWS Neuron device (Trainium/Inferentia), requested as aws.amazon.com/neuron.
	AcceleratorNeuron AcceleratorType = "Neuron"
	// AcceleratorCPU is no accelerator: the engines run vLLM's CPU backend (a CPU build of
	// vLLM, such as vllm-cpu images) on any node, request no device, and keep their KV in
	// host memory. For trying P/D without accelerators, and for tests.
	AcceleratorCPU AcceleratorType = "CPU"
)

// AcceleratorSpec says which accelerators an engine pod gets and how many.
//
// +kubebuilder:validation:XValidation:rule="self.type != 'CPU' || self.allocation != 'DRA'",message="accelerator.allocation DRA needs an accelerator: CPU engines request no device, so there is nothing to claim; use allocation DevicePlugin"
// +kubebuilder:validation:XValidation:rule="!has(self.dra) || self.allocation == 'DRA'",message="accelerator.dra is read only with accelerator.allocation DRA; set allocation: DRA or remove dra"
type AcceleratorSpec struct {
	// type is the kind of accelerator: NvidiaGPU, Neuron, or CPU (none: vLLM's CPU
	// backend, with a policy whose fabric.provider is tcp or shm).
	// +required
	Type AcceleratorType `json:"type"`

	// count is the number of accelerator devices per engine pod. 0 means
	// tensorParallelSize × pipelineParallelSize.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:default=0
	// +optional
	Count int32 `json:"count,omitempty"`

	// allocation is how the kubelet hands each engine its accelerators and EFAs:
	// DevicePlugin, as extended resources (nvidia.com/gpu, aws.amazon.com/neuron,
	// vpc.amazonaws.com/efa), or DRA, by a ResourceClaimTemplate of the pool's own that asks
	// for each accelerator together with its own EFAs (resource.k8s.io/v1).
	// +kubebuilder:default=DevicePlugin
	// +optional
	Allocation DeviceAllocation `json:"allocation,omitempty"`

	// dra says which DeviceClasses the claims ask and what locality they require, under
	// allocation DRA.
	// +optional
	DRA *DRASpec `json:"dra,omitempty"`
}

// PolicyReference names a KVTransferPolicy in the pool's namespace.
type PolicyReference struct {
	// name is the name of the KVTransferPolicy.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +required
	Name string `json:"name"`
}

// PoolReference names a PrefillPool in the DecodePool's namespace.
type PoolReference struct {
	// name is the name of the PrefillPool.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +required
	Name string `json:"name"`
}

// EngineSpec is what PrefillPool and DecodePool have in common: the vLLM engines of one
// pool, their parallelism, accelerators and the transfer policy they use.
//
// +kubebuilder:validation:XValidation:rule="self.accelerator.type != 'CPU' || self.accelerator.count == 0",message="accelerator.count must be 0 for CPU: CPU engines request no device (give them CPU and memory with spec.template's engine container resources)"
// +kubebuilder:validation:XValidation:rule="self.accelerator.type != 'NvidiaGPU' || self.accelerator.count == 0 || self.accelerator.count >= self.tensorParallelSize * self.pipelineParallelSize",message="accelerator.count must be 0 (meaning tensorParallelSize × pipelineParallelSize) or at least tensorParallelSize × pipelineParallelSize for NvidiaGPU: every GPU-sharded rank needs its own GPU"
type EngineSpec struct {
	// model is the model the engines serve, as vLLM takes it: a Hugging Face id
	// (Qwen/Qwen3-32B) or a path inside the image. Prefill and decode must serve the same model.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=512
	// +required
	Model string `json:"model"`

	// image is the vLLM container image of the engines (vllm/vllm-openai:v0.29.0).
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=1024
	// +required
	Image string `json:"image"`

	// replicas is the number of engines in the pool. Each engine is one pod.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:default=1
	// +optional
	Replicas *int32 `json:"replicas,omitempty"`

	// tensorParallelSize is the number of accelerators one engine shards each layer across
	// (vLLM --tensor-parallel-size). A prefill pool's value must not exceed its decode pool's.
	// +kubebuilder:validation:Enum=1;2;4;8;16
	// +kubebuilder:default=1
	// +optional
	TensorParallelSize int32 `json:"tensorParallelSize,omitempty"`

	// pipelineParallelSize is the number of pipeline stages one engine splits the layers into
	// (vLLM --pipeline-parallel-size).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=8
	// +kubebuilder:default=1
	// +optional
	PipelineParallelSize int32 `json:"pipelineParallelSize,omitempty"`

	// blockSize is the number of tokens per KV-cache block (vLLM --block-size). A prefill
	// pool's value must not exceed its decode pool's.
	// +kubebuilder:validation:Enum=8;16;32;64;128
	// +kubebuilder:default=16
	// +optional
	BlockSize int32 `json:"blockSize,omitempty"`

	// accelerator is the kind and number of accelerators each engine pod gets.
	// +required
	Accelerator AcceleratorSpec `json:"accelerator"`

	// instanceType pins engines to nodes of one EC2 instance type (p5en.48xlarge,
	// trn2.48xlarge) through the node.kubernetes.io/instance-type label. It also selects the
	// number of EFA interfaces per accelerator when the policy does not set one.
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z][a-z0-9-]*\.[a-z0-9]+$`
	// +optional
	InstanceType string `json:"instanceType,omitempty"`

	// transferPolicyRef names the KVTransferPolicy that says how KV moves between this pool
	// and its peer. Both pools of a pair must reference the same policy.
	// +required
	TransferPolicyRef PolicyReference `json:"transferPolicyRef"`

	// engineArgs are extra vLLM arguments, appended after the ones kvhandoff renders. Flags
	// that kvhandoff owns (--kv-transfer-config, --tensor-parallel-size, --pipeline-parallel-size,
	// --block-size, --port) are rejected in every spelling vLLM would read as them:
	// underscores for dashes, the dotted form that sets one key of a JSON flag
	// (--kv-transfer-config.engine_id=x), and abbreviations argparse expands (--tensor-par).
	// Set them through the pool's fields and its policy.
	// +kubebuilder:validation:MaxItems=128
	// +kubebuilder:validation:items:MaxLength=2048
	// The rule refuses an argument whose name (before "=", and before the "." of vLLM's
	// dotted form, underscores read as dashes) is -tp, -pp, or a prefix of an owned flag
	// longer than "--": argparse expands any unambiguous prefix to the whole flag.
	// +kubebuilder:validation:items:XValidation:rule="!(self in ['-tp', '-pp'] || self.startsWith('-tp=') || self.startsWith('-pp=') || (self.startsWith('--') && size(self.split('=')[0].split('.')[0]) > 2 && ['--kv-transfer-config', '--tensor-parallel-size', '--pipeline-parallel-size', '--block-size', '--port'].exists(f, f.startsWith(self.split('=')[0].split('.')[0].replace('_', '-')))))",message="engineArgs must not set --kv-transfer-config, --tensor-parallel-size (-tp), --pipeline-parallel-size (-pp), --block-size or --port, in any spelling (underscores, --kv-transfer-config.<key>, or an abbreviation argparse expands): kvhandoff renders them from the pool's fields and its KVTransferPolicy"
	// +listType=atomic
	// +optional
	EngineArgs []string `json:"engineArgs,omitempty"`

	// env is extra environment for the engine container, applied after what kvhandoff
	// renders. It may not set the variables the engine's identity and KV side channel come
	// from (POD_NAME, POD_NAMESPACE, VLLM_NIXL_SIDE_CHANNEL_HOST, VLLM_NIXL_SIDE_CHANNEL_PORT,
	// KVHANDOFF_AGENT_SOCKET): an engine_id taken from elsewhere could impersonate another.
	// Nor those that make the engine load code of their choosing (LD_PRELOAD,
	// LD_LIBRARY_PATH, LD_AUDIT, PYTHONPATH, PYTHONHOME, PYTHONSTARTUP, PYTHONUSERBASE,
	// PYTHONINSPECT, BASH_ENV, ENV): what runs is spec.image's vLLM with kvhandoff's
	// connector, as the engine's command cannot be set either.
	// +kubebuilder:validation:MaxItems=256
	// +kubebuilder:validation:XValidation:rule="self.all(e, !(e.name in ['POD_NAME', 'POD_NAMESPACE', 'VLLM_NIXL_SIDE_CHANNEL_HOST', 'VLLM_NIXL_SIDE_CHANNEL_PORT', 'KVHANDOFF_AGENT_SOCKET']))",message="env must not set POD_NAME, POD_NAMESPACE, VLLM_NIXL_SIDE_CHANNEL_HOST, VLLM_NIXL_SIDE_CHANNEL_PORT or KVHANDOFF_AGENT_SOCKET: the engine's identity and side channel are rendered from its pod"
	// +kubebuilder:validation:XValidation:rule="self.all(e, !(e.name in ['LD_PRELOAD', 'LD_LIBRARY_PATH', 'LD_AUDIT', 'PYTHONPATH', 'PYTHONHOME', 'PYTHONSTARTUP', 'PYTHONUSERBASE', 'PYTHONINSPECT', 'BASH_ENV', 'ENV']))",message="env must not set LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT, PYTHONPATH, PYTHONHOME, PYTHONSTARTUP, PYTHONUSERBASE, PYTHONINSPECT, BASH_ENV or ENV: they would load code of their choosing into the engine"
	// +listType=map
	// +listMapKey=name
	// +optional
	Env []corev1.EnvVar `json:"env,omitempty"`

	// runAsRoot runs the pool's engines as root, as stock vLLM images do on their own. By
	// default they run as a uid of the pool's own (and, with executor Agent, in the agent's
	// socket group): executor-Agent engines share the node's agent sockets with every other
	// engine there, and a root process could replace a socket and intercept them all (and,
	// with a policy's sameNode, signal any process on the host); executor-Engine engines
	// open the EFA devices themselves. Memory registration needs no root: IPC_LOCK, or the
	// node's unlimited locked-memory limit (EKS's EFA AMIs). Setting it is reported as the
	// EngineRunsAsRoot warning.
	// +kubebuilder:default=false
	// +optional
	RunAsRoot bool `json:"runAsRoot,omitempty"`

	// template is a partial pod template (metadata and spec, as in a Deployment) merged over
	// the rendered engine pod last, with Kubernetes' strategic merge, for what this API does
	// not cover: node selectors, affinity, extra volumes, sidecars, priority class. Containers
	// merge by name; the engine container is named "engine". It may be partial, so the API
	// server stores it as written; the manager decodes it strictly and reports unknown
	// fields, and anything the API server refuses in the result, as the InvalidTemplate
	// condition.
	// +kubebuilder:validation:Type=object
	// +kubebuilder:pruning:PreserveUnknownFields
	// +optional
	Template *runtime.RawExtension `json:"template,omitempty"`
}

// EngineStatus is the identity of one running engine, published so that a router can
// dispatch prefill and decode in parallel from the first request.
type EngineStatus struct {
	// podName is the name of the engine's pod.
	// +required
	PodName string `json:"podName"`

	// engineID is the vLLM engine_id of the engine, unique and stable across restarts of the pod.
	// +optional
	EngineID string `json:"engineID,omitempty"`

	// host is the pod IP the engine's KV side channel listens on.
	// +optional
	Host string `json:"host,omitempty"`

	// sideChannelPort is the port of the engine's KV side channel (VLLM_NIXL_SIDE_CHANNEL_PORT).
	// +optional
	SideChannelPort int32 `json:"sideChannelPort,omitempty"`

	// agent is host:port of the transfer agent on the engine's node, for a policy with
	// executor Agent: the engine's KV side channel, which a push decode leg names.
	// +optional
	Agent string `json:"agent,omitempty"`

	// tensorParallelSize is the engine's tensor-parallel size.
	// +optional
	TensorParallelSize int32 `json:"tensorParallelSize,omitempty"`

	// pipelineParallelSize is the engine's pipeline-parallel size.
	// +optional
	PipelineParallelSize int32 `json:"pipelineParallelSize,omitempty"`

	// nodeName is the node the engine's pod runs on.
	// +optional
	NodeName string `json:"nodeName,omitempty"`

	// compatHash is the kvhandoff.io/compat-hash the engine's pod runs with. A router pairs
	// a prefill and a decode engine only when theirs are equal.
	// +optional
	CompatHash string `json:"compatHash,omitempty"`

	// ready is true when the engine's pod is Ready: its OpenAI API answers.
	// +optional
	Ready bool `json:"ready,omitempty"`

	// agentSession is true when the transfer agent of the engine's node reports a session
	// of this engine (executor Agent only): its KV can move.
	// +optional
	AgentSession bool `json:"agentSession,omitempty"`

	// fabric is the libfabric provider the agent of the engine's node opened (executor
	// Agent only); empty while that agent reports none.
	// +optional
	Fabric string `json:"fabric,omitempty"`
}

// PoolStatus is the observed state of a PrefillPool or DecodePool.
type PoolStatus struct {
	// observedGeneration is the metadata.generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`

	// replicas is the number of engine pods that exist.
	// +optional
	Replicas int32 `json:"replicas,omitempty"`

	// readyReplicas is the number of engine pods that are ready to serve.
	// +optional
	ReadyReplicas int32 `json:"readyReplicas,omitempty"`

	// selector is the label selector of the pool's engine pods, in string form, for the
	// /scale subresource (HorizontalPodAutoscaler, kubectl scale).
	// +optional
	Selector string `json:"selector,omitempty"`

	// mode is the transfer mode (Push or Pull) of the policy the engines were rendered with.
	// +optional
	Mode TransferMode `json:"mode,omitempty"`

	// handoffFailurePolicy is the policy's, which a DecodePool's router carries out.
	// +optional
	HandoffFailurePolicy HandoffFailurePolicy `json:"handoffFailurePolicy,omitempty"`

	// handoffFailureLimitPercent is the policy's, which a DecodePool's router checks its
	// failed and fallen-back handoffs against.
	// +optional
	HandoffFailureLimitPercent int32 `json:"handoffFailureLimitPercent,omitempty"`

	// healthWindowSeconds is the policy's: how far back a DecodePool's router looks for
	// failed handoffs.
	// +optional
	HealthWindowSeconds int32 `json:"healthWindowSeconds,omitempty"`

	// routing is the policy's, which a DecodePool's routers and endpoint picker follow.
	// +optional
	Routing *RoutingSpec `json:"routing,omitempty"`

	// compatHash is the kvhandoff.io/compat-hash that every engine of the pool runs with;
	// empty while a rollout leaves engines of different configurations side by side.
	// A DecodePool is Paired when its compatHash equals its PrefillPool's.
	// +optional
	CompatHash string `json:"compatHash,omitempty"`

	// routerService is, on a DecodePool whose router is enabled, the name of the Service
	// clients send requests to (port 8000, named http).
	// +optional
	RouterService string `json:"routerService,omitempty"`

	// engines lists the identity of every engine pod that has one.
	// +listType=map
	// +listMapKey=podName
	// +optional
	Engines []EngineStatus `json:"engines,omitempty"`

	// warnings are what the manager found questionable but rendered anyway (an image tag
	// that names no vLLM version, KV the agent cannot move between every pair). Each is
	// also sent as a Warning event once, when it first appears here.
	// +listType=map
	// +listMapKey=reason
	// +optional
	Warnings []PoolWarning `json:"warnings,omitempty"`

	// autoscaling is set while a DecodePool's autoscaling owns the pool's replicas.
	// +optional
	Autoscaling *AutoscalingStatus `json:"autoscaling,omitempty"`

	// conditions are Ready, Progressing, Degraded and TransferHealthy (and Paired on a
	// DecodePool), in the
	// kstatus convention that Argo CD and Flux read health from.
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// PoolWarning is one warning about a pool that did not stop its rendering.
type PoolWarning struct {
	// reason is the warning's CamelCase reason, also the reason of its event.
	// +required
	Reason string `json:"reason"`
	// message says what was found and what it costs.
	// +required
	Message string `json:"message"`
}

// Condition types of PrefillPool and DecodePool.
const (
	// ConditionReady is True when every engine of the pool is ready and correctly wired.
	ConditionReady = "Ready"
	// ConditionProgressing is True while the pool's engines are being created, rolled or scaled.
	ConditionProgressing = "Progressing"
	// ConditionDegraded is True when the pool cannot reach its desired state without a change by the user.
	ConditionDegraded = "Degraded"
	// ConditionPaired is True on a DecodePool when it and its PrefillPool can exchange KV.
	ConditionPaired = "Paired"
	// ConditionTransferHealthy is True when the transfer agents of the pool's engines run
	// the policy's provider and see no failures, and (on a DecodePool) its routers hand
	// requests off within the policy's limit. False makes the pool Degraded and not Ready.
	ConditionTransferHealthy = "TransferHealthy"
	// ConditionInferencePoolReady is, on a DecodePool with gateway.inferencePool, True when
	// its InferencePool is accepted by a gateway with its references resolved; False when
	// the CRD is missing or a gateway refused it. Informational: it does not make the pool
	// Degraded, since the router serves clients without the gateway.
	ConditionInferencePoolReady = "InferencePoolReady"
)

// Reasons of the InferencePoolReady condition.
const (
	// ReasonInferencePoolAccepted: a gateway accepted the InferencePool and resolved its
	// endpoint picker.
	ReasonInferencePoolAccepted = "Accepted"
	// ReasonInferencePoolCRDMissing: the cluster has no InferencePool CRD
	// (inference.networking.k8s.io/v1); install the Gateway API Inference Extension's CRDs.
	ReasonInferencePoolCRDMissing = "InferencePoolCRDMissing"
	// ReasonNoParentGateway: no gateway reports on the InferencePool yet: no HTTPRoute of a
	// gateway that implements the extension names it.
	ReasonNoParentGateway = "NoParentGateway"
	// ReasonNotAccepted: a gateway reported the InferencePool not accepted, or its
	// references unresolved; the message carries the gateway's reason.
	ReasonNotAccepted = "NotAccepted"
)

// Reasons of the TransferHealthy condition. The agents and routers report them (package
// health), the manager puts the worst on the pool, naming the nodes or pods.
const (
	// ReasonTransfersHealthy: every agent and router of the pool sees nothing wrong.
	ReasonTransfersHealthy = "TransfersHealthy"
	// ReasonAgentNotReady: an engine runs on a node whose transfer agent is missing or not
	// ready (its provider cannot be opened, or it stopped), so its KV cannot move.
	ReasonAgentNotReady = "AgentNotReady"
	// ReasonProviderFallback: an agent of the pool's engines runs another libfabric
	// provider than the policy asks for (TCP where EFA was asked: about 100 times slower).
	ReasonProviderFallback = "ProviderFallback"
	// ReasonPeersLost: transfers failed because the other side's agent connection broke.
	ReasonPeersLost = "PeersLost"
	// ReasonTransferFailures: more than 5% (and at least 3) of an agent's attempts failed
	// over its health window.
	ReasonTransferFailures = "TransferFailures"
	// ReasonLeasesExpiring: at least 3 leases or TTLs ran out at an agent over its health
	// window: engines stop heartbeating, or leaseSeconds is too short.
	ReasonLeasesExpiring = "LeasesExpiring"
	// ReasonHandoffFailures: a router failed, or served on decode alone, more of its
	// requests than the policy's handoffFailureLimitPercent over its health window.
	ReasonHandoffFailures = "HandoffFailures"
)

// Reasons of the pool conditions. Those that say why a pool cannot be rendered also tell
// the user what to change, in the condition's message.
const (
	// ReasonPolicyNotFound: the KVTransferPolicy named by transferPolicyRef does not exist.
	ReasonPolicyNotFound = "PolicyNotFound"
	// ReasonPrefillPoolNotFound: the PrefillPool named by prefillPoolRef does not exist.
	ReasonPrefillPoolNotFound = "PrefillPoolNotFound"
	// ReasonPolicyMismatch: the two pools of a pair reference different policies.
	ReasonPolicyMismatch = "PolicyMismatch"
	// ReasonTensorParallelMismatch: the pools' tensorParallelSizes cannot pair: with
	// executor Engine the prefill pool's exceeds the decode pool's; with executor Agent
	// DecodePools of different sizes name one PrefillPool.
	ReasonTensorParallelMismatch = "TensorParallelMismatch"
	// ReasonPipelineParallelMismatch: with executor Agent the pools' pipelineParallelSizes differ.
	ReasonPipelineParallelMismatch = "PipelineParallelMismatch"
	// ReasonBlockSizeMismatch: the prefill pool's blockSize exceeds the decode pool's.
	ReasonBlockSizeMismatch = "BlockSizeMismatch"
	// ReasonModelMismatch: the two pools of a pair serve different models.
	ReasonModelMismatch = "ModelMismatch"
	// ReasonKVCacheDtypeMismatch: the two pools of a pair store KV in different dtypes.
	ReasonKVCacheDtypeMismatch = "KVCacheDtypeMismatch"
	// ReasonUnsupportedEngineVersion: the image's vLLM version is too old for safety or for the mode, or outside the range the connector is tested with (executor Agent).
	ReasonUnsupportedEngineVersion = "UnsupportedEngineVersion"
	// ReasonUnknownInstanceType: the number of EFA interfaces cannot be derived from the pool and policy.
	ReasonUnknownInstanceType = "UnknownInstanceType"
	// ReasonInstanceTypeMismatch: the instance type carries another kind of accelerator than the pool asks for.
	ReasonInstanceTypeMismatch = "InstanceTypeMismatch"
	// ReasonSameNodeUnsupported: the policy lets pairs share a node, and the pool's
	// accelerators have no intra-node transport in the agent (CUDA IPC is NVIDIA's).
	ReasonSameNodeUnsupported = "SameNodeUnsupported"
	// ReasonUnsupportedFabric: the policy's fabric provider cannot serve the pool's
	// accelerators (EFA interfaces are counted per accelerator; CPU engines have none).
	ReasonUnsupportedFabric = "UnsupportedFabric"
	// ReasonUnclaimableDevices: under accelerator.allocation DRA, the pool's devices do not
	// fit one ResourceClaim of an accelerator and its own EFAs per request pair.
	ReasonUnclaimableDevices = "UnclaimableDevices"
	// ReasonPrivilegedNotAllowed: the policy's fabric.privileged would run privileged engines
	// in a namespace the cluster's administrators have not labelled kvhandoff.io/privileged-engines=true.
	ReasonPrivilegedNotAllowed = "PrivilegedNotAllowed"
	// ReasonInvalidTemplate: spec.template sets what a template may not (docs/api.md), has
	// unknown fields, or the API server refused the engine workload it produced.
	ReasonInvalidTemplate = "InvalidTemplate"
	// ReasonAutoscalingConflict: more than one DecodePool with spec.autoscaling names this
	// PrefillPool; only one may size it.
	ReasonAutoscalingConflict = "AutoscalingConflict"
	// ReasonNameConflict: a workload with the pool's name exists and belongs to something else.
	ReasonNameConflict = "NameConflict"

	// ReasonEnginesReady: every engine is ready and runs the current configuration.
	ReasonEnginesReady = "EnginesReady"
	// ReasonEnginesNotReady: some engines are not ready or not yet updated.
	ReasonEnginesNotReady = "EnginesNotReady"
	// ReasonEnginesUnschedulable: the scheduler cannot place some engines (capacity,
	// instance type, placement rules); the message carries the scheduler's reason.
	ReasonEnginesUnschedulable = "EnginesUnschedulable"
	// ReasonDevicesUnallocatable: under accelerator.allocation DRA, the scheduler finds no
	// node whose devices satisfy the pool's claim (too few accelerators, or EFAs that share
	// no locality attribute with them); the message says what the claim asks and carries the
	// scheduler's reason.
	ReasonDevicesUnallocatable = "DevicesUnallocatable"
	// ReasonRollingOut: engines are being created, updated or scaled.
	ReasonRollingOut = "RollingOut"
	// ReasonRolledOut: every engine runs the current configuration.
	ReasonRolledOut = "RolledOut"
	// ReasonAsExpected: nothing is wrong.
	ReasonAsExpected = "AsExpected"
	// ReasonCompatible: both pools run engines with equal compat-hashes.
	ReasonCompatible = "Compatible"
	// ReasonCompatHashMismatch: the pools' engines differ in something that must match
	// (model, KV-cache dtype, mode, connector, image), or one of them is still rolling.
	ReasonCompatHashMismatch = "CompatHashMismatch"
)
