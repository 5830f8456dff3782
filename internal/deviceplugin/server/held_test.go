package server

import (
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs/sysfstest"
)

// Devices another resource holds are found by whatever name its plugin gave them, and
// devices the kubelet holds under the names this plugin advertises are not "elsewhere".
func TestHeldElsewhereFindsDevicesByAnyOfTheirNames(t *testing.T) {
	fx := newFixture(t, sysfstest.P5en(), p5enNVML())
	inv := fx.inv
	bundles := Resources(inv, true)
	gpu := inv.OfKind(inventory.GPU)[2]
	bundle := inv.Bundles[5]
	efas := inv.OfKind(inventory.EFA)
	uverbs := func(d inventory.Device) string {
		for _, n := range d.DeviceNodes {
			if len(n) > len("/dev/infiniband/uverbs") && n[:len("/dev/infiniband/uverbs")] == "/dev/infiniband/uverbs" {
				return n[len("/dev/infiniband/"):]
			}
		}
		t.Fatalf("EFA %s has no uverbs node", d.ID)
		return ""
	}
	for _, c := range []struct {
		name    string
		served  []Resource
		alloc   Allocation
		want    []string
		wantNot []string
	}{
		{"an EFA a pod got before bundles were switched on", bundles,
			Allocation{ResourceEFA, efas[0].ID, "default/trainer"}, []string{efas[0].ID}, nil},
		{"an EFA the AWS plugin named by its uverbs node", bundles,
			Allocation{ResourceEFA, uverbs(efas[3]), "default/trainer"}, []string{efas[3].ID}, nil},
		{"a GPU of the stock NVIDIA plugin, by UUID", bundles,
			Allocation{"nvidia.com/gpu", gpu.UUID, "default/train"}, []string{gpu.ID}, nil},
		{"a time-sliced replica of a GPU", bundles,
			Allocation{"nvidia.com/gpu", gpu.UUID + "::3", "default/train"}, []string{gpu.ID}, nil},
		{"a GPU by index", bundles,
			Allocation{"nvidia.com/gpu", "2", "default/train"}, []string{inv.OfKind(inventory.GPU)[2].ID}, nil},
		{"a bundle a pod got before bundles were switched off", Resources(inv, false),
			Allocation{ResourceGPUEFA, bundle.ID, "default/engine"}, append([]string{bundle.Accelerator}, bundle.EFAs...), nil},
		{"an EFA this plugin advertises under the same name", Resources(inv, false),
			Allocation{ResourceEFA, efas[0].ID, "default/engine"}, nil, []string{efas[0].ID}},
		{"a bundle this plugin advertises", bundles,
			Allocation{ResourceGPUEFA, bundle.ID, "default/engine"}, nil, append([]string{bundle.Accelerator}, bundle.EFAs...)},
		{"an EFA a claim of kvhandoff's DRA driver holds", Resources(inv, false),
			Allocation{DRAResource("dra.kvhandoff.io"), efas[2].DRAName(), "default/engine"}, []string{efas[2].ID}, nil},
		{"a GPU a claim of NVIDIA's DRA driver holds", bundles,
			Allocation{DRAResource("gpu.nvidia.com"), "gpu-2", "default/engine"}, []string{inv.OfKind(inventory.GPU)[2].ID}, nil},
		{"an index of a resource that is not indexed", bundles,
			Allocation{"example.com/fpga", "2", "default/x"}, nil, []string{gpu.ID}},
	} {
		held := HeldElsewhere(inv, c.served, []Allocation{c.alloc})
		for _, id := range c.want {
			if held[id] == "" {
				t.Errorf("%s: %s is not held; held: %v", c.name, id, held)
			}
		}
		for _, id := range c.wantNot {
			if held[id] != "" {
				t.Errorf("%s: %s is held (%s)", c.name, id, held[id])
			}
		}
		if c.want != nil && len(held) != len(c.want) {
			t.Errorf("%s: held %v, want exactly %v", c.name, held, c.want)
		}
	}
}
