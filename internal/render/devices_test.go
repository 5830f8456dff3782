package render

import (
	"testing"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/builder"
)

// A claim is allocated 32 devices at most (the scheduler refuses more: "exceeds the claim
// limit of 32"): a p5 TP8 engine's 8 GPUs and 32 EFAs take two claims, whole GPUs with
// their EFAs in each, and the engine container uses both.
func TestAnEngineTakesAsManyClaimsAsItsDevicesNeed(t *testing.T) {
	for _, c := range []struct {
		name   string
		pool   *builder.PoolBuilder[*kvv1.PrefillPool]
		policy *builder.PolicyBuilder
		want   []int // devices per claim
	}{
		{"p5en TP8", builder.PrefillPool("p").DRA(nil), builder.Policy("p"), []int{24}},
		{"p5 TP8: 4 EFAs per GPU", builder.PrefillPool("p").InstanceType("p5.48xlarge").DRA(nil), builder.Policy("p"), []int{30, 10}},
		{"trn2, 16 devices", builder.PrefillPool("p").Accelerator(kvv1.AcceleratorNeuron, 16).TP(16).InstanceType("trn2.48xlarge").DRA(nil),
			builder.Policy("p"), []int{32}},
		{"40 GPUs without EFA", builder.PrefillPool("p").Accelerator(kvv1.AcceleratorNvidiaGPU, 40).TP(8).PP(5).InstanceType("").DRA(nil),
			builder.Policy("p").Provider(kvv1.ProviderTCP), []int{32, 8}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := c.pool.Obj()
			w, err := Engines(Input{Role: kvv1.RolePrefill, Name: p.Name, Namespace: "ns", Spec: &p.Spec.EngineSpec, Policy: &c.policy.Obj().Spec})
			if err != nil {
				t.Fatal(err)
			}
			var got []int
			for _, tmpl := range w.DeviceClaims {
				n := 0
				for _, r := range tmpl.Spec.Spec.Devices.Requests {
					n += int(r.Exactly.Count)
				}
				got = append(got, n)
			}
			if len(got) != len(c.want) || got[0] != c.want[0] || got[len(got)-1] != c.want[len(c.want)-1] {
				t.Fatalf("devices per claim %v, want %v", got, c.want)
			}
			pod := w.StatefulSet.Spec.Template.Spec
			if len(pod.ResourceClaims) != len(got) || len(pod.Containers[0].Resources.Claims) != len(got) ||
				*pod.ResourceClaims[len(got)-1].ResourceClaimTemplateName != w.DeviceClaims[len(got)-1].Name {
				t.Fatalf("pod claims %+v, engine uses %+v", pod.ResourceClaims, pod.Containers[0].Resources.Claims)
			}
		})
	}
}
