// Package engineapi is the transfer agent's engine-facing side: the gRPC engine API on
// its Unix socket, the memory socket engines pass their KV memfds and doorbells over, the
// doorbell rings, and who each caller is (identity.go). Every call is checked here for
// who may make it, and by its session (package session) for what it asks; none waits on
// the fabric.
package engineapi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/peercred"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/session"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Config is what the engine-facing side needs of its agent.
type Config struct {
	// Socket is the engine API's Unix socket; the memory socket sits beside it
	// (agentv1.MemorySocket).
	Socket string
	// Sessions are the agent's engine sessions.
	Sessions *session.Table
	// Timeouts are the agent's fallbacks for engines that send none.
	Timeouts session.Timeouts
	// Pods, when set, makes the agent check that each engine runs in the pod its
	// engine_id names (identity.go); nil outside a cluster.
	Pods Pods
	// ProcRoot is where callers' /proc entries are read ("" for /proc).
	ProcRoot string
	// Ready says whether the agent can serve transfers; registrations wait for it.
	Ready func() error
	// Provider is the provider the agent runs on, and Self its peer address: both are
	// told to each engine at registration.
	Provider, Self string
	Log            *slog.Logger
	Metrics        *session.Metrics
}

// Server serves the engine API and the memory socket.
type Server struct {
	agentv1.UnimplementedAgentServer
	cfg   Config
	grpc  *grpc.Server
	engLn net.Listener
	memLn *net.UnixListener
	// callers reads who connected to the engine sockets; calls and memConns are each
	// owner's share of calls in flight and of memory socket connections.
	callers  peercred.Reader
	calls    *peercred.Slots
	memConns *peercred.Slots
	// bells are the sessions' doorbells, by session, once passed.
	bells sync.Map
	wg    sync.WaitGroup
}

// New binds the engine socket and the memory socket, in a folder only the agent owns.
func New(cfg Config) (*Server, error) {
	srv := &Server{cfg: cfg, callers: peercred.Reader{ProcRoot: cfg.ProcRoot},
		calls: peercred.NewSlots(maxCallsPerOwner), memConns: peercred.NewSlots(maxMemoryConnsPerOwner)}
	if err := os.MkdirAll(filepath.Dir(cfg.Socket), 0o755); err != nil {
		return nil, err
	}
	if err := ownSocketDir(filepath.Dir(cfg.Socket)); err != nil {
		return nil, err
	}
	ln, err := listenUnix("unix", cfg.Socket)
	if err != nil {
		return nil, err
	}
	mem, err := listenUnix("unixpacket", agentv1.MemorySocket(cfg.Socket))
	if err != nil {
		ln.Close()
		return nil, err
	}
	srv.engLn, srv.memLn = ln, mem.(*net.UnixListener)
	srv.grpc = grpc.NewServer(
		grpc.Creds(peercred.Credentials{Reader: srv.callers, Conns: peercred.NewSlots(maxConnsPerOwner), Refused: func(code string, err error) {
			cfg.Metrics.Refused.WithLabelValues("connection", code).Inc()
			cfg.Log.Warn("refused an engine connection", "err", err)
		}}),
		grpc.InTapHandle(srv.callLimit),
		grpc.MaxRecvMsgSize(maxRequest),
		grpc.StatsHandler(refusals{srv}),
	)
	agentv1.RegisterAgentServer(srv.grpc, srv)
	return srv, nil
}

// Serve serves both sockets until Stop.
func (srv *Server) Serve() {
	srv.wg.Add(2)
	go func() { defer srv.wg.Done(); _ = srv.grpc.Serve(srv.engLn) }()
	go func() { defer srv.wg.Done(); srv.serveMemory() }()
}

// Stop closes both sockets and every engine connection; Wait waits for what they ran.
func (srv *Server) Stop() {
	srv.grpc.Stop()
	srv.memLn.Close()
}

// Wait waits for the connections Stop ended, then removes the socket.
func (srv *Server) Wait() {
	srv.wg.Wait()
	os.Remove(srv.cfg.Socket)
}

// listenUnix binds a socket engines reach: only root and the socket's group (engines run
// in it) may use it.
func listenUnix(network, path string) (net.Listener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("agent: removing the stale socket %s: %w", path, err)
	}
	ln, err := net.Listen(network, path)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o660); err != nil {
		ln.Close()
		return nil, err
	}
	return ln, nil
}

