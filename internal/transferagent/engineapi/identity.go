package engineapi

import (
	"context"
	"maps"
	"slices"
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

// Pods finds engine pods, to check that an engine is the pod its engine_id names and
// that its ranks use the EFAs it was allocated.
type Pods interface {
	// Pod returns pod name of namespace as the agent needs it.
	Pod(ctx context.Context, namespace, name string) (EnginePod, error)
}

// EnginePod is what the agent knows of an engine's pod.
type EnginePod struct {
	UID string
	// EFAs are, where Dynamic Resource Allocation gave the pod its EFAs, each
	// accelerator's (RDMA device names) by accelerator index (package claimrails); nil
	// otherwise.
	EFAs map[int][]string
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
// hold dots, namespaces may not). It returns that pod (zero without Pods).
func (srv *Server) checkEngineID(ctx context.Context, c peercred.Caller, id string) (EnginePod, error) {
	if srv.cfg.Pods == nil {
		return EnginePod{}, nil
	}
	if c.Pod == "" {
		return EnginePod{}, status.Errorf(codes.PermissionDenied, "engine_id %q: the caller (%s) runs in no pod; this agent serves engine pods only", id, c)
	}
	dot := strings.LastIndexByte(id, '.')
	if dot <= 0 || dot == len(id)-1 {
		return EnginePod{}, session.Invalid("engine_id", "%q must be the engine pod's name.namespace", id)
	}
	name, namespace := id[:dot], id[dot+1:]
	pod, err := srv.cfg.Pods.Pod(ctx, namespace, name)
	if err != nil {
		return EnginePod{}, status.Errorf(codes.PermissionDenied, "engine_id %q: looking up pod %s/%s: %v", id, namespace, name, err)
	}
	if pod.UID != c.Pod {
		return EnginePod{}, status.Errorf(codes.PermissionDenied, "engine_id %q names pod %s/%s, and the caller (%s) is not in it", id, namespace, name, c)
	}
	return pod, nil
}

// allocatedDomains holds a rank to the EFAs its pod was allocated, where DRA allocated
// them: the domains it names must be exactly one accelerator's EFAs (the connector names
// its GPU's, from the variable the DRA driver sets), and a rank that names none gets
// accelerator tp_rank's. An engine can otherwise put its rails on any NIC of the node —
// another engine's, or one remote from its GPU. Without DRA the names are the engine's
// to choose (the device plugin's bundles set the same variable, but the agent cannot see
// device-plugin allocations here).
func allocatedDomains(pod EnginePod, provider string, r *agentv1.RegisterEngineRequest) ([]string, error) {
	if len(pod.EFAs) == 0 {
		return r.FabricDomains, nil
	}
	domain := func(rdma string) string {
		if provider == "efa" {
			return rdma + "-rdm" // the RDM domain of an EFA device
		}
		return rdma
	}
	var groups [][]string
	for _, i := range slices.Sorted(maps.Keys(pod.EFAs)) {
		var g []string
		for _, rdma := range pod.EFAs[i] {
			g = append(g, domain(rdma))
		}
		groups = append(groups, g)
	}
	if len(r.FabricDomains) == 0 {
		return groups[int(r.TpRank)%len(groups)], nil
	}
	named := slices.Sorted(slices.Values(r.FabricDomains))
	for _, g := range groups {
		if slices.Equal(named, g) {
			return r.FabricDomains, nil
		}
	}
	return nil, status.Errorf(codes.PermissionDenied, "fabric_domains %v are not the EFAs of one of this pod's accelerators; its claims "+
		"allocated %v", r.FabricDomains, groups)
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
