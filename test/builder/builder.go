// Package builder makes kvhandoff objects for tests in one line:
//
//	builder.PrefillPool("p").TP(8).Policy("push").Obj()
//
// Every builder starts from a valid object as the API server stores it, defaults filled
// in (pools: the P5en Qwen3-32B TP8 shape), so a test states only what it is about.
package builder

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/ptr"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
)

// Defaults every builder starts from.
const (
	Namespace = "default"
	Model     = "Qwen/Qwen3-32B"
	Image     = "vllm/vllm-openai:v0.29.0"
)

// PolicyBuilder builds a KVTransferPolicy.
type PolicyBuilder struct{ obj kvv1.KVTransferPolicy }

// Policy starts a push policy named name, with every other field at the value the
// API server's schema defaults it to.
func Policy(name string) *PolicyBuilder {
	return &PolicyBuilder{obj: kvv1.KVTransferPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: Namespace},
		Spec: kvv1.KVTransferPolicySpec{
			Mode:                       kvv1.TransferPush,
			Executor:                   kvv1.ExecutorEngine,
			Backend:                    kvv1.BackendLibfabric,
			Fabric:                     kvv1.FabricSpec{Provider: kvv1.ProviderEFA, GPUDirect: ptr.To(true)},
			LeaseSeconds:               kvv1.DefaultLeaseSeconds,
			RegistrationTimeoutSeconds: kvv1.DefaultRegistrationTimeoutSeconds,
			BlocksTTLSeconds:           kvv1.DefaultBlocksTTLSeconds,
			LoadFailurePolicy:          kvv1.LoadFailureFail,
			HandoffFailurePolicy:       kvv1.HandoffFailureFail,
			HandoffFailureLimitPercent: ptr.To[int32](kvv1.DefaultHandoffFailureLimitPercent),
			HealthWindowSeconds:        ptr.To[int32](kvv1.DefaultHealthWindowSeconds),
			Routing: &kvv1.RoutingSpec{DecodeChoice: kvv1.DecodeChoiceLoadOnly, PrefixSource: kvv1.PrefixSourceKVEvents,
				OverlapWeight: kvv1.DefaultOverlapWeight, LoadWeight: kvv1.DefaultLoadWeight},
			SameNode: kvv1.SameNodeForbid,
		},
	}}
}

func (b *PolicyBuilder) Namespace(ns string) *PolicyBuilder { b.obj.Namespace = ns; return b }
func (b *PolicyBuilder) Mode(m kvv1.TransferMode) *PolicyBuilder {
	b.obj.Spec.Mode = m
	return b
}
func (b *PolicyBuilder) Executor(e kvv1.TransferExecutor) *PolicyBuilder {
	b.obj.Spec.Executor = e
	return b
}
func (b *PolicyBuilder) Backend(be kvv1.TransferBackend) *PolicyBuilder {
	b.obj.Spec.Backend = be
	return b
}
func (b *PolicyBuilder) Provider(p kvv1.FabricProvider) *PolicyBuilder {
	b.obj.Spec.Fabric.Provider = p
	return b
}
func (b *PolicyBuilder) EFAPerAccelerator(n int32) *PolicyBuilder {
	b.obj.Spec.Fabric.EFAPerAccelerator = n
	return b
}
func (b *PolicyBuilder) Hugepages2Mi(q string) *PolicyBuilder {
	b.obj.Spec.Fabric.Hugepages2Mi = ptr.To(resource.MustParse(q))
	return b
}
func (b *PolicyBuilder) Bidirectional(on bool) *PolicyBuilder {
	b.obj.Spec.Bidirectional = on
	return b
}
func (b *PolicyBuilder) LayerStreaming(on bool) *PolicyBuilder {
	b.obj.Spec.LayerStreaming = on
	return b
}
func (b *PolicyBuilder) SameNode(sn kvv1.SameNodePolicy) *PolicyBuilder {
	b.obj.Spec.SameNode = sn
	return b
}
func (b *PolicyBuilder) Lease(seconds int32) *PolicyBuilder {
	b.obj.Spec.LeaseSeconds = seconds
	return b
}
func (b *PolicyBuilder) HealthWindow(seconds int32) *PolicyBuilder {
	b.obj.Spec.HealthWindowSeconds = &seconds
	return b
}
func (b *PolicyBuilder) RegistrationTimeout(seconds int32) *PolicyBuilder {
	b.obj.Spec.RegistrationTimeoutSeconds = seconds
	return b
}
func (b *PolicyBuilder) BlocksTTL(seconds int32) *PolicyBuilder {
	b.obj.Spec.BlocksTTLSeconds = seconds
	return b
}
func (b *PolicyBuilder) LoadFailurePolicy(p kvv1.LoadFailurePolicy) *PolicyBuilder {
	b.obj.Spec.LoadFailurePolicy = p
	return b
}
func (b *PolicyBuilder) HandoffFailurePolicy(p kvv1.HandoffFailurePolicy) *PolicyBuilder {
	b.obj.Spec.HandoffFailurePolicy = p
	return b
}

// Routing replaces the policy's routing.
func (b *PolicyBuilder) Routing(r kvv1.RoutingSpec) *PolicyBuilder {
	b.obj.Spec.Routing = &r
	return b
}