// ownSocketDir refuses a socket folder the agent does not own alone: one another user
// owns, or anyone but its owner may write to, lets that user replace the sockets every
// engine of the node connects to, and intercept them.
func ownSocketDir(dir string) error {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return fmt.Errorf("agent: socket folder %s: %w", dir, err)
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("agent: socket folder %s is not a directory (a link?): the agent's sockets need a folder of its own", dir)
	case int(st.Uid) != os.Geteuid():
		return fmt.Errorf("agent: socket folder %s belongs to uid %d, not the agent's %d: its owner could replace the sockets", dir, st.Uid, os.Geteuid())
	case st.Mode&0o022 != 0:
		return fmt.Errorf("agent: socket folder %s is writable by its group or others (mode %o): they could replace the sockets", dir, st.Mode&0o777)
	}
	return nil
}

// maxRequest bounds an engine API message: a registration of wire.MaxBlocks blocks fits.
const maxRequest = wire.MaxFrame

// refusals counts and logs every refused engine call, including those gRPC itself
// refuses before a handler runs (an oversized message): bad input must be visible to
// operators, not only to the engine that sent it.
type refusals struct{ srv *Server }

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
	r.srv.cfg.Metrics.Refused.WithLabelValues(method, code.String()).Inc()
	r.srv.cfg.Log.Warn("refused an engine call", "method", method, "code", code.String(), "err", status.Convert(end.Error).Message())
}

func (refusals) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (refusals) HandleConn(context.Context, stats.ConnStats)                       {}

// maxTimeoutMillis bounds the timeouts an engine may ask for: a day, as the policy's API does.
const maxTimeoutMillis = 24 * 3600 * 1000

