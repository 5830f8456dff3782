package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

var errNoSession = errors.New("no such session (register the engine first; a session ends when its event stream closes)")

// engineAPI implements the gRPC service. Every method validates its request against the
// session's state and returns an error naming the field and the rule it broke; nothing
// is recorded from a refused request.
type engineAPI struct {
	agentv1.UnimplementedAgentServer
	a *Agent
}

func invalid(field, format string, args ...any) error {
	return status.Errorf(codes.InvalidArgument, "%s: "+format, append([]any{field}, args...)...)
}

// refusals counts and logs every refused engine call, including those gRPC itself
// refuses before a handler runs (an oversized message): bad input must be visible to
// operators, not only to the engine that sent it.
type refusals struct{ a *Agent }

type methodKey struct{}

func (r refusals) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, methodKey{}, info.FullMethodName[strings.LastIndex(info.FullMethodName, "/")+1:])
}

func (r refusals) HandleRPC(ctx context.Context, s stats.RPCStats) {
	end, ok := s.(*stats.End)
	if !ok || end.Error == nil {
		return
	}
	code := status.Code(end.Error)
	if code == codes.Canceled {
		return // an engine closing its event stream
	}
	method, _ := ctx.Value(methodKey{}).(string)
	r.a.metrics.refused.WithLabelValues(method, code.String()).Inc()
	r.a.log.Warn("refused an engine call", "method", method, "code", code.String(), "err", status.Convert(end.Error).Message())
}

func (refusals) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (refusals) HandleConn(context.Context, stats.ConnStats)                       {}

func engineKey(id string, rank uint32) string { return fmt.Sprintf("%s/%d", id, rank) }

func checkRequestID(id string) error {
	if id == "" {
		return invalid("request_id", "must not be empty")
	}
	if len(id) > wire.MaxString {
		return invalid("request_id", "is %d bytes, longer than %d", len(id), wire.MaxString)
	}
	return nil
}

// checkRequest checks a request id and the blocks a call names.
func checkRequest(id, field string, ids []uint32) error {
	if err := checkRequestID(id); err != nil {
		return err
	}
	if len(ids) == 0 {
		return invalid(field, "must name at least one block")
	}
	if len(ids) > wire.MaxBlocks {
		return invalid(field, "names %d blocks, more than %d", len(ids), wire.MaxBlocks)
	}
	return nil
}

func checkSource(field string, ref *agentv1.EngineRef, rank uint32) error {
	switch {
	case ref == nil || ref.Agent == "" || ref.EngineId == "":
		return invalid(field, "must name the agent (host:port) and engine_id")
	case ref.TpRank != rank:
		return invalid(field+".tp_rank", "is %d; rank %d transfers only to and from rank %d (tensor-parallel sizes must match)", ref.TpRank, rank, rank)
	}
	return nil
}

// checkDomains checks the NICs an engine rank names for its rails: each once, no more
// than an endpoint's rails. Whether the provider has them is what opening them tells
// (openFailure).
func checkDomains(provider string, names []string) error {
	if len(names) > fabric.MaxRails {
		return invalid("fabric_domains", "names %d domains; a rank has at most %d rails", len(names), fabric.MaxRails)
	}
	if len(names) > 1 && provider == "shm" {
		return invalid("fabric_domains", "names %d domains; shm moves memory within a node and has no rails", len(names))
	}
	for i, n := range names {
		if slices.Index(names, n) != i {
			return invalid(fmt.Sprintf("fabric_domains[%d]", i), "%q is named twice: one rail per NIC", n)
		}
	}
	return nil
}

// openFailure is the answer to an endpoint that would not open: a named domain the
// provider lacks is the engine's mistake, named with the domains there are; anything
// else is the provider's.
func openFailure(provider string, names []string, err error) error {
	if have, lerr := fabric.Domains(provider); lerr == nil {
		for i, n := range names {
			if !slices.Contains(have, n) {
				return invalid(fmt.Sprintf("fabric_domains[%d]", i), "%q is not a domain of provider %s (it has %s)", n, provider, strings.Join(have, ", "))
			}
		}
	}
	return status.Errorf(codes.Unavailable, "opening a fabric endpoint: %v", err)
}

// maxTimeoutMillis bounds the timeouts an engine may ask for: a day, as the policy's API does.
const maxTimeoutMillis = 24 * 3600 * 1000

// maxSessions bounds the engine ranks one agent serves: a p5en node runs at most 16 (two
// TP8 engines), and each session holds a fabric endpoint and mapped memory.
const maxSessions = 256

