package simengine

import (
	"slices"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/cuda"
)

// device is a cache's GPU memory: one allocation holding every region, in the layout the
// host mirror has, passed to the agent as a file descriptor (or, legacy, named by an IPC
// handle). Fill and Verify hold its lock, so one's upload of a span of blocks
// never carries another's half-written mirror.
type device struct {
	mu     sync.Mutex
	ctx    *cuda.Context
	base   cuda.Ptr
	region uint64 // bytes per region
	size   uint64 // of the allocation
	fd     int    // the allocation's POSIX fd until it is passed; -1 for an IPC handle
	handle cuda.IPCHandle
	uuid   cuda.UUID
}

// newDevice allocates size bytes on GPU ordinal and exports them for the agent: as a
// file descriptor, or as a legacy IPC handle.
func newDevice(ordinal int, size, region uint64, legacy bool) (*device, error) {
	ctx, err := cuda.Open(ordinal)
	if err != nil {
		return nil, err
	}
	d := &device{ctx: ctx, region: region, fd: -1}
	if d.uuid, err = cuda.DeviceUUID(ordinal); err != nil {
		return nil, err
	}
	if !legacy {
		d.base, d.size, d.fd, err = ctx.AllocShareable(size)
		return d, err
	}
	if d.base, err = ctx.Alloc(size); err != nil {
		return nil, err
	}
	if d.handle, err = ctx.Export(d.base); err != nil {
		_ = ctx.Free(d.base)
		return nil, err
	}
	return d, nil
}

// free frees the allocation (the agent's mapping, if any, keeps its memory until unmapped).
func (d *device) free() {
	if d.fd >= 0 {
		unix.Close(d.fd)
	}
	if d.size > 0 {
		_ = d.ctx.Unmap(d.base, d.size)
	} else {
		_ = d.ctx.Free(d.base)
	}
}

func (d *device) lock() {
	if d != nil {
		d.mu.Lock()
	}
}

func (d *device) unlock() {
	if d != nil {
		d.mu.Unlock()
	}
}

// span is the bytes of every region from the lowest to the highest of blocks: one copy
// per region covers them all.
func span(c *Cache, blocks []uint32) (off, n uint64) {
	if len(blocks) == 0 {
		return 0, 0
	}
	bb := uint64(c.Layout.BlockBytes())
	lo, hi := uint64(slices.Min(blocks)), uint64(slices.Max(blocks))+1
	return lo * bb, (hi - lo) * bb
}

func (d *device) upload(c *Cache, blocks []uint32) error {
	if d == nil {
		return nil
	}
	off, n := span(c, blocks)
	for r, region := range c.Regions {
		if err := d.ctx.Upload(d.base+cuda.Ptr(uint64(r)*d.region+off), region[off:off+n]); err != nil {
			return err
		}
	}
	return nil
}

func (d *device) download(c *Cache, blocks []uint32, lo, hi int) error {
	if d == nil {
		return nil
	}
	off, n := span(c, blocks)
	for r := lo; r < hi; r++ {
		if err := d.ctx.Download(c.Regions[r][off:off+n], d.base+cuda.Ptr(uint64(r)*d.region+off)); err != nil {
			return err
		}
	}
	return nil
}