// RegisterEngine opens a session for an engine rank: the request is checked, then the
// caller (it must be the pod its engine_id names), then the agent's readiness, and the
// session table opens the rank's endpoint and admits it.
func (srv *Server) RegisterEngine(ctx context.Context, r *agentv1.RegisterEngineRequest) (*agentv1.RegisterEngineResponse, error) {
	if err := checkRegistration(r, srv.cfg.Timeouts); err != nil {
		return nil, err
	}
	caller, err := callerOf(ctx)
	if err != nil {
		return nil, err
	}
	pod, err := srv.checkEngineID(ctx, caller, r.EngineId)
	if err != nil {
		return nil, err
	}
	if r.FabricDomains, err = allocatedDomains(pod, srv.cfg.Provider, r); err != nil {
		return nil, err
	}
	if err := srv.cfg.Ready(); err != nil {
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	s, err := srv.cfg.Sessions.Register(r, caller.Owner())
	if err != nil {
		return nil, err
	}
	return &agentv1.RegisterEngineResponse{
		Session: s.ID(), Epoch: s.Epoch(), Provider: srv.cfg.Provider,
		Self: &agentv1.EngineRef{Agent: srv.cfg.Self, EngineId: r.EngineId, TpRank: r.TpRank, TpSize: r.TpSize},
	}, nil
}

// checkRegistration checks a RegisterEngine request's fields against each other.
func checkRegistration(r *agentv1.RegisterEngineRequest, fallback session.Timeouts) error {
	l := r.GetLayout()
	switch {
	case r.EngineId == "" || len(r.EngineId) > 253 || strings.Contains(r.EngineId, "/"):
		return session.Invalid("engine_id", "must be 1 to 253 bytes without '/'")
	case r.Role != agentv1.Role_ROLE_PREFILL && r.Role != agentv1.Role_ROLE_DECODE:
		return session.Invalid("role", "must be ROLE_PREFILL or ROLE_DECODE")
	case r.Mode != agentv1.Mode_MODE_PUSH && r.Mode != agentv1.Mode_MODE_PULL:
		return session.Invalid("mode", "must be MODE_PUSH or MODE_PULL")
	case r.TpSize == 0 || r.TpRank >= r.TpSize:
		return session.Invalid("tp_rank", "%d must be below tp_size %d", r.TpRank, r.TpSize)
	case l == nil || l.Layers == 0 || l.BlockSize == 0 || l.KvHeads == 0 || l.HeadDim == 0 || l.DtypeBytes == 0:
		return session.Invalid("layout", "every field must be positive")
	case agentv1.CheckShards(l.KvHeads, r.TpSize) != nil:
		return session.Invalid("layout.kv_heads", "%v", agentv1.CheckShards(l.KvHeads, r.TpSize))
	case r.LeaseMillis > maxTimeoutMillis || r.RegistrationTimeoutMillis > maxTimeoutMillis || r.BlocksTtlMillis > maxTimeoutMillis:
		return session.Invalid("lease_millis", "and registration_timeout_millis and blocks_ttl_millis must be at most a day")
	}
	if t := session.RequestTimeouts(r).Complete(fallback); t.RegistrationTimeout < t.Lease {
		return session.Invalid("registration_timeout_millis",
			"%s is shorter than the lease %s (the policy's rule: registrationTimeout ≥ lease)", t.RegistrationTimeout, t.Lease)
	}
	return nil
}

func (srv *Server) RegisterRegion(ctx context.Context, r *agentv1.RegisterRegionRequest) (*agentv1.RegisterRegionResponse, error) {
	s, err := srv.session(ctx, r.Session)
	if err != nil {
		return nil, err
	}
	if err := s.RegisterRegion(r); err != nil {
		return nil, err
	}
	return &agentv1.RegisterRegionResponse{}, nil
}

func (srv *Server) RegisterDestination(ctx context.Context, r *agentv1.RegisterDestinationRequest) (*agentv1.Ack, error) {
	s, err := srv.session(ctx, r.Session)
	if err != nil {
		return nil, err
	}
	return ack(s.RegisterDestination(r))
}

func (srv *Server) SourceReady(ctx context.Context, r *agentv1.SourceReadyRequest) (*agentv1.Ack, error) {
	s, err := srv.session(ctx, r.Session)
	if err != nil {
		return nil, err
	}
	return ack(s.SourceReady(r))
}

func (srv *Server) Pull(ctx context.Context, r *agentv1.PullRequest) (*agentv1.Ack, error) {
	s, err := srv.session(ctx, r.Session)
	if err != nil {
		return nil, err
	}
	return ack(s.Pull(r))
}

func (srv *Server) Cancel(ctx context.Context, r *agentv1.CancelRequest) (*agentv1.Ack, error) {
	s, err := srv.session(ctx, r.Session)
	if err != nil {
		return nil, err
	}
	return ack(s.Cancel(r))
}

func (srv *Server) Decline(ctx context.Context, r *agentv1.DeclineRequest) (*agentv1.Ack, error) {
	s, err := srv.session(ctx, r.Session)
	if err != nil {
		return nil, err
	}
	return ack(s.Decline(r))
}

func (srv *Server) Heartbeat(ctx context.Context, r *agentv1.HeartbeatRequest) (*agentv1.Ack, error) {
	s, err := srv.session(ctx, r.Session)
	if err != nil {
		return nil, err
	}
	return ack(s.Heartbeat())
}

// Events streams a session's events to its engine. The stream is the engine's liveness:
// when it ends, the session ends, and everything the engine had outstanding is fenced
// and failed. With a doorbell the events go into its ring, which the engine reads at
// each step; the stream stays open as its liveness.
func (srv *Server) Events(r *agentv1.EventsRequest, stream grpc.ServerStreamingServer[agentv1.Event]) error {
	s, err := srv.session(stream.Context(), r.Session)
	if err != nil {
		return err
	}
	if !s.Attach() {
		return status.Error(codes.AlreadyExists, "session: already has an event stream")
	}
	defer s.Close("the engine's event stream closed")
	for {
		select {
		case ev := <-s.Events():
			if err := srv.send(s, stream, ev); err != nil {
				return err
			}
		case <-stream.Context().Done():
			return nil
		case <-s.Stopped():
			return status.Error(codes.Aborted, s.CloseReason())
		}
	}
}

// send delivers one event: into the session's doorbell when it has one, else on the stream.
func (srv *Server) send(s *session.Session, stream grpc.ServerStreamingServer[agentv1.Event], ev *agentv1.Event) error {
	b, ok := srv.bells.Load(s)
	if !ok || !b.(*bell).live.Load() {
		return stream.Send(ev)
	}
	if err := b.(*bell).putEvent(ev, s.Stopped(), stream.Context().Done()); err != nil {
		s.Close(err.Error())
		return status.Error(codes.Aborted, err.Error())
	}
	srv.cfg.Metrics.BellRecords.WithLabelValues("event").Inc()
	return nil
}

// session returns the session a call names, if the caller owns it.
func (srv *Server) session(ctx context.Context, id string) (*session.Session, error) {
	c, err := callerOf(ctx)
	if err != nil {
		return nil, err
	}
	return srv.cfg.Sessions.Lookup(id, c.Owner())
}

func ack(err error) (*agentv1.Ack, error) {
	if err != nil {
		return nil, err
	}
	return &agentv1.Ack{}, nil
}
