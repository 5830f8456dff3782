package server

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
)

// Allocation is one device the kubelet gave a container, as its PodResources API lists
// it: the resource (DRAResource for a DRA driver's), the device's id as the plugin or
// driver that published it named it, and the pod.
type Allocation struct {
	Resource, DeviceID, Pod string
}

// DRAResource is the Allocation resource of devices a DRA driver's claims hold: never one
// this plugin advertises, so a device a claim holds is always held elsewhere.
func DRAResource(driver string) string { return "dra:" + driver }

// HeldElsewhere returns the inventory devices that allocations hold under another name
// than the one this plugin advertises them by now, each with who holds it: an EFA a pod
// got as vpc.amazonaws.com/efa before --bundles was switched on, or a GPU the stock
// NVIDIA plugin gave a pod. The kubelet accounts for each resource apart, so such a
// device, advertised again, would be handed to a second pod; it is advertised unhealthy
// until it is released.
//
// Another plugin names devices its own way, so a device id matches a device by any of
// its names: kvhandoff's id, its bundle's id, the GPU UUID (NVIDIA's id, "::n" replicas
// included), the PCI address, the RDMA device name and its device nodes' names (the EFA
// plugin's), or, for nvidia.com/gpu and aws.amazon.com/neuron(device), its index.
func HeldElsewhere(inv inventory.Inventory, served []Resource, allocs []Allocation) map[string]string {
	ours := map[string]map[string][]inventory.Device{}
	for _, r := range served {
		ours[r.Name] = r.members(inv)
	}
	out := map[string]string{}
	for _, a := range allocs {
		if _, ok := ours[a.Resource][a.DeviceID]; ok {
			continue // the kubelet accounts for it under the name we advertise
		}
		for _, d := range devicesNamed(inv, a.Resource, a.DeviceID) {
			out[d.ID] = fmt.Sprintf("%s %s of pod %s", a.Resource, a.DeviceID, a.Pod)
		}
	}
	return out
}

// indexed are resources whose plugins name devices by index, and the kind they index.
var indexed = map[string]inventory.Kind{
	"nvidia.com/gpu":              inventory.GPU,
	"aws.amazon.com/neuron":       inventory.Neuron,
	"aws.amazon.com/neurondevice": inventory.Neuron,
}

// devicesNamed returns the inventory devices id names under resource.
func devicesNamed(inv inventory.Inventory, resource, id string) []inventory.Device {
	for _, b := range inv.Bundles {
		if (resource == ResourceGPUEFA || resource == ResourceNeuronEFA) && b.ID == id {
			var out []inventory.Device
			for _, m := range append([]string{b.Accelerator}, b.EFAs...) {
				if d, ok := inv.Lookup(m); ok {
					out = append(out, d)
				}
			}
			return out
		}
	}
	id, _, _ = strings.Cut(id, "::") // NVIDIA's time-sliced replicas: <uuid>::<n>
	index, numeric := strconv.Atoi(id)
	var out []inventory.Device
	for _, d := range inv.Devices {
		names := []string{d.ID, d.UUID, d.PCIBusID, d.RDMA}
		if strings.HasPrefix(resource, "dra:") {
			names = append(names, d.DRAName()) // kvhandoff's driver's names, NVIDIA's for GPUs
		}
		for _, n := range d.DeviceNodes {
			names = append(names, filepath.Base(n))
		}
		kind, byIndex := indexed[resource]
		if named(id, names) || (numeric == nil && byIndex && d.Kind == kind && d.Index == index) {
			out = append(out, d)
		}
	}
	return out
}

func named(id string, names []string) bool {
	for _, n := range names {
		if n != "" && n == id {
			return true
		}
	}
	return false
}
