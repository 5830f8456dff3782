// Package rendezvous pairs a decode engine's registration of destination memory with the
// prefill engine's source blocks for one request (push mode), in either order, and
// guards the invariant the whole push design rests on:
//
//	No byte is written into decode memory after its registration was cancelled,
//	superseded or expired.
//
// It is enforced here, not by the fabric (which checks nothing): every write a writer
// posts is first admitted by Posted, which refuses a fenced attempt; and the decode side
// learns it may reuse its blocks (CancelAcked, Failed) only once the attempt's in-flight
// writes have completed. The table is pure: time is passed in, effects come out as
// Actions, so every ordering is testable.
package rendezvous

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// Errors a caller gets for input that breaks the protocol; the table is unchanged.
var (
	ErrStaleAttempt = errors.New("rendezvous: attempt is older than the request's current attempt")
	ErrDuplicate    = errors.New("rendezvous: attempt already registered")
	ErrStaleEpoch   = errors.New("rendezvous: registration from an older epoch of a restarted engine")
	ErrFenced       = errors.New("rendezvous: attempt is fenced (cancelled, superseded or expired); do not write")
	ErrUnknown      = errors.New("rendezvous: no such request and attempt")
	ErrBadBlocks    = errors.New("rendezvous: blocks do not fit the registration")
	ErrSourceGone   = errors.New("rendezvous: the request failed and its prefill blocks are being released; send it anew")
)

// Engine identifies a decode engine incarnation: a restarted engine gets a higher Epoch,
// and state of older epochs is dropped.
type Engine struct {
	ID    string
	Epoch uint64
}

// Registration is decode's destination for one attempt of a request: the blocks, in token
// order, that the request's KV goes into.
type Registration struct {
	Request string
	Attempt uint64
	Decode  Engine
	Blocks  []uint32
}

// Part is prefill's readiness of some of a request's blocks: Blocks are the source blocks
// for token-order positions Offset, Offset+1, …; Final marks the last part. A request may
// arrive in one part or many (per-layer streaming).
type Part struct {
	Request string
	Offset  int
	Blocks  []uint32
	Final   bool
}

// Config holds the policy's timeouts.
type Config struct {
	// Lease is how long a registration lives without a heartbeat.
	Lease time.Duration
	// RegistrationTimeout is how long a registration waits for every source block.
	RegistrationTimeout time.Duration
	// Regions is how many regions every block is written into (vLLM: 2 per layer): a
	// block is delivered once all of its regions' writes completed. 0 means 1.
	Regions int
}

// Action is an effect for the agent to carry out.
type Action interface{ isAction() }

// Transfer asks the request's writer to write source blocks Src to destination blocks Dst
// (pairwise) for this attempt. Posted must admit every write first.
type Transfer struct {
	Request  string
	Attempt  uint64
	Decode   Engine
	Src, Dst []uint32
}

// Delivered: every block of the attempt is written and complete; signal decode, free prefill.
type Delivered struct {
	Request string
	Attempt uint64
	Decode  Engine
}

// CancelAcked: a cancelled or superseded attempt has no write in flight; decode may reuse its blocks.
type CancelAcked struct {
	Request string
	Attempt uint64
	Decode  Engine
}

// Failed: the attempt expired (no heartbeat within the lease, or prefill not ready within
// the registration timeout) and has no write in flight; tell both engines.
type Failed struct {
	Request string
	Attempt uint64
	Decode  Engine
	// Code classifies the failure (for metrics); Reason says it in words.
	Code   string
	Reason string
}

// Failure codes.
const (
	CodeLeaseExpired        = "lease_expired"
	CodeRegistrationTimeout = "registration_timeout"
	CodeEngineRestarted     = "engine_restarted"
)

func (Transfer) isAction()    {}
func (Delivered) isAction()   {}
func (CancelAcked) isAction() {}
func (Failed) isAction()      {}

// attempt is one registration's state.
type attempt struct {
	reg        Registration
	registered time.Time
	leaseEnd   time.Time
	sent       []bool // positions handed to the writer
	inFlight   int    // block-regions whose writes were admitted and have not completed
	completed  int    // block-regions whose writes completed
	fenced     bool
	// outcome is what to report once drained: a CancelAcked or a Failed.
	outcome Action
	done    bool
}

