// Package cudaipc is the transfer agent's transport between engines on one node whose KV
// is GPU memory: the other processes' allocations, passed as file descriptors or named by
// legacy CUDA IPC handles, opened once per allocation and counted, and copies on one
// stream per engine rank that complete like fabric operations.
package cudaipc

import (
	"fmt"
	"sync"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/cuda"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
)

// Devices are the GPUs' contexts and the allocations opened on them, shared by the
// sessions of one agent: allocations engines passed as file descriptors, mapped once for
// every GPU that can reach them, and legacy IPC handles, opened once per GPU context.
// Each is counted, and unmapped when its last user closes it. The zero value is ready to
// use.
type Devices struct {
	mu      sync.Mutex
	ctxs    map[int]*cuda.Context
	imports map[Key]*imported
	passed  uint64 // allocations passed as fds so far: their keys' numbers
}

// Key names an opened allocation. Passed allocations and IPC handles never share a key:
// an engine cannot name a number by an IPC handle.
type Key struct {
	Passed uint64         // the number of an allocation passed as an fd; 0 for an IPC handle
	Handle cuda.IPCHandle // the IPC handle (Passed 0)
	GPU    int            // the context an IPC handle is opened in (Passed 0)
}

type imported struct {
	ptr    cuda.Ptr
	extent uint64
	refs   int
	ctx    *cuda.Context // a passed allocation's mapping, undone by Unmap; nil: an IPC import
}

// Context is GPU ordinal's context, retained once for the agent's life.
func (g *Devices) Context(ordinal int) (*cuda.Context, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.context(ordinal)
}

func (g *Devices) context(ordinal int) (*cuda.Context, error) {
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

// Pass maps the first size bytes of the allocation an engine passed as fd (the caller
// keeps fd) for its own GPU and every GPU that can reach it, and returns its key, counted
// once, and the GPU that holds it. The driver refuses a size beyond the allocation, and a
// file that is not a CUDA allocation's.
func (g *Devices) Pass(fd int, size uint64) (Key, int, error) {
	sh, err := cuda.ImportFD(fd)
	if err != nil {
		return Key{}, 0, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	c, err := g.context(sh.Ordinal)
	if err != nil {
		sh.Release()
		return Key{}, 0, err
	}
	n, _ := cuda.DeviceCount() // the driver answered for the import already
	devs := []int{sh.Ordinal}
	for d := range n {
		if d == sh.Ordinal {
			continue
		}
		if ok, _ := c.CanAccessPeer(d); ok {
			devs = append(devs, d)
		}
	}
	p, err := c.Map(sh, size, devs)
	if err != nil {
		return Key{}, 0, err
	}
	g.passed++
	k := Key{Passed: g.passed}
	g.imports[k] = &imported{ptr: p, extent: size, refs: 1, ctx: c}
	return k, sh.Ordinal, nil
}

// open counts one more use of the allocation k names, opening an IPC handle in its GPU's
// context the first time, and returns where it starts and how long it is. A passed
// allocation is open from Pass until its last Close.
func (g *Devices) open(k Key) (cuda.Ptr, uint64, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if m, ok := g.imports[k]; ok {
		m.refs++
		return m.ptr, m.extent, nil
	}
	if k.Passed != 0 {
		return 0, 0, fmt.Errorf("passed allocation %d is closed", k.Passed)
	}
	c, err := g.context(k.GPU)
	if err != nil {
		return 0, 0, err
	}
	p, err := c.Import(k.Handle)
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

// Close drops one count of k's allocation, unmapping it with its last.
func (g *Devices) Close(k Key) {
	g.mu.Lock()
	defer g.mu.Unlock()
	m, ok := g.imports[k]
	if !ok {
		return
	}
	if m.refs--; m.refs > 0 {
		return
	}
	delete(g.imports, k)
	if m.ctx != nil {
		_ = m.ctx.Unmap(m.ptr, m.extent)
	} else {
		_ = g.ctxs[k.GPU].Unimport(m.ptr)
	}
}

// Region is a region of GPU memory as a session holds it.
type Region struct {
	Key Key
	Off uint64
	Ptr cuda.Ptr // the region's start in this process
}

// OpenRegion opens a region of size bytes at off of k's allocation, refusing one that
// does not fit the allocation.
func (g *Devices) OpenRegion(k Key, off, size uint64) (*Region, error) {
	p, extent, err := g.open(k)
	if err != nil {
		return nil, err
	}
	if off > extent || size > extent-off {
		g.Close(k)
		return nil, fmt.Errorf("%d bytes at offset %d do not fit the %d-byte allocation", size, off, extent)
	}
	return &Region{Key: k, Off: off, Ptr: p + cuda.Ptr(off)}, nil
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

// Reap queues what was gathered and appends to done every copy of the finished batches,
// in order. All of them: a caller's window refills by what it reaps, and reaping a
// buffer's worth a step would queue the copies in batches that small again.
func (c *Copier) Reap(done []fabric.Completion) []fabric.Completion {
	if len(c.ids) > 0 {
		c.flush()
	}
	done = append(done, c.ready...)
	c.ready = c.ready[:0]
	for len(c.pending) > 0 {
		b := c.pending[0]
		finished, err := b.ev.Done()
		if !finished {
			break
		}
		for _, id := range b.ids {
			done = append(done, fabric.Completion{ID: id, Err: err})
		}
		_ = b.ev.Close()
		c.pending = c.pending[1:]
	}
	return done
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
