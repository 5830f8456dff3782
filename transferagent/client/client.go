// Package client is the Go client of the transfer agent's engine API, for engines (and
// the simulated engine) to use. It is a thin layer over the generated gRPC stubs: it
// dials the agent's Unix socket, registers an engine rank and keeps its event stream
// open, which is how the agent knows the engine is alive.
package client

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/doorbell"
)

// DefaultSocket is where the agent's DaemonSet puts its socket.
const DefaultSocket = "/var/run/kvhandoff/agent.sock"

// Client is a connection to the node's agent.
type Client struct {
	conn   *grpc.ClientConn
	socket string
	API    agentv1.AgentClient
}

// Dial connects to the agent's socket (lazily: the first call waits for it).
func Dial(socket string) (*Client, error) {
	conn, err := grpc.NewClient("unix://"+socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(16<<20)))
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, socket: socket, API: agentv1.NewAgentClient(conn)}, nil
}

// Close closes the connection, ending every session opened through it.
func (c *Client) Close() error { return c.conn.Close() }

// register registers r, waiting while ctx allows for an agent that is not there yet (its
// socket not open) or not ready yet (Unavailable: a restarted agent before its provider
// and pod cache are up). An engine that gave up at once would exit and be restarted by
// the kubelet with its back-off (10 s, then 20 s, …).
func register(ctx context.Context, api agentv1.AgentClient, r *agentv1.RegisterEngineRequest) (*agentv1.RegisterEngineResponse, error) {
	wait := 100 * time.Millisecond
	var refused error // the agent's last Unavailable: why, when ctx runs out
	for {
		resp, err := api.RegisterEngine(ctx, r, grpc.WaitForReady(true))
		switch {
		case err == nil:
			return resp, nil
		case ctx.Err() != nil && refused != nil: // cut by ctx while waiting to retry
			return nil, refused
		case status.Code(err) != codes.Unavailable:
			return nil, err
		}
		refused = err
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(wait):
		}
		wait = min(2*wait, 2*time.Second)
	}
}

// Engine is a registered engine rank.
type Engine struct {
	c        *Client
	Session  string
	Epoch    uint64
	Self     *agentv1.EngineRef
	Provider string
	events   chan *agentv1.Event
	cancel   context.CancelFunc
	bell     *bell // set by UseDoorbell

	mu  sync.Mutex
	err error
}

// RegisterEngine registers an engine rank and opens its event stream. It waits for the
// agent to come up and be ready, as long as ctx allows.
func (c *Client) RegisterEngine(ctx context.Context, r *agentv1.RegisterEngineRequest) (*Engine, error) {
	resp, err := register(ctx, c.API, r)
	if err != nil {
		return nil, err
	}
	sctx, cancel := context.WithCancel(context.Background())
	stream, err := c.API.Events(sctx, &agentv1.EventsRequest{Session: resp.Session})
	if err != nil {
		cancel()
		return nil, err
	}
	e := &Engine{c: c, Session: resp.Session, Epoch: resp.Epoch, Self: resp.Self, Provider: resp.Provider,
		events: make(chan *agentv1.Event, 1024), cancel: cancel}
	go func() {
		defer close(e.events)
		defer e.stopBell()
		for {
			ev, err := stream.Recv()
			if err != nil {
				e.fail(err)
				return
			}
			e.events <- ev
		}
	}()
	return e, nil
}

// Events delivers the session's outcomes; it closes when the session ends (see Err).
func (e *Engine) Events() <-chan *agentv1.Event { return e.events }

// Err is why the event stream ended.
func (e *Engine) Err() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err
}

// fail records why the session ended (the first reason) and ends it.
func (e *Engine) fail(err error) {
	e.mu.Lock()
	if e.err == nil {
		e.err = err
	}
	e.mu.Unlock()
	e.cancel()
}

// Close ends the session: the agent fences and fails what it had outstanding.
func (e *Engine) Close() { e.cancel() }

// Region describes one KV region: Size bytes at Offset of a memfd sealed against
// shrinking (see NewMemory).
type Region struct {
	ID         uint32
	FD         int
	Offset     uint64
	Size       uint64
	BlockLen   uint64
	BlockCount uint32
}

// RegisterRegion passes the region's memfd to the agent over the memory socket, then
// registers the region.
func (e *Engine) RegisterRegion(ctx context.Context, r Region) error {
	h, err := PassMemory(agentv1.MemorySocket(e.c.socket), e.Session, r.FD)
	if err != nil {
		return fmt.Errorf("registering region %d: %w", r.ID, err)
	}
	_, err = e.c.API.RegisterRegion(ctx, &agentv1.RegisterRegionRequest{
		Session: e.Session, RegionId: r.ID, Kind: agentv1.MemoryKind_MEMORY_KIND_HOST,
		MemoryHandle: h, Offset: r.Offset, Size: r.Size, BlockLen: r.BlockLen, BlockCount: r.BlockCount,
	})
	if err != nil {
		return fmt.Errorf("registering region %d: %w", r.ID, err)
	}
	return nil
}

