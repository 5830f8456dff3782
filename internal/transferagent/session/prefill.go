package session

import (
	"errors"
	"fmt"
	"sort"
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

// prefillSide drives a prefill rank: the rendezvous table decides (push), the writer
// moves the bytes, and the holds keep pull sources; this file only carries out their
// actions and talks to peers.
type prefillSide struct {
	s        *Session
	table    *rendezvous.Table // from the first transfer on, when the regions are fixed
	w        *writer.Writer
	holds    *rendezvous.Holds[*mesh.Peer]
	attempts map[landing.Key]*pushAttempt
	// waiting are pulls that came before their blocks were reported ready, by request:
	// the prefill engine's answer can reach the router, and the decode engine's pull
	// this agent, before the engine's worker reports the blocks. Such a pull waits for
	// them, never fails at once into a recompute.
	waiting map[string]*waitingPull
	// signalled are delivered attempts whose delivery signal a decode agent may ask for
	// again (Resignal), until a lease after delivery.
	signalled map[landing.Key]sentSignal
	// cancelled are requests the engine cancelled before any report of theirs came, until
	// a blocks TTL later: the engine's Cancel (an RPC) can overtake its own report (a
	// doorbell record, or one a GPU event still holds back), and a report arriving after
	// it is refused, not kept for a decode engine that will never register.
	cancelled map[string]time.Time
}

// maxCancelledEarly bounds the cancels remembered before their reports: past it an
// unknown request's cancel is refused (NotFound) as before, so an engine cannot grow the
// map without end.
const maxCancelledEarly = 1 << 14

// sentSignal is what posting a delivery signal again needs.
type sentSignal struct {
	decode rendezvous.Engine
	token  uint32
	peer   *mesh.Peer
	until  time.Time
}

// maxSignalled bounds the delivered attempts kept for a resignal: a lease of deliveries
// at a high rate; past it, an attempt whose signal is lost fails at decode's deadline,
// as it would without resignals.
const maxSignalled = 1 << 14

// waitingPull is a pull waiting for its blocks until a deadline: half the lease from its
// arrival, so the decode side, which counts the lease from before it asked, still has
// the other half to read in.
type waitingPull struct {
	peer  *mesh.Peer
	m     *wire.Acquire
	until time.Time
}

// pushAttempt is what the driver keeps of one decode registration beside the table's
// state: whom to signal and answer, and what it cost.
type pushAttempt struct {
	token    uint32
	decode   rendezvous.Engine // the incarnation the attempt writes into and signals
	peer     *mesh.Peer
	paired   time.Time
	lastPost time.Time
	writes   int
	bytes    uint64
}

// maxPositions bounds the token-order positions a prefill rank's requests hold in the
// agent at once, sources and registrations together: 512k, 64 requests of 128k tokens at
// 16 per block, each held by the agent until decode has it. A part names its positions
// by offset, so without a bound a few bytes could make the agent hold 2^19 positions per
// call (measured: 100 calls of 48 bytes grew the heap by 424 MB). At most about 40 bytes
// each: 20 MB per rank.
const maxPositions = 1 << 19

func newPrefillSide(s *Session) *prefillSide {
	return &prefillSide{s: s, holds: rendezvous.NewHolds[*mesh.Peer](s.pol.BlocksTTL, s.pol.Lease, maxPositions), attempts: map[landing.Key]*pushAttempt{},
		waiting: map[string]*waitingPull{}, signalled: map[landing.Key]sentSignal{}, cancelled: map[string]time.Time{}}
}

// partError is the engine's error for a part the tables refused: over the positions'
// bound, or else invalid.
func partError(err error, invalid string) error {
	if errors.Is(err, rendezvous.ErrOverBudget) {
		return status.Errorf(codes.ResourceExhausted, "offset: %v (the rank's requests hold what it reported until decode takes it or "+
			"the blocks TTL ends)", err)
	}
	return status.Error(codes.InvalidArgument, invalid+err.Error())
}

// Prefill memory is a source for writes and readable by peers (pull).
func (ps *prefillSide) access() fabric.Access { return fabric.Source | fabric.ReadSource }

func (ps *prefillSide) freeze() {
	s := ps.s
	ps.table = rendezvous.New(rendezvous.Config{Lease: s.pol.Lease, RegistrationTimeout: s.pol.RegistrationTimeout,
		BlocksTTL: s.pol.BlocksTTL, Regions: len(s.regions), MaxPositions: maxPositions})
	local := make(map[int]*fabric.Region, len(s.regions))
	for id, r := range s.regions {
		if r.reg != nil {
			local[int(id)] = r.reg
		}
	}
	ps.w = writer.New(s.ep, ps.table, local, s.layout)
	ps.w.OnPost = ps.onPost
	ps.w.OnSignalError = func(err error) {
		s.n.metrics.failures.WithLabelValues("signal_error").Inc()
		s.n.log.Warn("a posted signal failed: its decode agent will report the request after its registration timeout", "engine", s.key, "err", err)
	}
	if s.gpu != nil {
		ps.w.UseCopier(s.gpu.copier, s.devices())
	}
	// A request's merged writes (one per region and run: 128 for a contiguous Qwen3
	// request) go out at once; the window only bounds pathological fragmentation.
	ps.w.MaxInFlight = 512
}

func (ps *prefillSide) sourceReady(r *agentv1.SourceReadyRequest) error {
	s := ps.s
	if err := s.freeze(); err != nil {
		return err
	}
	if err := s.checkBlocks("block_ids", r.BlockIds); err != nil {
		return err
	}
	// A request holds each block once, so it has no more positions than the rank has
	// blocks; the tables keep positions in slices of that length.
	if end := uint64(r.Offset) + uint64(len(r.BlockIds)); end > uint64(s.minBlocks) {
		return Invalid("offset", "positions %d..%d exceed the %d blocks of the engine's regions", r.Offset, end, s.minBlocks)
	}
	now := time.Now()
	if _, ok := ps.cancelled[r.RequestId]; ok {
		return status.Errorf(codes.FailedPrecondition, "request_id: %s was cancelled by this engine before it was reported", r.RequestId)
	}
	part := rendezvous.Part{Request: r.RequestId, Offset: int(r.Offset), Blocks: r.BlockIds, Final: r.Final}
	kind := "blocks"
	if r.RegionCount != 0 {
		kind = "layer_group"
		if s.mode == agentv1.Mode_MODE_PULL {
			return status.Error(codes.InvalidArgument, "region_count: layer groups are for push; a pull reads whole blocks once prefill is over")
		}
		span, err := ps.span(r.FirstRegion, r.RegionCount)
		if err != nil {
			return err
		}
		part.Regions = span
	}
	if s.mode == agentv1.Mode_MODE_PULL {
		if err := ps.holds.Ready(now, part); err != nil {
			return partError(err, "")
		}
		if w := ps.waiting[r.RequestId]; w != nil {
			delete(ps.waiting, r.RequestId)
			ps.acquire(now, w)
		}
	} else {
		acts, err := ps.table.SourceReady(now, part)
		if errors.Is(err, rendezvous.ErrSourceGone) {
			return status.Errorf(codes.FailedPrecondition, "request_id: %s: %v", r.RequestId, err)
		}
		if err != nil {
			return partError(err, "block_ids: ")
		}
		ps.handle(now, acts)
	}
	s.n.metrics.parts.WithLabelValues(kind).Inc()
	return nil
}

// span turns a layer group's region ids (first .. first+count-1) into the table's span
// of layout indexes: the layout is in ascending region id, so the registered regions in
// that id range are contiguous in it.
func (ps *prefillSide) span(first, count uint32) (rendezvous.Span, error) {
	last := uint64(first) + uint64(count) // exclusive
	lo := sort.Search(len(ps.s.layout), func(i int) bool { return uint64(ps.s.layout[i].ID) >= uint64(first) })
	hi := sort.Search(len(ps.s.layout), func(i int) bool { return uint64(ps.s.layout[i].ID) >= last })
	if lo == hi {
		return rendezvous.Span{}, status.Errorf(codes.InvalidArgument, "first_region, region_count: no registered region has an id in %d..%d", first, last-1)
	}
	return rendezvous.Span{Lo: lo, Hi: hi}, nil
}

// onRegister takes a decode agent's registration, of positions first… (a tail: decode
// holds the positions before in its prefix cache). The decode engine's memory arrived
// before it (EngineInfo, once per connection and epoch); a newer epoch of the engine
// drops the older one's attempts.
func (ps *prefillSide) onRegister(p *mesh.Peer, m *wire.Register, first uint64) {
	s := ps.s
	refuse := func(format string, args ...any) {
		s.n.metrics.Refused.WithLabelValues("peer", "Register").Inc()
		reason := fmt.Sprintf(format, args...)
		s.n.log.Warn("refused a registration", "engine", s.key, "request", m.Request, "attempt", m.Attempt, "reason", reason)
		p.Send(&wire.Failed{Request: m.Request, Attempt: m.Attempt, Engine: m.Engine, Reason: reason})
	}
	if err := s.freeze(); err != nil {
		refuse("prefill engine %s has not registered its memory", s.key)
		return
	}
	info := p.Info(m.Engine)
	if info == nil || info.Epoch != m.EngineEpoch {
		refuse("decode engine %s (epoch %d) did not describe its memory first", m.Engine, m.EngineEpoch)
		return
	}
	if m.Token == 0 || m.Token > landing.MaxToken {
		refuse("token %d is outside 1..%d", m.Token, landing.MaxToken)
		return
	}
	if first >= wire.MaxBlocks {
		refuse("first position %d is not below %d", first, wire.MaxBlocks)
		return
	}
	if _, ok := ps.cancelled[m.Request]; ok {
		refuse("request %s was cancelled by its prefill engine", m.Request)
		return
	}
	now := time.Now()
	decode := rendezvous.Engine{ID: m.Engine, Epoch: m.EngineEpoch}
	if !ps.w.HasDestination(decode) {
		if err := ps.addDestination(p, info); err != nil {
			refuse("decode engine %s: %v", m.Engine, err)
			return
		}
		ps.handle(now, ps.table.EngineRestarted(now, decode))
	}
	acts, err := ps.table.Register(now, rendezvous.Registration{Request: m.Request, Attempt: m.Attempt, First: int(first), Blocks: m.Blocks, Decode: decode})
	if err != nil {
		refuse("%v", err)
		return
	}
	ps.attempts[landing.Key{Request: m.Request, Attempt: m.Attempt}] = &pushAttempt{token: uint32(m.Token), decode: decode, peer: p}
	ps.handle(now, acts)
}

// addDestination checks a decode engine's regions against this rank's (same ids, and the
// same block lengths unless the ranks hold different KV heads, of which each block moves
// the slice both hold) and makes it a write target.
func (ps *prefillSide) addDestination(p *mesh.Peer, info *wire.EngineInfo) error {
	re, err := ps.s.reach(p, info)
	if err != nil {
		return err
	}
	sl, err := ps.s.slice(re, false)
	if err != nil {
		return err
	}
	for _, l := range ps.s.layout {
		r, ok := re.byID[l.ID]
		if !ok || (sl == writer.Slice{} && r.BlockLen != l.BlockLen) {
			return fmt.Errorf("its region %d does not match this engine's (%d-byte blocks)", l.ID, l.BlockLen)
		}
	}
	d := writer.Destination{Peer: re.peer, Slice: sl}
	if re.onGPU {
		// A pair on this node: copies, and a notice to the decode rank in this agent.
		n := ps.s.n
		d.Notify = func(data uint64) error { return n.notifyDecode(info.Engine, info.Epoch, data) }
	}
	for _, r := range re.regions {
		d.Regions = append(d.Regions, re.byID[r.ID])
	}
	ps.w.AddDestination(rendezvous.Engine{ID: info.Engine, Epoch: info.Epoch}, d)
	return nil
}

func (ps *prefillSide) onPost(req string, attempt uint64) {
	if a := ps.attempts[landing.Key{Request: req, Attempt: attempt}]; a != nil {
		a.lastPost = time.Now()
	}
}

// handle carries out the rendezvous table's actions.
func (ps *prefillSide) handle(now time.Time, acts []rendezvous.Action) {
	s := ps.s
	for len(acts) > 0 {
		act := acts[0]
		acts = acts[1:]
		switch act := act.(type) {
		case rendezvous.Transfer:
			writes, bytes, err := ps.w.Submit(act)
			if err != nil {
				s.n.metrics.Refused.WithLabelValues("peer", "Transfer").Inc()
				acts = append(acts, ps.table.Fail(now, act.Request, act.Attempt, "bad_blocks", err.Error())...)
				continue
			}
			a := ps.attempts[landing.Key{Request: act.Request, Attempt: act.Attempt}]
			if a == nil {
				continue
			}
			if act.Paired {
				a.paired = now
				s.n.metrics.stage.WithLabelValues("push", "rendezvous_wait").Observe(act.SourceWait.Seconds())
				a.peer.Send(&wire.Writing{Request: act.Request, Attempt: act.Attempt, Engine: a.decode.ID})
			}
			a.writes += writes
			a.bytes += bytes
		case rendezvous.Delivered:
			ps.delivered(act)
		case rendezvous.CancelAcked:
			s.n.metrics.cancels.Inc()
			ps.w.Discard(act.Request, act.Attempt)
			ps.finish(act.Request, act.Attempt, act.Decode, "", "")
		case rendezvous.Failed:
			ps.w.Discard(act.Request, act.Attempt)
			ps.finish(act.Request, act.Attempt, act.Decode, act.Code, act.Reason)
		case rendezvous.SourceDeclined:
			s.n.metrics.declines.Inc()
			s.Emit(&agentv1.Event{Type: agentv1.Event_SOURCE_DONE, RequestId: act.Request, Reason: "declined: the decode engine computes the request itself"})
		case rendezvous.SourceExpired:
			s.n.metrics.expiries.WithLabelValues("source").Inc()
			s.n.metrics.failures.WithLabelValues("blocks_ttl").Inc()
			s.Emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: act.Request, Reason: act.Reason})
		}
	}
}

