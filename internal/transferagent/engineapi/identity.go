package engineapi

import (
	"context"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/peercred"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/session"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Who may do what on the engine sockets. The kernel says who connected (SO_PEERCRED);
// from that the agent reads the caller's pod. Invariants, enforced here:
//   - a session belongs to the owner (pod, or user outside pods) that registered it, and
//     every call naming it, on either socket, must come from that owner;
//   - with Pods set (an agent in a cluster), only a process in pod P may register engine
//     ranks of engine_id "P.name.P.namespace", so no engine can take another's id, not
//     even while that engine restarts;
//   - each owner holds at most its share of connections and concurrent calls, so one
//     engine flooding the agent is refused alone.

// Pods finds engine pods, to check that an engine is the pod its engine_id names.
type Pods interface {
	// UID returns the UID of pod name in namespace.
	UID(ctx context.Context, namespace, name string) (string, error)
}

// Per-owner limits on the engine socket: a TP8 engine's pod holds one connection per
// rank, and per rank two calls at most (the connector's worker and sender threads), twice
// over. Event streams are not counted: each needs a session, and its request is a
// session id. The calls bound what one owner can make the agent buffer: 32 requests of at
// most maxRequest (2 MiB), 64 MiB.
const (
	maxConnsPerOwner = 16
	maxCallsPerOwner = 32
)

// callerOf returns the caller of an engine call.
func callerOf(ctx context.Context) (peercred.Caller, error) {
	c, ok := peercred.FromContext(ctx)
	if !ok {
		return peercred.Caller{}, status.Error(codes.Unauthenticated, "the caller's credentials are unknown")
	}
	return c, nil
}

// checkEngineID refuses an engine_id the caller may not register: with Pods, the caller
// must run in the pod the id names (render.EngineID: pod name, ".", namespace; names may
// hold dots, namespaces may not).
func (srv *Server) checkEngineID(ctx context.Context, c peercred.Caller, id string) error {
	if srv.cfg.Pods == nil {
		return nil
	}
	if c.Pod == "" {
		return status.Errorf(codes.PermissionDenied, "engine_id %q: the caller (%s) runs in no pod; this agent serves engine pods only", id, c)
	}
	dot := strings.LastIndexByte(id, '.')
	if dot <= 0 || dot == len(id)-1 {
		return session.Invalid("engine_id", "%q must be the engine pod's name.namespace", id)
	}
	name, namespace := id[:dot], id[dot+1:]
	uid, err := srv.cfg.Pods.UID(ctx, namespace, name)
	if err != nil {
		return status.Errorf(codes.PermissionDenied, "engine_id %q: looking up pod %s/%s: %v", id, namespace, name, err)
	}
	if uid != c.Pod {
		return status.Errorf(codes.PermissionDenied, "engine_id %q names pod %s/%s, and the caller (%s) is not in it", id, namespace, name, c)
	}
	return nil
}

// callLimit is the engine server's tap: it refuses a call beyond its owner's share
// before its request is read, and gives the slot back when the call ends.
func (srv *Server) callLimit(ctx context.Context, info *tap.Info) (context.Context, error) {
	if info.FullMethodName == agentv1.Agent_Events_FullMethodName {
		return ctx, nil
	}
	c, err := callerOf(ctx)
	if err != nil {
		return nil, err
	}
	release, ok := srv.calls.Take(c.Owner())
	if !ok {
		srv.cfg.Metrics.Refused.WithLabelValues(info.FullMethodName[strings.LastIndexByte(info.FullMethodName, '/')+1:], codes.ResourceExhausted.String()).Inc()
		return nil, status.Errorf(codes.ResourceExhausted, "%s has %d calls in flight, its limit", c.Owner(), srv.calls.Limit())
	}
	context.AfterFunc(ctx, release)
	return ctx, nil
}
