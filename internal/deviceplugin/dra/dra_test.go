package dra

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/utils/ptr"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs/sysfstest"
)

// machine discovers fixture f written to a temporary folder; GPUs get NVML-like UUIDs.
func machine(t *testing.T, f sysfstest.Fixture) (inventory.Inventory, string) {
	t.Helper()
	root := t.TempDir()
	if err := f.Write(root, filepath.Join(root, "dev")); err != nil {
		t.Fatal(err)
	}
	inv := inventory.Discover(inventory.Options{Root: root, DevRoot: filepath.Join(root, "dev"), NVMLStatus: "disabled"})
	for i := range inv.Devices {
		if inv.Devices[i].Kind == inventory.GPU {
			inv.Devices[i].UUID = fmt.Sprintf("GPU-%08d", inv.Devices[i].Index)
		}
	}
	return inv, root
}

func str(a resourceapi.DeviceAttribute) string { return ptr.Deref(a.StringValue, "") }

func all(inventory.Device) bool { return true }

// TestEachAcceleratorSharesItsRootAndSwitchWithItsOwnEFAsOnly checks the slices against
// the bundles the device plugin pairs by PCIe switch: on every accelerator machine,
// an accelerator's pcieRoot and pcieSwitch are those of its own EFAs and of no other
// EFA, so a claim's matchAttribute gives it exactly its bundle's NICs.
func TestEachAcceleratorSharesItsRootAndSwitchWithItsOwnEFAsOnly(t *testing.T) {
	for _, f := range []sysfstest.Fixture{sysfstest.P5en(), sysfstest.P5(), sysfstest.Trn2()} {
		t.Run(f.Name, func(t *testing.T) {
			inv, root := machine(t, f)
			devices, problems := Devices(inv, filepath.Join(root, "sys"), true, all)
			if len(problems) > 0 {
				t.Fatal(problems)
			}
			byName := map[string]resourceapi.Device{}
			for _, d := range devices {
				byName[d.Name] = d
			}
			if got, want := len(devices), len(inv.Devices); got != want {
				t.Fatalf("%d devices published, want %d (every EFA and accelerator, no ConnectX)", got, want)
			}
			for _, b := range inv.Bundles {
				acc, _ := inv.Lookup(b.Accelerator)
				a := byName[Name(acc)]
				for _, attr := range []resourceapi.QualifiedName{deviceattribute.StandardDeviceAttributePCIeRoot, AttrPCIeSwitch} {
					var local []string
					for _, d := range devices {
						if str(d.Attributes[AttrType]) == "efa" && str(d.Attributes[attr]) == str(a.Attributes[attr]) {
							local = append(local, str(d.Attributes[AttrRDMADevice]))
						}
					}
					if strings.Join(local, ",") != strings.Join(b.EFAs, ",") || str(a.Attributes[attr]) == "" {
						t.Errorf("%s: EFAs of equal %s %q are %v, its bundle's %v", a.Name, attr, str(a.Attributes[attr]), local, b.EFAs)
					}
				}
				if a.Attributes[deviceattribute.StandardDeviceAttributePCIBusID].StringValue == nil ||
					a.Attributes[deviceattribute.StandardDeviceAttributeNUMANode].IntValue == nil {
					t.Errorf("%s lacks pciBusID or numaNode: %v", a.Name, a.Attributes)
				}
			}
		})
	}
}

func TestOnlyEFAsWithoutTheAcceleratorsFlagAndNoNUMAWhereUnknown(t *testing.T) {
	inv, root := machine(t, sysfstest.VM())
	devices, _ := Devices(inv, filepath.Join(root, "sys"), false, all)
	if len(devices) != 16 {
		t.Fatalf("%d devices, want the 16 EFAs alone", len(devices))
	}
	for _, d := range devices {
		if _, ok := d.Attributes[deviceattribute.StandardDeviceAttributeNUMANode]; ok {
			t.Errorf("%s publishes numaNode on a VM reporting none: it would match every device of unknown NUMA", d.Name)
		}
	}
	unhealthy := func(d inventory.Device) bool { return d.RDMA != "rdmap4s0" }
	if devices, _ = Devices(inv, filepath.Join(root, "sys"), false, unhealthy); len(devices) != 15 {
		t.Fatalf("%d devices with one failed EFA, want 15", len(devices))
	}
}

// p5enClaim is a claim allocated as the scheduler does for kvhandoff's TP-n template:
// accelerator-i from accDriver, efa-i from efaDriver.
func p5enClaim(uid string, inv inventory.Inventory, n int, accDriver, efaDriver string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "engine-0-devices", Namespace: "ns", UID: types.UID(uid)},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{}}}
	results := &c.Status.Allocation.Devices.Results
	for i, b := range inv.Bundles[:n] {
		acc, _ := inv.Lookup(b.Accelerator)
		*results = append(*results, resourceapi.DeviceRequestAllocationResult{Request: fmt.Sprintf("accelerator-%d", i), Driver: accDriver,
			Pool: "node-a", Device: Name(acc)})
		for _, e := range b.EFAs {
			efa, _ := inv.Lookup(e)
			*results = append(*results, resourceapi.DeviceRequestAllocationResult{Request: fmt.Sprintf("efa-%d", i), Driver: efaDriver,
				Pool: "node-a", Device: Name(efa)})
		}
	}
	return c
}