// PrefixAware routes by prefix with a tail under minPrefill tokens served on decode alone.
func (b *PolicyBuilder) PrefixAware(minPrefill int32) *PolicyBuilder {
	b.obj.Spec.Routing.DecodeChoice = kvv1.DecodeChoicePrefixAware
	b.obj.Spec.Routing.MinPrefillTokens = minPrefill
	return b
}

// Obj returns the policy.
func (b *PolicyBuilder) Obj() *kvv1.KVTransferPolicy { return &b.obj }

// PoolBuilder builds a PrefillPool or a DecodePool; the setters act on the EngineSpec
// both kinds share.
type PoolBuilder[P interface {
	*kvv1.PrefillPool | *kvv1.DecodePool
}] struct {
	obj  P
	meta *metav1.ObjectMeta
	spec *kvv1.EngineSpec
}

func engineSpec() kvv1.EngineSpec {
	return kvv1.EngineSpec{
		Model:                Model,
		Image:                Image,
		Replicas:             ptr.To[int32](1),
		TensorParallelSize:   8,
		PipelineParallelSize: 1,
		BlockSize:            16,
		Accelerator:          kvv1.AcceleratorSpec{Type: kvv1.AcceleratorNvidiaGPU},
		InstanceType:         "p5en.48xlarge",
		TransferPolicyRef:    kvv1.PolicyReference{Name: "policy"},
	}
}

// PrefillPool starts a TP8 Qwen3-32B prefill pool on p5en that uses the policy "policy".
func PrefillPool(name string) *PoolBuilder[*kvv1.PrefillPool] {
	p := &kvv1.PrefillPool{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: Namespace},
		Spec:       kvv1.PrefillPoolSpec{EngineSpec: engineSpec()},
	}
	return &PoolBuilder[*kvv1.PrefillPool]{obj: p, meta: &p.ObjectMeta, spec: &p.Spec.EngineSpec}
}

// DecodePool starts a TP8 Qwen3-32B decode pool on p5en, paired with the prefill pool
// named prefill, that uses the policy "policy".
func DecodePool(name, prefill string) *PoolBuilder[*kvv1.DecodePool] {
	d := &kvv1.DecodePool{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: Namespace},
		Spec: kvv1.DecodePoolSpec{
			EngineSpec:     engineSpec(),
			PrefillPoolRef: kvv1.PoolReference{Name: prefill},
		},
	}
	return &PoolBuilder[*kvv1.DecodePool]{obj: d, meta: &d.ObjectMeta, spec: &d.Spec.EngineSpec}
}

func (b *PoolBuilder[P]) Namespace(ns string) *PoolBuilder[P] { b.meta.Namespace = ns; return b }
func (b *PoolBuilder[P]) Model(m string) *PoolBuilder[P]      { b.spec.Model = m; return b }
func (b *PoolBuilder[P]) Image(i string) *PoolBuilder[P]      { b.spec.Image = i; return b }
func (b *PoolBuilder[P]) Replicas(n int32) *PoolBuilder[P] {
	b.spec.Replicas = ptr.To(n)
	return b
}
func (b *PoolBuilder[P]) TP(n int32) *PoolBuilder[P] { b.spec.TensorParallelSize = n; return b }
func (b *PoolBuilder[P]) PP(n int32) *PoolBuilder[P] { b.spec.PipelineParallelSize = n; return b }
func (b *PoolBuilder[P]) BlockSize(n int32) *PoolBuilder[P] {
	b.spec.BlockSize = n
	return b
}
func (b *PoolBuilder[P]) Accelerator(t kvv1.AcceleratorType, count int32) *PoolBuilder[P] {
	b.spec.Accelerator = kvv1.AcceleratorSpec{Type: t, Count: count}
	return b
}

// DRA gives the pool's engines their devices by claim, with dra's settings (nil: the defaults).
func (b *PoolBuilder[P]) DRA(dra *kvv1.DRASpec) *PoolBuilder[P] {
	b.spec.Accelerator.Allocation, b.spec.Accelerator.DRA = kvv1.DeviceAllocationDRA, dra
	return b
}
func (b *PoolBuilder[P]) Allocation(a kvv1.DeviceAllocation) *PoolBuilder[P] {
	b.spec.Accelerator.Allocation = a
	return b
}
func (b *PoolBuilder[P]) InstanceType(t string) *PoolBuilder[P] {
	b.spec.InstanceType = t
	return b
}
func (b *PoolBuilder[P]) Policy(name string) *PoolBuilder[P] {
	b.spec.TransferPolicyRef.Name = name
	return b
}
func (b *PoolBuilder[P]) EngineArgs(args ...string) *PoolBuilder[P] {
	b.spec.EngineArgs = args
	return b
}

// Env adds a plain environment variable to the engine container.
func (b *PoolBuilder[P]) Env(name, value string) *PoolBuilder[P] {
	b.spec.Env = append(b.spec.Env, corev1.EnvVar{Name: name, Value: value})
	return b
}

// Template sets the pool's partial pod template, as the JSON a user would write.
func (b *PoolBuilder[P]) RunAsRoot(on bool) *PoolBuilder[P] { b.spec.RunAsRoot = on; return b }
func (b *PoolBuilder[P]) Template(json string) *PoolBuilder[P] {
	b.spec.Template = &runtime.RawExtension{Raw: []byte(json)}
	return b
}

// Obj returns the pool.
func (b *PoolBuilder[P]) Obj() P { return b.obj }
