// Package landing is the decode agent's side of a KV handoff: where a request's KV lands.
// It tracks push destinations (registered with a prefill agent, which writes into them)
// and pulls (this agent reads from a prefill agent's held blocks), and decides when an
// attempt's outcome may be reported to the decode engine. The rule it enforces:
//
//	The engine hears an outcome (DELIVERED, CANCEL_ACKED, FAILED) only when no write or
//	read of the attempt can still land in its memory.
//
// For push that is a delivery signal (posted after every write completed), or a fence
// signal together with the prefill agent's message (in either order), or — when the
// prefill agent is lost — the end of a quarantine longer than any write can take to
// drain. For pull it is every read completed or dropped, and only reads that finished
// within the hold's lease are trusted.
//
// The table is pure, like rendezvous.Table: time is passed in, effects come out as
// Actions; the agent's session carries them out (messages to peers, events to the
// engine, fabric reads). P identifies a peer agent connection.
package landing

import (
	"errors"
	"fmt"
	"time"
)

// Errors a caller gets for input that breaks the protocol; the table is unchanged.
var (
	ErrDuplicate = errors.New("landing: attempt already registered")
	ErrStale     = errors.New("landing: attempt is older than a registered attempt of the request")
)

// MaxToken is the highest signal token. A signal's data is token<<1 | fence, and EFA
// carries 4 bytes of CQ data, so tokens stay below 2^31.
const MaxToken = 1<<30 - 1

// SignalData is the CQ data of a delivery (fence false) or fence signal for token.
func SignalData(token uint32, fence bool) uint64 {
	d := uint64(token) << 1
	if fence {
		d |= 1
	}
	return d
}

// QuarantineFor is how long decode blocks stay untouched after their prefill agent was
// lost. The prefill agent may notice the loss up to a lease later (its registrations
// expire then), its watchdog runs once a tick, and writes it posted before fencing still
// drain after that: a lease alone would end exactly when the last write may still be
// landing. The margin covers two ticks (one on each side) and a second of drain.
func QuarantineFor(lease, tick time.Duration) time.Duration {
	return lease + 2*tick + time.Second
}

// Config holds the policy's timeouts as the decode side needs them.
type Config struct {
	Lease               time.Duration
	RegistrationTimeout time.Duration
	Tick                time.Duration // the watchdog's period, on both agents
}

// Key names one attempt of a request.
type Key struct {
	Request string
	Attempt uint64
}

// Kind is an outcome reported to the engine.
type Kind int

const (
	Delivered Kind = iota
	CancelAcked
	Failed
)

// Action is an effect for the session to carry out.
type Action interface{ isAction() }

// Report tells the engine an attempt's outcome; the attempt is gone from the table.
type Report struct {
	Key
	Kind Kind
	// Code classifies a failure (for metrics); Reason says it in words.
	Code, Reason string
	Pull         bool
	// Blocks is a push destination's block count; Bytes and Reads a pull's volume, and
	// Wire how long its reads took from the grant.
	Blocks int
	Bytes  uint64
	Reads  int
	Wire   time.Duration
}

// SendCancel asks the prefill agent to fence a push registration.
type SendCancel[P comparable] struct {
	Key
	Peer   P
	Source string
}

// SendRelease tells the prefill agent a pull is over, so it frees the held blocks.
type SendRelease[P comparable] struct {
	Key
	Peer   P
	Source string
	Failed bool
}

// SendHeartbeat renews a push registration's lease at its prefill agent.
type SendHeartbeat[P comparable] struct {
	Key
	Peer   P
	Source string
}

// SendResignal asks the prefill agent to post a push destination's delivery signal again.
type SendResignal[P comparable] struct {
	Key
	Peer   P
	Source string
}

// ResignalGrace is how long after the prefill agent said it posted a delivery signal the
// decode side waits for it before asking again (and between asks): a signal arrives
// within milliseconds of its message, and asking once too often costs one duplicate.
const ResignalGrace = 250 * time.Millisecond

