// Package server serves the kubelet device plugin API (deviceplugin/v1beta1) for the
// resources kvhandoff advertises: vpc.amazonaws.com/efa, and opt-in bundles of an
// accelerator with its local EFAs (kvhandoff.io/gpu-efa, kvhandoff.io/neuron-efa).
package server

import (
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/topology"
)

// EnvAcceleratorEFAs is set in containers given bundles: for each accelerator, its EFAs'
// RDMA device names, "<accelerator>=<efa>,<efa>;…" in the order of the accelerator list
// (NVIDIA_VISIBLE_DEVICES, AWS_NEURON_VISIBLE_DEVICES), the accelerator named as there.
// kvhandoff's vLLM connector opens each rank's rails on its own accelerator's EFAs.
const EnvAcceleratorEFAs = "KVHANDOFF_ACCELERATOR_EFAS"

// Resource names.
const (
	ResourceEFA       = "vpc.amazonaws.com/efa"
	ResourceGPUEFA    = "kvhandoff.io/gpu-efa"
	ResourceNeuronEFA = "kvhandoff.io/neuron-efa"
)

// Resource is one advertised resource over an inventory.
type Resource struct {
	Name string
	// members maps an advertised device id to the inventory devices it stands for.
	members func(inv inventory.Inventory) map[string][]inventory.Device
	// anchor is the device whose locality stands for an advertised device.
	anchor func(members []inventory.Device) inventory.Device
	// env is extra container environment for an allocation.
	env func(members [][]inventory.Device) map[string]string
}

// Resources returns the resources to serve on a node with inv: EFA, and with bundles the
// accelerator+EFA bundles; only those with devices on the node.
//
// Invariant: no device is advertised under two resources. The kubelet accounts for each
// resource apart, so an EFA advertised both alone and inside a bundle could be handed to
// two pods at once (one asking for vpc.amazonaws.com/efa, one for bundles). With bundles,
// vpc.amazonaws.com/efa therefore advertises only EFAs that belong to no bundle.
func Resources(inv inventory.Inventory, bundles bool) []Resource {
	bundled := map[string]bool{}
	if bundles {
		for _, b := range inv.Bundles {
			for _, e := range b.EFAs {
				bundled[e] = true
			}
		}
	}
	rs := []Resource{{
		Name: ResourceEFA,
		members: func(inv inventory.Inventory) map[string][]inventory.Device {
			out := map[string][]inventory.Device{}
			for _, d := range inv.OfKind(inventory.EFA) {
				if !bundled[d.ID] {
					out[d.ID] = []inventory.Device{d}
				}
			}
			return out
		},
		anchor: func(m []inventory.Device) inventory.Device { return m[0] },
	}}
	if bundles {
		rs = append(rs, bundle(ResourceGPUEFA, inventory.GPU, "NVIDIA_VISIBLE_DEVICES", func(a inventory.Device) string {
			if a.UUID != "" {
				return a.UUID
			}
			return strconv.Itoa(a.Index)
		}), bundle(ResourceNeuronEFA, inventory.Neuron, "AWS_NEURON_VISIBLE_DEVICES", func(a inventory.Device) string {
			return strconv.Itoa(a.Index)
		}))
	}
	// Advertise only what exists: a GPU node has no Neuron bundles, and with bundles a p5en
	// has no EFA outside them.
	return slices.DeleteFunc(rs, func(r Resource) bool { return len(r.members(inv)) == 0 })
}

