package sysfs

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// RDMADevice is an entry of sys/class/infiniband: an EFA, a ConnectX, a soft RDMA device.
type RDMADevice struct {
	// Name is the RDMA device name (rdmap79s0, mlx5_0).
	Name string
	// PCIAddress is the PCI function behind it, "" for a device that has none.
	PCIAddress string
	// Uverbs is its verbs character device (uverbs3), "" when it has none.
	Uverbs string
	// PortState is port 1's state (ACTIVE, DOWN, …), "" when unreadable.
	PortState string
}

// RDMADevices lists sys/class/infiniband, sorted by name.
func (r Root) RDMADevices() ([]RDMADevice, []error) {
	entries, err := os.ReadDir(r.path("sys", "class", "infiniband"))
	if os.IsNotExist(err) {
		return nil, nil // no RDMA devices at all
	}
	if err != nil {
		return nil, []error{fmt.Errorf("listing RDMA devices: %w", err)}
	}
	uverbs := r.uverbsByDevice()
	var out []RDMADevice
	var errs []error
	for _, e := range entries {
		d := RDMADevice{Name: e.Name(), Uverbs: uverbs[e.Name()]}
		dev, err := filepath.EvalSymlinks(r.path("sys", "class", "infiniband", d.Name, "device"))
		if err != nil {
			errs = append(errs, fmt.Errorf("RDMA device %s: %w", d.Name, err))
			continue
		}
		if pciAddress.MatchString(filepath.Base(dev)) {
			d.PCIAddress = filepath.Base(dev)
		}
		if s, err := readTrimmed(r.path("sys", "class", "infiniband", d.Name, "ports", "1", "state")); err == nil {
			// "4: ACTIVE" → ACTIVE
			_, state, _ := strings.Cut(s, ": ")
			d.PortState = state
		}
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, errs
}

// PortState reads port 1's state of an RDMA device now.
func (r Root) PortState(name string) (string, error) {
	s, err := readTrimmed(r.path("sys", "class", "infiniband", name, "ports", "1", "state"))
	if err != nil {
		return "", err
	}
	_, state, _ := strings.Cut(s, ": ")
	return state, nil
}

// uverbsByDevice maps RDMA device names to their uverbs character devices through
// sys/class/infiniband_verbs/uverbsN/ibdev.
func (r Root) uverbsByDevice() map[string]string {
	out := map[string]string{}
	entries, _ := os.ReadDir(r.path("sys", "class", "infiniband_verbs"))
	for _, e := range entries {
		if name, err := readTrimmed(r.path("sys", "class", "infiniband_verbs", e.Name(), "ibdev")); err == nil {
			out[name] = e.Name()
		}
	}
	return out
}
