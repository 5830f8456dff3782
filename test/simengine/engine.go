package simengine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"time"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/client"
)

// Config describes one simulated engine rank.
type Config struct {
	ID     string
	Role   agentv1.Role
	Mode   agentv1.Mode
	Rank   int
	Layout Layout
	// Socket is the agent's socket.
	Socket string
	// Lease, RegistrationTimeout and BlocksTTL are the engine's policy's timeouts, sent in
	// RegisterEngine as a vLLM connector sends its kv_transfer_config's (0: the agent's).
	Lease, RegistrationTimeout, BlocksTTL time.Duration
	// GPU, when set, keeps the KV cache in that GPU's memory, passed to the agent as a
	// file descriptor (LegacyIPC: named by a CUDA IPC handle), instead of in a memfd.
	GPU       *int
	LegacyIPC bool
	// FabricDomains are the NICs the rank's rails open (RegisterEngine's fabric_domains).
	FabricDomains []string
	// Doorbell sends the rank's reports and takes its events through a doorbell
	// (client.UseDoorbell) instead of RPCs.
	Doorbell bool
}

// Engine is a simulated engine rank: its KV cache lives in a sealed memfd the agent maps,
// it talks to the agent only through the client API, and it allocates blocks the way an
// engine's block manager does.
type Engine struct {
	*client.Engine
	Cache *Cache
	cfg   Config
	cl    *client.Client
	mem   []byte

	mu      sync.Mutex
	free    []uint32
	freed   chan struct{} // closed (and replaced) whenever blocks are freed
	done    chan struct{} // closed when the session has ended
	waiters map[waitKey]chan *agentv1.Event
	early   map[waitKey]*agentv1.Event
}

type waitKey struct {
	req     string
	attempt uint64
}

// Start creates the engine's KV cache file, registers the engine rank and its regions.
func Start(ctx context.Context, cfg Config) (*Engine, error) {
	l := cfg.Layout
	l.Rank = cfg.Rank
	if err := l.Validate(); err != nil {
		return nil, err
	}
	regionBytes := l.Blocks * l.BlockBytes()
	size := l.Regions() * regionBytes
	var fd int
	var mem []byte
	var dev *device
	var err error
	if cfg.GPU != nil {
		mem = make([]byte, size) // the host mirror
		if dev, err = newDevice(*cfg.GPU, uint64(size), uint64(regionBytes), cfg.LegacyIPC); err != nil {
			return nil, err
		}
	} else {
		if fd, mem, err = client.NewMemory(fmt.Sprintf("kv-%s-%d", cfg.ID, cfg.Rank), size); err != nil {
			return nil, err
		}
		// The agent keeps its own reference to the memfd once the regions are registered.
		defer syscall.Close(fd)
	}
	regions := make([][]byte, l.Regions())
	for i := range regions {
		regions[i] = mem[i*regionBytes : (i+1)*regionBytes]
	}
	cache, err := NewCache(l, regions)
	if err != nil {
		return nil, err
	}
	cache.dev = dev
	e := &Engine{Cache: cache, cfg: cfg, mem: mem, waiters: map[waitKey]chan *agentv1.Event{}, early: map[waitKey]*agentv1.Event{}, freed: make(chan struct{}), done: make(chan struct{})}
	for b := l.Blocks - 1; b >= 0; b-- {
		e.free = append(e.free, uint32(b))
	}
	fail := func(err error) (*Engine, error) { e.release(); return nil, err }
	if e.cl, err = client.Dial(cfg.Socket); err != nil {
		return fail(err)
	}
	// As the connector: a minute for the agent to be there and ready.
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	e.Engine, err = e.cl.RegisterEngine(rctx, &agentv1.RegisterEngineRequest{
		EngineId: cfg.ID, Role: cfg.Role, Mode: cfg.Mode, TpRank: uint32(cfg.Rank), TpSize: uint32(l.TP),
		LeaseMillis: uint32(cfg.Lease.Milliseconds()), RegistrationTimeoutMillis: uint32(cfg.RegistrationTimeout.Milliseconds()),
		BlocksTtlMillis: uint32(cfg.BlocksTTL.Milliseconds()), FabricDomains: cfg.FabricDomains,
		Layout: &agentv1.KVLayout{Layers: uint32(l.Layers), BlockSize: uint32(l.BlockSize), KvHeads: uint32(l.KVHeads),
			HeadDim: uint32(l.HeadDim), DtypeBytes: uint32(l.DTypeBytes), HeadMajor: true},
	})
	if err != nil {
		return fail(err)
	}
	if cfg.Doorbell {
		if err := e.UseDoorbell(); err != nil {
			e.Engine.Close()
			return fail(err)
		}
	}
	var passed uint64
	if dev != nil && dev.fd >= 0 {
		passed, err = e.PassGPU(dev.fd, dev.size)
		if err != nil {
			e.Engine.Close()
			return fail(err)
		}
	}
	for i := range regions {
		r := client.Region{
			ID: uint32(i), FD: fd, Offset: uint64(i * regionBytes), Size: uint64(regionBytes),
			BlockLen: uint64(l.BlockBytes()), BlockCount: uint32(l.Blocks),
		}
		switch {
		case passed != 0:
			err = e.RegisterPassedGPURegion(ctx, r, passed)
		case dev != nil:
			err = e.RegisterGPURegion(ctx, r, dev.handle, dev.uuid)
		default:
			err = e.RegisterRegion(ctx, r)
		}
		if err != nil {
			e.Engine.Close()
			return fail(err)
		}
	}
	go e.route()
	return e, nil
}