// delivered signals decode — a write of CQ data posted after every write of the attempt
// completed, so it arrives after their data — and frees the prefill blocks.
func (ps *prefillSide) delivered(d rendezvous.Delivered) {
	s := ps.s
	k := landing.Key{Request: d.Request, Attempt: d.Attempt}
	a := ps.attempts[k]
	delete(ps.attempts, k)
	if a == nil {
		return
	}
	// Counted before the signal goes: the bytes are in decode memory already, and once
	// the signal is posted decode may report them before this rank runs again.
	now := time.Now()
	m := s.n.metrics
	if !a.paired.IsZero() && !a.lastPost.IsZero() {
		m.stage.WithLabelValues("push", "post").Observe(a.lastPost.Sub(a.paired).Seconds())
		m.stage.WithLabelValues("push", "wire").Observe(now.Sub(a.lastPost).Seconds())
	}
	m.bytes.WithLabelValues("push").Add(float64(a.bytes))
	m.descriptors.WithLabelValues("push").Add(float64(a.writes))
	// The fault hook (--test-drop-delivery-signals) drops a signal, as a provider might.
	if !s.n.dropSignal() {
		if err := ps.w.Signal(a.decode, landing.SignalData(a.token, false)); err != nil {
			m.failures.WithLabelValues("signal_error").Inc()
			a.peer.Send(&wire.Failed{Request: d.Request, Attempt: d.Attempt, Engine: a.decode.ID, Reason: fmt.Sprintf("signalling delivery failed: %v", err)})
			s.Emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: d.Request, Attempt: d.Attempt, Reason: "signalling delivery failed"})
			return
		}
	}
	if len(ps.signalled) < maxSignalled {
		ps.signalled[k] = sentSignal{decode: a.decode, token: a.token, peer: a.peer, until: now.Add(s.pol.Lease)}
	}
	a.peer.Send(&wire.Signalled{Request: d.Request, Attempt: d.Attempt, Engine: a.decode.ID})
	s.Emit(&agentv1.Event{Type: agentv1.Event_SOURCE_DONE, RequestId: d.Request, Attempt: d.Attempt, Bytes: a.bytes, Descriptors: uint64(a.writes)})
}

