package agent

import (
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/transferagent/rendezvous"
	"github.com/kvhandoff/kvhandoff/transferagent/wire"
	"github.com/kvhandoff/kvhandoff/transferagent/writer"
)

// destination is the decode agent's record of one push registration. Its outcome is
// reported to the engine only when it is final for the engine's memory: a delivery
// signal, or a fence signal plus the prefill agent's message (either order), or, when
// the prefill agent is lost, the end of a lease-long quarantine.
type destination struct {
	key        attemptKey
	token      uint32
	peer       *peer
	source     string
	blocks     int
	writing    bool      // the prefill agent started writing: poll without pause
	fenced     bool      // the fence signal arrived
	outcome    *outcome  // the prefill agent's message, waiting for the fence signal
	quarantine time.Time // peer lost: fail at this time
	// deadline is when the decode agent gives up waiting for any outcome: the prefill
	// agent fails a registration by its registration timeout, so one that has heard
	// nothing a quarantine after that lost a message, and no write can still land.
	deadline time.Time
}

type outcomeKind int

const (
	outcomeCancelAcked outcomeKind = iota
	outcomeFailed
)

type outcome struct {
	kind   outcomeKind
	reason string
}

// pull is one pull attempt on the decode side.
type pull struct {
	key       attemptKey
	peer      *peer
	source    string
	src, dst  []uint32
	sentAt    time.Time
	granted   time.Time
	deadline  time.Time // sentAt + the hold's lease; reads finishing later are not trusted
	acquired  bool
	cancelled bool
	failed    string
	inFlight  int
	queued    int
	writes    int
	bytes     uint64
}

type readOp struct {
	key    attemptKey
	peer   fabric.Peer
	remote wire.RegionInfo
	w      writer.Write
}

func (s *session) registerDestination(r *agentv1.RegisterDestinationRequest) error {
	if err := s.freeze(); err != nil {
		return err
	}
	if err := s.checkBlocks("block_ids", r.BlockIds); err != nil {
		return err
	}
	k := attemptKey{r.RequestId, r.Attempt}
	if _, dup := s.regs[k]; dup {
		return status.Errorf(codes.AlreadyExists, "attempt: %s attempt %d is already registered", r.RequestId, r.Attempt)
	}
	for o := range s.regs {
		if o.req == r.RequestId && o.attempt > r.Attempt {
			return status.Errorf(codes.FailedPrecondition, "attempt: %d is older than the registered attempt %d of %s", r.Attempt, o.attempt, r.RequestId)
		}
	}
	s.nextToken = s.nextToken%tokenMask + 1
	for s.byToken[s.nextToken] != nil {
		s.nextToken = s.nextToken%tokenMask + 1
	}
	d := &destination{
		key: k, token: s.nextToken, source: engineKey(r.Source.EngineId, r.Source.TpRank),
		blocks:   len(r.BlockIds),
		deadline: time.Now().Add(s.pol.RegistrationTimeout + QuarantineFor(s.pol.Lease, s.pol.Tick)),
	}
	d.peer = s.a.dial(r.Source.Agent)
	d.peer.describe(s)
	d.peer.send(&wire.Register{
		Request: r.RequestId, Attempt: r.Attempt, Engine: s.key, EngineEpoch: s.epoch,
		Source: d.source, Token: uint64(d.token), Blocks: r.BlockIds,
	})
	s.regs[k], s.byToken[d.token] = d, d
	return nil
}

func (s *session) cancel(req string, attempt uint64) error {
	k := attemptKey{req, attempt}
	switch s.role {
	case roleD:
		if d := s.regs[k]; d != nil {
			s.a.metrics.cancels.Inc()
			d.peer.send(&wire.Cancel{Request: req, Attempt: attempt, Source: d.source})
			return nil
		}
		if p := s.pulls[k]; p != nil {
			s.a.metrics.cancels.Inc()
			p.cancelled = true
			s.dropReads(k)
			s.maybeFinishPull(p)
			return nil
		}
	case roleP:
		if s.cancelSource(req) {
			return nil
		}
	}
	return status.Errorf(codes.NotFound, "request_id: %s attempt %d is not outstanding on this engine", req, attempt)
}