// RegisterGPURegion registers a region of GPU memory: r.Size bytes at r.Offset of the
// allocation handle names (cuIpcGetMemHandle), on the GPU with UUID device. r.FD is unused.
func (e *Engine) RegisterGPURegion(ctx context.Context, r Region, handle [64]byte, device [16]byte) error {
	_, err := e.c.API.RegisterRegion(ctx, &agentv1.RegisterRegionRequest{
		Session: e.Session, RegionId: r.ID, Kind: agentv1.MemoryKind_MEMORY_KIND_CUDA,
		CudaIpcHandle: handle[:], CudaDeviceUuid: device[:], Offset: r.Offset, Size: r.Size, BlockLen: r.BlockLen, BlockCount: r.BlockCount,
	})
	if err != nil {
		return fmt.Errorf("registering region %d: %w", r.ID, err)
	}
	return nil
}

// PassGPU hands the agent a GPU allocation of size bytes, as the POSIX fd
// cuMemExportToShareableHandle made for it, and returns the handle its regions name
// (RegisterPassedGPURegion). No PID namespace need be shared with the agent.
func (e *Engine) PassGPU(fd int, size uint64) (uint64, error) {
	return PassCUDA(agentv1.MemorySocket(e.c.socket), e.Session, fd, size)
}

// RegisterPassedGPURegion registers r.Size bytes at r.Offset of the GPU allocation handle
// names (PassGPU). r.FD is unused.
func (e *Engine) RegisterPassedGPURegion(ctx context.Context, r Region, handle uint64) error {
	_, err := e.c.API.RegisterRegion(ctx, &agentv1.RegisterRegionRequest{
		Session: e.Session, RegionId: r.ID, Kind: agentv1.MemoryKind_MEMORY_KIND_CUDA,
		MemoryHandle: handle, Offset: r.Offset, Size: r.Size, BlockLen: r.BlockLen, BlockCount: r.BlockCount,
	})
	if err != nil {
		return fmt.Errorf("registering region %d: %w", r.ID, err)
	}
	return nil
}

// RegisterDestination (push, decode) names where a request's KV goes.
func (e *Engine) RegisterDestination(ctx context.Context, req string, attempt uint64, blocks []uint32, source *agentv1.EngineRef) error {
	_, err := e.c.API.RegisterDestination(ctx, &agentv1.RegisterDestinationRequest{
		Session: e.Session, RequestId: req, Attempt: attempt, BlockIds: blocks, Source: source,
	})
	return err
}

// RegisterTail (push, decode) names where the tail of a request's KV goes: blocks hold
// token-order positions first, first+1, …; the engine's prefix cache holds the rest.
func (e *Engine) RegisterTail(ctx context.Context, req string, attempt uint64, first uint32, blocks []uint32, source *agentv1.EngineRef) error {
	_, err := e.c.API.RegisterDestination(ctx, &agentv1.RegisterDestinationRequest{
		Session: e.Session, RequestId: req, Attempt: attempt, BlockIds: blocks, Source: source, FirstPosition: first,
	})
	return err
}

// SourceReady (prefill) reports a part of a request's blocks ready.
// With a doorbell it goes through the submit ring, and the agent answers a report it
// refuses with a FAILED event rather than an error here.
func (e *Engine) SourceReady(ctx context.Context, req string, offset uint32, blocks []uint32, final bool) error {
	return e.sourceReady(ctx, &agentv1.SourceReadyRequest{
		Session: e.Session, RequestId: req, Offset: offset, BlockIds: blocks, Final: final,
	})
}

func (e *Engine) sourceReady(ctx context.Context, r *agentv1.SourceReadyRequest) error {
	if rung, err := e.submit(ctx, doorbell.KindSourceReady, r); rung || err != nil {
		return err
	}
	_, err := e.c.API.SourceReady(ctx, r)
	return err
}

// SourceRegionsReady (prefill, push) reports one layer group of a request ready: the
// regions with ids first .. first+count-1 of every block; the last group has final.
func (e *Engine) SourceRegionsReady(ctx context.Context, req string, first, count uint32, blocks []uint32, final bool) error {
	return e.sourceReady(ctx, &agentv1.SourceReadyRequest{
		Session: e.Session, RequestId: req, BlockIds: blocks, Final: final, FirstRegion: first, RegionCount: count,
	})
}

// Pull (pull, decode) reads a request's blocks from a prefill engine. With a doorbell it
// goes through the submit ring, and a refused pull is answered with a FAILED event.
func (e *Engine) Pull(ctx context.Context, req string, attempt uint64, source *agentv1.EngineRef, src, dst []uint32) error {
	r := &agentv1.PullRequest{
		Session: e.Session, RequestId: req, Attempt: attempt, Source: source, SourceBlockIds: src, DestinationBlockIds: dst,
	}
	if rung, err := e.submit(ctx, doorbell.KindPull, r); rung || err != nil {
		return err
	}
	_, err := e.c.API.Pull(ctx, r)
	return err
}

// Cancel fences an attempt.
func (e *Engine) Cancel(ctx context.Context, req string, attempt uint64) error {
	_, err := e.c.API.Cancel(ctx, &agentv1.CancelRequest{Session: e.Session, RequestId: req, Attempt: attempt})
	return err
}

// Decline (push, decode) says the engine computes a request itself and takes none of its
// KV; the source's agent frees the prefill engine's blocks at once.
func (e *Engine) Decline(ctx context.Context, req string, source *agentv1.EngineRef) error {
	_, err := e.c.API.Decline(ctx, &agentv1.DeclineRequest{Session: e.Session, RequestId: req, Source: source})
	return err
}

// Heartbeat renews the leases of everything the engine has outstanding.
func (e *Engine) Heartbeat(ctx context.Context) error {
	_, err := e.c.API.Heartbeat(ctx, &agentv1.HeartbeatRequest{Session: e.Session})
	return err
}