// finish reports a fenced attempt that has drained. When any of its writes was posted, a
// fence signal goes first, through the fabric: the decode agent acknowledges only once
// it arrives, which is after the data of every earlier write. code is empty for a
// cancel, which keeps the source for a retry; a failure drops it (the table did), and
// the prefill engine is told so it frees the blocks.
func (ps *prefillSide) finish(req string, attempt uint64, decode rendezvous.Engine, code, reason string) {
	s := ps.s
	k := landing.Key{Request: req, Attempt: attempt}
	a := ps.attempts[k]
	delete(ps.attempts, k)
	if code != "" {
		s.n.metrics.failures.WithLabelValues(code).Inc()
		if code == rendezvous.CodeLeaseExpired || code == rendezvous.CodeRegistrationTimeout {
			s.n.metrics.expiries.WithLabelValues("push").Inc()
		}
		s.Emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: req, Attempt: attempt, Reason: reason})
	}
	if a == nil {
		return
	}
	var signalled uint64
	if a.writes > 0 {
		if err := ps.w.Signal(decode, landing.SignalData(a.token, true)); err != nil {
			s.n.log.Warn("fence signal failed", "engine", s.key, "request", req, "err", err)
		} else {
			signalled = 1
		}
	}
	if code == "" {
		a.peer.Send(&wire.CancelAcked{Request: req, Attempt: attempt, Engine: decode.ID, Signalled: signalled})
	} else {
		a.peer.Send(&wire.Failed{Request: req, Attempt: attempt, Engine: decode.ID, Reason: reason, Signalled: signalled})
	}
}