func (s *session) heartbeat() {
	for k, d := range s.regs {
		d.peer.send(&wire.Heartbeat{Request: k.req, Attempt: k.attempt, Source: d.source})
	}
}

// stepDecode posts queued reads and reaps the endpoint: read completions, and remote CQ
// data — the prefill agents' delivery and fence signals.
func (s *session) stepDecode() bool {
	worked := false
	for len(s.reads) > 0 && len(s.pending) < 64 {
		op := s.reads[0]
		s.nextID++
		local := s.regions[uint32(op.w.Region)]
		err := s.ep.Read(op.peer, local.reg, op.w.DstOff, op.w.Len, op.remote.Addr+op.w.SrcOff, op.remote.Key, s.nextID)
		if errors.Is(err, fabric.ErrAgain) {
			break
		}
		s.reads = s.reads[1:]
		p := s.pulls[op.key]
		p.queued--
		if err != nil {
			p.failed = fmt.Sprintf("posting a read: %v", err)
			s.dropReads(op.key)
			s.maybeFinishPull(p)
			continue
		}
		p.inFlight++
		s.pending[s.nextID] = op
		worked = true
	}
	n := s.ep.Poll(s.buf)
	done := append(s.waited, s.buf[:n]...)
	s.waited = nil
	for _, c := range done {
		worked = true
		if c.Remote {
			s.onSignal(c.Data)
			continue
		}
		op, ok := s.pending[c.ID]
		if !ok {
			continue
		}
		delete(s.pending, c.ID)
		p := s.pulls[op.key]
		p.inFlight--
		if c.Err != nil && p.failed == "" {
			p.failed = fmt.Sprintf("RMA read failed: %v", c.Err)
			s.dropReads(op.key)
		}
		s.maybeFinishPull(p)
	}
	return worked
}

func (s *session) onWriting(p *peer, m *wire.Writing) {
	if d := s.regs[attemptKey{m.Request, m.Attempt}]; d != nil && d.peer == p {
		d.writing = true
	}
}

func (s *session) onSignal(data uint64) {
	d := s.byToken[uint32(data>>1)&tokenMask]
	if d == nil {
		return // an attempt already reported (e.g. cancelled, then delivered): nothing to do
	}
	if data&1 == 0 {
		s.report(d, agentv1.Event_DELIVERED, "")
		return
	}
	d.fenced = true
	if d.outcome != nil {
		s.reportOutcome(d)
	}
}

// onOutcome takes a prefill agent's CancelAcked or Failed. When the prefill agent posted
// a fence signal, the report waits for it: only then is no write of the attempt left on
// its way into the engine's memory.
func (s *session) onOutcome(p *peer, req string, attempt uint64, kind outcomeKind, reason string, signalled bool) {
	k := attemptKey{req, attempt}
	if d := s.regs[k]; d != nil && d.peer == p {
		d.outcome = &outcome{kind: kind, reason: reason}
		if !signalled || d.fenced {
			s.reportOutcome(d)
		}
		return
	}
	if pl := s.pulls[k]; pl != nil && pl.peer == p && kind == outcomeFailed && !pl.acquired {
		// The prefill agent refused the pull: nothing was read.
		pl.failed = reason
		s.maybeFinishPull(pl)
	}
}

func (s *session) reportOutcome(d *destination) {
	if d.outcome.kind == outcomeCancelAcked {
		s.report(d, agentv1.Event_CANCEL_ACKED, "")
		return
	}
	s.report(d, agentv1.Event_FAILED, d.outcome.reason)
}

