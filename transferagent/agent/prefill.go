package agent

import (
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
	"github.com/kvhandoff/kvhandoff/transferagent/rendezvous"
	"github.com/kvhandoff/kvhandoff/transferagent/wire"
	"github.com/kvhandoff/kvhandoff/transferagent/writer"
)

// pushAttempt is the prefill agent's record of one decode registration.
type pushAttempt struct {
	token    uint32
	decode   rendezvous.Engine // the incarnation the attempt writes into and signals
	peer     *peer
	paired   time.Time // when the first writes were planned: both halves were present
	lastPost time.Time
	writes   int
	bytes    uint64
}

// source is a push request's source side, for the blocks TTL and the rendezvous wait.
type source struct {
	first      time.Time // the first part arrived
	final      time.Time // zero until the final part arrived
	registered bool
}

// hold is a pull request's ready blocks, held for a decode agent to read.
type hold struct {
	positions map[uint32]bool // position → present
	blocks    map[uint32]bool // block ids held
	final     bool
	ttlEnd    time.Time
	acquired  *acquisition
}

type acquisition struct {
	attempt uint64
	peer    *peer
	until   time.Time
}

// Signal data is token<<1 | fence: EFA carries 4 bytes of CQ data, so tokens stay below 2^31.
const tokenMask = 1<<30 - 1

func (s *session) sourceReady(r *agentv1.SourceReadyRequest) error {
	if err := s.freeze(); err != nil {
		return err
	}
	if err := s.checkBlocks("block_ids", r.BlockIds); err != nil {
		return err
	}
	now := time.Now()
	if s.mode == agentv1.Mode_MODE_PULL {
		return s.holdBlocks(now, r)
	}
	acts, err := s.table.SourceReady(rendezvous.Part{Request: r.RequestId, Offset: int(r.Offset), Blocks: r.BlockIds, Final: r.Final})
	if errors.Is(err, rendezvous.ErrSourceGone) {
		return status.Errorf(codes.FailedPrecondition, "request_id: %s: %v", r.RequestId, err)
	}
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "block_ids: %v", err)
	}
	src := s.sources[r.RequestId]
	if src == nil {
		src = &source{first: now}
		s.sources[r.RequestId] = src
	}
	if r.Final {
		src.final = now
	}
	s.handle(acts)
	return nil
}

func (s *session) holdBlocks(now time.Time, r *agentv1.SourceReadyRequest) error {
	h := s.holds[r.RequestId]
	if h == nil {
		h = &hold{positions: map[uint32]bool{}, blocks: map[uint32]bool{}, ttlEnd: now.Add(s.pol.BlocksTTL)}
		s.holds[r.RequestId] = h
	}
	if h.final {
		return status.Errorf(codes.FailedPrecondition, "request_id: %s already had its final part", r.RequestId)
	}
	for i := range r.BlockIds {
		if h.positions[r.Offset+uint32(i)] {
			return status.Errorf(codes.InvalidArgument, "offset: position %d of %s was reported twice", r.Offset+uint32(i), r.RequestId)
		}
	}
	for i, b := range r.BlockIds {
		h.positions[r.Offset+uint32(i)] = true
		h.blocks[b] = true
	}
	h.final = r.Final
	return nil
}

// onRegister takes a decode agent's registration. The decode engine's memory arrived
// before it (EngineInfo, once per connection and epoch); a newer epoch of the engine
// drops the older one's attempts.
func (s *session) onRegister(p *peer, m *wire.Register) {
	refuse := func(format string, args ...any) {
		s.a.metrics.refused.WithLabelValues("peer", "Register").Inc()
		reason := fmt.Sprintf(format, args...)
		s.a.log.Warn("refused a registration", "engine", s.key, "request", m.Request, "attempt", m.Attempt, "reason", reason)
		p.send(&wire.Failed{Request: m.Request, Attempt: m.Attempt, Engine: m.Engine, Reason: reason})
	}
	if err := s.freeze(); err != nil {
		refuse("prefill engine %s has not registered its memory", s.key)
		return
	}
	info := p.info(m.Engine)
	if info == nil || info.Epoch != m.EngineEpoch {
		refuse("decode engine %s (epoch %d) did not describe its memory first", m.Engine, m.EngineEpoch)
		return
	}
	if m.Token == 0 || m.Token > tokenMask {
		refuse("token %d is outside 1..%d", m.Token, tokenMask)
		return
	}
	if !s.w.HasDestination(rendezvous.Engine{ID: m.Engine, Epoch: m.EngineEpoch}) {
		if err := s.addDestination(info); err != nil {
			refuse("decode engine %s: %v", m.Engine, err)
			return
		}
		s.handle(s.table.EngineRestarted(rendezvous.Engine{ID: m.Engine, Epoch: m.EngineEpoch}))
	}
	now := time.Now()
	acts, err := s.table.Register(now, rendezvous.Registration{
		Request: m.Request, Attempt: m.Attempt, Blocks: m.Blocks,
		Decode: rendezvous.Engine{ID: m.Engine, Epoch: m.EngineEpoch},
	})
	if err != nil {
		refuse("%v", err)
		return
	}
	s.attempts[attemptKey{m.Request, m.Attempt}] = &pushAttempt{token: uint32(m.Token), decode: rendezvous.Engine{ID: m.Engine, Epoch: m.EngineEpoch}, peer: p}
	if src := s.sources[m.Request]; src != nil {
		src.registered = true
	}
	s.handle(acts)
}