// DropReads asks the session to drop a pull's queued reads and say how many (Dropped).
type DropReads struct{ Key }

func (Report) isAction()           {}
func (SendCancel[P]) isAction()    {}
func (SendRelease[P]) isAction()   {}
func (SendHeartbeat[P]) isAction() {}
func (DropReads) isAction()        {}
func (SendResignal[P]) isAction()  {}

// destination is one push registration.
type destination[P comparable] struct {
	key      Key
	token    uint32
	peer     P
	source   string
	blocks   int
	writing  bool // the prefill agent started writing
	fenced   bool // the fence signal arrived
	outcome  *Report
	expected bool // the prefill agent's message said a fence signal is on its way
	// signalled is when the prefill agent said it posted the delivery signal, asked when
	// this side last asked for it again (Signalled, Expire).
	signalled, asked time.Time
	lost             time.Time // the prefill agent's connection was lost: fail at this time
	// deadline is when the decode side gives up waiting for any outcome: the prefill
	// agent fails a registration by its registration timeout, so one that has heard
	// nothing a quarantine after that lost a message, and no write can still land.
	deadline time.Time
}

// pull is one pull attempt.
type pull[P comparable] struct {
	key       Key
	peer      P
	source    string
	src, dst  []uint32
	sentAt    time.Time
	granted   time.Time
	deadline  time.Time // sentAt + the hold's lease: reads finishing later are not trusted
	acquired  bool
	cancelled bool
	failed    string
	inFlight  int
	queued    int
	reads     int
	bytes     uint64
}

// Table is one decode engine rank's landing state.
type Table[P comparable] struct {
	cfg     Config
	dests   map[Key]*destination[P]
	byToken map[uint32]*destination[P]
	token   uint32
	pulls   map[Key]*pull[P]
	writing int // destinations a prefill agent is writing into
}

// New returns an empty table.
func New[P comparable](cfg Config) *Table[P] {
	return &Table[P]{cfg: cfg, dests: map[Key]*destination[P]{}, byToken: map[uint32]*destination[P]{}, pulls: map[Key]*pull[P]{}}
}

// Len is how many push destinations and pulls the table keeps open.
func (t *Table[P]) Len() int { return len(t.dests) + len(t.pulls) }

// Register records a push destination of blocks blocks, registered with source's agent
// over peer, and returns the token its signals will carry.
func (t *Table[P]) Register(now time.Time, k Key, source string, peer P, blocks int) (uint32, error) {
	if _, dup := t.dests[k]; dup {
		return 0, fmt.Errorf("%w: %s attempt %d", ErrDuplicate, k.Request, k.Attempt)
	}
	for o := range t.dests {
		if o.Request == k.Request && o.Attempt > k.Attempt {
			return 0, fmt.Errorf("%w: %d is older than the registered attempt %d of %s", ErrStale, k.Attempt, o.Attempt, k.Request)
		}
	}
	t.token = t.token%MaxToken + 1
	for t.byToken[t.token] != nil {
		t.token = t.token%MaxToken + 1
	}
	d := &destination[P]{
		key: k, token: t.token, peer: peer, source: source, blocks: blocks,
		deadline: now.Add(t.cfg.RegistrationTimeout + QuarantineFor(t.cfg.Lease, t.cfg.Tick)),
	}
	t.dests[k], t.byToken[d.token] = d, d
	return d.token, nil
}

// Registered says whether an attempt of request req is registered here.
func (t *Table[P]) Registered(req string) bool {
	for k := range t.dests {
		if k.Request == req {
			return true
		}
	}
	return false
}

// Signalled records the prefill agent's word that it posted a destination's delivery
// signal: should the signal not arrive, Expire asks for it again.
func (t *Table[P]) Signalled(now time.Time, k Key, peer P) {
	if d := t.dests[k]; d != nil && d.peer == peer && d.signalled.IsZero() {
		d.signalled = now
	}
}

