package v1alpha1

// DeviceAllocation is how the kubelet hands an engine its devices.
// +kubebuilder:validation:Enum=DevicePlugin;DRA
type DeviceAllocation string

const (
	// DeviceAllocationDevicePlugin requests accelerators and EFAs as extended resources,
	// counted apart by device plugins.
	DeviceAllocationDevicePlugin DeviceAllocation = "DevicePlugin"
	// DeviceAllocationDRA claims them by Dynamic Resource Allocation: the scheduler
	// allocates each accelerator together with EFAs that share its locality attribute.
	DeviceAllocationDRA DeviceAllocation = "DRA"
)

// Device classes and attributes the claims use when a pool names none.
const (
	// DeviceClassNvidiaGPU is the class NVIDIA's DRA driver (gpu.nvidia.com) installs
	// for whole GPUs.
	DeviceClassNvidiaGPU = "gpu.nvidia.com"
	// DeviceClassNeuron is the class of AWS's Neuron DRA driver (neuron.aws.com).
	DeviceClassNeuron = "neuron.aws.com"
	// DeviceClassEFA is the EFA class of kvhandoff's DRA driver (config/dra).
	DeviceClassEFA = "efa.kvhandoff.io"
	// AttributePCIeRoot is Kubernetes' standard attribute for a device's PCIe root
	// complex, which NVIDIA's, AWS's and kvhandoff's drivers publish.
	AttributePCIeRoot = "resource.kubernetes.io/pcieRoot"
)

// DRASpec is what a pool's ResourceClaimTemplate asks for.
type DRASpec struct {
	// deviceClassName is the DeviceClass each accelerator is claimed from. Empty is the
	// class of the accelerator type's own DRA driver: gpu.nvidia.com for NvidiaGPU,
	// neuron.aws.com for Neuron (gpu.kvhandoff.io and neuron.kvhandoff.io where
	// kvhandoff's driver publishes the accelerators).
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	// +optional
	DeviceClassName string `json:"deviceClassName,omitempty"`

	// efaDeviceClassName is the DeviceClass each accelerator's EFAs are claimed from,
	// with a policy whose fabric.provider is efa: efa.kvhandoff.io (kvhandoff's driver),
	// or the class an EFA DRA driver's installation created.
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	// +kubebuilder:default="efa.kvhandoff.io"
	// +optional
	EFADeviceClassName string `json:"efaDeviceClassName,omitempty"`

	// localityAttribute is the device attribute an accelerator and each of its EFAs must
	// have equal (the claim's matchAttribute constraint): the standard
	// resource.kubernetes.io/pcieRoot, or kvhandoff's finer dra.kvhandoff.io/pcieSwitch
	// where one root complex holds several accelerators' switches (both drivers must
	// publish it: only kvhandoff's does).
	// +kubebuilder:validation:MaxLength=96
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[a-zA-Z][a-zA-Z0-9]*$`
	// +kubebuilder:default="resource.kubernetes.io/pcieRoot"
	// +optional
	LocalityAttribute string `json:"localityAttribute,omitempty"`
}