// shaped publishes inv's devices as NVIDIA's GPU driver (uuid, pcieBusID in its domain,
// NVML's 8-digit PCI domain) and DRANET (dra.net/rdmaDevice) would.
func shaped(inv inventory.Inventory) Foreign {
	return func(driver, pool, device string) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
		for _, d := range inv.Devices {
			if Name(d) != device {
				continue
			}
			switch driver {
			case "gpu.nvidia.com":
				return map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"type": {StringValue: ptr.To("gpu")},
					"uuid": {StringValue: ptr.To(d.UUID)}, "pcieBusID": {StringValue: ptr.To("0000" + d.PCIBusID)}}
			case "dra.net":
				return map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"dra.net/rdmaDevice": {StringValue: ptr.To(d.RDMA)},
					"dra.net/rdma": {BoolValue: ptr.To(true)}}
			}
		}
		return nil
	}
}

func TestRailsPairEachAcceleratorWithItsEFAsWhicheverDriverPublishedThem(t *testing.T) {
	inv, _ := machine(t, sysfstest.P5en())
	var groups []string // the device plugin's bundles, in its format
	for _, b := range inv.Bundles[:4] {
		acc, _ := inv.Lookup(b.Accelerator)
		groups = append(groups, acc.UUID+"="+strings.Join(b.EFAs, ","))
	}
	want := strings.Join(groups, ";")
	for _, c := range []struct{ acc, efa string }{{DriverName, DriverName}, {"gpu.nvidia.com", DriverName}, {"gpu.nvidia.com", "dra.net"}} {
		rails, problems := Rails(p5enClaim("u", inv, 4, c.acc, c.efa), inv, shaped(inv))
		if got := Env(rails); got != want || len(problems) > 0 {
			t.Errorf("accelerators of %s, EFAs of %s: %s (problems %v), want %s", c.acc, c.efa, got, problems, want)
		}
	}
	// Without NVML (no UUIDs) the accelerators are found by PCI address and named by index.
	noUUID := inv
	noUUID.Devices = slices.Clone(inv.Devices)
	for i := range noUUID.Devices {
		noUUID.Devices[i].UUID = ""
	}
	if rails, _ := Rails(p5enClaim("u", noUUID, 2, DriverName, DriverName), noUUID, nil); len(rails) != 2 || rails[1].Accelerator != "1" {
		t.Errorf("without UUIDs: %s", Env(rails))
	}
	// The second of two claims (accelerators 6 and 7 of a p5 TP8 engine) sets a variable
	// of its own.
	c := p5enClaim("u", inv, 8, DriverName, DriverName)
	c.Status.Allocation.Devices.Results = c.Status.Allocation.Devices.Results[18:]
	if rails, _ := Rails(c, inv, nil); EnvVar(rails) != EnvName+"_6" || len(rails) != 2 {
		t.Errorf("accelerators 6 and 7: %s=%s", EnvVar(rails), Env(rails))
	}
	// A driver whose devices say nothing that names them: reported, not guessed.
	rails, problems := Rails(p5enClaim("u", inv, 2, "gpu.example.com", DriverName), inv,
		func(string, string, string) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
			return map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"model": {StringValue: ptr.To("x")}}
		})
	if len(rails) != 0 || len(problems) != 2 || !strings.Contains(problems[0], "neither a uuid") {
		t.Errorf("rails %v, problems %q", rails, problems)
	}
}

func newDriver(t *testing.T, inv inventory.Inventory, root, cdi string) *Driver {
	t.Helper()
	held, err := loadPrepared(cdi)
	if err != nil {
		t.Fatal(err)
	}
	return &Driver{Inv: inv, SysRoot: filepath.Join(root, "sys"), DevRoot: filepath.Join(root, "dev"), CDIDir: cdi, Node: "node-a",
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), held: held, healthy: map[string]bool{}}
}

