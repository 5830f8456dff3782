package render

import (
	"fmt"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/claimrails"
	"github.com/kvhandoff/kvhandoff/internal/compat"
)

// DeviceClaim names the engine pod's claims (pod.spec.resourceClaims, devices-<k>) under
// accelerator.allocation DRA; the engine container uses them.
const DeviceClaim = "devices"

// acceleratorsRequest names a claim's one request without EFA. With EFA, requests are
// accelerator-<i> and efa-<i>, the EFAs of accelerator i (package claimrails): the
// allocation results carry each device's request, which is how the DRA driver and the
// agent tell which EFAs are whose.
const acceleratorsRequest = "accelerators"

// draSpec is the pool's DRA settings with their defaults.
func draSpec(spec *kvv1.EngineSpec) kvv1.DRASpec {
	d := ptr.Deref(spec.Accelerator.DRA, kvv1.DRASpec{})
	if d.DeviceClassName == "" {
		d.DeviceClassName = kvv1.DeviceClassNvidiaGPU
		if spec.Accelerator.Type == kvv1.AcceleratorNeuron {
			d.DeviceClassName = kvv1.DeviceClassNeuron
		}
	}
	if d.EFADeviceClassName == "" {
		d.EFADeviceClassName = kvv1.DeviceClassEFA
	}
	if d.LocalityAttribute == "" {
		d.LocalityAttribute = kvv1.AttributePCIeRoot
	}
	return d
}

// usesDRA reports whether the pool's devices come by claim.
func usesDRA(spec *kvv1.EngineSpec) bool {
	return spec.Accelerator.Allocation == kvv1.DeviceAllocationDRA && spec.Accelerator.Type != kvv1.AcceleratorCPU
}

// maxClaimDevices is how many devices the scheduler allocates to one claim
// (resource.k8s.io/v1's AllocationResultsMaxSize): a p5 TP8 engine's 8 GPUs and 32 EFAs
// take two claims.
const maxClaimDevices = 32

// deviceClaimTemplates renders the pool's ResourceClaimTemplates (none unless allocation
// is DRA). Without EFA they ask for the accelerators; with EFA, each accelerator i is a
// request accelerator-i and its own EFAs a request efa-i, bound by a matchAttribute
// constraint on the locality attribute, so the scheduler allocates each accelerator with
// NICs of its own PCIe root (p5en TP8: 8 GPUs, 16 EFAs, each GPU with its two). Whole
// accelerators with their EFAs fill a claim up to maxClaimDevices, and the engine takes
// as many claims as that needs. A template's spec is immutable, so its name carries the
// hash of what it asks: a change makes a new one, which the engines roll onto.
func deviceClaimTemplates(in Input) ([]*resourcev1.ResourceClaimTemplate, error) {
	if !usesDRA(in.Spec) {
		return nil, nil
	}
	d := draSpec(in.Spec)
	n := int(compat.Accelerators(in.Spec))
	per := 0
	if in.Policy.Fabric.Provider == kvv1.ProviderEFA {
		p, err := compat.EFAPerAccelerator(in.Spec, in.Policy)
		if err != nil {
			return nil, err
		}
		per = int(p)
	}
	exact := func(class string, count int) *resourcev1.ExactDeviceRequest {
		return &resourcev1.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: int64(count)}
	}
	var out []*resourcev1.ResourceClaimTemplate
	perClaim := maxClaimDevices / (1 + per)
	for first := 0; first < n; first += perClaim {
		last := min(first+perClaim, n)
		var devices resourcev1.DeviceClaim
		if per == 0 {
			devices.Requests = []resourcev1.DeviceRequest{{Name: acceleratorsRequest, Exactly: exact(d.DeviceClassName, last-first)}}
		}
		for i := first; per > 0 && i < last; i++ {
			acc, efa := claimrails.Accelerator+strconv.Itoa(i), claimrails.EFA+strconv.Itoa(i)
			devices.Requests = append(devices.Requests, resourcev1.DeviceRequest{Name: acc, Exactly: exact(d.DeviceClassName, 1)},
				resourcev1.DeviceRequest{Name: efa, Exactly: exact(d.EFADeviceClassName, per)})
			devices.Constraints = append(devices.Constraints, resourcev1.DeviceConstraint{
				Requests: []string{acc, efa}, MatchAttribute: ptr.To(resourcev1.FullyQualifiedName(d.LocalityAttribute))})
		}
		spec := resourcev1.ResourceClaimTemplateSpec{Spec: resourcev1.ResourceClaimSpec{Devices: devices}}
		hash, err := hashJSON(&spec)
		if err != nil {
			return nil, err
		}
		meta := objectMeta(in)
		meta.Name = fmt.Sprintf("%s-devices-%d-%s", in.Name, len(out), hash[:8])
		out = append(out, &resourcev1.ResourceClaimTemplate{
			TypeMeta:   metav1.TypeMeta{APIVersion: "resource.k8s.io/v1", Kind: "ResourceClaimTemplate"},
			ObjectMeta: meta,
			Spec:       spec,
		})
	}
	return out, nil
}

// addDeviceClaims gives the engine the pool's claims, devices-<k> of template k: one of
// each per pod, made by the ResourceClaim controller and deleted with the pod.
func addDeviceClaims(pod *corev1.PodTemplateSpec, engine *corev1.Container, templates []*resourcev1.ResourceClaimTemplate) {
	for k, t := range templates {
		name := fmt.Sprintf("%s-%d", DeviceClaim, k)
		pod.Spec.ResourceClaims = append(pod.Spec.ResourceClaims, corev1.PodResourceClaim{Name: name, ResourceClaimTemplateName: ptr.To(t.Name)})
		engine.Resources.Claims = append(engine.Resources.Claims, corev1.ResourceClaim{Name: name})
	}
}

// DeviceClaimSummary says in words what each engine of a DRA pool claims ("" for a pool
// on the device plugins, or without a policy).
func DeviceClaimSummary(spec *kvv1.EngineSpec, policy *kvv1.KVTransferPolicy) string {
	if !usesDRA(spec) || policy == nil {
		return ""
	}
	d := draSpec(spec)
	s := fmt.Sprintf("each engine claims %d device(s) of DeviceClass %s", compat.Accelerators(spec), d.DeviceClassName)
	if per, err := compat.EFAPerAccelerator(spec, &policy.Spec); err == nil && policy.Spec.Fabric.Provider == kvv1.ProviderEFA {
		s += fmt.Sprintf(", each with %d EFA(s) of DeviceClass %s of equal %s: a node needs that many of both, published by DRA drivers "+
			"with that attribute (kubectl get resourceslices --field-selector spec.nodeName=<node> -o yaml)", per, d.EFADeviceClassName, d.LocalityAttribute)
	}
	return s
}
