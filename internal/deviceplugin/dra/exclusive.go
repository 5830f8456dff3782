package dra

import (
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/deviceattribute"

	"github.com/kvhandoff/kvhandoff/internal/claimrails"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
)

// Extended resources a device plugin serves the devices this driver would publish by:
// the kubelet counts those apart from claims, so both at once hand one device out twice.
var (
	efaResources         = []corev1.ResourceName{"vpc.amazonaws.com/efa", "kvhandoff.io/gpu-efa", "kvhandoff.io/neuron-efa"}
	acceleratorResources = []corev1.ResourceName{"nvidia.com/gpu", "aws.amazon.com/neuron", "aws.amazon.com/neurondevice", "aws.amazon.com/neuroncore"}
)

// Conflicts says why publishing inv's devices on node would let one device be handed
// out twice: a device plugin that serves them there (the node's allocatable), or another
// DRA driver's slice with one of them (same PCI address, or, DRANET's, same RDMA
// device). Empty: none. The driver refuses to start on any.
func Conflicts(node *corev1.Node, others []resourceapi.ResourceSlice, inv inventory.Inventory, accelerators bool) []string {
	var out []string
	served := efaResources
	if accelerators {
		served = append(slices.Clone(efaResources), acceleratorResources...)
	}
	for _, r := range served {
		if q, ok := node.Status.Allocatable[r]; ok && !q.IsZero() {
			out = append(out, fmt.Sprintf("node %s has %s %s allocatable: a device plugin serves these devices, and the kubelet would give them to "+
				"its pods and to claims alike; remove that plugin from the node (its allocatable drops to 0 up to 5 minutes later) or do not "+
				"run this driver there", node.Name, q.String(), r))
		}
	}
	mine := map[string]string{}
	for _, d := range inv.Devices {
		if Published(d, accelerators) {
			mine[normalPCI(d.PCIBusID)] = Name(d)
			if d.RDMA != "" {
				mine["rdma:"+d.RDMA] = Name(d)
			}
		}
	}
	for _, s := range others {
		if s.Spec.Driver == DriverName {
			continue
		}
		for _, dev := range s.Spec.Devices {
			var keys []string
			if a, ok := dev.Attributes[deviceattribute.StandardDeviceAttributePCIBusID]; ok && a.StringValue != nil {
				keys = append(keys, normalPCI(*a.StringValue))
			}
			if name := claimrails.RDMADevice(s.Spec.Driver, dev.Attributes); name != "" {
				keys = append(keys, "rdma:"+name)
			}
			for _, k := range keys {
				if ours, ok := mine[k]; ok {
					out = append(out, fmt.Sprintf("driver %s publishes %s on node %s, which is this driver's %s: the scheduler could allocate "+
						"it through both; publish accelerators with one driver only (--accelerators only where no other driver does) and EFAs "+
						"with one", s.Spec.Driver, dev.Name, node.Name, ours))
					break
				}
			}
		}
	}
	return out
}
