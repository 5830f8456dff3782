package inventory

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/nvml"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs/sysfstest"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/topology"
)

// machine writes a fixture and returns its discovery options.
func machine(t *testing.T, f sysfstest.Fixture) Options {
	t.Helper()
	dir := t.TempDir()
	if err := f.Write(dir, filepath.Join(dir, "dev")); err != nil {
		t.Fatal(err)
	}
	return Options{Root: dir, DevRoot: filepath.Join(dir, "dev"), NVMLStatus: "disabled"}
}

func count(inv Inventory, k Kind) int { return len(inv.OfKind(k)) }

func TestDiscoverFixtures(t *testing.T) {
	cases := []struct {
		fixture             sysfstest.Fixture
		gpus, efas, neurons int
		efaPerBundle        []int // sorted distinct EFA counts across bundles
		locality            topology.Locality
	}{
		{sysfstest.P5en(), 8, 16, 0, []int{2}, topology.LocalityPCIe},
		{sysfstest.P5(), 8, 32, 0, []int{4}, topology.LocalityPCIe},
		{sysfstest.Trn2(), 0, 16, 16, []int{1}, topology.LocalityPCIe},
		{sysfstest.Trn1(), 0, 8, 16, []int{0, 1}, ""},
		{sysfstest.VM(), 8, 16, 0, []int{2}, topology.LocalityPCIe},
	}
	for _, c := range cases {
		t.Run(c.fixture.Name, func(t *testing.T) {
			inv := Discover(machine(t, c.fixture))
			if len(inv.Problems) > 0 {
				t.Errorf("problems on a healthy machine: %q", inv.Problems)
			}
			if count(inv, GPU) != c.gpus || count(inv, EFA) != c.efas || count(inv, Neuron) != c.neurons {
				t.Fatalf("found %d GPUs, %d EFAs, %d Neuron devices; want %d, %d, %d",
					count(inv, GPU), count(inv, EFA), count(inv, Neuron), c.gpus, c.efas, c.neurons)
			}
			seen := map[string]string{}
			sizes := map[int]bool{}
			for _, b := range inv.Bundles {
				sizes[len(b.EFAs)] = true
				acc, _ := inv.Lookup(b.Accelerator)
				for _, e := range b.EFAs {
					if other, dup := seen[e]; dup {
						t.Errorf("EFA %s is in the bundles of %s and %s", e, other, b.ID)
					}
					seen[e] = b.ID
					nic, _ := inv.Lookup(e)
					if nic.Switch != acc.Switch {
						t.Errorf("bundle %s: EFA %s is under switch %s, the accelerator under %s", b.ID, e, nic.Switch, acc.Switch)
					}
				}
				if c.locality != "" && b.Locality != c.locality {
					t.Errorf("bundle %s locality %s, want %s", b.ID, b.Locality, c.locality)
				}
			}
			for _, n := range c.efaPerBundle {
				if !sizes[n] {
					t.Errorf("no bundle has %d EFAs; sizes %v", n, sizes)
				}
			}
			if len(sizes) != len(c.efaPerBundle) {
				t.Errorf("bundle sizes %v, want %v", sizes, c.efaPerBundle)
			}
			for _, d := range inv.Devices {
				if !d.Healthy {
					t.Errorf("%s unhealthy on a healthy machine", d.ID)
				}
			}
		})
	}
}

func TestP5enIgnoresRDMADevicesThatAreNotEFA(t *testing.T) {
	inv := Discover(machine(t, sysfstest.P5en()))
	for _, d := range inv.Devices {
		if strings.HasPrefix(d.ID, "mlx5") || d.PCIBusID == "0000:a1:00.0" {
			t.Errorf("advertised %s (%s), which is not an EFA", d.ID, d.PCIBusID)
		}
	}
	efa := inv.OfKind(EFA)[0]
	if len(efa.DeviceNodes) != 2 || !strings.HasPrefix(efa.DeviceNodes[0], "/dev/infiniband/uverbs") || efa.DeviceNodes[1] != "/dev/infiniband/rdma_cm" {
		t.Errorf("EFA device nodes %v", efa.DeviceNodes)
	}
	if efa.NUMANode != 0 {
		t.Errorf("EFA NUMA %d, want 0", efa.NUMANode)
	}
}

func TestVMReportsUnknownNUMA(t *testing.T) {
	for _, d := range Discover(machine(t, sysfstest.VM())).Devices {
		if d.NUMANode != -1 {
			t.Errorf("%s NUMA %d, want -1", d.ID, d.NUMANode)
		}
	}
}

func TestBrokenTreeIsReportedPerDevice(t *testing.T) {
	inv := Discover(machine(t, sysfstest.Broken()))
	all := strings.Join(inv.Problems, "\n")
	for _, want := range []string{"0000:03:00.0", "driver link is dangling", `numa_node "garbage" is not a number`} {
		if !strings.Contains(all, want) {
			t.Errorf("problems do not mention %q:\n%s", want, all)
		}
	}
	if count(inv, GPU) != 7 {
		t.Errorf("%d GPUs: the one without a vendor file must be left out, the rest kept", count(inv, GPU))
	}
	if count(inv, EFA) != 15 {
		t.Errorf("%d EFAs: the one with a dangling driver link is unbound and must be left out", count(inv, EFA))
	}
	unhealthy := 0
	for _, d := range inv.OfKind(EFA) {
		if !d.Healthy {
			unhealthy++
		}
	}
	if unhealthy != 1 {
		t.Errorf("%d unhealthy EFAs, want the one whose port is down", unhealthy)
	}
}

type fakeNVML struct{ gpus []nvml.GPU }

func (f fakeNVML) GPUs() ([]nvml.GPU, error)                         { return f.gpus, nil }
func (f fakeNVML) Events(context.Context) (<-chan nvml.Event, error) { return nil, nil }
func (f fakeNVML) Usable(string) (bool, string)                      { return true, "" }
func (f fakeNVML) Shutdown()                                         {}

func TestNVMLGivesUUIDsAndIsCrossCheckedInSysfs(t *testing.T) {
	o := machine(t, sysfstest.P5en())
	o.NVML = fakeNVML{gpus: []nvml.GPU{
		{UUID: "GPU-aaaa", Minor: 0, PCIBusID: "0000:03:00.0", NVLinks: 18},
		{UUID: "GPU-bbbb", Minor: 9, PCIBusID: "0000:ee:00.0"},
	}}
	o.NVMLStatus = "ok"
	inv := Discover(o)
	g, ok := inv.Lookup("GPU-aaaa")
	if !ok || g.Switch == "" || g.NUMANode != 0 || g.NVLinks != 18 {
		t.Fatalf("GPU-aaaa = %+v, want its sysfs locality", g)
	}
	if !strings.Contains(strings.Join(inv.Problems, "\n"), "GPU-bbbb at 0000:ee:00.0") {
		t.Errorf("a GPU NVML reports but sysfs lacks is not reported: %q", inv.Problems)
	}
}
