package dra

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/deviceattribute"

	"github.com/kvhandoff/kvhandoff/internal/claimrails"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/server"
)

// Foreign returns the attributes of a device another driver published ((driver, pool,
// device) of an allocation result), nil when it is not known.
type Foreign func(driver, pool, device string) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute

// Rail is one accelerator of a claim with its own EFAs.
type Rail struct {
	// Accelerator names the accelerator as the visibility variable does (GPU UUID,
	// Neuron index); EFAs are its EFAs' RDMA device names.
	Accelerator string
	EFAs        []string
	pci         string
	index       int
}

// Rails pairs each accelerator of claim with its own EFAs from the allocation results:
// request accelerator-i with request efa-i. The accelerator is resolved to a device of
// inv — by the GPU UUID an NVIDIA-shaped driver publishes, or by its PCI address — to
// name it as the engine sees it; the EFAs may be kvhandoff's (rdmaDevice) or another
// driver's (DRANET's dra.net/rdmaDevice). The rails come in the accelerators' PCI order,
// which is CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID and the Neuron runtime's.
// What cannot be resolved is reported and left out, never guessed.
func Rails(claim *resourceapi.ResourceClaim, inv inventory.Inventory, foreign Foreign) ([]Rail, []string) {
	if claim.Status.Allocation == nil {
		return nil, nil
	}
	byName := map[string]inventory.Device{}
	for _, d := range inv.Devices {
		byName[Name(d)] = d
	}
	accs, efas := map[int]inventory.Device{}, map[int][]string{}
	var problems []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		kind, i, ok := claimrails.Request(r.Request)
		if !ok {
			continue
		}
		attrs := attributesOf(r, byName, foreign)
		if attrs == nil {
			problems = append(problems, fmt.Sprintf("%s: %s/%s/%s is in no ResourceSlice this driver can read", r.Request, r.Driver, r.Pool, r.Device))
			continue
		}
		switch kind {
		case claimrails.Accelerator:
			d, found := resolveAccelerator(r.Driver, attrs, inv)
			if !found {
				problems = append(problems, fmt.Sprintf("%s: %s/%s carries neither a uuid this node's GPUs have nor a PCI address of an "+
					"accelerator here", r.Request, r.Driver, r.Device))
				continue
			}
			accs[i] = d
		case claimrails.EFA:
			name := claimrails.RDMADevice(r.Driver, attrs)
			if name == "" {
				problems = append(problems, fmt.Sprintf("%s: %s/%s publishes no rdmaDevice attribute", r.Request, r.Driver, r.Device))
				continue
			}
			efas[i] = append(efas[i], name)
		}
	}
	var rails []Rail
	for i, acc := range accs {
		name := acc.UUID
		if name == "" {
			name = strconv.Itoa(acc.Index)
		}
		rail := Rail{Accelerator: name, EFAs: efas[i], pci: acc.PCIBusID, index: i}
		slices.Sort(rail.EFAs)
		rails = append(rails, rail)
	}
	slices.SortFunc(rails, func(a, b Rail) int { return cmp.Or(cmp.Compare(a.pci, b.pci), cmp.Compare(a.index, b.index)) })
	return rails, problems
}

// Env is KVHANDOFF_ACCELERATOR_EFAS's value for rails, in the device plugin's format.
func Env(rails []Rail) string {
	var groups []string
	for _, r := range rails {
		groups = append(groups, r.Accelerator+"="+strings.Join(r.EFAs, ","))
	}
	return strings.Join(groups, ";")
}

// EnvName is the variable the connector reads its ranks' EFAs from.
const EnvName = server.EnvAcceleratorEFAs

// EnvVar is the variable a claim's rails go in. An engine whose devices take several
// claims (a claim holds 32 devices) gets one spec per claim, and two specs setting one
// variable would leave the container one of them: the claim of accelerator-0 sets
// KVHANDOFF_ACCELERATOR_EFAS, a claim starting at accelerator-i sets
// KVHANDOFF_ACCELERATOR_EFAS_<i>, and the connector reads them all in that order.
func EnvVar(rails []Rail) string {
	first := -1
	for _, r := range rails {
		if first < 0 || r.index < first {
			first = r.index
		}
	}
	if first <= 0 {
		return EnvName
	}
	return EnvName + "_" + strconv.Itoa(first)
}

func attributesOf(r resourceapi.DeviceRequestAllocationResult, own map[string]inventory.Device,
	foreign Foreign) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
	if r.Driver == DriverName {
		d, ok := own[r.Device]
		if !ok {
			return nil
		}
		return identity(d)
	}
	if foreign == nil {
		return nil
	}
	return foreign(r.Driver, r.Pool, r.Device)
}

// stringAttr reads attribute name in driver's domain: unqualified, or qualified with it.
func stringAttr(attrs map[resourceapi.QualifiedName]resourceapi.DeviceAttribute, driver, name string) string {
	for _, key := range []string{name, driver + "/" + name} {
		if a, ok := attrs[resourceapi.QualifiedName(key)]; ok && a.StringValue != nil {
			return *a.StringValue
		}
	}
	return ""
}

// resolveAccelerator finds the inventory device an allocated accelerator is: by the
// uuid attribute of its driver's domain (NVIDIA's gpu.nvidia.com/uuid), else by its PCI
// address (the standard pciBusID, or NVIDIA's pcieBusID).
func resolveAccelerator(driver string, attrs map[resourceapi.QualifiedName]resourceapi.DeviceAttribute, inv inventory.Inventory) (inventory.Device, bool) {
	uuid := stringAttr(attrs, driver, AttrUUID)
	pci := stringAttr(attrs, driver, "pcieBusID")
	if a, ok := attrs[deviceattribute.StandardDeviceAttributePCIBusID]; ok && a.StringValue != nil {
		pci = *a.StringValue
	}
	for _, d := range inv.Devices {
		if d.Kind == inventory.EFA {
			continue
		}
		if (uuid != "" && d.UUID == uuid) || (pci != "" && normalPCI(d.PCIBusID) == normalPCI(pci)) {
			return d, true
		}
	}
	return inventory.Device{}, false
}

// normalPCI writes a PCI address as sysfs does: NVML's 8-digit domain (00000000:12:00.0)
// becomes 4 digits, hex in lower case.
func normalPCI(addr string) string {
	addr = strings.ToLower(addr)
	if domain, rest, ok := strings.Cut(addr, ":"); ok && len(domain) > 4 {
		addr = domain[len(domain)-4:] + ":" + rest
	}
	return addr
}