// request is one request's state: its source parts and its attempts.
type request struct {
	src     map[int]uint32 // position → source block
	final   int            // number of positions, once the final part arrived; -1 before
	current *attempt
	old     []*attempt // fenced attempts still draining
	// failed is set when an attempt failed: the prefill engine is told and frees the
	// request's blocks, so nothing more of the request is paired until the agent forgets it.
	failed bool
	// latest is the highest attempt ever registered: a registration must be above it, even
	// once older attempts have drained and gone, since a writer may still hold their
	// queued writes, which an attempt of the same number would admit.
	latest uint64
}

// Table is the prefill agent's rendezvous table.
type Table struct {
	cfg    Config
	mu     sync.Mutex
	reqs   map[string]*request
	epochs map[string]uint64
}

// New returns an empty table.
func New(cfg Config) *Table {
	return &Table{cfg: cfg, reqs: map[string]*request{}, epochs: map[string]uint64{}}
}

func (t *Table) request(id string) *request {
	r, ok := t.reqs[id]
	if !ok {
		r = &request{src: map[int]uint32{}, final: -1}
		t.reqs[id] = r
	}
	return r
}

// positions is how many token-order positions the source side has named so far.
func (r *request) positions() int {
	n := r.final
	for pos := range r.src {
		n = max(n, pos+1)
	}
	return n
}

// Register records decode's registration. A newer attempt fences the current one; its
// transfers start once the older attempt has drained.
func (t *Table) Register(now time.Time, reg Registration) ([]Action, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if reg.Request == "" || len(reg.Blocks) == 0 {
		return nil, fmt.Errorf("%w: a registration needs a request id and blocks", ErrBadBlocks)
	}
	if e := t.epochs[reg.Decode.ID]; reg.Decode.Epoch < e {
		return nil, ErrStaleEpoch
	}
	r := t.request(reg.Request)
	if r.failed {
		return nil, ErrSourceGone
	}
	switch {
	case r.current != nil && reg.Attempt == r.current.reg.Attempt:
		return nil, ErrDuplicate
	case reg.Attempt <= r.latest:
		return nil, ErrStaleAttempt
	}
	var acts []Action
	if cur := r.current; cur != nil {
		if !cur.done { // a delivered attempt has nothing left to stop or acknowledge
			acts = append(acts, t.fence(r, cur, CancelAcked{Request: reg.Request, Attempt: cur.reg.Attempt, Decode: cur.reg.Decode})...)
		}
	}
	if need := r.positions(); len(reg.Blocks) < need {
		return nil, fmt.Errorf("%w: %d destination blocks for %d source blocks", ErrBadBlocks, len(reg.Blocks), need)
	}
	r.current = &attempt{reg: reg, registered: now, leaseEnd: now.Add(t.cfg.Lease), sent: make([]bool, len(reg.Blocks))}
	r.latest = reg.Attempt
	return append(acts, t.progress(r)...), nil
}

// SourceReady records a part of prefill's blocks.
func (t *Table) SourceReady(p Part) ([]Action, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.request(p.Request)
	if r.failed {
		return nil, ErrSourceGone
	}
	end := p.Offset + len(p.Blocks)
	if p.Offset < 0 || (r.final >= 0 && end > r.final) || (r.current != nil && end > len(r.current.reg.Blocks)) {
		return nil, fmt.Errorf("%w: positions %d..%d", ErrBadBlocks, p.Offset, end)
	}
	for i, b := range p.Blocks {
		if _, dup := r.src[p.Offset+i]; dup {
			return nil, fmt.Errorf("%w: position %d reported twice", ErrBadBlocks, p.Offset+i)
		}
		r.src[p.Offset+i] = b
	}
	if p.Final {
		r.final = end
	}
	return t.progress(r), nil
}

// progress hands the current attempt's newly pairable positions to the writer, and
// reports delivery when everything is written. A current attempt waits while an older
// one drains.
func (t *Table) progress(r *request) []Action {
	cur := r.current
	if cur == nil || cur.fenced || cur.done || len(r.old) > 0 {
		return nil
	}
	tr := Transfer{Request: cur.reg.Request, Attempt: cur.reg.Attempt, Decode: cur.reg.Decode}
	for pos, src := range r.src {
		if pos < len(cur.sent) && !cur.sent[pos] {
			cur.sent[pos] = true
			tr.Src = append(tr.Src, src)
			tr.Dst = append(tr.Dst, cur.reg.Blocks[pos])
		}
	}
	var acts []Action
	if len(tr.Src) > 0 {
		sortPairs(tr.Src, tr.Dst)
		acts = append(acts, tr)
	}
	return append(acts, t.maybeDelivered(r)...)
}

