package health

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/inventory"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/nvml"
	"github.com/kvhandoff/kvhandoff/internal/deviceplugin/sysfs"
)

// Monitor checks every device each Interval — its device nodes exist, an EFA's port is
// ACTIVE, NVML can use a GPU, no other resource holds it — and takes NVML's critical XID
// events as they come, then reports every device's health to Report.
type Monitor struct {
	Root, DevRoot string
	Interval      time.Duration
	Tracker       *Tracker
	Events        <-chan nvml.Event
	// NVML is asked at every check whether each GPU is usable: one that fell off the bus
	// keeps its device node but fails every query (GPU_IS_LOST), and is latched unhealthy
	// until NVML can use it again. Without NVML a latched GPU stays unhealthy until the
	// plugin restarts (after the node's reboot or a reset).
	NVML nvml.Interface
	// Held returns the devices the kubelet gave pods under another resource than this
	// plugin advertises them by (server.HeldElsewhere), with who holds each: they are
	// unhealthy while held. Nil: none.
	Held   func() (map[string]string, error)
	Report func(map[string]bool)
	Log    *slog.Logger

	// held and heldErr are the last check's, to log changes only.
	held    map[string]string
	heldErr string
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
		m.Check(inv)
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

// event latches a GPU that had a critical XID; the application's own XIDs are ignored. An
// event without a GPU (NVML's wait failed) only wakes the monitor: the check that follows
// asks NVML about every GPU.
func (m *Monitor) event(e nvml.Event, byUUID map[string]string) {
	if e.UUID == "" {
		m.log().Warn("NVML event wait failed; checking every GPU", "err", e.Err)
		return
	}
	if id, known := byUUID[e.UUID]; known && !nvml.ApplicationXIDs[e.XID] {
		m.log().Warn("critical XID; GPU unhealthy until NVML can use it", "device", id, "xid", e.XID)
		m.Tracker.Latch(id)
	}
}

func (m *Monitor) log() *slog.Logger {
	if m.Log == nil {
		return slog.Default()
	}
	return m.Log
}

// Check checks every device once and reports their health.
func (m *Monitor) Check(inv inventory.Inventory) {
	root := sysfs.Root(m.Root)
	held := m.heldDevices()
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
		if d.UUID != "" && m.NVML != nil {
			switch usable, reason := m.NVML.Usable(d.UUID); {
			case !usable && !m.Tracker.Latched(d.ID):
				m.log().Warn("NVML cannot use the GPU; unhealthy until it can", "device", d.ID, "reason", reason)
				m.Tracker.Latch(d.ID)
			case usable && m.Tracker.Latched(d.ID):
				m.Tracker.Unlatch(d.ID)
			}
		}
		out[d.ID] = m.Tracker.Healthy(d.ID) && held[d.ID] == ""
	}
	m.Report(out)
}

// heldDevices asks Held, logging what changed. When it cannot answer, the last answer
// stands: a device is not handed out again because the kubelet was briefly unreachable.
func (m *Monitor) heldDevices() map[string]string {
	if m.Held == nil {
		return nil
	}
	held, err := m.Held()
	if err != nil {
		if err.Error() != m.heldErr {
			m.log().Warn("cannot tell which devices other resources hold; keeping the last answer", "err", err)
		}
		m.heldErr = err.Error()
		return m.held
	}
	m.heldErr = ""
	for id, by := range held {
		if m.held[id] != by {
			m.log().Warn("device held under another resource; advertised unhealthy until released", "device", id, "held", by)
		}
	}
	for id := range m.held {
		if held[id] == "" {
			m.log().Info("device released by the other resource", "device", id)
		}
	}
	m.held = held
	return held
}