// addDestination checks a decode engine's regions against this rank's (same ids and
// block lengths: the planner maps region to region) and makes it a write target.
func (s *session) addDestination(info *wire.EngineInfo) error {
	regions, byID := remoteLayout(info)
	for _, l := range s.layout {
		r, ok := byID[l.ID]
		if !ok || r.BlockLen != l.BlockLen {
			return fmt.Errorf("its region %d does not match this engine's (%d-byte blocks)", l.ID, l.BlockLen)
		}
	}
	fp, err := s.remote(info)
	if err != nil {
		return err
	}
	d := writer.Destination{Peer: fp}
	for _, r := range regions {
		ri := byID[r.ID]
		d.Regions = append(d.Regions, writer.RemoteRegion{Region: r, Addr: ri.Addr, Key: ri.Key})
	}
	s.w.AddDestination(rendezvous.Engine{ID: info.Engine, Epoch: info.Epoch}, d)
	return nil
}

func (s *session) onPost(req string, attempt uint64) {
	if a := s.attempts[attemptKey{req, attempt}]; a != nil {
		a.lastPost = time.Now()
	}
}

// handle carries out the rendezvous table's actions.
func (s *session) handle(acts []rendezvous.Action) {
	for len(acts) > 0 {
		act := acts[0]
		acts = acts[1:]
		switch act := act.(type) {
		case rendezvous.Transfer:
			a := s.attempts[attemptKey{act.Request, act.Attempt}]
			writes, bytes, err := s.w.Submit(act)
			if err != nil {
				s.a.metrics.refused.WithLabelValues("peer", "Transfer").Inc()
				acts = append(acts, s.table.Fail(act.Request, act.Attempt, "bad_blocks", err.Error())...)
				continue
			}
			if a != nil {
				if a.paired.IsZero() {
					// The table pairs at once: the first transfer is the moment both halves
					// were present, and the source waited for the registration since its
					// first part (zero in push, where decode registers first).
					a.paired = time.Now()
					var wait time.Duration
					if src := s.sources[act.Request]; src != nil {
						wait = a.paired.Sub(src.first)
					}
					s.a.metrics.stage.WithLabelValues("push", "rendezvous_wait").Observe(wait.Seconds())
					a.peer.send(&wire.Writing{Request: act.Request, Attempt: act.Attempt, Engine: a.decode.ID})
				}
				a.writes += writes
				a.bytes += bytes
			}
		case rendezvous.Delivered:
			s.delivered(act)
		case rendezvous.CancelAcked:
			s.a.metrics.cancels.Inc()
			s.w.Discard(act.Request, act.Attempt)
			s.finish(act.Request, act.Attempt, act.Decode, "", "")
		case rendezvous.Failed:
			s.w.Discard(act.Request, act.Attempt)
			s.finish(act.Request, act.Attempt, act.Decode, act.Code, act.Reason)
		}
	}
}