func (ps *prefillSide) onHeartbeat(m *wire.Heartbeat) {
	if ps.table != nil {
		_ = ps.table.Heartbeat(time.Now(), m.Request, m.Attempt)
	}
}

func (ps *prefillSide) onCancel(p *mesh.Peer, m *wire.Cancel) {
	a := ps.attempts[landing.Key{Request: m.Request, Attempt: m.Attempt}]
	if a == nil || a.peer != p {
		// Already finished (its outcome is on its way) or never registered here.
		return
	}
	now := time.Now()
	acts, err := ps.table.Cancel(now, m.Request, m.Attempt)
	if err != nil && !errors.Is(err, rendezvous.ErrUnknown) {
		ps.s.n.log.Warn("cancel", "engine", ps.s.key, "request", m.Request, "err", err)
	}
	ps.handle(now, acts)
}

// onResignal posts a delivered attempt's signal again, for the decode agent it was for:
// that agent heard it was posted (Signalled) and has not seen it.
func (ps *prefillSide) onResignal(p *mesh.Peer, m *wire.Resignal) {
	sig, ok := ps.signalled[landing.Key{Request: m.Request, Attempt: m.Attempt}]
	if !ok || sig.peer != p {
		return
	}
	ps.s.n.metrics.resignals.WithLabelValues("sent").Inc()
	if err := ps.w.Signal(sig.decode, landing.SignalData(sig.token, false)); err != nil {
		ps.s.n.log.Warn("posting a delivery signal again", "engine", ps.s.key, "request", m.Request, "err", err)
	}
}

