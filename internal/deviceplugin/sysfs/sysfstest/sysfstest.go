// Package sysfstest writes sysfs trees in the real layout for tests and for
// `device-plugin discover`: the /sys/devices/pci… hierarchy with PCIe bridges,
// /sys/bus/pci/devices and driver links, /sys/class/infiniband and infiniband_verbs,
// /sys/class/neuron_device, NVIDIA's /proc/driver/nvidia/gpus, and /dev nodes as plain files.
package sysfstest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Function is one PCI function of a fixture.
type Function struct {
	// Chain is the PCI addresses from the root port down to the function itself.
	Chain  []string
	Vendor string
	Device string
	Class  string
	Driver string
	// NUMA is numa_node's content; "" leaves the file out.
	NUMA string
	// RDMA names the function's infiniband device; Uverbs is its uverbs index.
	RDMA      string
	Uverbs    int
	PortState string // default "4: ACTIVE"
	// NvidiaMinor > -1 writes NVIDIA's proc information and /dev/nvidia<minor>.
	NvidiaMinor int
	// NeuronIndex > -1 writes sys/class/neuron_device/neuron<i> and /dev/neuron<i>.
	NeuronIndex int
}

// Fixture is a machine: its PCI functions.
type Fixture struct {
	Name      string
	Functions []Function
}

// Write writes the fixture under root (sys/, proc/) and devRoot (/dev).
func (f Fixture) Write(root, devRoot string) error {
	w := writer{root: root, dev: devRoot}
	for _, fn := range f.Functions {
		if err := w.function(fn); err != nil {
			return fmt.Errorf("%s: %w", f.Name, err)
		}
	}
	return w.err
}

type writer struct {
	root, dev string
	err       error
}

func (w *writer) file(path, content string) {
	if w.err != nil {
		return
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		w.err = err
		return
	}
	w.err = os.WriteFile(path, []byte(content), 0o644)
}

// link makes a relative symlink at path pointing to target, as sysfs does.
func (w *writer) link(path, target string) {
	if w.err != nil {
		return
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		w.err = err
		return
	}
	rel, err := filepath.Rel(filepath.Dir(path), target)
	if err != nil {
		w.err = err
		return
	}
	if _, err := os.Lstat(path); err == nil {
		return
	}
	w.err = os.Symlink(rel, path)
}

func (w *writer) function(fn Function) error {
	rootBus := fn.Chain[0][:7] // 0000:00
	dir := filepath.Join(w.root, "sys", "devices", "pci"+rootBus)
	for i, addr := range fn.Chain {
		dir = filepath.Join(dir, addr)
		last := i == len(fn.Chain)-1
		if last {
			break
		}
		// Bridges: present once, with their own bus/pci/devices entry.
		if _, err := os.Stat(filepath.Join(dir, "vendor")); err != nil {
			w.file(filepath.Join(dir, "vendor"), "0x1000\n")
			w.file(filepath.Join(dir, "device"), "0xc030\n")
			w.file(filepath.Join(dir, "class"), "0x060400\n")
			if fn.NUMA != "" {
				w.file(filepath.Join(dir, "numa_node"), fn.NUMA+"\n")
			}
			w.link(filepath.Join(w.root, "sys", "bus", "pci", "devices", addr), dir)
		}
	}
	addr := fn.Chain[len(fn.Chain)-1]
	if fn.Vendor != "" {
		w.file(filepath.Join(dir, "vendor"), fn.Vendor+"\n")
	}
	w.file(filepath.Join(dir, "device"), fn.Device+"\n")
	w.file(filepath.Join(dir, "class"), fn.Class+"\n")
	if fn.NUMA != "" {
		w.file(filepath.Join(dir, "numa_node"), fn.NUMA+"\n")
	}
	w.link(filepath.Join(w.root, "sys", "bus", "pci", "devices", addr), dir)
	if fn.Driver != "" {
		drv := filepath.Join(w.root, "sys", "bus", "pci", "drivers", fn.Driver)
		if w.err == nil && !strings.HasPrefix(fn.Driver, "dangling") {
			w.err = os.MkdirAll(drv, 0o755)
		}
		w.link(filepath.Join(dir, "driver"), drv)
	}
	if fn.RDMA != "" {
		ib := filepath.Join(dir, "infiniband", fn.RDMA)
		state := fn.PortState
		if state == "" {
			state = "4: ACTIVE"
		}
		w.file(filepath.Join(ib, "ports", "1", "state"), state+"\n")
		w.link(filepath.Join(ib, "device"), dir)
		w.link(filepath.Join(w.root, "sys", "class", "infiniband", fn.RDMA), ib)
		uv := fmt.Sprintf("uverbs%d", fn.Uverbs)
		verbs := filepath.Join(dir, "infiniband_verbs", uv)
		w.file(filepath.Join(verbs, "ibdev"), fn.RDMA+"\n")
		w.file(filepath.Join(verbs, "dev"), fmt.Sprintf("231:%d\n", 192+fn.Uverbs))
		w.link(filepath.Join(w.root, "sys", "class", "infiniband_verbs", uv), verbs)
		w.file(filepath.Join(w.dev, "infiniband", uv), "")
		w.file(filepath.Join(w.dev, "infiniband", "rdma_cm"), "")
	}
	if fn.NvidiaMinor > -1 {
		w.file(filepath.Join(w.root, "proc", "driver", "nvidia", "gpus", addr, "information"),
			fmt.Sprintf("Model: \t\t NVIDIA H200\nIRQ:   \t\t 0\nDevice Minor: \t %d\nBus Location: \t %s\n", fn.NvidiaMinor, addr))
		w.file(filepath.Join(w.dev, fmt.Sprintf("nvidia%d", fn.NvidiaMinor)), "")
		for _, n := range []string{"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"} {
			w.file(filepath.Join(w.dev, n), "")
		}
	}
	if fn.NeuronIndex > -1 {
		name := fmt.Sprintf("neuron%d", fn.NeuronIndex)
		w.link(filepath.Join(w.root, "sys", "class", "neuron_device", name, "device"), dir)
		w.file(filepath.Join(w.dev, name), "")
	}
	return w.err
}