func (e *engineAPI) RegisterEngine(ctx context.Context, r *agentv1.RegisterEngineRequest) (*agentv1.RegisterEngineResponse, error) {
	a := e.a
	l := r.GetLayout()
	switch {
	case r.EngineId == "" || len(r.EngineId) > 253 || strings.Contains(r.EngineId, "/"):
		return nil, invalid("engine_id", "must be 1 to 253 bytes without '/'")
	case r.Role != agentv1.Role_ROLE_PREFILL && r.Role != agentv1.Role_ROLE_DECODE:
		return nil, invalid("role", "must be ROLE_PREFILL or ROLE_DECODE")
	case r.Mode != agentv1.Mode_MODE_PUSH && r.Mode != agentv1.Mode_MODE_PULL:
		return nil, invalid("mode", "must be MODE_PUSH or MODE_PULL")
	case r.TpSize == 0 || r.TpRank >= r.TpSize:
		return nil, invalid("tp_rank", "%d must be below tp_size %d", r.TpRank, r.TpSize)
	case l == nil || l.Layers == 0 || l.BlockSize == 0 || l.KvHeads == 0 || l.HeadDim == 0 || l.DtypeBytes == 0:
		return nil, invalid("layout", "every field must be positive")
	case l.KvHeads%r.TpSize != 0:
		return nil, invalid("layout.kv_heads", "%d do not split over tp_size %d", l.KvHeads, r.TpSize)
	case r.LeaseMillis > maxTimeoutMillis || r.RegistrationTimeoutMillis > maxTimeoutMillis || r.BlocksTtlMillis > maxTimeoutMillis:
		return nil, invalid("lease_millis", "and registration_timeout_millis and blocks_ttl_millis must be at most a day")
	}
	if t := requestTimeouts(r).complete(a.cfg.Timeouts); t.RegistrationTimeout < t.Lease {
		return nil, invalid("registration_timeout_millis",
			"%s is shorter than the lease %s (the policy's rule: registrationTimeout ≥ lease)", t.RegistrationTimeout, t.Lease)
	}
	caller, err := callerOf(ctx)
	if err != nil {
		return nil, err
	}
	if err := a.checkEngineID(ctx, caller, r.EngineId); err != nil {
		return nil, err
	}
	if err := a.Ready(); err != nil {
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	if err := checkDomains(a.cfg.Provider, r.FabricDomains); err != nil {
		return nil, err
	}
	var ep *fabric.Endpoint
	if len(r.FabricDomains) > 0 {
		ep, err = fabric.OpenDomains(a.cfg.Provider, r.FabricDomains)
	} else {
		ep, err = fabric.OpenRails(a.cfg.Provider, a.cfg.Rails)
	}
	if err != nil {
		return nil, openFailure(a.cfg.Provider, r.FabricDomains, err)
	}
	var id [16]byte
	_, _ = rand.Read(id[:])
	key := engineKey(r.EngineId, r.TpRank)

	a.mu.Lock()
	refuse := func(err error) (*agentv1.RegisterEngineResponse, error) {
		a.mu.Unlock()
		ep.Close()
		return nil, err
	}
	if a.closed {
		return refuse(status.Error(codes.Unavailable, "agent is shutting down"))
	}
	old := a.engines[key]
	if old != nil && !old.ended() && old.owner != caller.Owner() {
		return refuse(status.Errorf(codes.PermissionDenied, "engine_id: %s rank %d is held by %s, not the caller's %s",
			r.EngineId, r.TpRank, old.owner, caller.Owner()))
	}
	if old != nil && !old.ended() && old.id != r.ReplacesSession {
		// Only the live incarnation itself, which alone knows its session id, may hand its
		// rank over; a restarted engine finds the rank free once its old stream closed.
		return refuse(status.Errorf(codes.AlreadyExists, "engine_id: %s rank %d has a live session; register again once its event stream has "+
			"ended, or name it in replaces_session", r.EngineId, r.TpRank))
	}
	if old == nil && len(a.sessions) >= maxSessions {
		return refuse(status.Errorf(codes.ResourceExhausted, "the agent serves %d engine ranks, its limit", maxSessions))
	}
	a.nextEpoch++
	s := newSession(a.node, a.cfg.Timeouts, hex.EncodeToString(id[:]), key, caller.Owner(), a.nextEpoch, r, ep)
	a.sessions[s.id], a.engines[key] = s, s
	a.metrics.sessions.Set(float64(len(a.sessions)))
	a.mu.Unlock()
	if old != nil {
		// A new incarnation of the same rank: the old one's memory is gone.
		old.close("replaced by a new incarnation of the engine")
	}
	time.AfterFunc(a.cfg.EventsDeadline, func() {
		if !s.attached.Load() {
			s.close(fmt.Sprintf("no event stream within %s of registering", a.cfg.EventsDeadline))
		}
	})
	go s.run()
	a.log.Info("engine registered", "engine", key, "caller", caller.String(), "role", r.Role.String(), "mode", r.Mode.String(), "epoch", s.epoch, "rails", ep.Domains())
	return &agentv1.RegisterEngineResponse{
		Session: s.id, Epoch: s.epoch, Provider: a.limits.Provider,
		Self: &agentv1.EngineRef{Agent: a.self, EngineId: r.EngineId, TpRank: r.TpRank},
	}, nil
}

func (e *engineAPI) RegisterRegion(ctx context.Context, r *agentv1.RegisterRegionRequest) (*agentv1.RegisterRegionResponse, error) {
	s, err := e.session(ctx, r.Session)
	if err != nil {
		return nil, err
	}
	switch {
	case r.BlockLen == 0 || r.BlockCount == 0:
		return nil, invalid("block_len", "and block_count must be positive")
	case r.BlockLen > r.Size/uint64(r.BlockCount):
		return nil, invalid("size", "%d bytes cannot hold %d blocks of %d bytes", r.Size, r.BlockCount, r.BlockLen)
	}
	switch r.Kind {
	case agentv1.MemoryKind_MEMORY_KIND_HOST:
	case agentv1.MemoryKind_MEMORY_KIND_CUDA, agentv1.MemoryKind_MEMORY_KIND_NEURON:
		if r.Kind == agentv1.MemoryKind_MEMORY_KIND_CUDA && len(r.CudaIpcHandle) > 0 {
			if err := e.registerGPURegion(s, r); err != nil {
				return nil, err
			}
			return &agentv1.RegisterRegionResponse{}, nil
		}
		// The dmabuf path needs libfabric's FI_MR_DMABUF at build time and the fd in
		// this process; without either, say so rather than register something else.
		if !fabric.HasDmabuf() {
			return nil, status.Errorf(codes.FailedPrecondition, "kind %s: %v", r.Kind, fabric.ErrNoDmabuf)
		}
		return nil, status.Errorf(codes.Unimplemented, "kind %s: device memory needs its dmabuf fd passed to the agent over the socket, which this "+
			"agent does not accept yet", r.Kind)
	default:
		return nil, invalid("kind", "must be MEMORY_KIND_HOST, _CUDA or _NEURON")
	}
	f := s.claim(r.MemoryHandle)
	if f == nil {
		return nil, invalid("memory_handle", "%d names no memfd this session passed over %s (each handle registers one region)",
			r.MemoryHandle, agentv1.MemorySocketName)
	}
	m, err := mapFD(f, r.Offset, r.Size)
	f.Close() // the mapping keeps the memory
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := e.a.claim(s, r.RegionId, m); err != nil {
		m.unmap()
		return nil, status.Error(codes.AlreadyExists, err.Error())
	}
	if err := s.call(func() error { return s.addRegion(r, m) }); err != nil {
		e.a.release(s, r.RegionId)
		m.unmap()
		return nil, err
	}
	return &agentv1.RegisterRegionResponse{}, nil
}

func (e *engineAPI) RegisterDestination(ctx context.Context, r *agentv1.RegisterDestinationRequest) (*agentv1.Ack, error) {
	s, err := e.sessionFor(ctx, r.Session, agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, "RegisterDestination")
	if err != nil {
		return nil, err
	}
	if err := checkRequest(r.RequestId, "block_ids", r.BlockIds); err != nil {
		return nil, err
	}
	if err := checkSource("source", r.Source, s.rank); err != nil {
		return nil, err
	}
	return ack(s.call(func() error { return s.decode().registerDestination(r) }))
}

func (e *engineAPI) SourceReady(ctx context.Context, r *agentv1.SourceReadyRequest) (*agentv1.Ack, error) {
	s, err := e.sessionFor(ctx, r.Session, agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_UNSPECIFIED, "SourceReady")
	if err != nil {
		return nil, err
	}
	if err := checkRequest(r.RequestId, "block_ids", r.BlockIds); err != nil {
		return nil, err
	}
	return ack(s.call(func() error { return s.prefill().sourceReady(r) }))
}

func (e *engineAPI) Pull(ctx context.Context, r *agentv1.PullRequest) (*agentv1.Ack, error) {
	s, err := e.sessionFor(ctx, r.Session, agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PULL, "Pull")
	if err != nil {
		return nil, err
	}
	if err := checkPull(r, s.rank); err != nil {
		return nil, err
	}
	return ack(s.call(func() error { return s.decode().pull(r) }))
}

// checkPull is Pull's check of its fields, for the RPC and the doorbell.
func checkPull(r *agentv1.PullRequest, rank uint32) error {
	if err := checkRequest(r.RequestId, "source_block_ids", r.SourceBlockIds); err != nil {
		return err
	}
	if len(r.DestinationBlockIds) != len(r.SourceBlockIds) {
		return invalid("destination_block_ids", "names %d blocks for %d source blocks", len(r.DestinationBlockIds), len(r.SourceBlockIds))
	}
	return checkSource("source", r.Source, rank)
}

func (e *engineAPI) Cancel(ctx context.Context, r *agentv1.CancelRequest) (*agentv1.Ack, error) {
	s, err := e.session(ctx, r.Session)
	if err != nil {
		return nil, err
	}
	if err := checkRequestID(r.RequestId); err != nil {
		return nil, err
	}
	return ack(s.call(func() error { return s.side.cancel(time.Now(), r.RequestId, r.Attempt) }))
}

func (e *engineAPI) Decline(ctx context.Context, r *agentv1.DeclineRequest) (*agentv1.Ack, error) {
	s, err := e.sessionFor(ctx, r.Session, agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH, "Decline")
	if err != nil {
		return nil, err
	}
	if err := checkRequestID(r.RequestId); err != nil {
		return nil, err
	}
	if err := checkSource("source", r.Source, s.rank); err != nil {
		return nil, err
	}
	return ack(s.call(func() error { return s.decode().decline(r) }))
}

func (e *engineAPI) Heartbeat(ctx context.Context, r *agentv1.HeartbeatRequest) (*agentv1.Ack, error) {
	s, err := e.session(ctx, r.Session)
	if err != nil {
		return nil, err
	}
	return ack(s.call(func() error {
		if ds := s.decode(); ds != nil {
			ds.heartbeat()
		}
		return nil
	}))
}

func (e *engineAPI) Events(r *agentv1.EventsRequest, stream grpc.ServerStreamingServer[agentv1.Event]) error {
	s, err := e.session(stream.Context(), r.Session)
	if err != nil {
		return err
	}
	if !s.attach() {
		return status.Error(codes.AlreadyExists, "session: already has an event stream")
	}
	// The stream is the engine's liveness: when it ends, the session ends, and everything
	// the engine had outstanding is fenced and failed.
	defer s.close("the engine's event stream closed")
	for {
		select {
		case ev := <-s.events:
			// With a doorbell the events go into its ring, which the engine reads at
			// each step; the stream stays open as its liveness.
			if b := s.bell.Load(); b != nil {
				if err := b.putEvent(ev, s.stopped); err != nil {
					s.close(err.Error())
					return status.Error(codes.Aborted, err.Error())
				}
				s.n.metrics.bellRecords.WithLabelValues("event").Inc()
				continue
			}
			if err := stream.Send(ev); err != nil {
				return err
			}
		case <-stream.Context().Done():
			return nil
		case <-s.stopped:
			return status.Error(codes.Aborted, s.closeReason())
		}
	}
}

// session returns the session a call names, if the caller owns it.
func (e *engineAPI) session(ctx context.Context, id string) (*session, error) {
	c, err := callerOf(ctx)
	if err != nil {
		return nil, err
	}
	return e.a.session(id, c.Owner())
}

// sessionFor returns a session that may make a call, refusing calls its role or mode
// does not allow (MODE_UNSPECIFIED: either mode).
func (e *engineAPI) sessionFor(ctx context.Context, id string, role agentv1.Role, mode agentv1.Mode, call string) (*session, error) {
	s, err := e.session(ctx, id)
	if err != nil {
		return nil, err
	}
	if s.role != role || (mode != agentv1.Mode_MODE_UNSPECIFIED && s.mode != mode) {
		return nil, status.Errorf(codes.FailedPrecondition, "%s: not allowed for a %s engine in %s", call, s.role, s.mode)
	}
	return s, nil
}

func ack(err error) (*agentv1.Ack, error) {
	if err != nil {
		return nil, err
	}
	return &agentv1.Ack{}, nil
}
