package health

import (
	"context"
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
		m.check(inv)
		if reported["GPU-1"] {
			t.Fatal("a GPU NVML calls unusable came back healthy after the recovery delay")
		}
	}
	n.usable = true // reset
	m.check(inv)
	if reported["GPU-1"] {
		t.Fatal("healthy at once after the reset: the quiet period must start then")
	}
	now = now.Add(time.Minute)
	m.check(inv)
	if !reported["GPU-1"] {
		t.Fatal("not healthy a quiet minute after NVML said it is usable")
	}
	// An application's XID never latches.
	m.event(nvml.Event{UUID: "GPU-1", XID: 13}, byUUID)
	m.check(inv)
	if !reported["GPU-1"] || tr.Latched("GPU-1") {
		t.Fatal("XID 13 (an application's error) took the GPU down")
	}
}
