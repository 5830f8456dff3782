// Package inventory discovers the devices the plugin advertises — EFA NICs, NVIDIA GPUs,
// Neuron devices — from sysfs and NVML, and pairs each accelerator with its local EFAs.
package inventory

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/nvml"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/topology"
)

// Kind is what a device is.
type Kind string

const (
	GPU    Kind = "gpu"
	EFA    Kind = "efa"
	Neuron Kind = "neuron"
)

// Device is one advertisable device.
type Device struct {
	Kind Kind   `json:"kind"`
	ID   string `json:"id"`
	// PCIBusID is the device's PCI address, 0000:12:00.0.
	PCIBusID string `json:"pciBusID"`
	// NUMANode is -1 when the platform does not say.
	NUMANode int `json:"numaNode"`
	// Switch is the locality group: the PCIe switch the device sits under.
	Switch string `json:"switch"`
	// DeviceNodes are the /dev paths a container needs for this device.
	DeviceNodes []string `json:"deviceNodes"`
	Healthy     bool     `json:"healthy"`

	// UUID is a GPU's UUID (with NVML). Index is the GPU minor or Neuron index.
	UUID    string   `json:"uuid,omitempty"`
	Index   int      `json:"-"`
	Bridges []string `json:"-"`
	// RDMA is an EFA's RDMA device name, for its port state.
	RDMA string `json:"-"`
	// NVLinks is a GPU's number of active NVLinks (with NVML).
	NVLinks int `json:"nvlinks,omitempty"`
}

// Bundle is an accelerator with its local EFAs, advertised as one device.
type Bundle struct {
	ID          string            `json:"id"`
	Kind        Kind              `json:"kind"`
	Accelerator string            `json:"accelerator"`
	EFAs        []string          `json:"efas"`
	Locality    topology.Locality `json:"locality"`
}

// Inventory is what Discover found.
type Inventory struct {
	Devices []Device `json:"devices"`
	Bundles []Bundle `json:"bundles"`
	// NVML says whether GPU data came from NVML: "ok", "disabled", or why it is unavailable.
	NVML string `json:"nvml"`
	// Problems are the entries that could not be read, one line each.
	Problems []string `json:"problems,omitempty"`
}

// Options say where to look.
type Options struct {
	// Root holds sys/ and proc/ ("/" on a node).
	Root string
	// DevRoot holds the device nodes ("/dev" on a node).
	DevRoot string
	// NVML is nil when NVML is disabled or unavailable; NVMLStatus says which.
	NVML       nvml.Interface
	NVMLStatus string
}

// Discover reads the machine.
func Discover(o Options) Inventory {
	root := sysfs.Root(o.Root)
	inv := Inventory{NVML: o.NVMLStatus}
	if inv.NVML == "" {
		inv.NVML = "ok"
	}
	fns, errs := root.PCIFunctions()
	for _, err := range errs {
		inv.Problems = append(inv.Problems, err.Error())
	}
	byAddr := map[string]sysfs.PCIFunction{}
	for _, f := range fns {
		byAddr[f.Address] = f
	}
	devNode := func(name string) string { return filepath.Join("/dev", name) }
	exists := func(name string) bool {
		_, err := os.Stat(filepath.Join(o.DevRoot, name))
		return err == nil
	}

	// EFA: RDMA devices whose PCI function is Amazon's and bound to the efa driver. Never
	// "every RDMA device": a ConnectX next to EFA breaks libfabric's efa provider in pods.
	rdma, errs := root.RDMADevices()
	for _, err := range errs {
		inv.Problems = append(inv.Problems, err.Error())
	}
	for _, r := range rdma {
		f, ok := byAddr[r.PCIAddress]
		if !ok || f.Vendor != sysfs.VendorAmazon || f.Driver != "efa" {
			continue
		}
		d := Device{Kind: EFA, ID: r.Name, PCIBusID: f.Address, NUMANode: f.NUMANode, Bridges: f.Bridges, RDMA: r.Name, Healthy: true}
		if r.Uverbs == "" {
			inv.Problems = append(inv.Problems, fmt.Sprintf("EFA %s has no uverbs device; not advertised", r.Name))
			continue
		}
		d.DeviceNodes = []string{devNode("infiniband/" + r.Uverbs), devNode("infiniband/rdma_cm")}
		d.Healthy = r.PortState == "ACTIVE" && exists("infiniband/"+r.Uverbs)
		inv.Devices = append(inv.Devices, d)
	}

	inv.Devices = append(inv.Devices, gpus(root, o, byAddr, &inv, exists)...)

	neuronIdx := root.NeuronIndexes()
	var neurons []sysfs.PCIFunction
	for _, f := range fns {
		if f.Vendor == sysfs.VendorAmazon && f.Driver == "neuron" {
			neurons = append(neurons, f)
		}
	}
	for i, f := range neurons {
		idx, ok := neuronIdx[f.Address]
		if !ok {
			idx = i // no class entry: the driver numbers devices in PCI order
		}
		name := fmt.Sprintf("neuron%d", idx)
		inv.Devices = append(inv.Devices, Device{Kind: Neuron, ID: name, PCIBusID: f.Address, NUMANode: f.NUMANode, Bridges: f.Bridges,
			Index: idx, DeviceNodes: []string{devNode(name)}, Healthy: exists(name)})
	}

	for i := range inv.Devices {
		inv.Devices[i].Switch = locality(inv.Devices[i]).Switch()
	}
	inv.Bundles = bundles(inv.Devices)
	sort.SliceStable(inv.Devices, func(i, j int) bool {
		if inv.Devices[i].Kind != inv.Devices[j].Kind {
			return inv.Devices[i].Kind < inv.Devices[j].Kind
		}
		return inv.Devices[i].PCIBusID < inv.Devices[j].PCIBusID
	})
	return inv
}

