package compat

import (
	"slices"
	"strings"
	"testing"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

func TestImageVersion(t *testing.T) {
	cases := map[string]string{
		"vllm/vllm-openai:v0.29.0":                     "v0.29.0",
		"vllm/vllm-openai:0.13.2":                      "v0.13.2",
		"registry.local:5000/vllm/vllm-openai:v0.26.1": "v0.26.1",
		"vllm/vllm-openai:v0.29.0-cu130":               "v0.29.0",
		"vllm/vllm-openai:v0.30":                       "v0.30.0",
		"vllm/vllm-openai:v0.29.0@sha256:abc":          "v0.29.0",
		"vllm/vllm-openai:latest":                      "",
		"vllm/vllm-openai@sha256:abc":                  "",
		"registry.local:5000/vllm":                     "",
		"vllm/vllm-openai:nightly-0.30":                "",
	}
	for image, want := range cases {
		v, ok := ImageVersion(image)
		got := ""
		if ok {
			got = v.String()
		}
		if got != want {
			t.Errorf("ImageVersion(%q) = %q, want %q", image, got, want)
		}
	}
}

func TestKVCacheDtype(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{nil, "auto"},
		{[]string{"--max-model-len", "32768"}, "auto"},
		{[]string{"--kv-cache-dtype", "fp8"}, "fp8_e4m3"},
		{[]string{"--kv_cache_dtype=fp8_e4m3"}, "fp8_e4m3"},
		{[]string{"--kv-cache-dtype=fp8", "--kv-cache-dtype", "auto"}, "auto"},
		{[]string{"--dtype", "bfloat16"}, "bfloat16"},
		{[]string{"--dtype=half", "--kv-cache-dtype=auto"}, "float16"},
		{[]string{"--dtype=float", "--kv-cache-dtype=fp8_e5m2"}, "fp8_e5m2"},
	}
	for _, c := range cases {
		if got := KVCacheDtype(c.args); got != c.want {
			t.Errorf("KVCacheDtype(%q) = %q, want %q", c.args, got, c.want)
		}
	}
}

func TestHashChangesWithWhatMustMatch(t *testing.T) {
	push := builder.Policy("p").Obj().Spec
	pull := builder.Policy("p").Mode(kvv1.TransferPull).Obj().Spec
	base := &builder.PrefillPool("p").Obj().Spec.EngineSpec
	h := Hash(base, &push, "")

	same := []*kvv1.EngineSpec{
		&builder.PrefillPool("other-name").TP(4).BlockSize(8).Replicas(7).Obj().Spec.EngineSpec,
		&builder.DecodePool("d", "p").EngineArgs("--max-model-len", "1024").Obj().Spec.EngineSpec,
	}
	for _, s := range same {
		if got := Hash(s, &push, ""); got != h {
			t.Errorf("hash changed with a field engines may differ in: %+v", s)
		}
	}
	if Hash(base, &pull, "") == h {
		t.Error("hash ignores the mode")
	}
	if Hash(base, &push, LayoutHND) == h {
		t.Error("hash ignores the KV layout")
	}
	differ := []*kvv1.EngineSpec{
		&builder.PrefillPool("p").Model("Qwen/Qwen3-8B").Obj().Spec.EngineSpec,
		&builder.PrefillPool("p").Image("vllm/vllm-openai:v0.30.0").Obj().Spec.EngineSpec,
		&builder.PrefillPool("p").EngineArgs("--kv-cache-dtype", "fp8").Obj().Spec.EngineSpec,
	}
	for _, s := range differ {
		if Hash(s, &push, "") == h {
			t.Errorf("hash ignores a field that must match: %+v", s)
		}
	}
}

// GPU engines lay KV out head by head (HND) exactly where they pair with another
// tensor-parallel size; CPU and Neuron KV is head-major already.
func TestKVLayout(t *testing.T) {
	gpu := &builder.PrefillPool("p").TP(2).Obj().Spec.EngineSpec
	cpu := &builder.PrefillPool("p").TP(2).Accelerator(kvv1.AcceleratorCPU, 0).Obj().Spec.EngineSpec
	for _, c := range []struct {
		spec *kvv1.EngineSpec
		peer int32
		want string
	}{{gpu, 0, ""}, {gpu, 2, ""}, {gpu, 4, LayoutHND}, {gpu, 1, LayoutHND}, {cpu, 4, ""}} {
		if got := KVLayout(c.spec, c.peer); got != c.want {
			t.Errorf("KVLayout(%s TP2, peer %d) = %q, want %q", c.spec.Accelerator.Type, c.peer, got, c.want)
		}
	}
}