// Writing records that the prefill agent started writing a destination.
func (t *Table[P]) Writing(k Key, peer P) {
	if d := t.dests[k]; d != nil && d.peer == peer && !d.writing {
		d.writing = true
		t.writing++
	}
}

// Signal takes a remote CQ datum: a delivery signal reports the destination delivered
// (every write completed before it was posted, so their data is in); a fence signal
// reports the prefill agent's outcome if it has arrived. An unknown token belongs to an
// attempt already reported (for example cancelled, then delivered): nothing to do.
func (t *Table[P]) Signal(data uint64) []Action {
	d := t.byToken[uint32(data>>1)&MaxToken]
	if d == nil {
		return nil
	}
	if data&1 == 0 {
		return t.report(d, Report{Key: d.key, Kind: Delivered, Blocks: d.blocks})
	}
	d.fenced = true
	if d.outcome != nil {
		return t.report(d, *d.outcome)
	}
	return nil
}

// Outcome takes the prefill agent's CancelAcked (cancelled) or Failed for an attempt.
// When that agent posted a fence signal (signalled), the report waits for it: only then
// is no write of the attempt left on its way. A Failed for a pull that was never granted
// is the prefill agent refusing it: nothing was read.
func (t *Table[P]) Outcome(now time.Time, k Key, peer P, cancelled bool, reason string, signalled bool) []Action {
	if d := t.dests[k]; d != nil && d.peer == peer {
		r := Report{Key: k, Kind: Failed, Code: "prefill_failed", Reason: reason}
		if cancelled {
			r = Report{Key: k, Kind: CancelAcked}
		}
		d.outcome = &r
		if !signalled || d.fenced {
			return t.report(d, r)
		}
		return nil
	}
	if p := t.pulls[k]; p != nil && p.peer == peer && !cancelled && !p.acquired {
		return t.failPull(now, p, reason)
	}
	return nil
}

// Cancel starts cancelling an attempt. A push destination is fenced by its prefill agent
// (SendCancel; CANCEL_ACKED follows its answer and fence signal); a pull stops reading
// and is acknowledged once its reads in flight are done. It reports whether the attempt
// is outstanding.
func (t *Table[P]) Cancel(now time.Time, k Key) ([]Action, bool) {
	if d := t.dests[k]; d != nil {
		return []Action{SendCancel[P]{Key: k, Peer: d.peer, Source: d.source}}, true
	}
	if p := t.pulls[k]; p != nil {
		p.cancelled = true
		return append(t.drop(p), t.maybeFinish(now, p)...), true
	}
	return nil, false
}

// CancelAll cancels everything outstanding: the engine's session is ending.
func (t *Table[P]) CancelAll(now time.Time) []Action {
	var acts []Action
	for k := range t.dests {
		a, _ := t.Cancel(now, k)
		acts = append(acts, a...)
	}
	for k := range t.pulls {
		a, _ := t.Cancel(now, k)
		acts = append(acts, a...)
	}
	return acts
}

// Heartbeats renews the leases of every push registration.
func (t *Table[P]) Heartbeats() []Action {
	out := make([]Action, 0, len(t.dests))
	for k, d := range t.dests {
		out = append(out, SendHeartbeat[P]{Key: k, Peer: d.peer, Source: d.source})
	}
	return out
}

// PeerLost handles a lost prefill agent connection. If it was ever established (reached),
// what that agent already sent may still be on its way into this engine's memory (the
// fabric has its own connections), so its destinations fail only after a quarantine,
// never at once. A connection that never got through its handshake carried no
// registration, so that agent knows nothing of these blocks: they fail at once. Pulls fail
// once their reads have drained.
func (t *Table[P]) PeerLost(now time.Time, peer P, reached bool, reason string) []Action {
	var acts []Action
	for _, d := range t.dests {
		switch {
		case d.peer != peer || !d.lost.IsZero():
		case reached:
			d.lost = now.Add(QuarantineFor(t.cfg.Lease, t.cfg.Tick))
		default:
			acts = append(acts, t.report(d, Report{Key: d.key, Kind: Failed, Code: "peer_unreachable",
				Reason: fmt.Sprintf("the agent of prefill engine %s could not be reached (%s); nothing was sent to it", d.source, reason)})...)
		}
	}
	for _, p := range t.pulls {
		if p.peer == peer && p.failed == "" {
			acts = append(acts, t.failPull(now, p, reason)...)
		}
	}
	return acts
}

