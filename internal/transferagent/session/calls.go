package session

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// The engine's calls on its session, whichever way they arrive (an RPC or a doorbell
// record). Each checks its request against the session's state and returns an error
// naming the field and the rule it broke; nothing is recorded from a refused request.
// The work runs on the session's pump; the fabric work a call starts runs on after it
// returns.

// Invalid is the answer to a request that broke a rule: its field, and the rule.
func Invalid(field, format string, args ...any) error {
	return status.Errorf(codes.InvalidArgument, "%s: "+format, append([]any{field}, args...)...)
}

// RegisterDestination registers decode blocks for a push (decode, push).
func (s *Session) RegisterDestination(r *agentv1.RegisterDestinationRequest) error {
	if err := s.allow("RegisterDestination", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH); err != nil {
		return err
	}
	if err := checkRequest(r.RequestId, "block_ids", r.BlockIds); err != nil {
		return err
	}
	if err := s.checkSource("source", r.Source); err != nil {
		return err
	}
	return s.call(func() error { return s.decode().registerDestination(r) })
}

// SourceReady reports prefill blocks (or a part of them) ready (prefill, either mode).
func (s *Session) SourceReady(r *agentv1.SourceReadyRequest) error {
	if err := s.checkSourceReady(r); err != nil {
		return err
	}
	return s.call(func() error { return s.prefill().sourceReady(r) })
}

func (s *Session) checkSourceReady(r *agentv1.SourceReadyRequest) error {
	if err := s.allow("SourceReady", agentv1.Role_ROLE_PREFILL, agentv1.Mode_MODE_UNSPECIFIED); err != nil {
		return err
	}
	return checkRequest(r.RequestId, "block_ids", r.BlockIds)
}

// Pull reads a prefill engine's blocks into the engine's (decode, pull).
func (s *Session) Pull(r *agentv1.PullRequest) error {
	if err := s.checkPull(r); err != nil {
		return err
	}
	return s.call(func() error { return s.decode().pull(r) })
}

func (s *Session) checkPull(r *agentv1.PullRequest) error {
	if err := s.allow("Pull", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PULL); err != nil {
		return err
	}
	if err := checkRequest(r.RequestId, "source_block_ids", r.SourceBlockIds); err != nil {
		return err
	}
	if len(r.DestinationBlockIds) != len(r.SourceBlockIds) {
		return Invalid("destination_block_ids", "names %d blocks for %d source blocks", len(r.DestinationBlockIds), len(r.SourceBlockIds))
	}
	return s.checkSource("source", r.Source)
}

// Report is one record of an engine's doorbell: a SourceReady or a Pull.
type Report struct {
	Ready *agentv1.SourceReadyRequest
	Pull  *agentv1.PullRequest
}

// Reports runs a batch of doorbell records on the pump, in order, as their RPCs would
// run; a refused one is answered by a FAILED event for its request and attempt.
func (s *Session) Reports(rs []Report) {
	s.post(func() {
		for _, r := range rs {
			if err := s.report(r); err != nil {
				s.n.metrics.Refused.WithLabelValues("doorbell", status.Code(err).String()).Inc()
				s.Emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: r.request(), Attempt: r.attempt(), Reason: status.Convert(err).Message()})
			}
		}
	})
}

func (s *Session) report(r Report) error {
	if r.Pull != nil {
		if err := s.checkPull(r.Pull); err != nil {
			return err
		}
		return s.decode().pull(r.Pull)
	}
	if err := s.checkSourceReady(r.Ready); err != nil {
		return err
	}
	return s.prefill().sourceReady(r.Ready)
}

func (r Report) request() string {
	if r.Pull != nil {
		return r.Pull.RequestId
	}
	return r.Ready.RequestId
}

func (r Report) attempt() uint64 {
	if r.Pull != nil {
		return r.Pull.Attempt
	}
	return 0
}

// Cancel fences an attempt of a request (either role).
func (s *Session) Cancel(r *agentv1.CancelRequest) error {
	if err := checkRequestID(r.RequestId); err != nil {
		return err
	}
	return s.call(func() error { return s.side.cancel(time.Now(), r.RequestId, r.Attempt) })
}