func TestCheckPool(t *testing.T) {
	push := builder.Policy("p").Obj().Spec
	pull := builder.Policy("p").Mode(kvv1.TransferPull).Obj().Spec
	pull.Fabric.Provider = kvv1.ProviderEFA
	tcp := builder.Policy("p").Provider(kvv1.ProviderTCP).Obj().Spec
	override := builder.Policy("p").EFAPerAccelerator(1).Obj().Spec
	efa32 := builder.Policy("p").EFAPerAccelerator(32).Obj().Spec
	agent := builder.Policy("p").Executor(kvv1.ExecutorAgent).Obj().Spec
	sameNode := builder.Policy("p").Executor(kvv1.ExecutorAgent).SameNode(kvv1.SameNodeAllow).Obj().Spec
	agentPull := builder.Policy("p").Executor(kvv1.ExecutorAgent).Mode(kvv1.TransferPull).Obj().Spec
	agentTCP := builder.Policy("p").Executor(kvv1.ExecutorAgent).Provider(kvv1.ProviderTCP).Obj().Spec
	cases := []struct {
		name        string
		pool        *builder.PoolBuilder[*kvv1.PrefillPool]
		policy      *kvv1.KVTransferPolicySpec
		reason      string
		message     string
		wantWarning string
	}{
		{"the sample shape", builder.PrefillPool("p"), &push, "", "", ""},
		{"vLLM before the CVE fix", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.13.0"), &pull,
			kvv1.ReasonUnsupportedEngineVersion, "CVE-2026-22807", ""},
		{"push before the push connector", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.25.1"), &push,
			kvv1.ReasonUnsupportedEngineVersion, "no push connector", ""},
		{"pull on 0.25 is fine", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.25.1"), &pull, "", "", ""},
		{"an unreadable tag warns", builder.PrefillPool("p").Image("vllm/vllm-openai:latest"), &push, "", "", WarningEngineVersionUnknown},
		{"executor Agent before the connector's vLLM", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.25.1"), &agentPull,
			kvv1.ReasonUnsupportedEngineVersion, "tested with vLLM v0.26.0 through v0.34.x only", ""},
		{"executor Agent on the oldest vLLM of the range", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.26.0"), &sameNode,
			"", "", WarningDeviceMemoryUnsupported},
		{"executor Agent on a patch release of the newest", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.34.2"), &sameNode,
			"", "", WarningDeviceMemoryUnsupported},
		{"executor Agent on CPUs before the connector could allocate host KV", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.30.0").
			Accelerator(kvv1.AcceleratorCPU, 0), &agentTCP, kvv1.ReasonUnsupportedEngineVersion, "with accelerator.type CPU", ""},
		{"executor Agent on CPUs from 0.31", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.31.0").Accelerator(kvv1.AcceleratorCPU, 0).InstanceType(""),
			&agentTCP, "", "", ""},
		{"executor Agent after the connector's vLLM", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.35.0"), &agent,
			kvv1.ReasonUnsupportedEngineVersion, "tested with vLLM v0.26.0 through v0.34.x only", ""},
		{"executor Agent on GPUs warns of device memory", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0"), &agent, "", "",
			WarningDeviceMemoryUnsupported},
		{"unknown instance type on EFA", builder.PrefillPool("p").InstanceType("g6.48xlarge"), &push, kvv1.ReasonUnknownInstanceType, "g6.48xlarge", ""},
		{"no instance type on EFA", builder.PrefillPool("p").InstanceType(""), &push, kvv1.ReasonUnknownInstanceType, "spec.instanceType", ""},
		{"unknown instance type with an EFA override", builder.PrefillPool("p").InstanceType("g6.48xlarge"), &override, "", "", ""},
		{"unknown instance type without EFA", builder.PrefillPool("p").InstanceType("g6.48xlarge"), &tcp, "", "", ""},
		{"same-node pairs on GPUs", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0"), &sameNode, "", "", WarningDeviceMemoryUnsupported},
		{"same-node pairs on Neuron devices", builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0").Accelerator(kvv1.AcceleratorNeuron,
			4).InstanceType("trn2.48xlarge"), &sameNode,
			kvv1.ReasonSameNodeUnsupported, "sameNode: Allow lets a pair share a node, whose KV the transfer agent moves with CUDA copies, and this " +
				"pool's accelerators are Neuron", WarningDeviceMemoryUnsupported},
		{"DRA on p5en: two EFAs of its own per GPU", builder.PrefillPool("p").DRA(nil), &push, "", "", ""},
		{"DRA on trn1: one EFA per two Neuron devices cannot be each one's own", builder.PrefillPool("p").Accelerator(kvv1.AcceleratorNeuron,
			16).InstanceType("trn1.32xlarge").DRA(nil), &push, kvv1.ReasonUnclaimableDevices, "8 EFAs do not divide among 16 accelerators", ""},
		{"DRA on trn1 with an EFA per device set", builder.PrefillPool("p").Accelerator(kvv1.AcceleratorNeuron, 16).InstanceType("trn1.32xlarge").
			DRA(nil), &override, "", "", ""},
		{"DRA with more EFAs per accelerator than a claim holds", builder.PrefillPool("p").DRA(nil),
			&efa32, kvv1.ReasonUnclaimableDevices, "its 32 EFAs together, and a ResourceClaim holds at most 32 devices", ""},
		{"DRA with 32 accelerators and their EFAs takes several claims", builder.PrefillPool("p").Accelerator(kvv1.AcceleratorNeuron, 32).
			InstanceType("").DRA(nil), &override, "", "", ""},
		{"GPU pool on a Trainium type", builder.PrefillPool("p").InstanceType("trn2.48xlarge"), &push, kvv1.ReasonInstanceTypeMismatch, "carries Neuron", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, warnings := CheckPool(&c.pool.Obj().Spec.EngineSpec, c.policy)
			var reasons []string
			for _, w := range warnings {
				reasons = append(reasons, w.Reason)
			}
			if want := []string{c.wantWarning}; (c.wantWarning == "" && len(warnings) > 0) || (c.wantWarning != "" && !slices.Equal(reasons, want)) {
				t.Errorf("warnings = %q, want %q", warnings, c.wantWarning)
			}
			if c.reason == "" {
				if p != nil {
					t.Fatalf("unexpected problem %v", p)
				}
				return
			}
			if p == nil || p.Reason != c.reason || !strings.Contains(p.Message, c.message) {
				t.Fatalf("problem = %v, want %s containing %q", p, c.reason, c.message)
			}
		})
	}
}