// delivered signals decode — a write of CQ data posted after every write of the attempt
// completed, so it arrives after their data — and frees the prefill blocks.
func (s *session) delivered(d rendezvous.Delivered) {
	k := attemptKey{d.Request, d.Attempt}
	a := s.attempts[k]
	delete(s.attempts, k)
	delete(s.sources, d.Request)
	s.table.Forget(d.Request)
	if a == nil {
		return
	}
	now := time.Now()
	if err := s.w.Signal(a.decode, uint64(a.token)<<1); err != nil {
		s.a.metrics.failures.WithLabelValues("signal_error").Inc()
		a.peer.send(&wire.Failed{Request: d.Request, Attempt: d.Attempt, Engine: a.decode.ID, Reason: fmt.Sprintf("signalling delivery failed: %v", err)})
		s.emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: d.Request, Attempt: d.Attempt, Reason: "signalling delivery failed"})
		return
	}
	m := s.a.metrics
	if !a.paired.IsZero() && !a.lastPost.IsZero() {
		m.stage.WithLabelValues("push", "post").Observe(a.lastPost.Sub(a.paired).Seconds())
		m.stage.WithLabelValues("push", "wire").Observe(now.Sub(a.lastPost).Seconds())
	}
	m.bytes.WithLabelValues("push").Add(float64(a.bytes))
	m.descriptors.WithLabelValues("push").Add(float64(a.writes))
	s.emit(&agentv1.Event{Type: agentv1.Event_SOURCE_DONE, RequestId: d.Request, Attempt: d.Attempt, Bytes: a.bytes, Descriptors: uint64(a.writes)})
}

// finish reports a fenced attempt that has drained. When any of its writes was posted, a
// fence signal goes first, through the fabric: the decode agent acknowledges only once
// it arrives, which is after the data of every earlier write. code is empty for a cancel.
func (s *session) finish(req string, attempt uint64, decode rendezvous.Engine, code, reason string) {
	k := attemptKey{req, attempt}
	a := s.attempts[k]
	delete(s.attempts, k)
	if code == "" {
		// A cancel keeps the source for a retry, but a decode engine that aborted the
		// request for good never retries: the source waits for a new registration for
		// one blocks TTL from now (or from its final part), then expires and the prefill
		// engine is told to free its blocks.
		if src := s.sources[req]; src != nil && s.table.Idle(req) {
			src.registered = false
			if !src.final.IsZero() {
				src.final = time.Now()
			}
		}
	} else {
		// The prefill engine hears of the failure and frees the request's blocks; the table
		// already dropped them (rendezvous: fence), and so does the session.
		delete(s.sources, req)
		s.table.Forget(req)
		s.a.metrics.failures.WithLabelValues(code).Inc()
		if code == rendezvous.CodeLeaseExpired || code == rendezvous.CodeRegistrationTimeout {
			s.a.metrics.expiries.WithLabelValues("push").Inc()
		}
		s.emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: req, Attempt: attempt, Reason: reason})
	}
	if a == nil {
		return
	}
	var signalled uint64
	if a.writes > 0 {
		if err := s.w.Signal(decode, uint64(a.token)<<1|1); err != nil {
			s.a.log.Warn("fence signal failed", "engine", s.key, "request", req, "err", err)
		} else {
			signalled = 1
		}
	}
	if code == "" {
		a.peer.send(&wire.CancelAcked{Request: req, Attempt: attempt, Engine: decode.ID, Signalled: signalled})
	} else {
		a.peer.send(&wire.Failed{Request: req, Attempt: attempt, Engine: decode.ID, Reason: reason, Signalled: signalled})
	}
}

func (s *session) onHeartbeat(m *wire.Heartbeat) {
	if s.table != nil {
		_ = s.table.Heartbeat(time.Now(), m.Request, m.Attempt)
	}
}

func (s *session) onCancel(p *peer, m *wire.Cancel) {
	k := attemptKey{m.Request, m.Attempt}
	a := s.attempts[k]
	if a == nil || a.peer != p {
		// Already finished (its outcome is on its way) or never registered here.
		return
	}
	acts, err := s.table.Cancel(m.Request, m.Attempt)
	if err != nil && !errors.Is(err, rendezvous.ErrUnknown) {
		s.a.log.Warn("cancel", "engine", s.key, "request", m.Request, "err", err)
	}
	s.handle(acts)
}