// onAbandon takes a decode agent's word that the engine of an attempt it cancelled has
// ended: the request fails now, and the prefill engine frees its blocks, rather than
// holding them for the blocks TTL for a retry that cannot come.
func (ps *prefillSide) onAbandon(m *wire.Abandon) {
	if ps.table == nil {
		return // pull: a hold nobody acquired ends with its TTL
	}
	now := time.Now()
	ps.handle(now, ps.table.Abandon(now, m.Request, m.Attempt, m.Engine))
}

// onDecline takes a decode agent's decline of a push (its engine computes the request
// itself): the source's blocks are freed without waiting out the blocks TTL. Any agent
// of the mesh may decline any request it can name; transfer keys are unguessable, and a
// mesh peer can already fail a request it names by registering for it.
func (ps *prefillSide) onDecline(m *wire.Decline) {
	if ps.table == nil {
		return // pull: a source nobody pulls ends with its hold's TTL
	}
	now := time.Now()
	acts, err := ps.table.Decline(now, m.Request)
	if err != nil {
		ps.s.n.metrics.Refused.WithLabelValues("peer", "Decline").Inc()
		ps.s.n.log.Warn("refused a decline", "engine", ps.s.key, "request", m.Request, "err", err)
		return
	}
	ps.handle(now, acts)
}