// Expire is the watchdog: destinations whose quarantine or deadline passed, and pulls
// whose lease ended with reads outstanding.
func (t *Table[P]) Expire(now time.Time) []Action {
	var acts []Action
	for _, d := range t.dests {
		switch {
		case !d.lost.IsZero() && !now.Before(d.lost):
			acts = append(acts, t.report(d, Report{Key: d.key, Kind: Failed, Code: "peer_lost",
				Reason: fmt.Sprintf("the agent of prefill engine %s was lost; blocks were quarantined for the lease (%s) and a margin so no late "+
					"write can land", d.source, t.cfg.Lease)})...)
		case d.lost.IsZero() && !now.Before(d.deadline):
			acts = append(acts, t.report(d, Report{Key: d.key, Kind: Failed, Code: "no_outcome",
				Reason: fmt.Sprintf("no outcome from the agent of prefill engine %s within the registration timeout (%s) and a quarantine after "+
					"it; a message was lost, and no write can still land", d.source, t.cfg.RegistrationTimeout)})...)
		case !d.signalled.IsZero() && !now.Before(d.signalled.Add(ResignalGrace)) && !now.Before(d.asked.Add(ResignalGrace)):
			// Posted, by the prefill agent's word, and not here: lost or stalled in the
			// provider. Ask again; a duplicate is harmless.
			d.asked = now
			acts = append(acts, SendResignal[P]{Key: d.key, Peer: d.peer, Source: d.source})
		}
	}
	for _, p := range t.pulls {
		if p.acquired && p.failed == "" && now.After(p.deadline) {
			acts = append(acts, t.failPull(now, p, "reads did not finish within the hold's lease")...)
		}
	}
	return acts
}

// Hot reports whether a prefill agent is writing into this rank's memory now: the
// provider may move that data only while the session polls. It is asked on every turn
// of the session's pump, so it is a counter, not a scan. (Pull reads in flight are the
// session's own to see.)
func (t *Table[P]) Hot() bool { return t.writing > 0 }

// Idle reports whether nothing is outstanding.
func (t *Table[P]) Idle() bool { return len(t.dests) == 0 && len(t.pulls) == 0 }

// Pull records a pull of source blocks src into dst from source's agent over peer.
func (t *Table[P]) Pull(now time.Time, k Key, source string, peer P, src, dst []uint32) error {
	if _, dup := t.pulls[k]; dup {
		return fmt.Errorf("%w: %s attempt %d is already being pulled", ErrDuplicate, k.Request, k.Attempt)
	}
	t.pulls[k] = &pull[P]{key: k, peer: peer, source: source, src: src, dst: dst, sentAt: now}
	return nil
}

// Grant is a granted pull for the session to plan: read Src of Source into Dst.
type Grant struct {
	Source   string
	Src, Dst []uint32
	Wait     time.Duration // how long the grant took
}

// Granted records the prefill agent's grant of a pull for a lease, counted from when the
// pull was sent (before the grant, so this side stops trusting reads before that side
// can free the blocks). It returns the reads to plan (then Planned or Fail), or nil and
// the actions that end a pull cancelled or failed meanwhile.
func (t *Table[P]) Granted(now time.Time, k Key, peer P, lease time.Duration) (*Grant, []Action) {
	p := t.pulls[k]
	if p == nil || p.peer != peer || p.acquired {
		return nil, nil
	}
	p.acquired, p.granted, p.deadline = true, now, p.sentAt.Add(lease)
	if p.cancelled || p.failed != "" {
		return nil, t.maybeFinish(now, p)
	}
	return &Grant{Source: p.source, Src: p.src, Dst: p.dst, Wait: now.Sub(p.sentAt)}, nil
}

