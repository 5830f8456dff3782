package health

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/nvml"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs"
)

// Monitor checks every device each Interval — its device nodes exist, an EFA's port is
// ACTIVE — and takes NVML's critical XID events as they come, then reports every
// device's health to Report.
type Monitor struct {
	Root, DevRoot string
	Interval      time.Duration
	Tracker       *Tracker
	Events        <-chan nvml.Event
	// NVML says when a GPU latched by a critical XID is usable again; without it such a
	// GPU stays unhealthy until the plugin restarts (after the node's reboot or a reset).
	NVML   nvml.Interface
	Report func(map[string]bool)
}

// Run monitors inv until ctx ends.
func (m *Monitor) Run(ctx context.Context, inv inventory.Inventory) {
	tick := time.NewTicker(m.Interval)
	defer tick.Stop()
	byUUID := map[string]string{}
	for _, d := range inv.Devices {
		if d.UUID != "" {
			byUUID[d.UUID] = d.ID
		}
	}
	for {
		m.check(inv)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case e, ok := <-m.Events:
			if !ok {
				m.Events = nil
				continue
			}
			m.event(e, byUUID)
		}
	}
}

// event latches a GPU that had a critical XID; the application's own XIDs are ignored.
func (m *Monitor) event(e nvml.Event, byUUID map[string]string) {
	if id, known := byUUID[e.UUID]; known && !nvml.ApplicationXIDs[e.XID] {
		m.Tracker.Latch(id)
	}
}

func (m *Monitor) check(inv inventory.Inventory) {
	root := sysfs.Root(m.Root)
	out := make(map[string]bool, len(inv.Devices))
	for _, d := range inv.Devices {
		ok := true
		for _, node := range d.DeviceNodes {
			if _, err := os.Stat(filepath.Join(m.DevRoot, strings.TrimPrefix(node, "/dev/"))); err != nil {
				ok = false
			}
		}
		if d.Kind == inventory.EFA {
			if state, err := root.PortState(d.RDMA); err != nil || state != "ACTIVE" {
				ok = false
			}
		}
		if !ok {
			m.Tracker.Fail(d.ID)
		}
		if d.UUID != "" && m.NVML != nil && m.Tracker.Latched(d.ID) {
			if usable, _ := m.NVML.Usable(d.UUID); usable {
				m.Tracker.Unlatch(d.ID)
			}
		}
		out[d.ID] = m.Tracker.Healthy(d.ID)
	}
	m.Report(out)
}