func (e *Engine) release() {
	if e.cl != nil {
		e.cl.Close()
	}
	if d := e.Cache.dev; d != nil {
		d.free()
		return
	}
	_ = syscall.Munmap(e.mem)
}

// Stop ends the session and frees the cache.
func (e *Engine) Stop() {
	e.Engine.Close()
	e.release()
}

// Done is closed when the session has ended (its event stream closed: the engine
// stopped, or its agent went away).
func (e *Engine) Done() <-chan struct{} { return e.done }

// route hands events to whoever waits for them.
func (e *Engine) route() {
	defer close(e.done)
	for ev := range e.Events() {
		k := waitKey{ev.RequestId, ev.Attempt}
		e.mu.Lock()
		if ev.Attempt == 0 {
			// About the request as a whole (its source or hold expired before any attempt
			// claimed it): whoever waits for an attempt of it hears of it.
			for wk := range e.waiters {
				if wk.req == ev.RequestId {
					k = wk
					break
				}
			}
		}
		if ch, ok := e.waiters[k]; ok {
			delete(e.waiters, k)
			ch <- ev
		} else {
			e.early[k] = ev
		}
		e.mu.Unlock()
	}
	e.mu.Lock()
	for k, ch := range e.waiters {
		close(ch)
		delete(e.waiters, k)
	}
	e.mu.Unlock()
}

// Wait returns the next event of a request's attempt, or of the request as a whole
// (attempt 0: its source or hold expired unclaimed).
func (e *Engine) Wait(ctx context.Context, req string, attempt uint64) (*agentv1.Event, error) {
	k := waitKey{req, attempt}
	e.mu.Lock()
	for _, ek := range []waitKey{k, {req, 0}} {
		if ev, ok := e.early[ek]; ok {
			delete(e.early, ek)
			e.mu.Unlock()
			return ev, nil
		}
	}
	ch := make(chan *agentv1.Event, 1)
	e.waiters[k] = ch
	e.mu.Unlock()
	select {
	case ev, ok := <-ch:
		if !ok {
			return nil, fmt.Errorf("simengine: session ended: %v", e.Err())
		}
		return ev, nil
	case <-ctx.Done():
		e.mu.Lock()
		delete(e.waiters, k)
		e.mu.Unlock()
		return nil, ctx.Err()
	}
}

// ErrNoBlocks means the cache is full: a decode engine preempts a request to make room.
var ErrNoBlocks = errors.New("simengine: no free blocks")

// Allocate takes n free blocks, like vLLM's block manager (not necessarily contiguous:
// freed blocks are reused first).
func (e *Engine) Allocate(n int) ([]uint32, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if n > len(e.free) {
		return nil, ErrNoBlocks
	}
	out := make([]uint32, n)
	for i := range out {
		out[i] = e.free[len(e.free)-1]
		e.free = e.free[:len(e.free)-1]
	}
	return out, nil
}

// Free returns blocks to the allocator. Decode frees only after the agent said no write
// can land in them any more (DELIVERED then done, CANCEL_ACKED or FAILED).
func (e *Engine) Free(blocks []uint32) {
	e.mu.Lock()
	defer e.mu.Unlock()
	// The free list is a stack popped from its end: push in reverse, so a request of the
	// same size gets the same ascending run back, as from vLLM's free-block queue.
	for i := len(blocks) - 1; i >= 0; i-- {
		e.free = append(e.free, blocks[i])
	}
	close(e.freed)
	e.freed = make(chan struct{})
}

// FreeBlocks is how many blocks are free now.
func (e *Engine) FreeBlocks() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.free)
}

// AllocateWait takes n blocks, waiting for frees while the cache is full: a request
// waits for running ones to finish, as in vLLM's scheduler.
func (e *Engine) AllocateWait(ctx context.Context, n int) ([]uint32, error) {
	if n > e.cfg.Layout.Blocks {
		return nil, fmt.Errorf("simengine: %d blocks requested from a cache of %d", n, e.cfg.Layout.Blocks)
	}
	for {
		e.mu.Lock()
		freed := e.freed
		e.mu.Unlock()
		b, err := e.Allocate(n)
		if !errors.Is(err, ErrNoBlocks) {
			return b, err
		}
		select {
		case <-freed:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Preempt gives up a registered attempt the way vLLM preempts a request to make room: it
// cancels the attempt and frees its blocks once the agent says nothing more will land in
// them (CANCEL_ACKED, or DELIVERED or FAILED when the attempt ended first), returning
// that event. The request is retried later with a higher attempt.
func (e *Engine) Preempt(ctx context.Context, req string, attempt uint64, blocks []uint32) (*agentv1.Event, error) {
	if err := e.Cancel(ctx, req, attempt); err != nil {
		return nil, err
	}
	ev, err := e.Wait(ctx, req, attempt)
	if err != nil {
		return nil, err
	}
	e.Free(blocks)
	return ev, nil
}
