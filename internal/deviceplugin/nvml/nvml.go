// Package nvml is the device plugin's view of NVIDIA's management library: the GPUs and
// their critical events. Interface is what the plugin uses; Open returns the real one,
// backed by go-nvml (which loads libnvidia-ml.so.1 at run time), and tests substitute
// their own.
package nvml

import (
	"context"
	"strings"
)

// GPU is what NVML says about one GPU.
type GPU struct {
	UUID string
	// Minor is the device minor: /dev/nvidia<Minor>.
	Minor int
	// PCIBusID is the GPU's PCI address in sysfs form, 0000:18:00.0.
	PCIBusID string
	Name     string
	// NVLinks is the number of active NVLinks; NVLinkPeers the PCI addresses at their far ends.
	NVLinks     int
	NVLinkPeers []string
}

// Event is a critical event NVML reported for a GPU, or, with no UUID, a failed wait for
// events (Err says why): after GPU_IS_LOST, for one, every GPU must be asked again.
type Event struct {
	UUID string
	// XID is the NVIDIA driver's error id.
	XID uint64
	Err string
}

// Interface is the part of NVML the device plugin uses.
type Interface interface {
	GPUs() ([]GPU, error)
	// Events streams XID events until ctx ends.
	Events(ctx context.Context) (<-chan Event, error)
	// Usable asks the driver whether a GPU can run work again after a critical error: it
	// answers queries, and has no row remapping or page retirement waiting for a reset.
	// When not, reason says why.
	Usable(uuid string) (ok bool, reason string)
	Shutdown()
}

// ApplicationXIDs are errors caused by the application on the GPU, not the GPU; they
// never make a GPU unhealthy (the same list as NVIDIA's device plugin).
var ApplicationXIDs = map[uint64]bool{13: true, 31: true, 43: true, 45: true, 68: true, 109: true}

// NormalizeBusID turns NVML's "00000000:18:00.0" into sysfs' "0000:18:00.0".
func NormalizeBusID(id string) string {
	id = strings.ToLower(strings.TrimRight(id, "\x00"))
	if domain, rest, ok := strings.Cut(id, ":"); ok && len(domain) == 8 {
		return domain[4:] + ":" + rest
	}
	return id
}