func (t *Table) maybeDelivered(r *request) []Action {
	cur := r.current
	if cur == nil || cur.fenced || cur.done || r.final < 0 || cur.inFlight > 0 || cur.completed < r.final*max(t.cfg.Regions, 1) {
		return nil
	}
	cur.done = true
	return []Action{Delivered{Request: cur.reg.Request, Attempt: cur.reg.Attempt, Decode: cur.reg.Decode}}
}

// Posted admits writes covering n blocks of one region of an attempt, before the writer
// posts them (a merged write covers several blocks; accounting is in block-regions). It refuses a fenced
// attempt: this check is where "no write after cancel or expiry" is enforced.
func (t *Table) Posted(req string, att uint64, n int) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	a := t.find(req, att)
	if a == nil {
		return ErrUnknown
	}
	if a.fenced || a.done {
		return ErrFenced
	}
	a.inFlight += n
	return nil
}

// Completed records that the writes covering n admitted blocks of an attempt completed
// (successfully or not: a failed write is reported by the writer as a failure of the
// request); a drained fenced attempt is acknowledged, a complete current one delivered.
func (t *Table) Completed(req string, att uint64, n int) ([]Action, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.reqs[req]
	a := t.find(req, att)
	if a == nil || n > a.inFlight {
		return nil, fmt.Errorf("%w: %d completions for %s attempt %d", ErrUnknown, n, req, att)
	}
	a.inFlight -= n
	a.completed += n
	if a.fenced {
		return t.drained(r), nil
	}
	return t.maybeDelivered(r), nil
}

// Withdraw takes back the admission of n blocks whose write was not posted after all (the
// provider said "again"); a fenced attempt that has drained by that is acknowledged.
func (t *Table) Withdraw(req string, att uint64, n int) ([]Action, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	a := t.find(req, att)
	if a == nil || n > a.inFlight {
		return nil, fmt.Errorf("%w: withdrawing %d blocks of %s attempt %d", ErrUnknown, n, req, att)
	}
	a.inFlight -= n
	if a.fenced {
		return t.drained(t.reqs[req]), nil
	}
	return nil, nil
}

// Heartbeat renews an attempt's lease.
func (t *Table) Heartbeat(now time.Time, req string, att uint64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	a := t.find(req, att)
	if a == nil {
		return ErrUnknown
	}
	if a.fenced {
		return ErrFenced
	}
	a.leaseEnd = now.Add(t.cfg.Lease)
	return nil
}

// Cancel fences an attempt; CancelAcked comes once its writes have drained (at once when
// none are in flight).
func (t *Table) Cancel(req string, att uint64) ([]Action, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.reqs[req]
	if r == nil || r.current == nil || r.current.reg.Attempt != att || r.current.done {
		if t.find(req, att) != nil {
			return nil, nil // already fenced or delivered: nothing left to stop
		}
		return nil, ErrUnknown
	}
	cur := r.current
	return t.fence(r, cur, CancelAcked{Request: req, Attempt: att, Decode: cur.reg.Decode}), nil
}

// Expire is the watchdog: it fences every attempt whose lease or registration timeout has
// passed at now, reporting Failed once each has drained.
func (t *Table) Expire(now time.Time) []Action {
	t.mu.Lock()
	defer t.mu.Unlock()
	var acts []Action
	for id, r := range t.reqs {
		cur := r.current
		if cur == nil || cur.fenced || cur.done {
			continue
		}
		f := Failed{Request: id, Attempt: cur.reg.Attempt, Decode: cur.reg.Decode}
		switch {
		case !now.Before(cur.leaseEnd):
			f.Code, f.Reason = CodeLeaseExpired, fmt.Sprintf("lease of %s expired without a heartbeat", t.cfg.Lease)
		case !now.Before(cur.registered.Add(t.cfg.RegistrationTimeout)):
			f.Code, f.Reason = CodeRegistrationTimeout, fmt.Sprintf("prefill did not finish within the registration timeout of %s", t.cfg.RegistrationTimeout)
		default:
			continue
		}
		acts = append(acts, t.fence(r, cur, f)...)
	}
	return acts
}