func gpus(root sysfs.Root, o Options, byAddr map[string]sysfs.PCIFunction, inv *Inventory, exists func(string) bool) []Device {
	var out []Device
	nodes := func(minor int) []string {
		return []string{fmt.Sprintf("/dev/nvidia%d", minor), "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
	}
	if o.NVML != nil {
		list, err := o.NVML.GPUs()
		if err == nil {
			for _, g := range list {
				f, ok := byAddr[g.PCIBusID]
				if !ok || f.Vendor != sysfs.VendorNVIDIA {
					inv.Problems = append(inv.Problems,
						fmt.Sprintf("NVML reports GPU %s at %s, which sysfs does not show as an NVIDIA function", g.UUID, g.PCIBusID))
					f = sysfs.PCIFunction{Address: g.PCIBusID, NUMANode: -1}
				}
				out = append(out, Device{Kind: GPU, ID: g.UUID, UUID: g.UUID, PCIBusID: g.PCIBusID, NUMANode: f.NUMANode, Bridges: f.Bridges,
					Index: g.Minor, NVLinks: g.NVLinks, DeviceNodes: nodes(g.Minor), Healthy: exists(fmt.Sprintf("nvidia%d", g.Minor))})
			}
			return out
		}
		inv.NVML = "unavailable: " + err.Error()
	}
	// Without NVML: NVIDIA display and 3D controllers in sysfs, minors from the driver.
	for _, f := range sortedFunctions(byAddr) {
		if f.Vendor != sysfs.VendorNVIDIA || !(strings.HasPrefix(f.Class, "0x0302") || strings.HasPrefix(f.Class, "0x0300")) {
			continue
		}
		minor := root.NvidiaMinor(f.Address)
		if minor < 0 {
			inv.Problems = append(inv.Problems, fmt.Sprintf("NVIDIA GPU %s: no device minor in proc/driver/nvidia (driver not loaded?); not "+
				"advertised", f.Address))
			continue
		}
		out = append(out, Device{Kind: GPU, ID: fmt.Sprintf("nvidia%d", minor), PCIBusID: f.Address, NUMANode: f.NUMANode, Bridges: f.Bridges,
			Index: minor, DeviceNodes: nodes(minor), Healthy: exists(fmt.Sprintf("nvidia%d", minor))})
	}
	return out
}

func sortedFunctions(m map[string]sysfs.PCIFunction) []sysfs.PCIFunction {
	out := make([]sysfs.PCIFunction, 0, len(m))
	for _, f := range m {
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Address < out[j].Address })
	return out
}

func locality(d Device) topology.Device {
	return topology.Device{ID: d.ID, Bridges: d.Bridges, NUMA: d.NUMANode}
}

// bundles pairs each accelerator with its local EFAs.
func bundles(devices []Device) []Bundle {
	var accs, nics []topology.Device
	kind := map[string]Kind{}
	for _, d := range devices {
		switch d.Kind {
		case EFA:
			nics = append(nics, locality(d))
		default:
			accs = append(accs, locality(d))
			kind[d.ID] = d.Kind
		}
	}
	assigned := topology.Assign(accs, nics)
	var out []Bundle
	for _, a := range accs {
		as := assigned[a.ID]
		loc := as.Locality
		if loc == "" {
			loc = topology.LocalityNone
		}
		efas := as.NICs
		if efas == nil {
			efas = []string{}
		}
		out = append(out, Bundle{ID: a.ID, Kind: kind[a.ID], Accelerator: a.ID, EFAs: efas, Locality: loc})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// DRAName is the device's name in kvhandoff's ResourceSlices: a DNS label of its kind and
// identity (efa-rdmap79s0, gpu-3 — NVIDIA's DRA driver names GPUs so too — neuron-12).
func (d Device) DRAName() string {
	switch d.Kind {
	case EFA:
		return "efa-" + d.RDMA
	case GPU:
		return fmt.Sprintf("gpu-%d", d.Index)
	default:
		return fmt.Sprintf("neuron-%d", d.Index)
	}
}

// Lookup returns the device with id.
func (inv Inventory) Lookup(id string) (Device, bool) {
	for _, d := range inv.Devices {
		if d.ID == id {
			return d, true
		}
	}
	return Device{}, false
}

// OfKind returns the devices of one kind.
func (inv Inventory) OfKind(k Kind) []Device {
	var out []Device
	for _, d := range inv.Devices {
		if d.Kind == k {
			out = append(out, d)
		}
	}
	return out
}
