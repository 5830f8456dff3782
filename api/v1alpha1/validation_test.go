package v1alpha1_test

import (
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

// expectAdmission creates obj and checks the API server's answer: accepted when want is
// empty, otherwise rejected with an error that contains want.
func expectAdmission(obj client.Object, want string) {
	obj.SetNamespace(freshNamespace())
	err := k8s.Create(ctx, obj)
	if want == "" {
		Expect(err).NotTo(HaveOccurred())
		return
	}
	Expect(err).To(HaveOccurred())
	Expect(err.Error()).To(ContainSubstring(want))
}

var _ = Describe("KVTransferPolicy validation", func() {
	DescribeTable("the API server's answer",
		func(p *builder.PolicyBuilder, want string) { expectAdmission(p.Obj(), want) },
		Entry("accepts push", builder.Policy("p"), ""),
		Entry("accepts pull with bidirectional KV", builder.Policy("p").Mode(kvv1.TransferPull).Bidirectional(true), ""),
		Entry("accepts the agent executor over libfabric", builder.Policy("p").Executor(kvv1.ExecutorAgent).Provider(kvv1.ProviderTCP), ""),
		Entry("rejects an empty mode", builder.Policy("p").Mode(""),
			`spec.mode: Unsupported value: ""`),
		Entry("rejects an unknown mode", builder.Policy("p").Mode("Broadcast"),
			`spec.mode: Unsupported value: "Broadcast": supported values: "Push", "Pull"`),
		Entry("rejects push with bidirectional KV", builder.Policy("p").Bidirectional(true),
			"mode: Push does not support bidirectional KV (bidirectional: true): push writes only from prefill into decode; use mode: Pull to send "+
				"KV back to prefill"),
		Entry("rejects a registration timeout shorter than the lease", builder.Policy("p").Lease(60).RegistrationTimeout(30),
			"registrationTimeoutSeconds must be greater than or equal to leaseSeconds"),
		Entry("rejects a lease longer than the defaulted registration timeout", builder.Policy("p").Lease(600).RegistrationTimeout(0),
			"registrationTimeoutSeconds must be greater than or equal to leaseSeconds"),
		Entry("accepts layer streaming for push through the agent",
			builder.Policy("p").Executor(kvv1.ExecutorAgent).Provider(kvv1.ProviderTCP).LayerStreaming(true), ""),
		Entry("accepts same-node pairs through the agent", builder.Policy("p").Executor(kvv1.ExecutorAgent).SameNode(kvv1.SameNodePrefer), ""),
		Entry("rejects same-node pairs through vLLM's own connector", builder.Policy("p").SameNode(kvv1.SameNodeAllow),
			"sameNode: Allow and Prefer need executor: Agent"),
		Entry("rejects an unknown sameNode", builder.Policy("p").Executor(kvv1.ExecutorAgent).SameNode("Always"),
			`spec.sameNode: Unsupported value: "Always": supported values: "Forbid", "Allow", "Prefer"`),
		Entry("rejects layer streaming in pull", builder.Policy("p").Mode(kvv1.TransferPull).Executor(kvv1.ExecutorAgent).LayerStreaming(true),
			"layerStreaming needs mode: Push and executor: Agent"),
		Entry("rejects layer streaming through vLLM's own connector", builder.Policy("p").LayerStreaming(true),
			"layerStreaming needs mode: Push and executor: Agent"),
		Entry("rejects the agent executor over UCX", builder.Policy("p").Executor(kvv1.ExecutorAgent).Backend(kvv1.BackendUCX),
			"executor: Agent moves KV with the kvhandoff transfer agent, which speaks libfabric only"),
		Entry("rejects a negative lease", builder.Policy("p").Lease(-1),
			"spec.leaseSeconds: Invalid value: -1: spec.leaseSeconds in body should be greater than or equal to 1"),
		Entry("rejects a lease over an hour", builder.Policy("p").Lease(3601),
			"spec.leaseSeconds: Invalid value: 3601: spec.leaseSeconds in body should be less than or equal to 3600"),
		Entry("rejects a health window under 10 s", builder.Policy("p").HealthWindow(5),
			"spec.healthWindowSeconds: Invalid value: 5: spec.healthWindowSeconds in body should be greater than or equal to 10"),
		Entry("rejects a registration timeout over a day", builder.Policy("p").RegistrationTimeout(86401),
			"spec.registrationTimeoutSeconds in body should be less than or equal to 86400"),
		Entry("rejects a negative blocks TTL", builder.Policy("p").BlocksTTL(-5),
			"spec.blocksTTLSeconds in body should be greater than or equal to 1"),
		Entry("rejects an unknown executor", builder.Policy("p").Executor("Sidecar"),
			`spec.executor: Unsupported value: "Sidecar": supported values: "Engine", "Agent"`),
		Entry("rejects an unknown backend", builder.Policy("p").Backend("MPI"),
			`spec.backend: Unsupported value: "MPI": supported values: "Libfabric", "UCX"`),
		Entry("rejects an unknown provider", builder.Policy("p").Provider("verbs"),
			`spec.fabric.provider: Unsupported value: "verbs": supported values: "efa", "tcp", "shm"`),
		Entry("rejects a negative EFA count", builder.Policy("p").EFAPerAccelerator(-1),
			"spec.fabric.efaPerAccelerator in body should be greater than or equal to 0"),
		Entry("rejects zero hugepages", builder.Policy("p").Hugepages2Mi("0"),
			"fabric.hugepages2Mi must be greater than zero when set; omit it for no hugepages"),
		Entry("accepts hugepages", builder.Policy("p").Hugepages2Mi("2Gi"), ""),
		Entry("rejects an unknown load failure policy", builder.Policy("p").LoadFailurePolicy("Retry"),
			`spec.loadFailurePolicy: Unsupported value: "Retry": supported values: "Fail", "Recompute"`),
		Entry("rejects an unknown handoff failure policy", builder.Policy("p").HandoffFailurePolicy("Recompute"),
			`spec.handoffFailurePolicy: Unsupported value: "Recompute": supported values: "Fail", "ServeOnDecode"`),
		Entry("accepts serving on decode", builder.Policy("p").HandoffFailurePolicy(kvv1.HandoffFailureServeOnDecode), ""),
		Entry("accepts prefix-aware routing", builder.Policy("p").PrefixAware(256), ""),
		Entry("rejects an unknown decode choice", builder.Policy("p").Routing(kvv1.RoutingSpec{DecodeChoice: "Random", LoadWeight: 1}),
			`spec.routing.decodeChoice: Unsupported value: "Random": supported values: "LoadOnly", "PrefixAware"`),
		Entry("rejects an unknown prefix source", builder.Policy("p").Routing(kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoicePrefixAware, LoadWeight: 1, PrefixSource: "Tokenizer"}),
			`spec.routing.prefixSource: Unsupported value: "Tokenizer": supported values: "KVEvents", "RoutingHistory"`),
		Entry("rejects a load weight below 1", builder.Policy("p").Routing(kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoicePrefixAware, LoadWeight: -1}),
			"spec.routing.loadWeight in body should be greater than or equal to 1"),
		Entry("rejects an overlap weight over 1000", builder.Policy("p").Routing(kvv1.RoutingSpec{OverlapWeight: 1001, LoadWeight: 1}),
			"spec.routing.overlapWeight in body should be less than or equal to 1000"),
		Entry("rejects a negative minPrefillTokens", builder.Policy("p").Routing(kvv1.RoutingSpec{MinPrefillTokens: -1, LoadWeight: 1}),
			"spec.routing.minPrefillTokens in body should be greater than or equal to 0"),
	)
})

