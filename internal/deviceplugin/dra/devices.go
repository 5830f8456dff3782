// Package dra is kvhandoff's kubelet DRA plugin (resource.k8s.io/v1): the devices the
// device plugin discovers, published as ResourceSlices with the standard locality
// attributes and kvhandoff's PCIe switch, prepared for containers through CDI with their
// device nodes, visibility variables and each accelerator's EFAs.
package dra

import (
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/utils/ptr"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
)

// DriverName is the driver's name, the domain of its attributes and its DeviceClasses'
// selector (config/dra).
const DriverName = "dra.kvhandoff.io"

// Attributes of kvhandoff's devices, in the driver's domain
// (device.attributes['dra.kvhandoff.io'].type in a CEL selector).
const (
	// AttrType is efa, gpu or neuron.
	AttrType = "type"
	// AttrRDMADevice is an EFA's RDMA device name (rdmap79s0), the libfabric domain
	// rdmap79s0-rdm: what the agent opens a rail on.
	AttrRDMADevice = "rdmaDevice"
	// AttrUUID is a GPU's UUID (with NVML).
	AttrUUID = "uuid"
	// AttrIndex is a GPU's minor or a Neuron device's index.
	AttrIndex = "index"
	// AttrPCIeSwitch is the PCIe switch the device sits under: finer than the standard
	// pcieRoot where one root complex holds several switches.
	AttrPCIeSwitch = "pcieSwitch"
)

// Name is a device's name in the slices (inventory.Device.DRAName).
func Name(d inventory.Device) string { return d.DRAName() }

// Published says which kinds the driver publishes: EFAs always, accelerators only where
// no other driver publishes them (--accelerators).
func Published(d inventory.Device, accelerators bool) bool {
	return d.Kind == inventory.EFA || accelerators
}

// Devices are the slice entries of inv's healthy devices that the driver publishes.
// A device that fails its checks leaves the slice (the scheduler allocates it to no new
// claim; claims that hold it keep it) and comes back once it recovers. sysRoot holds the
// sys/ folder the standard attributes are read from.
func Devices(inv inventory.Inventory, sysRoot string, accelerators bool, healthy func(inventory.Device) bool) ([]resourceapi.Device, []string) {
	var out []resourceapi.Device
	var problems []string
	for _, d := range inv.Devices {
		if !Published(d, accelerators) || !healthy(d) {
			continue
		}
		dev, err := device(d, sysRoot)
		if err != nil {
			problems = append(problems, err.Error())
		}
		out = append(out, dev)
	}
	return out, problems
}

// device is one slice entry. A standard attribute that cannot be read is left out
// (reported): a claim's matchAttribute on it then never picks the device, rather than
// pairing it with a device of another root.
func device(d inventory.Device, sysRoot string) (resourceapi.Device, error) {
	attrs := identity(d)
	if d.Switch != "" {
		attrs[AttrPCIeSwitch] = resourceapi.DeviceAttribute{StringValue: ptr.To(d.Switch)}
	}
	var err error
	if _, ok := attrs[deviceattribute.StandardDeviceAttributePCIBusID]; ok {
		root, e := deviceattribute.GetPCIeRootAttributeByPCIBusID(d.PCIBusID, deviceattribute.WithFSFromRoot(sysRoot))
		if e == nil {
			attrs[root.Name] = root.Value
		} else {
			err = fmt.Errorf("%s: no %s attribute: %w", Name(d), deviceattribute.StandardDeviceAttributePCIeRoot, e)
		}
	} else {
		err = fmt.Errorf("%s: no PCI attributes: PCI address %q is not one", Name(d), d.PCIBusID)
	}
	// NUMA -1 (unknown) is left out: it would match every other device of unknown NUMA.
	if d.NUMANode >= 0 {
		numa, _ := deviceattribute.GetNUMANodeAttribute(d.NUMANode, deviceattribute.ScalarAttribute)
		attrs[numa.Name] = numa.Value
	}
	return resourceapi.Device{Name: Name(d), Attributes: attrs}, err
}

// identity are the attributes that name a device, from discovery alone (no sysfs read):
// its kind, RDMA device, index, UUID and PCI address (by which an accelerator without a
// UUID is found again).
func identity(d inventory.Device) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{AttrType: {StringValue: ptr.To(string(d.Kind))}}
	if bus, err := deviceattribute.GetPCIBusIDAttribute(d.PCIBusID); err == nil {
		attrs[bus.Name] = bus.Value
	}
	switch d.Kind {
	case inventory.EFA:
		attrs[AttrRDMADevice] = resourceapi.DeviceAttribute{StringValue: ptr.To(d.RDMA)}
	default:
		attrs[AttrIndex] = resourceapi.DeviceAttribute{IntValue: ptr.To(int64(d.Index))}
		if d.UUID != "" {
			attrs[AttrUUID] = resourceapi.DeviceAttribute{StringValue: ptr.To(d.UUID)}
		}
	}
	return attrs
}
