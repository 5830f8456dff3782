package v1alpha1_test

import (
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

// createYAML creates the object a user would write as manifest in a fresh namespace
// and returns the error of the create.
func createYAML(manifest string) (*unstructured.Unstructured, error) {
	u := &unstructured.Unstructured{}
	Expect(yaml.Unmarshal([]byte(manifest), &u.Object)).To(Succeed())
	u.SetNamespace(freshNamespace())
	return u, k8s.Create(ctx, u)
}

// readBack creates manifest and reads it back typed, with the schema's defaults applied.
func readBack(manifest string, into client.Object) {
	u, err := createYAML(manifest)
	Expect(err).NotTo(HaveOccurred())
	Expect(k8s.Get(ctx, client.ObjectKeyFromObject(u), into)).To(Succeed())
}

// minimalPolicy is a push policy that gives nothing else, as the API server defaults it.
func minimalPolicy() kvv1.KVTransferPolicy {
	var p kvv1.KVTransferPolicy
	readBack(`
apiVersion: kvhandoff.io/v1alpha1
kind: KVTransferPolicy
metadata: {name: minimal}
spec: {mode: Push}
`, &p)
	return p
}

var _ = Describe("Defaults", func() {
	// The builders, the agent's fallbacks and the CRD's markers share the defaults in
	// defaults.go; a marker or a constant changed alone breaks this equality.
	It("defaults a minimal policy to exactly the test builder's policy", func() {
		Expect(minimalPolicy().Spec).To(Equal(builder.Policy("minimal").Obj().Spec))
	})

	It("fills every KVTransferPolicy default when only mode is given", func() {
		Expect(minimalPolicy().Spec).To(Equal(kvv1.KVTransferPolicySpec{
			Mode:     kvv1.TransferPush,
			Executor: kvv1.ExecutorEngine,
			Backend:  kvv1.BackendLibfabric,
			Fabric: kvv1.FabricSpec{
				Provider:          kvv1.ProviderEFA,
				EFAPerAccelerator: 0,
				GPUDirect:         ptr.To(true),
				Privileged:        false,
			},
			LeaseSeconds:               30,
			RegistrationTimeoutSeconds: 480,
			BlocksTTLSeconds:           480,
			LoadFailurePolicy:          kvv1.LoadFailureFail,
			HandoffFailurePolicy:       kvv1.HandoffFailureFail,
			HandoffFailureLimitPercent: ptr.To[int32](5),
			HealthWindowSeconds:        ptr.To[int32](60),
			Routing:                    &kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoiceLoadOnly, OverlapWeight: 4, LoadWeight: 1, PrefixSource: kvv1.PrefixSourceKVEvents},
			Bidirectional:              false,
			SameNode:                   kvv1.SameNodeForbid,
		}))
	})

	It("fills fabric defaults inside a partly written fabric", func() {
		var p kvv1.KVTransferPolicy
		readBack(`
apiVersion: kvhandoff.io/v1alpha1
kind: KVTransferPolicy
metadata: {name: partial}
spec: {mode: Pull, fabric: {provider: tcp}}
`, &p)
		Expect(p.Spec.Fabric.Provider).To(Equal(kvv1.ProviderTCP))
		Expect(p.Spec.Fabric.GPUDirect).To(Equal(ptr.To(true)))
	})

	It("fills every pool default when only the required fields are given", func() {
		var d kvv1.DecodePool
		readBack(`
apiVersion: kvhandoff.io/v1alpha1
kind: DecodePool
metadata: {name: minimal}
spec:
  model: Qwen/Qwen3-32B
  image: vllm/vllm-openai:v0.29.0
  accelerator: {type: NvidiaGPU}
  transferPolicyRef: {name: policy}
  prefillPoolRef: {name: prefill}
`, &d)
		Expect(d.Spec.Replicas).To(Equal(ptr.To[int32](1)))
		Expect(d.Spec.TensorParallelSize).To(BeEquivalentTo(1))
		Expect(d.Spec.PipelineParallelSize).To(BeEquivalentTo(1))
		Expect(d.Spec.BlockSize).To(BeEquivalentTo(16))
		Expect(d.Spec.Accelerator.Count).To(BeEquivalentTo(0))
		Expect(d.Spec.Gateway).To(Equal(kvv1.GatewaySpec{FailureMode: kvv1.GatewayFailClose, EndpointPickerReplicas: ptr.To[int32](2)}),
			"no gateway unless asked; FailClose and two pickers when it is")
	})

	It("refuses a gateway failure mode the InferencePool does not have, naming the field", func() {
		_, err := createYAML(`
apiVersion: kvhandoff.io/v1alpha1
kind: DecodePool
metadata: {name: bad-gateway}
spec:
  model: m
  image: i
  accelerator: {type: NvidiaGPU}
  transferPolicyRef: {name: policy}
  prefillPoolRef: {name: prefill}
  gateway: {inferencePool: true, failureMode: FailSoft}
`)
		Expect(err).To(MatchError(ContainSubstring("spec.gateway.failureMode")))
	})

	It("refuses a picker client that is both an address range and pods, naming the rule", func() {
		_, err := createYAML(`
apiVersion: kvhandoff.io/v1alpha1
kind: DecodePool
metadata: {name: bad-picker-client}
spec:
  model: m
  image: i
  accelerator: {type: NvidiaGPU}
  transferPolicyRef: {name: policy}
  prefillPoolRef: {name: prefill}
  gateway: {inferencePool: true, pickerClients: [{ipBlock: {cidr: 198.18.0.0/24}, podSelector: {}}]}
`)
		Expect(err).To(MatchError(And(ContainSubstring("spec.gateway.pickerClients[0]"), ContainSubstring("set ipBlock, or podSelector and/or namespaceSelector"))))
	})

	It("keeps replicas: 0 instead of defaulting it to 1", func() {
		var p kvv1.PrefillPool
		readBack(`
apiVersion: kvhandoff.io/v1alpha1
kind: PrefillPool
metadata: {name: scaled-to-zero}
spec:
  model: m
  image: i
  replicas: 0
  accelerator: {type: Neuron}
  transferPolicyRef: {name: policy}
`, &p)
		Expect(p.Spec.Replicas).To(Equal(ptr.To[int32](0)))
	})
})

var _ = Describe("Required fields", func() {
	DescribeTable("a manifest without a required field is rejected naming it",
		func(manifest, want string) {
			_, err := createYAML(manifest)
			Expect(err).To(HaveOccurred())
			Expect(err.Error()).To(ContainSubstring(want))
		},
		Entry("policy without mode", `
apiVersion: kvhandoff.io/v1alpha1
kind: KVTransferPolicy
metadata: {name: p}
spec: {leaseSeconds: 30}
`, "spec.mode: Required value"),
		Entry("pool without model", `
apiVersion: kvhandoff.io/v1alpha1
kind: PrefillPool
metadata: {name: p}
spec: {image: i, accelerator: {type: NvidiaGPU}, transferPolicyRef: {name: x}}
`, "spec.model: Required value"),
		Entry("pool without accelerator", `
apiVersion: kvhandoff.io/v1alpha1
kind: PrefillPool
metadata: {name: p}
spec: {model: m, image: i, transferPolicyRef: {name: x}}
`, "spec.accelerator: Required value"),
		Entry("decode pool without prefillPoolRef", `
apiVersion: kvhandoff.io/v1alpha1
kind: DecodePool
metadata: {name: d}
spec: {model: m, image: i, accelerator: {type: NvidiaGPU}, transferPolicyRef: {name: x}}
`, "spec.prefillPoolRef: Required value"),
	)
})
