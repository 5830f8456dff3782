// Package cudaipc is the transfer agent's transport between engines on one node whose KV
// is GPU memory: the other processes' allocations opened from their CUDA IPC handles
// (once per allocation, counted), and copies on one stream per engine rank that complete
// like fabric operations.
package cudaipc

import (
	"fmt"
	"sync"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/cuda"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
)

// Devices is the agent's CUDA state: a context per GPU it has used, and the allocations it
// has opened from IPC handles, shared by the sessions that name them (a handle opens once
// per context and process).
// Devices are the GPUs' contexts and the allocations opened on them, shared by the
// sessions of one agent. The zero value is ready to use.
type Devices struct {
	mu      sync.Mutex
	ctxs    map[int]*cuda.Context
	imports map[Key]*imported
}

// Key names an opened allocation: its handle and the GPU it is opened on.
type Key struct {
	Handle cuda.IPCHandle
	GPU    int
}

type imported struct {
	ptr    cuda.Ptr
	extent uint64
	refs   int
}

// Context is GPU ordinal's context, retained once for the agent's life.
func (g *Devices) Context(ordinal int) (*cuda.Context, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if c, ok := g.ctxs[ordinal]; ok {
		return c, nil
	}
	c, err := cuda.Open(ordinal)
	if err != nil {
		return nil, err
	}
	if g.ctxs == nil {
		g.ctxs, g.imports = map[int]*cuda.Context{}, map[Key]*imported{}
	}
	g.ctxs[ordinal] = c
	return c, nil
}

// open maps the allocation of handle into GPU ordinal's context (once, then counted) and
// returns where it starts and how long it is.
func (g *Devices) open(h cuda.IPCHandle, ordinal int) (cuda.Ptr, uint64, error) {
	c, err := g.Context(ordinal)
	if err != nil {
		return 0, 0, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	k := Key{Handle: h, GPU: ordinal}
	if m, ok := g.imports[k]; ok {
		m.refs++
		return m.ptr, m.extent, nil
	}
	p, err := c.Import(h)
	if err != nil {
		return 0, 0, err
	}
	extent, err := c.Extent(p)
	if err != nil {
		_ = c.Unimport(p)
		return 0, 0, err
	}
	g.imports[k] = &imported{ptr: p, extent: extent, refs: 1}
	return p, extent, nil
}

// Close drops one use of an opened allocation, unmapping it after the last.
func (g *Devices) Close(h cuda.IPCHandle, ordinal int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	k := Key{Handle: h, GPU: ordinal}
	m, ok := g.imports[k]
	if !ok {
		return
	}
	if m.refs--; m.refs == 0 {
		delete(g.imports, k)
		_ = g.ctxs[ordinal].Unimport(m.ptr)
	}
}

// Region is a region of GPU memory as a session holds it.
type Region struct {
	Handle cuda.IPCHandle
	Off    uint64
	Ptr    cuda.Ptr // the region's start in this process
}

// OpenRegion opens a region of size bytes at off of handle's allocation on GPU ordinal,
// refusing one that does not fit the allocation.
func (g *Devices) OpenRegion(h cuda.IPCHandle, ordinal int, off, size uint64) (*Region, error) {
	p, extent, err := g.open(h, ordinal)
	if err != nil {
		return nil, err
	}
	if off > extent || size > extent-off {
		g.Close(h, ordinal)
		return nil, fmt.Errorf("%d bytes at offset %d do not fit the %d-byte allocation", size, off, extent)
	}
	return &Region{Handle: h, Off: off, Ptr: p + cuda.Ptr(off)}, nil
}

// Copier moves one rank's bytes with copies on one stream of its GPU: the writer's Copier
// (push) and the decode side's reads (pull). Copies are gathered as they are posted and
// queued at the next Poll in one call, behind one event: the stream runs them in order,
// so the event's completion completes them all — a driver call per copy, not three plus
// a context switch.
type Copier struct {
	stream   *cuda.Stream
	gathered cuda.Copies
	ids      []uint64            // of the gathered copies
	pending  []batch             // in stream order
	ready    []fabric.Completion // outcomes known without an event (a refused batch)
}

type batch struct {
	ids []uint64
	ev  *cuda.Event
}

// NewCopier makes a copier on a new stream of context c.
func NewCopier(c *cuda.Context) (*Copier, error) {
	s, err := c.NewStream()
	if err != nil {
		return nil, err
	}
	return &Copier{stream: s}, nil
}

// Copy gathers a copy of n bytes from src to dst, reported by Poll under id.
func (c *Copier) Copy(dst, src, n, id uint64) error {
	c.gathered.Add(cuda.Ptr(dst), cuda.Ptr(src), n)
	c.ids = append(c.ids, id)
	return nil
}

// Poll queues what was gathered and reports the copies of finished batches, in order.
func (c *Copier) Poll(out []fabric.Completion) int {
	if len(c.ids) > 0 {
		c.flush()
	}
	n := copy(out, c.ready)
	c.ready = c.ready[n:]
	for n < len(out) && len(c.pending) > 0 {
		b := &c.pending[0]
		done, err := b.ev.Done()
		if !done {
			break
		}
		for n < len(out) && len(b.ids) > 0 {
			out[n] = fabric.Completion{ID: b.ids[0], Err: err}
			b.ids = b.ids[1:]
			n++
		}
		if len(b.ids) == 0 {
			_ = b.ev.Close()
			c.pending = c.pending[1:]
		}
	}
	return n
}

// flush queues the gathered copies behind one event. The copies of one batch may run in
// any order among themselves: no two write the same bytes, since an attempt's copies start
// only once every older attempt of its request has drained. When the driver refuses a copy or
// the event, it waits for what it did queue, so that no copy is reported done before its
// bytes have landed, and reports the rest failed.
func (c *Copier) flush() {
	ids := c.ids
	c.ids = nil
	defer c.gathered.Reset()
	queued, err := c.stream.CopyAll(&c.gathered)
	if err == nil {
		var ev *cuda.Event
		if ev, err = c.stream.Record(); err == nil {
			c.pending = append(c.pending, batch{ids: ids, ev: ev})
			return
		}
		queued = len(ids)
	}
	synced := c.stream.Sync()
	for i, id := range ids {
		e := err
		if i < queued {
			e = synced
		}
		c.ready = append(c.ready, fabric.Completion{ID: id, Err: e})
	}
}

// Busy reports copies gathered, queued or running.
func (c *Copier) Busy() bool { return len(c.ids) > 0 || len(c.pending) > 0 || len(c.ready) > 0 }

// Close waits for what is queued and releases the stream.
func (c *Copier) Close() {
	_ = c.stream.Sync()
	for _, b := range c.pending {
		_ = b.ev.Close()
	}
	c.pending, c.ids, c.ready = nil, nil, nil
	_ = c.stream.Close()
}