func TestCheckPair(t *testing.T) {
	cases := []struct {
		name    string
		prefill *builder.PoolBuilder[*kvv1.PrefillPool]
		decode  *builder.PoolBuilder[*kvv1.DecodePool]
		reason  string
	}{
		{"equal pools", builder.PrefillPool("p"), builder.DecodePool("d", "p"), ""},
		{"TP4 prefill into TP8 decode", builder.PrefillPool("p").TP(4), builder.DecodePool("d", "p").TP(8), ""},
		{"TP8 prefill into TP4 decode", builder.PrefillPool("p").TP(8), builder.DecodePool("d", "p").TP(4), kvv1.ReasonTensorParallelMismatch},
		{"block 16 into 32", builder.PrefillPool("p").BlockSize(16), builder.DecodePool("d", "p").BlockSize(32), ""},
		{"block 32 into 16", builder.PrefillPool("p").BlockSize(32), builder.DecodePool("d", "p").BlockSize(16), kvv1.ReasonBlockSizeMismatch},
		{"different models", builder.PrefillPool("p").Model("a"), builder.DecodePool("d", "p").Model("b"), kvv1.ReasonModelMismatch},
		{"different policies", builder.PrefillPool("p").Policy("x"), builder.DecodePool("d", "p").Policy("y"), kvv1.ReasonPolicyMismatch},
		{"different KV dtypes", builder.PrefillPool("p").EngineArgs("--kv-cache-dtype=fp8"), builder.DecodePool("d", "p"), kvv1.ReasonKVCacheDtypeMismatch},
		{"fp8 and its full name are one dtype", builder.PrefillPool("p").EngineArgs("--kv-cache-dtype=fp8"), builder.DecodePool("d",
			"p").EngineArgs("--kv_cache_dtype", "fp8_e4m3"), ""},
		{"a model dtype that differs with auto KV", builder.PrefillPool("p").EngineArgs("--dtype=half"), builder.DecodePool("d", "p"),
			kvv1.ReasonKVCacheDtypeMismatch},
		{"half and float16 are one dtype", builder.PrefillPool("p").EngineArgs("--dtype", "half"), builder.DecodePool("d",
			"p").EngineArgs("--dtype=float16"), ""},
		{"an explicit KV dtype wins over the model's", builder.PrefillPool("p").EngineArgs("--dtype=half", "--kv-cache-dtype=fp8"),
			builder.DecodePool("d", "p").EngineArgs("--kv-cache-dtype", "fp8"), ""},
		// The agent maps ranks by KV heads, both ways (the model's heads must split or
		// replicate over both sizes: the connector and the agent check that at start).
		{"TP4 into TP8 with the agent", builder.PrefillPool("p").TP(4).Policy("agent"), builder.DecodePool("d",
			"p").TP(8).Policy("agent"), ""},
		{"TP8 into TP2 with the agent", builder.PrefillPool("p").TP(8).Policy("agent"), builder.DecodePool("d",
			"p").TP(2).Policy("agent"), ""},
		{"PP2 into PP1 with the agent", builder.PrefillPool("p").PP(2).Policy("agent"), builder.DecodePool("d",
			"p").Policy("agent"), kvv1.ReasonPipelineParallelMismatch},
		{"block 16 into 32 with the agent", builder.PrefillPool("p").BlockSize(16).Policy("agent"), builder.DecodePool("d",
			"p").BlockSize(32).Policy("agent"), kvv1.ReasonBlockSizeMismatch},
		{"equal pools with the agent", builder.PrefillPool("p").Policy("agent"), builder.DecodePool("d", "p").Policy("agent"), ""},
	}
	policies := map[string]*kvv1.KVTransferPolicySpec{
		"agent": &builder.Policy("agent").Executor(kvv1.ExecutorAgent).Obj().Spec,
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			policy := policies[c.decode.Obj().Spec.TransferPolicyRef.Name]
			if policy == nil {
				policy = &builder.Policy("policy").Obj().Spec
			}
			p := CheckPair("p", &c.prefill.Obj().Spec.EngineSpec, &c.decode.Obj().Spec.EngineSpec, policy)
			got := ""
			if p != nil {
				got = p.Reason
				if !strings.Contains(p.Message, "PrefillPool p") {
					t.Errorf("message %q does not name the prefill pool", p.Message)
				}
			}
			if got != c.reason {
				t.Fatalf("reason = %q (%v), want %q", got, p, c.reason)
			}
		})
	}
}

