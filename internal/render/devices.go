package render

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/internal/compat"
)

// DeviceClaim is the name of the engine pod's claim (pod.spec.resourceClaims) under
// accelerator.allocation DRA; the engine container uses it.
const DeviceClaim = "devices"

// Request names in the claim: accelerator-<i> and efa-<i>, the EFAs of accelerator i.
// The names are how the agent and the docs tell which EFAs are whose (claim results
// carry the request of each device).
const (
	AcceleratorRequest = "accelerator"
	EFARequest         = "efa"
)

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

// deviceClaimTemplate renders the pool's ResourceClaimTemplate (nil unless allocation
// is DRA). Without EFA it asks for N accelerators; with EFA, one request per
// accelerator and one for its own EFAs, bound by a matchAttribute constraint on the
// locality attribute, so the scheduler allocates each accelerator with NICs of its own
// PCIe root (p5en TP8: 8 GPUs, 16 EFAs, each GPU with its two). A template's spec is
// immutable, so its name carries the hash of what it asks: a change makes a new one,
// which the engines roll onto.
func deviceClaimTemplate(in Input) (*resourcev1.ResourceClaimTemplate, error) {
	if !usesDRA(in.Spec) {
		return nil, nil
	}
	d := draSpec(in.Spec)
	n := compat.Accelerators(in.Spec)
	var devices resourcev1.DeviceClaim
	if in.Policy.Fabric.Provider != kvv1.ProviderEFA {
		devices.Requests = []resourcev1.DeviceRequest{{Name: AcceleratorRequest,
			Exactly: &resourcev1.ExactDeviceRequest{DeviceClassName: d.DeviceClassName, AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: int64(n)}}}
	} else {
		per, err := compat.EFAPerAccelerator(in.Spec, in.Policy)
		if err != nil {
			return nil, err
		}
		for i := range n {
			acc, efa := fmt.Sprintf("%s-%d", AcceleratorRequest, i), fmt.Sprintf("%s-%d", EFARequest, i)
			devices.Requests = append(devices.Requests,
				resourcev1.DeviceRequest{Name: acc, Exactly: &resourcev1.ExactDeviceRequest{DeviceClassName: d.DeviceClassName,
					AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: 1}},
				resourcev1.DeviceRequest{Name: efa, Exactly: &resourcev1.ExactDeviceRequest{DeviceClassName: d.EFADeviceClassName,
					AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: int64(per)}})
			devices.Constraints = append(devices.Constraints, resourcev1.DeviceConstraint{
				Requests: []string{acc, efa}, MatchAttribute: ptr.To(resourcev1.FullyQualifiedName(d.LocalityAttribute))})
		}
	}
	spec := resourcev1.ResourceClaimTemplateSpec{Spec: resourcev1.ResourceClaimSpec{Devices: devices}}
	hash, err := hashJSON(&spec)
	if err != nil {
		return nil, err
	}
	meta := objectMeta(in)
	meta.Name = fmt.Sprintf("%s-devices-%s", in.Name, hash[:8])
	return &resourcev1.ResourceClaimTemplate{
		TypeMeta:   metav1.TypeMeta{APIVersion: "resource.k8s.io/v1", Kind: "ResourceClaimTemplate"},
		ObjectMeta: meta,
		Spec:       spec,
	}, nil
}

// addDeviceClaim gives the engine the pool's claim: one per pod, made by the
// ResourceClaim controller from the template and deleted with the pod.
func addDeviceClaim(pod *corev1.PodTemplateSpec, engine *corev1.Container, template string) {
	pod.Spec.ResourceClaims = append(pod.Spec.ResourceClaims, corev1.PodResourceClaim{Name: DeviceClaim, ResourceClaimTemplateName: ptr.To(template)})
	engine.Resources.Claims = append(engine.Resources.Claims, corev1.ResourceClaim{Name: DeviceClaim})
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