// onAcquire grants a pull: the blocks stay held for a lease from now. The decode agent
// counts the same lease from before it sent Acquire, so it stops trusting its reads
// before this side can release the blocks.
func (s *session) onAcquire(p *peer, m *wire.Acquire) {
	refuse := func(format string, args ...any) {
		s.a.metrics.refused.WithLabelValues("peer", "Acquire").Inc()
		s.a.metrics.failures.WithLabelValues("acquire_refused").Inc()
		p.send(&wire.Failed{Request: m.Request, Attempt: m.Attempt, Engine: m.Engine, Reason: fmt.Sprintf(format, args...)})
	}
	h := s.holds[m.Request]
	switch {
	case h == nil:
		refuse("request %s holds no blocks at prefill engine %s (not ready, expired or released)", m.Request, s.key)
		return
	case h.acquired != nil && (h.acquired.attempt != m.Attempt || h.acquired.peer != p):
		refuse("request %s is being pulled by attempt %d", m.Request, h.acquired.attempt)
		return
	}
	for _, b := range m.Blocks {
		if !h.blocks[b] {
			refuse("block %d is not among request %s's ready blocks", b, m.Request)
			return
		}
	}
	h.acquired = &acquisition{attempt: m.Attempt, peer: p, until: time.Now().Add(s.pol.Lease)}
	p.describe(s)
	p.send(&wire.Acquired{Request: m.Request, Attempt: m.Attempt, Engine: m.Engine, LeaseMillis: uint64(s.pol.Lease.Milliseconds())})
}

func (s *session) onRelease(p *peer, m *wire.Release) {
	h := s.holds[m.Request]
	if h == nil || h.acquired == nil || h.acquired.attempt != m.Attempt || h.acquired.peer != p {
		return
	}
	delete(s.holds, m.Request)
	if m.Failed != 0 {
		s.emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: m.Request, Attempt: m.Attempt, Reason: "the decode engine's pull did not complete"})
		return
	}
	n := len(h.blocks)
	s.a.metrics.bytes.WithLabelValues("pull").Add(float64(s.bytesFor(n)))
	s.emit(&agentv1.Event{Type: agentv1.Event_SOURCE_DONE, RequestId: m.Request, Attempt: m.Attempt, Bytes: s.bytesFor(n)})
}

// expirePrefill is the prefill side's watchdog: registrations past their lease or
// timeout, push sources nobody registered for within the blocks TTL, and pull holds
// nobody acquired within it or whose lease ended.
func (s *session) expirePrefill(now time.Time) {
	if s.table == nil {
		return // nothing happens before the regions are frozen
	}
	s.handle(s.table.Expire(now))
	for req, src := range s.sources {
		if !src.registered && !src.final.IsZero() && now.Sub(src.final) >= s.pol.BlocksTTL {
			delete(s.sources, req)
			s.table.Forget(req)
			s.a.metrics.expiries.WithLabelValues("source").Inc()
			s.a.metrics.failures.WithLabelValues("blocks_ttl").Inc()
			s.emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: req, Reason: fmt.Sprintf("no decode registration within the blocks TTL of %s", s.pol.BlocksTTL)})
		}
	}
	for req, h := range s.holds {
		var reason string
		switch {
		case h.acquired != nil && !now.Before(h.acquired.until):
			reason = fmt.Sprintf("pull lease of %s ended before the decode agent released the blocks", s.pol.Lease)
		case h.acquired == nil && !now.Before(h.ttlEnd):
			reason = fmt.Sprintf("no pull within the blocks TTL of %s", s.pol.BlocksTTL)
		default:
			continue
		}
		delete(s.holds, req)
		s.a.metrics.expiries.WithLabelValues("hold").Inc()
		s.a.metrics.failures.WithLabelValues("blocks_ttl").Inc()
		s.emit(&agentv1.Event{Type: agentv1.Event_FAILED, RequestId: req, Reason: reason})
	}
}

// peerLost handles a lost agent connection. Prefill: the peer's registrations are failed
// (nobody is left to tell); its pulls keep their blocks until their lease ends (the
// watchdog releases them), since its reads may still be in flight. Decode: see decode.go.
func (s *session) peerLost(p *peer) {
	if s.role == roleD {
		s.decodePeerLost(p)
		return
	}
	for k, a := range s.attempts {
		if a.peer == p {
			s.handle(s.table.Fail(k.req, k.attempt, "peer_lost", "decode agent connection lost"))
		}
	}
}

// cancelSource is a prefill engine giving up a request: its attempts are failed (after
// draining), its source and any unacquired hold dropped. It reports whether anything was
// outstanding.
func (s *session) cancelSource(req string) bool {
	if s.table == nil {
		return false // nothing happens before the regions are frozen
	}
	found := s.sources[req] != nil
	delete(s.sources, req)
	for k := range s.attempts {
		if k.req == req {
			found = true
			s.handle(s.table.Fail(k.req, k.attempt, "source_cancelled", "the prefill engine cancelled the request"))
		}
	}
	s.table.Forget(req)
	if h := s.holds[req]; h != nil && h.acquired == nil {
		found = true
		delete(s.holds, req)
	}
	if found {
		s.a.metrics.cancels.Inc()
	}
	return found
}
