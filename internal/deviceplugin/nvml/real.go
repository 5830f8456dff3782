package nvml

import (
	"context"
	"fmt"
	"time"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Open initialises NVML. It fails when the NVIDIA driver (libnvidia-ml.so.1) is absent.
func Open() (Interface, error) {
	lib := gonvml.New()
	if ret := lib.Init(); ret != gonvml.SUCCESS {
		return nil, fmt.Errorf("NVML init: %s", lib.ErrorString(ret))
	}
	return &real{lib: lib}, nil
}

type real struct{ lib gonvml.Interface }

func (r *real) Shutdown() { r.lib.Shutdown() }

func (r *real) GPUs() ([]GPU, error) {
	n, ret := r.lib.DeviceGetCount()
	if ret != gonvml.SUCCESS {
		return nil, fmt.Errorf("NVML device count: %s", r.lib.ErrorString(ret))
	}
	out := make([]GPU, 0, n)
	for i := range n {
		d, ret := r.lib.DeviceGetHandleByIndex(i)
		if ret != gonvml.SUCCESS {
			return nil, fmt.Errorf("NVML device %d: %s", i, r.lib.ErrorString(ret))
		}
		g := GPU{}
		if g.UUID, ret = d.GetUUID(); ret != gonvml.SUCCESS {
			return nil, fmt.Errorf("NVML device %d UUID: %s", i, r.lib.ErrorString(ret))
		}
		if g.Minor, ret = d.GetMinorNumber(); ret != gonvml.SUCCESS {
			return nil, fmt.Errorf("NVML device %d minor: %s", i, r.lib.ErrorString(ret))
		}
		pci, ret := d.GetPciInfo()
		if ret != gonvml.SUCCESS {
			return nil, fmt.Errorf("NVML device %d PCI info: %s", i, r.lib.ErrorString(ret))
		}
		g.PCIBusID = NormalizeBusID(busID(pci.BusId))
		g.Name, _ = d.GetName()
		for link := range gonvml.NVLINK_MAX_LINKS {
			state, ret := d.GetNvLinkState(link)
			if ret != gonvml.SUCCESS || state != gonvml.FEATURE_ENABLED {
				continue
			}
			g.NVLinks++
			if remote, ret := d.GetNvLinkRemotePciInfo(link); ret == gonvml.SUCCESS {
				g.NVLinkPeers = append(g.NVLinkPeers, NormalizeBusID(busID(remote.BusId)))
			}
		}
		out = append(out, g)
	}
	return out, nil
}

func busID[T ~int8 | ~uint8](b [32]T) string {
	s := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
}

func (r *real) Events(ctx context.Context) (<-chan Event, error) {
	set, ret := r.lib.EventSetCreate()
	if ret != gonvml.SUCCESS {
		return nil, fmt.Errorf("NVML event set: %s", r.lib.ErrorString(ret))
	}
	n, _ := r.lib.DeviceGetCount()
	for i := range n {
		d, ret := r.lib.DeviceGetHandleByIndex(i)
		if ret != gonvml.SUCCESS {
			continue
		}
		_ = d.RegisterEvents(gonvml.EventTypeXidCriticalError|gonvml.EventTypeSingleBitEccError|gonvml.EventTypeDoubleBitEccError, set)
	}
	out := make(chan Event)
	go func() {
		defer close(out)
		defer set.Free()
		pump(ctx, set, out, time.After, r.lib.ErrorString)
	}()
	return out, nil
}

// waitBackoff is how long the pump waits after NVML failed a wait before it waits again.
const waitBackoff = time.Second

// waiter is the part of an NVML event set the pump uses.
type waiter interface {
	Wait(timeoutMs uint32) (gonvml.EventData, gonvml.Return)
}

// pump passes set's critical XID events to out until ctx ends. A failed wait (other than
// a timeout) is passed on as an Event without a GPU, so the monitor asks NVML about
// every GPU, and the next wait is put off by waitBackoff: errors such as GPU_IS_LOST
// repeat at once, and skipping them spun the loop without anyone learning of them.
func pump(ctx context.Context, set waiter, out chan<- Event, after func(time.Duration) <-chan time.Time, describe func(gonvml.Return) string) {
	send := func(e Event) bool {
		select {
		case out <- e:
			return true
		case <-ctx.Done():
			return false
		}
	}
	for ctx.Err() == nil {
		e, ret := set.Wait(1000)
		switch {
		case ret == gonvml.ERROR_TIMEOUT:
		case ret != gonvml.SUCCESS:
			if !send(Event{Err: describe(ret)}) {
				return
			}
			select {
			case <-after(waitBackoff):
			case <-ctx.Done():
				return
			}
		case e.EventType == gonvml.EventTypeXidCriticalError:
			uuid, _ := e.Device.GetUUID()
			if !send(Event{UUID: uuid, XID: e.EventData}) {
				return
			}
		}
	}
}

func (r *real) Usable(uuid string) (bool, string) {
	d, ret := r.lib.DeviceGetHandleByUUID(uuid)
	if ret != gonvml.SUCCESS {
		return false, "NVML cannot open it: " + r.lib.ErrorString(ret)
	}
	// A GPU that fell off the bus (XID 79) fails every query with GPU_IS_LOST.
	if _, ret := d.GetMemoryInfo(); ret != gonvml.SUCCESS {
		return false, "NVML memory query: " + r.lib.ErrorString(ret)
	}
	// Uncorrectable ECC errors are contained by remapping rows or retiring pages, which
	// take effect only after a GPU reset; until then the GPU must not be handed out.
	if _, _, pending, failed, ret := d.GetRemappedRows(); ret == gonvml.SUCCESS && (pending || failed) {
		return false, "row remapping pending or failed: the GPU needs a reset"
	}
	if st, ret := d.GetRetiredPagesPendingStatus(); ret == gonvml.SUCCESS && st == gonvml.FEATURE_ENABLED {
		return false, "retired pages pending: the GPU needs a reset"
	}
	return true, ""
}