// onAcquire grants a pull: the blocks stay held for a lease from now. The decode agent
// counts the same lease from before it sent Acquire, so it stops trusting its reads
// before this side can release the blocks. A pull of blocks not reported ready yet
// waits for them (waitingPull).
func (ps *prefillSide) onAcquire(p *mesh.Peer, m *wire.Acquire) {
	now := time.Now()
	w := &waitingPull{peer: p, m: m, until: now.Add(ps.holds.Lease() / 2)}
	if _, ok := ps.cancelled[m.Request]; ok {
		ps.refuse(w, "acquire_refused", fmt.Sprintf("request %s was cancelled by its prefill engine", m.Request))
		return
	}
	if ps.acquire(now, w); ps.waiting[m.Request] == w {
		ps.s.n.metrics.pullWaits.Inc()
	}
}

// acquire grants w, parks it until its blocks are ready, or refuses it.
func (ps *prefillSide) acquire(now time.Time, w *waitingPull) {
	s, m := ps.s, w.m
	lease, err := ps.holds.Acquire(now, m.Request, m.Attempt, w.peer, m.Engine, m.Blocks)
	if errors.Is(err, rendezvous.ErrNotReady) && now.Before(w.until) {
		other := ps.waiting[m.Request]
		switch {
		case other == nil:
			ps.waiting[m.Request] = w
			return
		case other.peer == w.peer && other.m.Attempt == m.Attempt:
			return // asked again: it keeps waiting until its first deadline
		}
		err = fmt.Errorf("request %s is being pulled by attempt %d, which waits for its blocks", m.Request, other.m.Attempt)
	}
	if err != nil {
		ps.refuse(w, "acquire_refused", err.Error())
		return
	}
	w.peer.Describe(s.key, s.epoch, s.describe)
	w.peer.Send(&wire.Acquired{Request: m.Request, Attempt: m.Attempt, Engine: m.Engine, LeaseMillis: uint64(lease.Milliseconds())})
}

// refuse answers a pull that cannot be granted with a Failed naming why.
func (ps *prefillSide) refuse(w *waitingPull, failure, why string) {
	s := ps.s
	s.n.metrics.Refused.WithLabelValues("peer", "Acquire").Inc()
	s.n.metrics.failures.WithLabelValues(failure).Inc()
	w.peer.Send(&wire.Failed{Request: w.m.Request, Attempt: w.m.Attempt, Engine: w.m.Engine, Reason: fmt.Sprintf("prefill engine %s: %s", s.key, why)})
}

func (ps *prefillSide) onRelease(p *mesh.Peer, m *wire.Release) {
	s := ps.s
	n, reader, ok := ps.holds.Release(m.Request, m.Attempt, p)
	if !ok {
		return
	}
	if m.Failed != 0 {
		s.Emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: m.Request, Attempt: m.Attempt, Reason: "the decode engine's pull did not complete"})
		return
	}
	bytes := s.bytesFor(n)
	if info := p.Info(reader); info != nil && info.Heads != nil && s.heads.Count > 0 {
		// A decode rank of another tensor-parallel size read only the heads both hold.
		theirs := agentv1.Heads{First: uint32(info.Heads.First), Count: uint32(info.Heads.Count)}
		bytes = bytes * uint64(theirs.Shared(s.heads)) / uint64(s.heads.Count)
	}
	s.n.metrics.bytes.WithLabelValues("pull").Add(float64(bytes))
	s.Emit(&agentv1.Event{Type: agentv1.Event_SOURCE_DONE, RequestId: m.Request, Attempt: m.Attempt, Bytes: bytes})
}

// watchdog: registrations past their lease or timeout and push sources nobody registered
// for within the blocks TTL (the table), pull holds nobody acquired within it or whose
// lease ended (the holds).
func (ps *prefillSide) watchdog(now time.Time) {
	if ps.table != nil {
		ps.handle(now, ps.table.Expire(now))
	}
	for _, e := range ps.holds.Expire(now) {
		ps.s.n.metrics.expiries.WithLabelValues("hold").Inc()
		ps.s.n.metrics.failures.WithLabelValues("blocks_ttl").Inc()
		ps.s.Emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: e.Request, Reason: e.Reason})
	}
	for k, sig := range ps.signalled {
		if !now.Before(sig.until) {
			delete(ps.signalled, k)
		}
	}
	for req, until := range ps.cancelled {
		if !now.Before(until) {
			delete(ps.cancelled, req)
		}
	}
	for req, w := range ps.waiting {
		if !now.Before(w.until) {
			delete(ps.waiting, req)
			ps.refuse(w, "acquire_timeout", fmt.Sprintf("request %s's blocks were not reported ready within %s of the pull", req, ps.holds.Lease()/2))
		}
	}
}