// Planned records that a granted pull's reads (reads of bytes in all) were queued.
func (t *Table[P]) Planned(k Key, reads int, bytes uint64) {
	if p := t.pulls[k]; p != nil {
		p.queued, p.reads, p.bytes = reads, reads, bytes
	}
}

// Fail fails a pull for a reason of the session's (its reads could not be planned or
// posted): what is queued is dropped, and it is reported once nothing is in flight.
func (t *Table[P]) Fail(now time.Time, k Key, reason string) []Action {
	if p := t.pulls[k]; p != nil && p.failed == "" {
		return t.failPull(now, p, reason)
	}
	return nil
}

// Posted moves one queued read of a pull in flight.
func (t *Table[P]) Posted(k Key) {
	if p := t.pulls[k]; p != nil {
		p.queued--
		p.inFlight++
	}
}

// Unposted takes back a queued read that could not be posted (err), failing the pull.
func (t *Table[P]) Unposted(now time.Time, k Key, err error) []Action {
	p := t.pulls[k]
	if p == nil {
		return nil
	}
	p.queued--
	if p.failed != "" {
		return t.maybeFinish(now, p)
	}
	return t.failPull(now, p, fmt.Sprintf("posting a read: %v", err))
}

// ReadDone records a completed read (err: the provider failed it).
func (t *Table[P]) ReadDone(now time.Time, k Key, err error) []Action {
	p := t.pulls[k]
	if p == nil {
		return nil
	}
	p.inFlight--
	if err != nil && p.failed == "" {
		return t.failPull(now, p, fmt.Sprintf("RMA read failed: %v", err))
	}
	return t.maybeFinish(now, p)
}

// Dropped records that n queued reads of a pull were dropped (after DropReads).
func (t *Table[P]) Dropped(now time.Time, k Key, n int) []Action {
	p := t.pulls[k]
	if p == nil {
		return nil
	}
	p.queued -= n
	return t.maybeFinish(now, p)
}

func (t *Table[P]) report(d *destination[P], r Report) []Action {
	if d.writing {
		t.writing--
	}
	delete(t.dests, d.key)
	delete(t.byToken, d.token)
	return []Action{r}
}

func (t *Table[P]) failPull(now time.Time, p *pull[P], reason string) []Action {
	p.failed = reason
	return append(t.drop(p), t.maybeFinish(now, p)...)
}

func (t *Table[P]) drop(p *pull[P]) []Action {
	if p.queued > 0 {
		return []Action{DropReads{p.key}}
	}
	return nil
}

// maybeFinish reports a pull once nothing of it is queued or in flight. Its data is
// trusted only if every read completed before the deadline: after it, the prefill agent
// may have released the blocks to be reused.
func (t *Table[P]) maybeFinish(now time.Time, p *pull[P]) []Action {
	if p.inFlight > 0 || p.queued > 0 || (!p.acquired && !p.cancelled && p.failed == "") {
		return nil
	}
	delete(t.pulls, p.key)
	r := Report{Key: p.key, Pull: true}
	switch {
	case p.cancelled:
		r.Kind = CancelAcked
	case p.failed != "":
		r.Kind, r.Code, r.Reason = Failed, "pull_failed", p.failed
	case now.After(p.deadline):
		r.Kind, r.Code, r.Reason = Failed, "pull_late", "reads finished after the hold's lease; the data is not trusted"
	default:
		r.Kind, r.Bytes, r.Reads, r.Wire = Delivered, p.bytes, p.reads, now.Sub(p.granted)
	}
	var acts []Action
	if p.acquired || p.cancelled {
		acts = append(acts, SendRelease[P]{Key: p.key, Peer: p.peer, Source: p.source, Failed: r.Kind != Delivered})
	}
	return append(acts, r)
}
