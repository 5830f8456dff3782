package session

import (
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/landing"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/mesh"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/rendezvous"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/wire"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/writer"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// decodeSide drives a decode rank: the landing table decides when an outcome may reach
// the engine; this file carries out its actions, talks to peers and posts pull reads.
type decodeSide struct {
	s       *Session
	table   *landing.Table[*mesh.Peer]
	reads   []readOp
	pending map[uint64]readOp
	nextID  uint64
	waited  []fabric.Completion // read by a Wait, for the next step
	// shared is, by push registration until its outcome, how many of this rank's KV
	// heads its source rank holds (all of them unless the engines' sizes differ).
	shared map[landing.Key]uint32
}

type readOp struct {
	key    landing.Key
	peer   fabric.Peer
	remote writer.RemoteRegion
	w      writer.Write
	copy   bool // GPU memory on this node: a device copy, not an RMA read
}

func newDecodeSide(s *Session) *decodeSide {
	return &decodeSide{
		s:       s,
		table:   landing.New[*mesh.Peer](landing.Config{Lease: s.pol.Lease, RegistrationTimeout: s.pol.RegistrationTimeout, Tick: s.pol.Tick}),
		pending: map[uint64]readOp{},
		shared:  map[landing.Key]uint32{},
	}
}

// Decode memory is writable by peers (push) and a target for reads (pull).
func (ds *decodeSide) access() fabric.Access { return fabric.Target | fabric.ReadTarget }

func (ds *decodeSide) freeze() {}

func (ds *decodeSide) registerDestination(r *agentv1.RegisterDestinationRequest) error {
	s := ds.s
	if err := s.freeze(); err != nil {
		return err
	}
	if err := s.checkBlocks("block_ids", r.BlockIds); err != nil {
		return err
	}
	if r.FirstPosition >= wire.MaxBlocks {
		return status.Errorf(codes.InvalidArgument, "first_position: %d is not below %d", r.FirstPosition, wire.MaxBlocks)
	}
	k := landing.Key{Request: r.RequestId, Attempt: r.Attempt}
	source := engineKey(r.Source.EngineId, r.Source.TpRank)
	p := s.n.mesh.Dial(r.Source.Agent)
	token, err := ds.table.Register(time.Now(), k, source, p, len(r.BlockIds))
	switch {
	case errors.Is(err, landing.ErrDuplicate):
		return status.Errorf(codes.AlreadyExists, "attempt: %v", err)
	case err != nil:
		return status.Errorf(codes.FailedPrecondition, "attempt: %v", err)
	}
	ds.shared[k] = s.sharedHeads(r.Source)
	p.Describe(s.key, s.epoch, s.describe)
	reg := wire.Register{
		Request: r.RequestId, Attempt: r.Attempt, Engine: s.key, EngineEpoch: s.epoch,
		Source: source, Token: uint64(token), Blocks: r.BlockIds,
	}
	if r.FirstPosition > 0 {
		p.Send(&wire.RegisterTail{Register: reg, First: uint64(r.FirstPosition)})
		return nil
	}
	p.Send(&reg)
	return nil
}

// decline tells the source's agent that this engine takes none of a request's KV. A
// request this engine registered is cancelled, not declined.
func (ds *decodeSide) decline(r *agentv1.DeclineRequest) error {
	if ds.table.Registered(r.RequestId) {
		return status.Errorf(codes.FailedPrecondition, "request_id: %s is registered on this engine; cancel it instead", r.RequestId)
	}
	ds.s.n.mesh.Dial(r.Source.Agent).Send(&wire.Decline{Request: r.RequestId, Source: engineKey(r.Source.EngineId, r.Source.TpRank)})
	return nil
}

func (ds *decodeSide) pull(r *agentv1.PullRequest) error {
	s := ds.s
	if err := s.freeze(); err != nil {
		return err
	}
	if err := s.checkBlocks("destination_block_ids", r.DestinationBlockIds); err != nil {
		return err
	}
	k := landing.Key{Request: r.RequestId, Attempt: r.Attempt}
	source := engineKey(r.Source.EngineId, r.Source.TpRank)
	p := s.n.mesh.Dial(r.Source.Agent)
	if err := ds.table.Pull(time.Now(), k, source, p, r.SourceBlockIds, r.DestinationBlockIds); err != nil {
		return status.Errorf(codes.AlreadyExists, "attempt: %v", err)
	}
	// The prefill agent reads from this rank's description which KV heads it read (what
	// its SOURCE_DONE counts); nothing is written to this rank's memory in a pull.
	p.Describe(s.key, s.epoch, s.describe)
	p.Send(&wire.Acquire{Request: r.RequestId, Attempt: r.Attempt, Engine: s.key, EngineEpoch: s.epoch, Source: source, Blocks: r.SourceBlockIds})
	return nil
}

func (ds *decodeSide) cancel(now time.Time, req string, attempt uint64) error {
	acts, ok := ds.table.Cancel(now, landing.Key{Request: req, Attempt: attempt})
	if !ok {
		return status.Errorf(codes.NotFound, "request_id: %s attempt %d is not outstanding on this engine", req, attempt)
	}
	ds.s.n.metrics.cancels.Inc()
	ds.handle(now, acts)
	return nil
}

func (ds *decodeSide) heartbeat() { ds.handle(time.Now(), ds.table.Heartbeats()) }

// handle carries out the landing table's actions.
func (ds *decodeSide) handle(now time.Time, acts []landing.Action) {
	for len(acts) > 0 {
		act := acts[0]
		acts = acts[1:]
		switch act := act.(type) {
		case landing.SendCancel[*mesh.Peer]:
			act.Peer.Send(&wire.Cancel{Request: act.Request, Attempt: act.Attempt, Source: act.Source})
		case landing.SendResignal[*mesh.Peer]:
			ds.s.n.metrics.resignals.WithLabelValues("asked").Inc()
			act.Peer.Send(&wire.Resignal{Request: act.Request, Attempt: act.Attempt, Source: act.Source})
		case landing.SendHeartbeat[*mesh.Peer]:
			act.Peer.Send(&wire.Heartbeat{Request: act.Request, Attempt: act.Attempt, Source: act.Source})
		case landing.SendRelease[*mesh.Peer]:
			failed := uint64(0)
			if act.Failed {
				failed = 1
			}
			act.Peer.Send(&wire.Release{Request: act.Request, Attempt: act.Attempt, Source: act.Source, Failed: failed})
		case landing.DropReads:
			acts = append(acts, ds.table.Dropped(now, act.Key, ds.dropReads(act.Key))...)
		case landing.Report:
			ds.report(act)
		}
	}
}

func (ds *decodeSide) report(r landing.Report) {
	m := ds.s.n.metrics
	ev := &agentv1.Event{RequestId: r.Request, Attempt: r.Attempt, Reason: r.Reason}
	defer delete(ds.shared, landing.Key{Request: r.Request, Attempt: r.Attempt})
	switch r.Kind {
	case landing.Delivered:
		ev.Type = agentv1.Event_DELIVERED
		if r.Pull {
			ev.Bytes, ev.Descriptors = r.Bytes, uint64(r.Reads)
			m.stage.WithLabelValues("pull", "wire").Observe(r.Wire.Seconds())
			m.bytes.WithLabelValues("pull").Add(float64(r.Bytes))
			m.descriptors.WithLabelValues("pull").Add(float64(r.Reads))
		} else {
			// A pair of ranks holding different heads moves their shared ones only.
			ev.Bytes = ds.s.bytesFor(r.Blocks) * uint64(ds.shared[landing.Key{Request: r.Request, Attempt: r.Attempt}]) / uint64(ds.s.heads.Count)
		}
	case landing.CancelAcked:
		ev.Type = agentv1.Event_CANCEL_ACKED
	case landing.Failed:
		ev.Type = agentv1.Event_FAILED
		if r.Code != "prefill_failed" {
			m.failures.WithLabelValues(r.Code).Inc()
		}
	}
	start := time.Now()
	ds.s.Emit(ev)
	if r.Kind == landing.Delivered && !r.Pull {
		m.stage.WithLabelValues("push", "notify").Observe(time.Since(start).Seconds())
	}
}

func (ds *decodeSide) onSignalled(p *mesh.Peer, m *wire.Signalled) {
	ds.table.Signalled(time.Now(), landing.Key{Request: m.Request, Attempt: m.Attempt}, p)
}

func (ds *decodeSide) onWriting(p *mesh.Peer, m *wire.Writing) {
	ds.table.Writing(landing.Key{Request: m.Request, Attempt: m.Attempt}, p)
}

func (ds *decodeSide) onOutcome(p *mesh.Peer, req string, attempt uint64, cancelled bool, reason string, signalled bool) {
	now := time.Now()
	ds.handle(now, ds.table.Outcome(now, landing.Key{Request: req, Attempt: attempt}, p, cancelled, reason, signalled))
}

// onAcquired plans the reads of a granted pull against the source's regions (sent just
// before, as EngineInfo) and queues them.
func (ds *decodeSide) onAcquired(pr *mesh.Peer, m *wire.Acquired) {
	s := ds.s
	now := time.Now()
	k := landing.Key{Request: m.Request, Attempt: m.Attempt}
	g, acts := ds.table.Granted(now, k, pr, time.Duration(m.LeaseMillis)*time.Millisecond)
	ds.handle(now, acts)
	if g == nil {
		return
	}
	s.n.metrics.stage.WithLabelValues("pull", "rendezvous_wait").Observe(g.Wait.Seconds())
	fail := func(reason string) { ds.handle(now, ds.table.Fail(now, k, reason)) }
	info := pr.Info(g.Source)
	if info == nil {
		fail(fmt.Sprintf("prefill engine %s did not describe its memory", g.Source))
		return
	}
	re, err := s.reach(pr, info)
	if err != nil {
		s.n.metrics.Refused.WithLabelValues("peer", "Pull").Inc()
		fail(fmt.Sprintf("prefill engine %s: %v", g.Source, err))
		return
	}
	sl, err := s.slice(re, true)
	if err != nil {
		s.n.metrics.Refused.WithLabelValues("peer", "Pull").Inc()
		fail(fmt.Sprintf("prefill engine %s: %v", g.Source, err))
		return
	}
	plan, err := writer.Plan(rendezvous.Transfer{Request: m.Request, Attempt: m.Attempt, Src: g.Src, Dst: g.Dst}, re.regions, s.layout,
		s.ep.Limits().MaxMsgSize, sl)
	if err != nil {
		s.n.metrics.Refused.WithLabelValues("peer", "Pull").Inc()
		fail(err.Error())
		return
	}
	var bytes uint64
	for _, w := range plan {
		ds.reads = append(ds.reads, readOp{key: k, peer: re.peer, remote: re.byID[w.Region], w: w, copy: re.onGPU})
		bytes += w.Len
	}
	ds.table.Planned(k, len(plan), bytes)
}

// onSignal takes a prefill agent's delivery or fence signal: remote CQ data, or for a
// pair on this node the notice its copies completed.
func (ds *decodeSide) onSignal(now time.Time, data uint64) {
	ds.handle(now, ds.table.Signal(data))
}

func (ds *decodeSide) dropReads(k landing.Key) int {
	n := 0
	keep := ds.reads[:0]
	for _, op := range ds.reads {
		if op.key == k {
			n++
			continue
		}
		keep = append(keep, op)
	}
	ds.reads = keep
	return n
}

// The reads a rank keeps posted. RDMA reads wait in the provider's queues, which a
// window of 64 keeps full. Device copies queue on a stream, gathered into one batch
// behind one event a step (cudaipc.Copier), so a window of 64 would be 64 copies an event
// and a step's round trip for a fragmented request; the larger window bounds only the
// bookkeeping.
const (
	maxReads  = 64
	maxCopies = 4096
)

// step posts queued reads and reaps the endpoint: read completions, and remote CQ data —
// the prefill agents' delivery and fence signals.
func (ds *decodeSide) step(now time.Time) bool {
	s := ds.s
	worked := false
	window := maxReads
	if s.gpu != nil {
		window = maxCopies
	}
	for len(ds.reads) > 0 && len(ds.pending) < window {
		op := ds.reads[0]
		ds.nextID++
		local := s.regions[uint32(op.w.Region)]
		var err error
		if op.copy {
			err = s.gpu.copier.Copy(uint64(local.dev.Ptr)+op.w.DstOff, op.remote.Addr+op.w.SrcOff, op.w.Len, ds.nextID)
		} else {
			err = s.ep.Read(op.peer, local.reg, op.w.DstOff, op.w.Len, op.remote.Addr+op.w.SrcOff, op.remote.Keys, ds.nextID)
		}
		if errors.Is(err, fabric.ErrAgain) {
			break
		}
		ds.reads = ds.reads[1:]
		worked = true
		if err != nil {
			ds.handle(now, ds.table.Unposted(now, op.key, err))
			continue
		}
		ds.table.Posted(op.key)
		ds.pending[ds.nextID] = op
	}
	n := s.ep.Poll(s.buf)
	done := append(ds.waited, s.buf[:n]...)
	if s.gpu != nil {
		done = s.gpu.copier.Reap(done)
	}
	ds.waited = nil
	for _, c := range done {
		worked = true
		if c.Remote {
			ds.onSignal(now, c.Data)
			continue
		}
		op, ok := ds.pending[c.ID]
		if !ok {
			continue
		}
		delete(ds.pending, c.ID)
		ds.handle(now, ds.table.ReadDone(now, op.key, c.Err))
	}
	return worked
}

func (ds *decodeSide) absorb(cs []fabric.Completion) { ds.waited = append(ds.waited, cs...) }

func (ds *decodeSide) hot() bool {
	return len(ds.reads) > 0 || len(ds.pending) > 0 || ds.table.Hot()
}

// warm: registrations wait for their source, so something may arrive.
func (ds *decodeSide) warm() bool { return !ds.table.Idle() }

func (ds *decodeSide) watchdog(now time.Time) { ds.handle(now, ds.table.Expire(now)) }

func (ds *decodeSide) peerLost(now time.Time, p *mesh.Peer) {
	ds.handle(now, ds.table.PeerLost(now, p, p.Reached(), fmt.Sprintf("prefill agent %s connection lost: %v", p.Addr(), p.Err())))
}

func (ds *decodeSide) fenceAll(now time.Time, reason string) {
	acts := ds.table.CancelAll(now)
	ds.handle(now, acts)
	// The engine is gone: no attempt of these requests follows from it, so their prefill
	// agents may fail them and free the sources now (after each Cancel, on the same
	// connection) instead of holding them for the blocks TTL.
	for _, a := range acts {
		if c, ok := a.(landing.SendCancel[*mesh.Peer]); ok {
			c.Peer.Send(&wire.Abandon{Request: c.Request, Attempt: c.Attempt, Engine: ds.s.key, Source: c.Source})
		}
	}
}

func (ds *decodeSide) drained() bool { return len(ds.pending) == 0 }

func (ds *decodeSide) held() int { return ds.table.Len() }