// peerLost fails the lost peer's registrations (nobody is left to tell); its pulls keep
// their blocks until their lease ends (the watchdog releases them), since its reads may
// still be in flight.
func (ps *prefillSide) peerLost(now time.Time, p *mesh.Peer) {
	ps.holds.PeerLost(p)
	for req, w := range ps.waiting {
		if w.peer == p {
			delete(ps.waiting, req)
		}
	}
	for k, a := range ps.attempts {
		if a.peer == p {
			ps.handle(now, ps.table.Fail(now, k.Request, k.Attempt, "peer_lost", "decode agent connection lost"))
		}
	}
}

// cancel is the prefill engine giving up a request: its attempts are failed (after
// draining), its source and any unacquired hold dropped. A request nothing of which has
// come yet is remembered a blocks TTL: its report and its registrations, when they come,
// are refused.
func (ps *prefillSide) cancel(now time.Time, req string, attempt uint64) error {
	found := ps.holds.Cancel(req)
	if w := ps.waiting[req]; w != nil {
		delete(ps.waiting, req)
		ps.refuse(w, "acquire_refused", fmt.Sprintf("request %s was cancelled by its prefill engine", req))
		found = true
	}
	if ps.table != nil {
		acts, known := ps.table.CancelSource(now, req)
		found = found || known
		ps.handle(now, acts)
	}
	if !found {
		if len(ps.cancelled) >= maxCancelledEarly {
			return status.Errorf(codes.NotFound, "request_id: %s attempt %d is not outstanding on this engine", req, attempt)
		}
		ps.cancelled[req] = now.Add(ps.s.pol.BlocksTTL)
	}
	ps.s.n.metrics.cancels.Inc()
	return nil
}

// step posts queued writes and reaps their completions; in pull, peers read from this
// rank and the provider needs this side to poll.
func (ps *prefillSide) step(now time.Time) bool {
	s := ps.s
	if ps.w != nil && !ps.w.Idle() {
		acts, failed, err := ps.w.Poll(now)
		if err != nil {
			s.n.log.Error("writer state disagrees with the rendezvous table", "engine", s.key, "err", err)
		}
		for _, f := range failed {
			s.n.metrics.failures.WithLabelValues("write_error").Inc()
			acts = append(acts, ps.table.Fail(now, f.Request, f.Attempt, "write_error", fmt.Sprintf("RMA write failed: %v", f.Err))...)
		}
		ps.handle(now, acts)
		return len(acts) > 0 || len(failed) > 0
	}
	if ps.holds.Acquired() {
		return s.ep.Poll(s.buf) > 0
	}
	return false
}

func (ps *prefillSide) absorb(cs []fabric.Completion) {
	if ps.w != nil {
		ps.w.Absorb(cs)
	}
}

func (ps *prefillSide) hot() bool  { return (ps.w != nil && !ps.w.Idle()) || ps.holds.Acquired() }
func (ps *prefillSide) warm() bool { return false }

// fenceAll fails everything outstanding when the session ends.
func (ps *prefillSide) fenceAll(now time.Time, reason string) {
	for req, w := range ps.waiting {
		delete(ps.waiting, req)
		ps.refuse(w, "acquire_refused", "prefill engine's session ended: "+reason)
	}
	if ps.table == nil {
		return
	}
	for _, reg := range ps.table.Current() {
		ps.handle(now, ps.table.Fail(now, reg.Request, reg.Attempt, "session_closed", "prefill engine's session ended: "+reason))
	}
}

func (ps *prefillSide) drained() bool { return ps.w == nil || ps.w.Idle() }

func (ps *prefillSide) held() int {
	n := ps.holds.Len() + len(ps.waiting)
	if ps.table != nil {
		n += ps.table.Len()
	}
	return n
}
