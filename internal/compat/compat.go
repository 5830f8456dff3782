// Package compat decides whether pools and policies can be rendered into engines that
// exchange KV: the checks that need the API server's view of several objects (and so
// cannot be CEL), the engine version rules, and the compat-hash that labels engines.
package compat

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/instancetype"
)

// Problem is why a pool cannot be rendered as written: a condition reason and a message
// that tells the user what to change.
type Problem struct {
	Reason  string
	Message string
}

func (p *Problem) Error() string { return p.Reason + ": " + p.Message }

func problem(reason, format string, args ...any) *Problem {
	return &Problem{Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// Connector is the vLLM KV connector of a transfer mode. Newer vLLM treats NixlConnector
// as the pull connector.
func Connector(mode kvv1.TransferMode) string {
	if mode == kvv1.TransferPush {
		return "NixlPushConnector"
	}
	return "NixlConnector"
}

// KVCacheDtype is the dtype vLLM stores KV in, as the engine arguments select it: the
// --kv-cache-dtype, or, when that is auto, the model's dtype (--dtype), each normalized
// the way vLLM reads its aliases (fp8 is fp8_e4m3, half is float16, float is float32) and
// in any spelling vLLM accepts (underscores, "=value" or a separate value; the last
// occurrence wins). "auto" means the model's own dtype from its config.
func KVCacheDtype(engineArgs []string) string {
	if kv := dtypeAlias(flagValue(engineArgs, "--kv-cache-dtype")); kv != "auto" {
		return kv
	}
	return dtypeAlias(flagValue(engineArgs, "--dtype"))
}

var dtypeAliases = map[string]string{"": "auto", "fp8": "fp8_e4m3", "half": "float16", "float": "float32"}

func dtypeAlias(v string) string {
	v = strings.ToLower(v)
	if a, ok := dtypeAliases[v]; ok {
		return a
	}
	return v
}

// flagValue is the value of the last occurrence of flag in args ("" when absent).
func flagValue(args []string, flag string) string {
	value := ""
	for i, a := range args {
		name, v, hasValue := strings.Cut(a, "=")
		if strings.ReplaceAll(name, "_", "-") != flag {
			continue
		}
		switch {
		case hasValue:
			value = v
		case i+1 < len(args):
			value = args[i+1]
		}
	}
	return value
}

// Hash is the compat-hash of engines rendered from spec and policy with the KV layout
// layout (KVLayout): equal hashes mean the engines can exchange KV. Tensor-parallel and
// block sizes are left out on purpose: engines of different sizes exchange KV where
// CheckPair allows it, and then both lay it out head by head, which the layout says.
func Hash(spec *kvv1.EngineSpec, policy *kvv1.KVTransferPolicySpec, layout string) string {
	h := sha256.New()
	parts := []string{spec.Model, KVCacheDtype(spec.EngineArgs), string(policy.Mode), Connector(policy.Mode), spec.Image}
	if layout != "" { // vLLM's default layout leaves the hashes engines already run unchanged
		parts = append(parts, layout)
	}
	for _, part := range parts {
		h.Write([]byte(part))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil))[:10]
}

// LayoutHND is vLLM's KV-cache layout (VLLM_KV_CACHE_LAYOUT) in which a block holds its
// KV heads one after another, so that each head's share of a block is contiguous.
const LayoutHND = "HND"

// KVLayout is the KV-cache layout GPU engines of spec must run with to pair with engines of
// tensor-parallel size peerTP (0: spec's own): HND where the sizes differ, since each rank
// then sends or receives a head slice of every block ("": vLLM's default). vLLM's CPU and
// Neuron KV is laid out head by head already.
func KVLayout(spec *kvv1.EngineSpec, peerTP int32) string {
	if spec.Accelerator.Type == kvv1.AcceleratorNvidiaGPU && peerTP != 0 && peerTP != spec.TensorParallelSize {
		return LayoutHND
	}
	return ""
}

// Warning is worth an event but does not stop rendering; Reason is the event's.
type Warning struct{ Reason, Message string }

// Warning reasons.
const (
	// WarningEngineVersionUnknown: the image tag names no vLLM version to check.
	WarningEngineVersionUnknown = "EngineVersionUnknown"
	// WarningEngineRunsAsRoot: a pool's engines run as root (runAsRoot): beside EFA
	// devices, and with executor Agent beside the node's shared agent sockets.
	WarningEngineRunsAsRoot = "EngineRunsAsRoot"
	// WarningDeviceMemoryUnsupported: executor Agent where the agent cannot move the
	// accelerators' KV, or not between every pair (device memory between nodes needs its
	// dmabuf path; GPU memory within a node moves by CUDA IPC).
	WarningDeviceMemoryUnsupported = "DeviceMemoryUnsupported"
)

// CheckPool checks what one pool and its policy must satisfy.
func CheckPool(spec *kvv1.EngineSpec, policy *kvv1.KVTransferPolicySpec) (p *Problem, warnings []Warning) {
	if v, ok := ImageVersion(spec.Image); !ok {
		warnings = append(warnings, Warning{WarningEngineVersionUnknown, fmt.Sprintf("cannot read a vLLM version from image %q; kvhandoff needs "+
			"vLLM >= %s (>= %s for Push, %s for executor Agent) and cannot check it", spec.Image, MinSafeVersion, MinPushVersion, AgentRange())})
	} else if v.Less(MinSafeVersion) {
		return problem(kvv1.ReasonUnsupportedEngineVersion, "image %q runs vLLM %s; versions before %s execute code from the model at load time "+
			"(CVE-2026-22807, CVSS 8.8); use vllm/vllm-openai:v0.29.0 or later", spec.Image, v, MinSafeVersion), warnings
	} else if policy.Mode == kvv1.TransferPush && v.Less(MinPushVersion) {
		return problem(kvv1.ReasonUnsupportedEngineVersion, "image %q runs vLLM %s, which has no push connector (needs %s); upgrade the image or "+
			"use a policy with mode: Pull", spec.Image, v, MinPushVersion), warnings
	} else if policy.Executor == kvv1.ExecutorAgent && !AgentSupports(v) {
		return problem(kvv1.ReasonUnsupportedEngineVersion,
			"image %q runs vLLM %s; kvhandoff's connector (executor Agent) is tested with vLLM %s only; use an image in that range "+
				"(a newer vLLM needs a kvhandoff release tested with it)", spec.Image, v, AgentRange()), warnings
	} else if policy.Executor == kvv1.ExecutorAgent && spec.Accelerator.Type == kvv1.AcceleratorCPU && v.Less(MinAgentHostKVVersion) {
		return problem(kvv1.ReasonUnsupportedEngineVersion,
			"image %q runs vLLM %s; with accelerator.type CPU kvhandoff's connector (executor Agent) needs vLLM %s or later, the first "+
				"that lets it allocate the KV cache the agent maps", spec.Image, v, MinAgentHostKVVersion), warnings
	}
	if policy.Executor == kvv1.ExecutorAgent && spec.RunAsRoot {
		warnings = append(warnings, Warning{WarningEngineRunsAsRoot,
			"runAsRoot: the engines run as root beside the node's agent sockets, which every engine of the node shares; a root engine " +
				"can replace a socket and intercept the others' KV (and with sameNode Allow or Prefer, signal any process on the host)"})
	} else if spec.RunAsRoot {
		warnings = append(warnings, Warning{WarningEngineRunsAsRoot,
			"runAsRoot: the engines run as root; a root process that escapes its container owns the node and its devices"})
	}
	if policy.Executor == kvv1.ExecutorAgent {
		// Rendered anyway, so the pool reports its engines' own error rather than none.
		switch {
		case spec.Accelerator.Type == kvv1.AcceleratorCPU:
			// Host memory: the agent moves it between nodes and within one.
		case spec.Accelerator.Type != kvv1.AcceleratorNvidiaGPU:
			warnings = append(warnings, Warning{WarningDeviceMemoryUnsupported, fmt.Sprintf(
				"executor Agent: vLLM on %s keeps its KV in device memory, which the transfer agent does not move "+
					"(that needs its dmabuf path), so the engines will stop at start saying so", spec.Accelerator.Type)})
		case policy.SameNode == kvv1.SameNodeForbid:
			warnings = append(warnings, Warning{WarningDeviceMemoryUnsupported,
				"executor Agent: vLLM on NvidiaGPU keeps its KV in GPU memory, which the transfer agent moves only between engines " +
					"on one node (CUDA IPC), and sameNode: Forbid keeps pairs apart (between nodes it needs the agent's EFA dmabuf path, " +
					"which it does not have), so the engines will stop at start saying so; set the policy's sameNode: Allow or Prefer"})
		default:
			warnings = append(warnings, Warning{WarningDeviceMemoryUnsupported, fmt.Sprintf(
				"executor Agent: the transfer agent moves GPU KV only between engines on one node (CUDA IPC); a pair the scheduler "+
					"places on two nodes cannot hand over (that needs the agent's EFA dmabuf path, which it does not have) and its "+
					"requests take loadFailurePolicy %s", policy.LoadFailurePolicy)})
		}
	}

	if spec.Accelerator.Type == kvv1.AcceleratorCPU && policy.Fabric.Provider == kvv1.ProviderEFA {
		return problem(kvv1.ReasonUnsupportedFabric, "accelerator.type CPU with the policy's fabric.provider efa: EFA interfaces are requested per "+
			"accelerator, and CPU engines have none; use a policy whose fabric.provider is tcp or shm"), warnings
	}
	if info, ok := instancetype.Lookup(spec.InstanceType); ok && info.Accelerator != spec.Accelerator.Type {
		return problem(kvv1.ReasonInstanceTypeMismatch,
			"instanceType %s carries %s accelerators but accelerator.type is %s; change one of them", spec.InstanceType, info.Accelerator,
			spec.Accelerator.Type), warnings
	}
	if policy.SameNode != kvv1.SameNodeForbid && spec.Accelerator.Type == kvv1.AcceleratorNeuron {
		return problem(kvv1.ReasonSameNodeUnsupported, "the policy's sameNode: %s lets a pair share a node, whose KV the transfer agent moves with "+
			"CUDA copies, and this pool's accelerators are %s; use sameNode: Forbid", policy.SameNode, spec.Accelerator.Type), warnings
	}
	if policy.Fabric.Provider == kvv1.ProviderEFA {
		if _, err := instancetype.EFACount(Accelerators(spec), spec.InstanceType, policy.Fabric.EFAPerAccelerator); err != nil {
			return problem(kvv1.ReasonUnknownInstanceType, "%s", err), warnings
		}
		if spec.Accelerator.Allocation == kvv1.DeviceAllocationDRA {
			if _, err := EFAPerAccelerator(spec, policy); err != nil {
				return problem(kvv1.ReasonUnclaimableDevices, "%s", err), warnings
			}
		}
	}
	return nil, warnings
}

// maxClaimDevices is how many devices one ResourceClaim is allocated at most.
const maxClaimDevices = 32

// EFAPerAccelerator is the number of EFAs each accelerator of a DRA pool claims as its
// own: a claim pairs every accelerator with whole NICs, so the pool's EFAs must divide
// evenly among its accelerators, and an accelerator with its EFAs must fit one claim.
func EFAPerAccelerator(spec *kvv1.EngineSpec, policy *kvv1.KVTransferPolicySpec) (int32, error) {
	n := Accelerators(spec)
	efa, err := instancetype.EFACount(n, spec.InstanceType, policy.Fabric.EFAPerAccelerator)
	if err != nil {
		return 0, err
	}
	if efa%n != 0 {
		return 0, fmt.Errorf("accelerator.allocation DRA claims each accelerator with EFAs of its own, and %d EFAs do not divide among %d "+
			"accelerators (%s has fewer EFAs than accelerators); set the policy's fabric.efaPerAccelerator, or use allocation DevicePlugin",
			efa, n, spec.InstanceType)
	}
	if 1+efa/n > maxClaimDevices {
		return 0, fmt.Errorf("accelerator.allocation DRA claims an accelerator and its %d EFAs together, and a ResourceClaim holds at most "+
			"%d devices; set the policy's fabric.efaPerAccelerator to at most %d", efa/n, maxClaimDevices, maxClaimDevices-1)
	}
	return efa / n, nil
}

// CheckPair checks what a prefill pool and a decode pool must agree on to exchange KV.
func CheckPair(prefillName string, prefill *kvv1.EngineSpec, decode *kvv1.EngineSpec, policy *kvv1.KVTransferPolicySpec) *Problem {
	agent := policy.Executor == kvv1.ExecutorAgent
	switch {
	case prefill.TransferPolicyRef.Name != decode.TransferPolicyRef.Name:
		return problem(kvv1.ReasonPolicyMismatch, "PrefillPool %s uses KVTransferPolicy %s but this pool uses %s; both pools of a pair must "+
			"reference the same policy", prefillName, prefill.TransferPolicyRef.Name, decode.TransferPolicyRef.Name)
	case prefill.Model != decode.Model:
		return problem(kvv1.ReasonModelMismatch, "PrefillPool %s serves model %s but this pool serves %s; KV of one model is meaningless to another",
			prefillName, prefill.Model, decode.Model)
	case KVCacheDtype(prefill.EngineArgs) != KVCacheDtype(decode.EngineArgs):
		return problem(kvv1.ReasonKVCacheDtypeMismatch, "PrefillPool %s stores KV as %s but this pool as %s (vLLM's effective KV-cache dtype: "+
			"--kv-cache-dtype, or --dtype when that is auto); set the same in both pools' engineArgs", prefillName, KVCacheDtype(prefill.EngineArgs),
			KVCacheDtype(decode.EngineArgs))
	case !agent && prefill.TensorParallelSize > decode.TensorParallelSize:
		return problem(kvv1.ReasonTensorParallelMismatch, "PrefillPool %s has tensorParallelSize %d, more than this pool's %d; vLLM transfers KV "+
			"only when prefill's tensor-parallel size is at most decode's", prefillName, prefill.TensorParallelSize, decode.TensorParallelSize)
	case prefill.BlockSize > decode.BlockSize:
		return problem(kvv1.ReasonBlockSizeMismatch, "PrefillPool %s has blockSize %d, more than this pool's %d; set the prefill block size at "+
			"most the decode block size", prefillName, prefill.BlockSize, decode.BlockSize)
	// The agent moves KV between ranks of different tensor-parallel sizes by heads (each
	// decode rank from the prefill ranks holding its heads); a pipeline stage's layers are
	// another engine's unless both split the layers alike.
	case agent && prefill.PipelineParallelSize != decode.PipelineParallelSize:
		return problem(kvv1.ReasonPipelineParallelMismatch, "PrefillPool %s has pipelineParallelSize %d and this pool %d; with executor Agent "+
			"both pools must have the same pipelineParallelSize (each rank's layers are its pipeline stage's)", prefillName,
			prefill.PipelineParallelSize, decode.PipelineParallelSize)
	case agent && prefill.BlockSize != decode.BlockSize:
		return problem(kvv1.ReasonBlockSizeMismatch, "PrefillPool %s has blockSize %d and this pool %d; with executor Agent both pools must have "+
			"the same blockSize", prefillName, prefill.BlockSize, decode.BlockSize)
	}
	return nil
}

// Accelerators is the number of accelerator devices an engine pod gets.
func Accelerators(spec *kvv1.EngineSpec) int32 {
	if spec.Accelerator.Count > 0 {
		return spec.Accelerator.Count
	}
	return spec.TensorParallelSize * spec.PipelineParallelSize
}