func (s *session) report(d *destination, t agentv1.Event_Type, reason string) {
	delete(s.regs, d.key)
	delete(s.byToken, d.token)
	ev := &agentv1.Event{Type: t, RequestId: d.key.req, Attempt: d.key.attempt, Reason: reason}
	if t == agentv1.Event_DELIVERED {
		ev.Bytes = s.bytesFor(d.blocks)
	}
	start := time.Now()
	s.emit(ev)
	if t == agentv1.Event_DELIVERED {
		s.a.metrics.stage.WithLabelValues("push", "notify").Observe(time.Since(start).Seconds())
	}
}

// QuarantineFor is how long decode blocks stay untouched after their prefill agent was
// lost. The prefill agent may notice the loss up to a lease later (its registrations
// expire then), its watchdog runs once a tick, and writes it posted before fencing still
// drain after that: a lease alone would end exactly when the last write may still be
// landing. The margin covers two ticks (one on each side) and a second of drain.
func QuarantineFor(lease, tick time.Duration) time.Duration {
	return lease + 2*tick + time.Second
}

// decodePeerLost: the prefill agent is gone, but what it already sent may still be on
// its way into this engine's memory (the fabric has its own connections). The attempts
// are failed after a lease-long quarantine, never at once; pulls fail once their reads
// have drained.
func (s *session) decodePeerLost(p *peer) {
	now := time.Now()
	for _, d := range s.regs {
		if d.peer == p && d.quarantine.IsZero() {
			d.quarantine = now.Add(QuarantineFor(s.pol.Lease, s.pol.Tick))
		}
	}
	for _, pl := range s.pulls {
		if pl.peer == p && pl.failed == "" {
			pl.failed = fmt.Sprintf("prefill agent %s connection lost: %v", p.addr, p.err)
			s.dropReads(pl.key)
			s.maybeFinishPull(pl)
		}
	}
}

func (s *session) expireDecode(now time.Time) {
	for _, d := range s.regs {
		switch {
		case !d.quarantine.IsZero() && !now.Before(d.quarantine):
			s.a.metrics.failures.WithLabelValues("peer_lost").Inc()
			s.report(d, agentv1.Event_FAILED, fmt.Sprintf("prefill agent %s connection lost; blocks were quarantined for the lease (%s) and a margin so no late write can land", d.peer.addr, s.pol.Lease))
		case d.quarantine.IsZero() && !now.Before(d.deadline):
			s.a.metrics.failures.WithLabelValues("no_outcome").Inc()
			s.report(d, agentv1.Event_FAILED, fmt.Sprintf("no outcome from prefill agent %s within the registration timeout (%s) and a quarantine after it; a message was lost, and no write can still land", d.peer.addr, s.pol.RegistrationTimeout))
		}
	}
	for _, pl := range s.pulls {
		if pl.acquired && pl.failed == "" && now.After(pl.deadline) {
			pl.failed = "reads did not finish within the hold's lease"
			s.a.metrics.expiries.WithLabelValues("pull").Inc()
			s.dropReads(pl.key)
			s.maybeFinishPull(pl)
		}
	}
}

func (s *session) pull(r *agentv1.PullRequest) error {
	if err := s.freeze(); err != nil {
		return err
	}
	if err := s.checkBlocks("destination_block_ids", r.DestinationBlockIds); err != nil {
		return err
	}
	k := attemptKey{r.RequestId, r.Attempt}
	if _, dup := s.pulls[k]; dup {
		return status.Errorf(codes.AlreadyExists, "attempt: %s attempt %d is already being pulled", r.RequestId, r.Attempt)
	}
	p := &pull{
		key: k, source: engineKey(r.Source.EngineId, r.Source.TpRank),
		src: r.SourceBlockIds, dst: r.DestinationBlockIds, sentAt: time.Now(),
	}
	p.peer = s.a.dial(r.Source.Agent)
	p.peer.send(&wire.Acquire{Request: r.RequestId, Attempt: r.Attempt, Engine: s.key, EngineEpoch: s.epoch, Source: p.source, Blocks: r.SourceBlockIds})
	s.pulls[k] = p
	return nil
}

