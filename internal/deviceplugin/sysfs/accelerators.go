package sysfs

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
)

// NvidiaMinor reads the device minor of the NVIDIA GPU at a PCI address from the driver's
// proc/driver/nvidia/gpus/<address>/information (/dev/nvidia<minor>); -1 when unknown.
func (r Root) NvidiaMinor(addr string) int {
	b, err := os.ReadFile(r.path("proc", "driver", "nvidia", "gpus", addr, "information"))
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "Device Minor" {
			if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
				return n
			}
		}
	}
	return -1
}

var neuronName = regexp.MustCompile(`^neuron(\d+)$`)

// NeuronIndexes maps PCI addresses to Neuron device indexes (/dev/neuron<index>) through
// sys/class/neuron_device/neuron<index>/device.
func (r Root) NeuronIndexes() map[string]int {
	out := map[string]int{}
	entries, _ := os.ReadDir(r.path("sys", "class", "neuron_device"))
	for _, e := range entries {
		m := neuronName.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		dev, err := filepath.EvalSymlinks(r.path("sys", "class", "neuron_device", e.Name(), "device"))
		if err != nil {
			continue
		}
		n, _ := strconv.Atoi(m[1])
		out[filepath.Base(dev)] = n
	}
	return out
}
