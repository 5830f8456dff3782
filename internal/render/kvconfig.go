package render

import (
	"encoding/json"
	"strings"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/compat"
)

// kvTransferConfig is vLLM's --kv-transfer-config.
type kvTransferConfig struct {
	KVConnector         string      `json:"kv_connector"`
	KVConnectorModule   string      `json:"kv_connector_module_path,omitempty"`
	KVRole              string      `json:"kv_role"`
	EngineID            string      `json:"engine_id"`
	KVBufferDevice      string      `json:"kv_buffer_device,omitempty"`
	KVLoadFailurePolicy string      `json:"kv_load_failure_policy"`
	ExtraConfig         extraConfig `json:"kv_connector_extra_config"`
}

type extraConfig struct {
	Backends                []string `json:"backends,omitempty"`
	KVLeaseDuration         int32    `json:"kv_lease_duration"`
	PushRegistrationTimeout int32    `json:"push_registration_timeout,omitempty"`
	DecoderKVBlocksTTL      int32    `json:"decoder_kv_blocks_ttl"`
	// The kvhandoff connector's (executor Agent): the engine's mode and role, and the
	// agent's socket.
	Mode   string `json:"mode,omitempty"`
	Role   string `json:"role,omitempty"`
	Socket string `json:"socket,omitempty"`
	// LayerStreaming: a push prefill engine reports each layer as it is computed.
	LayerStreaming bool `json:"layer_streaming,omitempty"`
	// SameNode: pairs may share a node, where the agent moves GPU KV (CUDA IPC); without
	// it the connector refuses GPU KV at start, which nothing could move.
	SameNode bool `json:"same_node,omitempty"`
	// PeerTPSize: the other side's tensor-parallel size, where it is not this engine's.
	PeerTPSize int32 `json:"peer_tp_size,omitempty"`
}

// The kvhandoff vLLM connector (vllm-connector/), which executor Agent renders: its class,
// and its module, which the connector init container puts on the engine's PYTHONPATH.
const (
	AgentConnector           = "KVHandoffConnector"
	AgentConnectorModulePath = "kvhandoff_vllm.connector"
)

// KVTransferConfig renders the --kv-transfer-config JSON of an engine of role. Its
// engine_id refers to $(POD_NAME) and $(POD_NAMESPACE), which the kubelet expands from
// the container's downward-API environment.
// peerTP is the other side's tensor-parallel size (0: the same).
func KVTransferConfig(role kvv1.Role, spec *kvv1.EngineSpec, policy *kvv1.KVTransferPolicySpec, peerTP int32) string {
	cfg := kvTransferConfig{
		KVConnector: compat.Connector(policy.Mode),
		// Both roles are kv_both: the connector decides direction per request, and push
		// needs the decode side to register memory as well as receive.
		KVRole:              "kv_both",
		EngineID:            EngineID("$(POD_NAME)", "$(POD_NAMESPACE)"),
		KVLoadFailurePolicy: strings.ToLower(string(policy.LoadFailurePolicy)),
		ExtraConfig: extraConfig{
			Backends:           []string{strings.ToUpper(string(policy.Backend))},
			KVLeaseDuration:    policy.LeaseSeconds,
			DecoderKVBlocksTTL: policy.BlocksTTLSeconds,
		},
	}
	// GPUs hold the KV in device memory; on Neuron the connector's default applies.
	if spec.Accelerator.Type == kvv1.AcceleratorNvidiaGPU {
		cfg.KVBufferDevice = "cuda"
	}
	if policy.Mode == kvv1.TransferPush {
		cfg.ExtraConfig.PushRegistrationTimeout = policy.RegistrationTimeoutSeconds
	}
	if policy.Executor == kvv1.ExecutorAgent {
		// The connector registers the KV where vLLM keeps it (host or GPU memory) with the
		// agent; vLLM's own KV buffer setting does not apply.
		cfg.KVConnector, cfg.KVConnectorModule, cfg.KVBufferDevice = AgentConnector, AgentConnectorModulePath, ""
		cfg.ExtraConfig.Backends = nil
		cfg.ExtraConfig.Mode = strings.ToLower(string(policy.Mode))
		cfg.ExtraConfig.Role = strings.ToLower(string(role))
		cfg.ExtraConfig.Socket = AgentSocket
		cfg.ExtraConfig.LayerStreaming = policy.LayerStreaming && role == kvv1.RolePrefill
		cfg.ExtraConfig.SameNode = policy.SameNode != kvv1.SameNodeForbid
		if peerTP != spec.TensorParallelSize {
			cfg.ExtraConfig.PeerTPSize = peerTP
		}
	}
	data, err := json.Marshal(cfg)
	if err != nil {
		panic(err) // a struct of strings and ints always marshals
	}
	return string(data)
}