// onAcquired plans the reads of a granted pull against the source's regions (sent just
// before, as EngineInfo) and queues them.
func (s *session) onAcquired(pr *peer, m *wire.Acquired) {
	p := s.pulls[attemptKey{m.Request, m.Attempt}]
	if p == nil || p.peer != pr || p.acquired {
		return
	}
	p.acquired, p.granted = true, time.Now()
	p.deadline = p.sentAt.Add(time.Duration(m.LeaseMillis) * time.Millisecond)
	s.a.metrics.stage.WithLabelValues("pull", "rendezvous_wait").Observe(time.Since(p.sentAt).Seconds())
	if p.cancelled || p.failed != "" {
		s.maybeFinishPull(p)
		return
	}
	info := pr.info(p.source)
	if info == nil {
		p.failed = fmt.Sprintf("prefill engine %s did not describe its memory", p.source)
		s.maybeFinishPull(p)
		return
	}
	fp, err := s.remote(info)
	if err != nil {
		p.failed = fmt.Sprintf("adding prefill engine %s's fabric address: %v", p.source, err)
		s.maybeFinishPull(p)
		return
	}
	src, byID := remoteLayout(info)
	plan, err := writer.Plan(rendezvous.Transfer{Request: m.Request, Attempt: m.Attempt, Src: p.src, Dst: p.dst}, src, s.layout, s.ep.Limits().MaxMsgSize)
	if err != nil {
		s.a.metrics.refused.WithLabelValues("peer", "Pull").Inc()
		p.failed = err.Error()
		s.maybeFinishPull(p)
		return
	}
	for _, w := range plan {
		s.reads = append(s.reads, readOp{key: p.key, peer: fp, remote: byID[w.Region], w: w})
		p.bytes += w.Len
	}
	p.queued, p.writes = len(plan), len(plan)
}

func (s *session) dropReads(k attemptKey) {
	keep := s.reads[:0]
	for _, op := range s.reads {
		if op.key != k {
			keep = append(keep, op)
			continue
		}
		s.pulls[k].queued--
	}
	s.reads = keep
}

// maybeFinishPull reports a pull once nothing of it is queued or in flight. Its data is
// trusted only if every read completed before the deadline: after it, the prefill agent
// may have released the blocks to be reused.
func (s *session) maybeFinishPull(p *pull) {
	if p.inFlight > 0 || p.queued > 0 || (!p.acquired && !p.cancelled && p.failed == "") {
		return
	}
	delete(s.pulls, p.key)
	ev := &agentv1.Event{RequestId: p.key.req, Attempt: p.key.attempt}
	switch {
	case p.cancelled:
		ev.Type = agentv1.Event_CANCEL_ACKED
	case p.failed != "":
		ev.Type, ev.Reason = agentv1.Event_FAILED, p.failed
		s.a.metrics.failures.WithLabelValues("pull_failed").Inc()
	case time.Now().After(p.deadline):
		ev.Type, ev.Reason = agentv1.Event_FAILED, "reads finished after the hold's lease; the data is not trusted"
		s.a.metrics.failures.WithLabelValues("pull_late").Inc()
	default:
		ev.Type, ev.Bytes, ev.Descriptors = agentv1.Event_DELIVERED, p.bytes, uint64(p.writes)
		s.a.metrics.stage.WithLabelValues("pull", "wire").Observe(time.Since(p.granted).Seconds())
		s.a.metrics.bytes.WithLabelValues("pull").Add(float64(p.bytes))
		s.a.metrics.descriptors.WithLabelValues("pull").Add(float64(p.writes))
	}
	failed := uint64(0)
	if ev.Type != agentv1.Event_DELIVERED {
		failed = 1
	}
	if p.acquired || p.cancelled {
		p.peer.send(&wire.Release{Request: p.key.req, Attempt: p.key.attempt, Source: p.source, Failed: failed})
	}
	s.emit(ev)
}