// TestPrepareWritesTheClaimsCDISpecAndRefusesADeviceTwice prepares a TP2 claim of
// kvhandoff's GPUs and EFAs: one spec with every device node (host paths under the
// fixture's dev), the GPU UUIDs and the rails; a second claim holding one of its EFAs is
// refused, also by a driver restarted in between; after Unprepare it is not.
func TestPrepareWritesTheClaimsCDISpecAndRefusesADeviceTwice(t *testing.T) {
	inv, root := machine(t, sysfstest.P5en())
	cdi := t.TempDir()
	d := newDriver(t, inv, root, cdi)
	first := p5enClaim("uid-1", inv, 2, DriverName, DriverName)
	res := d.prepare(first, nil)
	if res.Err != nil {
		t.Fatal(res.Err)
	}
	if len(res.Devices) != 6 || res.Devices[0].CDIDeviceIDs[0] != "kvhandoff.io/claim=uid-1" || len(res.Devices[1].CDIDeviceIDs) != 0 {
		t.Fatalf("devices %+v: want 6, the claim's one CDI device on the first", res.Devices)
	}
	data, err := os.ReadFile(specFile(cdi, "uid-1"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"NVIDIA_VISIBLE_DEVICES=GPU-00000000,GPU-00000001"`,
		`"KVHANDOFF_ACCELERATOR_EFAS=GPU-00000000=rdmap4s0,rdmap5s0;GPU-00000001=rdmap20s0,rdmap21s0"`,
		`{"path":"/dev/infiniband/uverbs0","hostPath":"` + filepath.Join(root, "dev", "infiniband", "uverbs0") + `"}`,
		`{"path":"/dev/nvidia1","hostPath":"` + filepath.Join(root, "dev", "nvidia1") + `"}`} {
		if !strings.Contains(string(data), want) {
			t.Errorf("spec lacks %s:\n%s", want, data)
		}
	}
	if strings.Count(string(data), `"path":"/dev/infiniband/rdma_cm"`) != 1 {
		t.Errorf("rdma_cm, shared by every EFA, must be in the spec once:\n%s", data)
	}

	second := p5enClaim("uid-2", inv, 1, DriverName, DriverName)
	second.Status.Allocation.Devices.Results = second.Status.Allocation.Devices.Results[1:2] // efa-0: rdmap4s0, uid-1's
	if res := d.prepare(second, nil); res.Err == nil || !strings.Contains(res.Err.Error(), "prepared for claim uid-1 already") {
		t.Fatalf("second claim of rdmap4s0: %v", res.Err)
	}
	restarted := newDriver(t, inv, root, cdi)
	if res := restarted.prepare(second, nil); res.Err == nil {
		t.Fatal("a restarted driver handed rdmap4s0 out again")
	}
	if res := restarted.prepare(first, nil); res.Err != nil {
		t.Fatalf("preparing the same claim again (the kubelet retries) must succeed: %v", res.Err)
	}
	if _, err := restarted.UnprepareResourceClaims(t.Context(), []kubeletplugin.NamespacedObject{{UID: "uid-1"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(specFile(cdi, "uid-1")); !os.IsNotExist(err) {
		t.Fatalf("spec still there after Unprepare: %v", err)
	}
	if res := restarted.prepare(second, nil); res.Err != nil {
		t.Fatalf("after Unprepare: %v", res.Err)
	}
}

func TestADeviceServedElsewhereStopsTheDriver(t *testing.T) {
	inv, _ := machine(t, sysfstest.P5en())
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}, Status: corev1.NodeStatus{Allocatable: corev1.ResourceList{
		"nvidia.com/gpu": resource.MustParse("8"), "vpc.amazonaws.com/efa": resource.MustParse("0")}}}
	if got := Conflicts(node, nil, inv, false); len(got) != 0 {
		t.Errorf("EFAs alone beside NVIDIA's GPU plugin, no EFA plugin left: %q", got)
	}
	if got := Conflicts(node, nil, inv, true); len(got) != 1 || !strings.Contains(got[0], "8 nvidia.com/gpu allocatable") {
		t.Errorf("--accelerators beside NVIDIA's GPU plugin: %q", got)
	}
	node.Status.Allocatable["vpc.amazonaws.com/efa"] = resource.MustParse("16")
	if got := Conflicts(node, nil, inv, false); len(got) != 1 || !strings.Contains(got[0], "16 vpc.amazonaws.com/efa") {
		t.Errorf("beside the EFA plugin: %q", got)
	}
	node.Status.Allocatable = nil
	efa := inv.OfKind(inventory.EFA)[3]
	dranet := resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Driver: "dra.net", Devices: []resourceapi.Device{
		{Name: "eth3", Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"dra.net/rdmaDevice": {StringValue: ptr.To(efa.RDMA)}}}}}}
	nvidia := resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Driver: "gpu.nvidia.com", Devices: []resourceapi.Device{
		{Name: "gpu-0", Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			deviceattribute.StandardDeviceAttributePCIBusID: {StringValue: ptr.To(inv.OfKind(inventory.GPU)[0].PCIBusID)}}}}}}
	if got := Conflicts(node, []resourceapi.ResourceSlice{dranet, nvidia}, inv, false); len(got) != 1 || !strings.Contains(got[0], "driver dra.net publishes eth3") {
		t.Errorf("beside DRANET and NVIDIA's driver, EFAs alone: %q", got)
	}
	if got := Conflicts(node, []resourceapi.ResourceSlice{nvidia}, inv, true); len(got) != 1 || !strings.Contains(got[0], "gpu.nvidia.com publishes gpu-0") {
		t.Errorf("--accelerators beside NVIDIA's driver: %q", got)
	}
}
