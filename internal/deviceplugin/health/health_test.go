package health

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/nvml"
)

func TestFailedDeviceRecoversAfterItsQuietPeriod(t *testing.T) {
	now := time.Unix(1000, 0)
	tr := NewTracker(2 * time.Minute)
	tr.Now = func() time.Time { return now }
	if !tr.Healthy("gpu0") {
		t.Fatal("a device that never failed is unhealthy")
	}
	tr.Fail("gpu0")
	if tr.Healthy("gpu0") {
		t.Fatal("a device that just failed is healthy")
	}
	now = now.Add(119 * time.Second)
	if tr.Healthy("gpu0") {
		t.Fatal("healthy before the quiet period ended")
	}
	tr.Fail("gpu0") // fails again: the quiet period starts over
	now = now.Add(time.Minute)
	if tr.Healthy("gpu0") {
		t.Fatal("a second failure did not restart the quiet period")
	}
	now = now.Add(time.Minute)
	if !tr.Healthy("gpu0") {
		t.Fatal("not healthy after two quiet minutes")
	}
	if !tr.Healthy("gpu1") {
		t.Fatal("another device's failure leaked")
	}
}

type fakeNVML struct{ usable bool }

func (f *fakeNVML) GPUs() ([]nvml.GPU, error)                         { return nil, nil }
func (f *fakeNVML) Events(context.Context) (<-chan nvml.Event, error) { return nil, nil }
func (f *fakeNVML) Usable(string) (bool, string)                      { return f.usable, "GPU is lost" }
func (f *fakeNVML) Shutdown()                                         {}

// A GPU that fell off the bus keeps its device node: after a critical XID it must stay
// unhealthy, past any recovery delay, until the driver says it is usable again.
func TestACriticalXIDHoldsTheGPUDownUntilNVMLSaysItIsUsable(t *testing.T) {
	dev := t.TempDir()
	if err := os.WriteFile(filepath.Join(dev, "nvidia0"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1000, 0)
	tr := NewTracker(time.Minute)
	tr.Now = func() time.Time { return now }
	n := &fakeNVML{usable: false}
	var reported map[string]bool
	m := &Monitor{Root: t.TempDir(), DevRoot: dev, Tracker: tr, NVML: n, Report: func(h map[string]bool) { reported = h }}
	inv := inventory.Inventory{Devices: []inventory.Device{{Kind: inventory.GPU, ID: "GPU-1", UUID: "GPU-1", DeviceNodes: []string{"/dev/nvidia0"}}}}
	byUUID := map[string]string{"GPU-1": "GPU-1"}

	m.event(nvml.Event{UUID: "GPU-1", XID: 79}, byUUID)
	for range 3 {
		now = now.Add(time.Hour)
		m.Check(inv)
		if reported["GPU-1"] {
			t.Fatal("a GPU NVML calls unusable came back healthy after the recovery delay")
		}
	}
	n.usable = true // reset
	m.Check(inv)
	if reported["GPU-1"] {
		t.Fatal("healthy at once after the reset: the quiet period must start then")
	}
	now = now.Add(time.Minute)
	m.Check(inv)
	if !reported["GPU-1"] {
		t.Fatal("not healthy a quiet minute after NVML said it is usable")
	}
	// An application's XID never latches.
	m.event(nvml.Event{UUID: "GPU-1", XID: 13}, byUUID)
	m.Check(inv)
	if !reported["GPU-1"] || tr.Latched("GPU-1") {
		t.Fatal("XID 13 (an application's error) took the GPU down")
	}
}

// A GPU that fell off the bus with no event seen (the wait failed, or the plugin started
// after it fell) keeps its device node; the check asks NVML about every GPU, so it goes
// unhealthy at the next check all the same.
func TestAGPUNVMLCannotUseIsUnhealthyWithoutAnEvent(t *testing.T) {
	dev := t.TempDir()
	if err := os.WriteFile(filepath.Join(dev, "nvidia0"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var reported map[string]bool
	m := &Monitor{Root: t.TempDir(), DevRoot: dev, Tracker: NewTracker(time.Minute), NVML: &fakeNVML{usable: false},
		Report: func(h map[string]bool) { reported = h }}
	inv := inventory.Inventory{Devices: []inventory.Device{{Kind: inventory.GPU, ID: "GPU-1", UUID: "GPU-1", DeviceNodes: []string{"/dev/nvidia0"}}}}
	m.event(nvml.Event{Err: "GPU is lost"}, map[string]string{"GPU-1": "GPU-1"})
	m.Check(inv)
	if reported["GPU-1"] || !m.Tracker.Latched("GPU-1") {
		t.Fatalf("a GPU NVML cannot use: reported %v, latched %v", reported, m.Tracker.Latched("GPU-1"))
	}
}

// A device another resource holds is unhealthy while it is held, and healthy again as
// soon as it is released (it never failed). When the kubelet cannot say, the last answer
// stands.
func TestADeviceHeldUnderAnotherResourceIsUnhealthyUntilReleased(t *testing.T) {
	dev := t.TempDir()
	for _, n := range []string{"uverbs0", "uverbs1"} {
		if err := os.WriteFile(filepath.Join(dev, n), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	root := t.TempDir()
	for _, r := range []string{"rdmap0", "rdmap1"} {
		p := filepath.Join(root, "sys", "class", "infiniband", r, "ports", "1")
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(p, "state"), []byte("4: ACTIVE\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	held := map[string]string{"rdmap1": "vpc.amazonaws.com/efa rdmap1 of pod default/trainer"}
	var heldErr error
	var reported map[string]bool
	m := &Monitor{Root: root, DevRoot: dev, Tracker: NewTracker(time.Minute),
		Held:   func() (map[string]string, error) { return held, heldErr },
		Report: func(h map[string]bool) { reported = h }}
	inv := inventory.Inventory{Devices: []inventory.Device{
		{Kind: inventory.EFA, ID: "rdmap0", RDMA: "rdmap0", DeviceNodes: []string{"/dev/uverbs0"}},
		{Kind: inventory.EFA, ID: "rdmap1", RDMA: "rdmap1", DeviceNodes: []string{"/dev/uverbs1"}},
	}}
	m.Check(inv)
	if !reported["rdmap0"] || reported["rdmap1"] {
		t.Fatalf("while rdmap1 is held: %v", reported)
	}
	held, heldErr = nil, errors.New("kubelet unreachable")
	m.Check(inv)
	if reported["rdmap1"] {
		t.Fatal("the kubelet could not answer, and the held device was advertised again")
	}
	heldErr = nil
	m.Check(inv)
	if !reported["rdmap0"] || !reported["rdmap1"] {
		t.Fatalf("after rdmap1 was released: %v", reported)
	}
}