// Engines that share the node's agent sockets run as root only when their pool says so,
// with a warning, same-node policies included: no engine joins the host's PID namespace.
func TestRootEngines(t *testing.T) {
	agent := builder.Policy("p").Executor(kvv1.ExecutorAgent).Obj().Spec
	sameNode := builder.Policy("p").Executor(kvv1.ExecutorAgent).SameNode(kvv1.SameNodePrefer).Obj().Spec
	root := builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0").RunAsRoot(true).Obj().Spec.EngineSpec
	p, warnings := CheckPool(&root, &agent)
	if p != nil || !slices.ContainsFunc(warnings, func(w Warning) bool { return w.Reason == WarningEngineRunsAsRoot }) {
		t.Errorf("runAsRoot with executor Agent: problem %v, warnings %v; want the EngineRunsAsRoot warning", p, warnings)
	}
	if p, _ := CheckPool(&root, &sameNode); p != nil {
		t.Errorf("runAsRoot with sameNode Prefer: problem %v, want none", p)
	}
	nonRoot := builder.PrefillPool("p").Image("vllm/vllm-openai:v0.33.0").Obj().Spec.EngineSpec
	if _, warnings := CheckPool(&nonRoot, &agent); slices.ContainsFunc(warnings, func(w Warning) bool { return w.Reason == WarningEngineRunsAsRoot }) {
		t.Errorf("a pool that runs its engines as uid %d warned of root", 1000)
	}
}

// CPU engines have no accelerator to count EFA interfaces by: EFA is refused by name;
// tcp and shm serve them.
func TestCPUEnginesNeedAHostFabric(t *testing.T) {
	spec := builder.PrefillPool("p").InstanceType("").Accelerator(kvv1.AcceleratorCPU, 0).Obj().Spec.EngineSpec
	if p, _ := CheckPool(&spec, &builder.Policy("efa").Obj().Spec); p == nil || p.Reason != kvv1.ReasonUnsupportedFabric {
		t.Errorf("CPU engines with EFA: %v, want UnsupportedFabric", p)
	}
	for _, prov := range []kvv1.FabricProvider{kvv1.ProviderTCP, kvv1.ProviderSHM} {
		if p, _ := CheckPool(&spec, &builder.Policy("host").Provider(prov).Obj().Spec); p != nil {
			t.Errorf("CPU engines with %s: %v", prov, p)
		}
	}
}