// EngineRestarted drops the state of older epochs of a decode engine: their memory is
// gone, so their attempts are fenced (and acknowledged once drained).
func (t *Table) EngineRestarted(e Engine) []Action {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e.Epoch <= t.epochs[e.ID] {
		return nil
	}
	t.epochs[e.ID] = e.Epoch
	var acts []Action
	for id, r := range t.reqs {
		if cur := r.current; cur != nil && cur.reg.Decode.ID == e.ID && cur.reg.Decode.Epoch < e.Epoch && !cur.fenced {
			acts = append(acts, t.fence(r, cur, Failed{Request: id, Attempt: cur.reg.Attempt, Decode: cur.reg.Decode, Code: CodeEngineRestarted, Reason: "decode engine restarted"})...)
		}
	}
	return acts
}

// Fail fences an attempt for a reason of the agent's own (a write error, a lost peer):
// Failed comes once its writes have drained. An attempt already fenced or finished is
// left as it is.
func (t *Table) Fail(req string, att uint64, code, reason string) []Action {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.reqs[req]
	if r == nil || r.current == nil || r.current.reg.Attempt != att || r.current.done {
		return nil
	}
	return t.fence(r, r.current, Failed{Request: req, Attempt: att, Decode: r.current.reg.Decode, Code: code, Reason: reason})
}

// Current lists the live (unfenced, undelivered) attempts, so an agent can fail them
// when their engine or peer goes away.
func (t *Table) Current() []Registration {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []Registration
	for _, r := range t.reqs {
		if c := r.current; c != nil && !c.done {
			out = append(out, c.reg)
		}
	}
	return out
}

// Idle reports whether a request has no live attempt: none registered, or every one
// fenced or delivered.
func (t *Table) Idle(req string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.reqs[req]
	return r == nil || r.current == nil || r.current.done
}

// Forget drops a finished request (delivered and acknowledged by the agent).
func (t *Table) Forget(req string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if r := t.reqs[req]; r != nil && len(r.old) == 0 && (r.current == nil || r.current.done) {
		delete(t.reqs, req)
	}
}

// fence stops an attempt from writing and queues its outcome for when it has drained.
//
// A Failed outcome also drops the request's source: the agent tells the prefill engine as
// well, which then frees those blocks, so no later attempt may be paired with them, and
// later parts and registrations of the request are refused (ErrSourceGone) until the agent
// forgets it. A cancel keeps the source: the prefill engine was not told, and a retried
// attempt takes the same blocks.
func (t *Table) fence(r *request, a *attempt, outcome Action) []Action {
	a.fenced, a.outcome = true, outcome
	if r.current == a {
		r.current = nil
	}
	if _, failed := outcome.(Failed); failed {
		r.src, r.final, r.failed = map[int]uint32{}, -1, true
	}
	r.old = append(r.old, a)
	return t.drained(r)
}

// drained reports the outcomes of fenced attempts with nothing in flight, then lets the
// current attempt proceed once no older attempt is draining.
func (t *Table) drained(r *request) []Action {
	var acts []Action
	keep := r.old[:0]
	for _, a := range r.old {
		if a.inFlight == 0 {
			acts = append(acts, a.outcome)
			continue
		}
		keep = append(keep, a)
	}
	r.old = keep
	return append(acts, t.progress(r)...)
}

func (t *Table) find(req string, att uint64) *attempt {
	r := t.reqs[req]
	if r == nil {
		return nil
	}
	if r.current != nil && r.current.reg.Attempt == att {
		return r.current
	}
	for _, a := range r.old {
		if a.reg.Attempt == att {
			return a
		}
	}
	return nil
}

// sortPairs orders a transfer by source block, so contiguous runs are easy to merge.
func sortPairs(src, dst []uint32) {
	idx := make([]int, len(src))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int { return cmp.Compare(src[a], src[b]) })
	s, d := slices.Clone(src), slices.Clone(dst)
	for i, j := range idx {
		src[i], dst[i] = s[j], d[j]
	}
}