// bundle is a resource whose devices are an accelerator of kind with its local EFAs. An
// allocation's container gets the accelerators in visible (named by id) and, in
// EnvAcceleratorEFAs, each one's EFAs.
func bundle(name string, kind inventory.Kind, visible string, id func(acc inventory.Device) string) Resource {
	return Resource{
		Name: name,
		members: func(inv inventory.Inventory) map[string][]inventory.Device {
			out := map[string][]inventory.Device{}
			for _, b := range inv.Bundles {
				if b.Kind != kind {
					continue
				}
				acc, _ := inv.Lookup(b.Accelerator)
				m := []inventory.Device{acc}
				for _, e := range b.EFAs {
					nic, _ := inv.Lookup(e)
					m = append(m, nic)
				}
				out[b.ID] = m
			}
			return out
		},
		anchor: func(m []inventory.Device) inventory.Device { return m[0] },
		env: func(members [][]inventory.Device) map[string]string {
			accs, efas := make([]string, len(members)), make([]string, len(members))
			for i, m := range members {
				accs[i] = id(m[0])
				nics := make([]string, len(m)-1)
				for j, nic := range m[1:] {
					nics[j] = nic.ID
				}
				efas[i] = accs[i] + "=" + strings.Join(nics, ",")
			}
			return map[string]string{visible: strings.Join(accs, ","), EnvAcceleratorEFAs: strings.Join(efas, ";")}
		},
	}
}

// devices lists the resource's devices for ListAndWatch: healthy only when every member
// is, with the anchor's NUMA node as topology (omitted when unknown).
func (r Resource) devices(inv inventory.Inventory, healthy func(inventory.Device) bool) []*pluginapi.Device {
	members := r.members(inv)
	ids := make([]string, 0, len(members))
	for id := range members {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	out := make([]*pluginapi.Device, 0, len(ids))
	for _, id := range ids {
		d := &pluginapi.Device{ID: id, Health: pluginapi.Healthy}
		for _, m := range members[id] {
			if !healthy(m) {
				d.Health = pluginapi.Unhealthy
			}
		}
		if numa := r.anchor(members[id]).NUMANode; numa >= 0 {
			d.Topology = &pluginapi.TopologyInfo{Nodes: []*pluginapi.NUMANode{{ID: int64(numa)}}}
		}
		out = append(out, d)
	}
	return out
}

// allocate answers one container's allocation: the device nodes of every member (each
// once) and the resource's environment.
func (r Resource) allocate(inv inventory.Inventory, ids []string) (*pluginapi.ContainerAllocateResponse, error) {
	members := r.members(inv)
	resp := &pluginapi.ContainerAllocateResponse{}
	seen := map[string]bool{}
	var picked [][]inventory.Device
	for _, id := range ids {
		m, ok := members[id]
		if !ok {
			return nil, fmt.Errorf("%s: unknown device %q", r.Name, id)
		}
		picked = append(picked, m)
		for _, d := range m {
			for _, node := range d.DeviceNodes {
				if seen[node] {
					continue
				}
				seen[node] = true
				resp.Devices = append(resp.Devices, &pluginapi.DeviceSpec{ContainerPath: node, HostPath: node, Permissions: "rw"})
			}
		}
	}
	if r.env != nil {
		resp.Envs = r.env(picked)
	}
	return resp, nil
}

// preferred picks size of the available devices: must-include first, then as few PCIe
// switches and NUMA nodes as possible.
func (r Resource) preferred(inv inventory.Inventory, available, mustInclude []string, size int) []string {
	members := r.members(inv)
	var ds []topology.Device
	for _, id := range available {
		if m, ok := members[id]; ok {
			a := r.anchor(m)
			ds = append(ds, topology.Device{ID: id, Bridges: a.Bridges, NUMA: a.NUMANode})
		}
	}
	return topology.Preferred(ds, mustInclude, size)
}

// Prefer is the allocation the plugin would prefer for resource, as the discover
// command prints it. available defaults to every device of the resource.
func Prefer(inv inventory.Inventory, resource string, available, mustInclude []string, size int) ([]string, error) {
	// EFA from the view without bundles: every EFA of the node.
	for _, r := range append(Resources(inv, false), Resources(inv, true)...) {
		if r.Name != resource {
			continue
		}
		if available == nil {
			for id := range r.members(inv) {
				available = append(available, id)
			}
			sort.Strings(available)
		}
		ids := r.preferred(inv, available, mustInclude, size)
		if ids == nil {
			return nil, fmt.Errorf("cannot pick %d of the %d available %s devices including %v", size, len(available), resource, mustInclude)
		}
		return ids, nil
	}
	return nil, fmt.Errorf("resource %q: none on this node, or unknown (want %s, %s or %s)", resource, ResourceEFA, ResourceGPUEFA, ResourceNeuronEFA)
}