// Decline frees a push source the decode engine will not take (decode, push).
func (s *Session) Decline(r *agentv1.DeclineRequest) error {
	if err := s.allow("Decline", agentv1.Role_ROLE_DECODE, agentv1.Mode_MODE_PUSH); err != nil {
		return err
	}
	if err := checkRequestID(r.RequestId); err != nil {
		return err
	}
	if err := s.checkSource("source", r.Source); err != nil {
		return err
	}
	return s.call(func() error { return s.decode().decline(r) })
}

// Heartbeat renews the leases of everything the engine has outstanding.
func (s *Session) Heartbeat() error {
	return s.call(func() error {
		if ds := s.decode(); ds != nil {
			ds.heartbeat()
		}
		return nil
	})
}

// allow refuses a call the session's role or mode does not allow (MODE_UNSPECIFIED:
// either mode).
func (s *Session) allow(call string, role agentv1.Role, mode agentv1.Mode) error {
	if s.role != role || (mode != agentv1.Mode_MODE_UNSPECIFIED && s.mode != mode) {
		return status.Errorf(codes.FailedPrecondition, "%s: not allowed for a %s engine in %s", call, s.role, s.mode)
	}
	return nil
}

func checkRequestID(id string) error {
	if id == "" {
		return Invalid("request_id", "must not be empty")
	}
	if len(id) > wire.MaxString {
		return Invalid("request_id", "is %d bytes, longer than %d", len(id), wire.MaxString)
	}
	return nil
}

// checkRequest checks a request id and the blocks a call names.
func checkRequest(id, field string, ids []uint32) error {
	if err := checkRequestID(id); err != nil {
		return err
	}
	if len(ids) == 0 {
		return Invalid(field, "must name at least one block")
	}
	if len(ids) > wire.MaxBlocks {
		return Invalid(field, "names %d blocks, more than %d", len(ids), wire.MaxBlocks)
	}
	return nil
}

// checkSource checks the prefill engine rank a call names: its size's heads must map
// onto the model's, and it must hold some of this rank's heads.
func (s *Session) checkSource(field string, ref *agentv1.EngineRef) error {
	if ref == nil || ref.Agent == "" || ref.EngineId == "" {
		return Invalid(field, "must name the agent (host:port) and engine_id")
	}
	size := cmp.Or(ref.TpSize, s.tpSize)
	if err := agentv1.CheckShards(s.kvHeads, size); err != nil {
		return Invalid(field+".tp_size", "%v", err)
	}
	if ref.TpRank >= size {
		return Invalid(field+".tp_rank", "%d must be below tp_size %d", ref.TpRank, size)
	}
	if size != s.tpSize && !s.headMajor {
		return Invalid(field+".tp_size", "is %d and this engine's %d: engines of different tensor-parallel sizes move a slice of each block, "+
			"which needs head-major KV (RegisterEngine's layout.head_major)", size, s.tpSize)
	}
	if s.sharedHeads(ref) == 0 {
		return Invalid(field+".tp_rank", "rank %d of %d holds KV heads %s and this rank %d of %d holds %s: they share none (pair ranks by "+
			"agentv1.Sources)", ref.TpRank, size, agentv1.RankHeads(s.kvHeads, size, ref.TpRank), s.rank, s.tpSize, s.heads)
	}
	return nil
}

// sharedHeads is how many of this rank's KV heads the engine rank ref holds.
func (s *Session) sharedHeads(ref *agentv1.EngineRef) uint32 {
	return agentv1.RankHeads(s.kvHeads, cmp.Or(ref.TpSize, s.tpSize), ref.TpRank).Shared(s.heads)
}

// checkDomains checks the NICs an engine rank names for its rails: each once, no more
// than an endpoint's rails. Whether the provider has them is what opening them tells
// (openFailure).
func checkDomains(provider string, names []string) error {
	if len(names) > fabric.MaxRails {
		return Invalid("fabric_domains", "names %d domains; a rank has at most %d rails", len(names), fabric.MaxRails)
	}
	if len(names) > 1 && provider == "shm" {
		return Invalid("fabric_domains", "names %d domains; shm moves memory within a node and has no rails", len(names))
	}
	for i, n := range names {
		if slices.Index(names, n) != i {
			return Invalid(fmt.Sprintf("fabric_domains[%d]", i), "%q is named twice: one rail per NIC", n)
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
				return Invalid(fmt.Sprintf("fabric_domains[%d]", i), "%q is not a domain of provider %s (it has %s)", n, provider, strings.Join(have, ", "))
			}
		}
	}
	return status.Errorf(codes.Unavailable, "opening a fabric endpoint: %v", err)
}