var _ = Describe("PrefillPool and DecodePool validation", func() {
	DescribeTable("the API server's answer to a PrefillPool",
		func(p *builder.PoolBuilder[*kvv1.PrefillPool], want string) { expectAdmission(p.Obj(), want) },
		Entry("accepts the P5en TP8 shape", builder.PrefillPool("p"), ""),
		Entry("accepts a Neuron engine with fewer devices than TP ranks",
			builder.PrefillPool("p").TP(16).Accelerator(kvv1.AcceleratorNeuron, 4).InstanceType("trn2.48xlarge"), ""),
		Entry("accepts engine arguments kvhandoff does not own",
			builder.PrefillPool("p").EngineArgs("--max-model-len", "32768", "--gpu-memory-utilization=0.9", "--portable-flag"), ""),
		Entry("rejects an empty model", builder.PrefillPool("p").Model(""),
			`spec.model: Invalid value: "": spec.model in body should be at least 1 chars long`),
		Entry("rejects an empty image", builder.PrefillPool("p").Image(""),
			`spec.image: Invalid value: "": spec.image in body should be at least 1 chars long`),
		Entry("rejects TP 3", builder.PrefillPool("p").TP(3),
			"spec.tensorParallelSize: Unsupported value: 3: supported values: \"1\", \"2\", \"4\", \"8\", \"16\""),
		Entry("rejects PP 9", builder.PrefillPool("p").PP(9),
			"spec.pipelineParallelSize: Invalid value: 9: spec.pipelineParallelSize in body should be less than or equal to 8"),
		Entry("rejects block size 24", builder.PrefillPool("p").BlockSize(24),
			"spec.blockSize: Unsupported value: 24: supported values: \"8\", \"16\", \"32\", \"64\", \"128\""),
		Entry("rejects negative replicas", builder.PrefillPool("p").Replicas(-1),
			"spec.replicas in body should be greater than or equal to 0"),
		Entry("rejects an unknown accelerator", builder.PrefillPool("p").Accelerator("TPU", 0),
			`spec.accelerator.type: Unsupported value: "TPU": supported values: "NvidiaGPU", "Neuron", "CPU"`),
		Entry("accepts CPU engines", builder.PrefillPool("p").InstanceType("").Accelerator(kvv1.AcceleratorCPU, 0), ""),
		Entry("rejects a device count for CPU engines", builder.PrefillPool("p").InstanceType("").Accelerator(kvv1.AcceleratorCPU, 2),
			"accelerator.count must be 0 for CPU: CPU engines request no device"),
		Entry("accepts DRA with its defaults", builder.PrefillPool("p").DRA(nil), ""),
		Entry("rejects DRA for CPU engines", builder.PrefillPool("p").InstanceType("").Accelerator(kvv1.AcceleratorCPU, 0).DRA(nil),
			"accelerator.allocation DRA needs an accelerator: CPU engines request no device"),
		Entry("rejects dra settings under the device plugins", builder.PrefillPool("p").DRA(&kvv1.DRASpec{}).
			Allocation(kvv1.DeviceAllocationDevicePlugin), "accelerator.dra is read only with accelerator.allocation DRA"),
		Entry("rejects an unqualified locality attribute", builder.PrefillPool("p").DRA(&kvv1.DRASpec{LocalityAttribute: "pcieRoot"}),
			"spec.accelerator.dra.localityAttribute in body should match"),
		Entry("rejects fewer GPUs than TP × PP ranks", builder.PrefillPool("p").TP(8).PP(2).Accelerator(kvv1.AcceleratorNvidiaGPU, 8),
			"accelerator.count must be 0 (meaning tensorParallelSize × pipelineParallelSize) or at least tensorParallelSize × pipelineParallelSize "+
				"for NvidiaGPU"),
		Entry("rejects an instance type that is not one", builder.PrefillPool("p").InstanceType("P5EN"),
			`spec.instanceType: Invalid value: "P5EN": spec.instanceType in body should match`),
		Entry("rejects a missing policy reference", builder.PrefillPool("p").Policy(""),
			"spec.transferPolicyRef.name: Invalid value: \"\": spec.transferPolicyRef.name in body should be at least 1 chars long"),
		Entry("rejects --kv-transfer-config in engineArgs", builder.PrefillPool("p").EngineArgs("--kv-transfer-config", "{}"),
			"engineArgs must not set --kv-transfer-config, --tensor-parallel-size (-tp), --pipeline-parallel-size (-pp), --block-size or --port"),
		Entry("rejects --tensor-parallel-size=4 in engineArgs", builder.PrefillPool("p").EngineArgs("--tensor-parallel-size=4"),
			"engineArgs must not set"),
		Entry("rejects -tp in engineArgs", builder.PrefillPool("p").EngineArgs("-tp", "4"),
			"engineArgs must not set"),
		Entry("rejects the underscore spelling vLLM also accepts", builder.PrefillPool("p").EngineArgs("--block_size=32"),
			"engineArgs must not set"),
		Entry("rejects one key of --kv-transfer-config in vLLM's dotted form",
			builder.PrefillPool("p").EngineArgs("--kv-transfer-config.engine_id=someone-else"),
			"engineArgs must not set"),
		Entry("rejects the dotted form with underscores", builder.PrefillPool("p").EngineArgs("--kv_transfer_config.kv_connector", "X"),
			"engineArgs must not set"),
		Entry("rejects an abbreviation argparse would expand to an owned flag", builder.PrefillPool("p").EngineArgs("--tensor-par", "4"),
			"engineArgs must not set"),
		Entry("rejects an abbreviation with a value", builder.PrefillPool("p").EngineArgs("--kv-transfer={}"),
			"engineArgs must not set"),
		Entry("rejects an abbreviation in the dotted form", builder.PrefillPool("p").EngineArgs("--kv-transfer-c.engine_id=X"),
			"engineArgs must not set"),
		Entry("rejects a short abbreviation in the dotted form", builder.PrefillPool("p").EngineArgs("--kv-t.kv_connector=Y"),
			"engineArgs must not set"),
		Entry("rejects an abbreviation in the dotted form with underscores", builder.PrefillPool("p").EngineArgs("--kv_transfer.kv_role", "kv_both"),
			"engineArgs must not set"),
		Entry("accepts flags that merely share a prefix with owned ones", builder.PrefillPool("p").EngineArgs("--kv-cache-dtype=fp8",
			"--block-allocator", "x", "--", "--port-range"), ""),
		Entry("rejects env that would change the engine's identity", builder.PrefillPool("p").Env("POD_NAME", "prefill-0"),
			"env must not set POD_NAME, POD_NAMESPACE"),
		Entry("rejects env that would load code into the engine", builder.PrefillPool("p").Env("LD_PRELOAD", "/tmp/hook.so"),
			"env must not set LD_PRELOAD"),
		Entry("rejects env that would replace the connector's path", builder.PrefillPool("p").Env("PYTHONPATH", "/models/evil"),
			"env must not set LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT, PYTHONPATH"),
	)

	DescribeTable("the API server's answer to a DecodePool",
		func(d *builder.PoolBuilder[*kvv1.DecodePool], want string) { expectAdmission(d.Obj(), want) },
		Entry("accepts the P5en TP8 shape", builder.DecodePool("d", "p"), ""),
		Entry("rejects a missing prefill pool reference", builder.DecodePool("d", ""),
			"spec.prefillPoolRef.name: Invalid value: \"\": spec.prefillPoolRef.name in body should be at least 1 chars long"),
		Entry("rejects --port in engineArgs", builder.DecodePool("d", "p").EngineArgs("--port", "9000"),
			"engineArgs must not set"),
		Entry("rejects fewer GPUs than TP ranks", builder.DecodePool("d", "p").TP(8).Accelerator(kvv1.AcceleratorNvidiaGPU, 4),
			"accelerator.count must be 0"),
	)

	DescribeTable("the API server's answer to a DecodePool's autoscaling",
		func(change func(*kvv1.AutoscalingSpec), want string) {
			d := builder.DecodePool("d", "p").Obj()
			d.Spec.Autoscaling = &kvv1.AutoscalingSpec{TTFT: kvv1.LatencyTarget{Milliseconds: 2000}, ITL: kvv1.LatencyTarget{Milliseconds: 50},
				Prefill: kvv1.ReplicaRange{MinReplicas: 1, MaxReplicas: 4}, Decode: kvv1.ReplicaRange{MinReplicas: 1, MaxReplicas: 4}, AcceleratorBudget: 64}
			change(d.Spec.Autoscaling)
			expectAdmission(d, want)
		},
		Entry("accepts targets, ranges and a budget", func(*kvv1.AutoscalingSpec) {}, ""),
		Entry("rejects a minimum above the maximum", func(a *kvv1.AutoscalingSpec) { a.Decode.MinReplicas = 5 },
			"autoscaling.decode.minReplicas must not exceed autoscaling.decode.maxReplicas"),
		Entry("rejects a budget below the minimums", func(a *kvv1.AutoscalingSpec) {
			a.Prefill.MinReplicas, a.Decode.MinReplicas, a.AcceleratorBudget = 2, 2, 3
		}, "autoscaling.acceleratorBudget must hold both roles' minReplicas"),
		Entry("rejects a percentile that is not 50, 90, 95 or 99", func(a *kvv1.AutoscalingSpec) { a.TTFT.Percentile = 75 },
			`spec.autoscaling.ttft.percentile: Unsupported value: 75`),
		Entry("rejects a zero target", func(a *kvv1.AutoscalingSpec) { a.ITL.Milliseconds = 0 },
			"spec.autoscaling.itl.milliseconds"),
		Entry("rejects a window under 5 seconds", func(a *kvv1.AutoscalingSpec) { a.WindowSeconds = 2 },
			"spec.autoscaling.windowSeconds: Invalid value: 2"),
	)

	It("defaults the autoscaling windows", func() {
		d := builder.DecodePool("d", "p").Obj()
		d.Spec.Autoscaling = &kvv1.AutoscalingSpec{TTFT: kvv1.LatencyTarget{Milliseconds: 2000}, ITL: kvv1.LatencyTarget{Milliseconds: 50},
			Prefill: kvv1.ReplicaRange{MaxReplicas: 4}, Decode: kvv1.ReplicaRange{MaxReplicas: 4}, AcceleratorBudget: 64}
		expectAdmission(d, "")
		a := d.Spec.Autoscaling
		Expect([]int32{a.TTFT.Percentile, a.ITL.Percentile, a.Prefill.MinReplicas, a.Decode.MinReplicas, *a.StabilizationWindowSeconds, *a.WarmupSeconds, a.WindowSeconds}).
			To(Equal([]int32{90, 90, 1, 1, 300, 60, 60}))
	})
})
