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
	"errors"
	"fmt"
	"math/bits"
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
	ErrRegistered   = errors.New("rendezvous: the request has a registration (live or draining); cancel it instead")
	ErrTooMany      = errors.New("rendezvous: too many declines waiting for their sources")
	ErrOverBudget   = errors.New("rendezvous: the table holds its most positions")
)

// maxDeclined bounds the declines the table remembers: each is a few dozen bytes, and a
// peer could otherwise grow the table without end.
const maxDeclined = 1 << 16

// Engine identifies a decode engine incarnation: a restarted engine gets a higher Epoch,
// and state of older epochs is dropped.
type Engine struct {
	ID    string
	Epoch uint64
}

// Registration is decode's destination for one attempt of a request: the blocks, in token
// order, that the request's KV goes into, from position First on. Decode's prefix cache
// holds the positions before First: they are never written, and the attempt is delivered
// once every position from First to the source's last is.
type Registration struct {
	Request string
	Attempt uint64
	Decode  Engine
	First   int
	Blocks  []uint32
}

// end is the position after the registration's last.
func (reg *Registration) end() int { return reg.First + len(reg.Blocks) }

// Part is prefill's readiness of some of a request's blocks: Blocks are the source blocks
// for token-order positions Offset, Offset+1, …, ready in the regions Regions; Final marks
// the last part. A request may arrive in one part or many: runs of positions, or layer
// groups (layer-streamed push: each part names every position and a span of regions,
// written while the next group computes).
type Part struct {
	Request string
	Offset  int
	Blocks  []uint32
	// Regions is the part's span of regions; the zero Span means all of them.
	Regions Span
	Final   bool
}

// Span is a range [Lo, Hi) of region indexes, in the order of the engine's region layout
// (ascending region id).
type Span struct{ Lo, Hi int }

// Config holds the policy's timeouts.
type Config struct {
	// Lease is how long a registration lives without a heartbeat.
	Lease time.Duration
	// RegistrationTimeout is how long a registration waits for every source block.
	RegistrationTimeout time.Duration
	// BlocksTTL is how long a finished source waits with no live registration (none yet,
	// or its attempt was cancelled) before it expires and the prefill engine frees it.
	BlocksTTL time.Duration
	// Regions is how many regions every block is written into (vLLM: 2 per layer): a
	// block is delivered once all of its regions' writes completed. 0 means 1.
	Regions int
	// MaxPositions bounds what the table holds for all its requests together: their
	// source positions up to the highest named (kept densely) and their attempts'
	// destination blocks. A part or registration beyond it is refused (ErrOverBudget).
	// 0: no bound.
	MaxPositions int
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
	// Regions are the regions to write (the table always sets them; the zero Span means
	// all, as in Part).
	Regions Span
	// Paired marks the attempt's first transfer, the moment both halves were present;
	// SourceWait is then how long the source had waited for the registration since its
	// first part (zero when decode registered first, as in push).
	Paired     bool
	SourceWait time.Duration
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
	CodeEngineGone          = "engine_gone"
	CodeSourceCancelled     = "source_cancelled"
)

// SourceExpired: a finished source waited a blocks TTL with no live registration; the
// request is dropped and the prefill engine is told to free its blocks.
type SourceExpired struct {
	Request string
	Reason  string
}

// SourceDeclined: decode computes the request itself and takes none of its KV (a decline);
// the prefill engine frees the request's blocks now. Not a failure.
type SourceDeclined struct {
	Request string
}

func (Transfer) isAction()       {}
func (Delivered) isAction()      {}
func (CancelAcked) isAction()    {}
func (Failed) isAction()         {}
func (SourceExpired) isAction()  {}
func (SourceDeclined) isAction() {}

// attempt is one registration's state.
type attempt struct {
	reg        Registration
	registered time.Time
	leaseEnd   time.Time
	sent       int  // the request's parts handed to the writer
	paired     bool // a transfer was handed out
	inFlight   int  // block-regions whose writes were admitted and have not completed
	completed  int  // block-regions whose writes completed
	fenced     bool
	// outcome is what to report once drained: a CancelAcked or a Failed.
	outcome Action
	done    bool
}

// request is one request's state: its source parts and its attempts.
type request struct {
	id string
	// src is, per token-order position, its source block and the regions reported ready
	// (nil for a position no part named yet). A slice, not a map: a 16k-token part is 1024
	// positions, recorded on the rank's pump before its writes start. The caller bounds
	// positions (the agent by the engine's block count).
	src []*source
	// parts are the parts in arrival order: every attempt is handed them in that order.
	parts []Part
	final int       // number of positions, once the final part arrived; -1 before
	first time.Time // when the first part arrived
	// waiting is when the finished source last found itself with no live registration
	// (its final part came first, or its attempt was cancelled); zero while one is live.
	// The blocks TTL counts from it.
	waiting time.Time
	current *attempt
	old     []*attempt // fenced attempts still draining
	// failed is set when an attempt failed: the prefill engine is told and frees the
	// request's blocks, so nothing more of the request is paired until the agent forgets it.
	failed bool
	// latest is the highest attempt ever registered: a registration must be above it, even
	// once older attempts have drained and gone, since a writer may still hold their
	// queued writes, which an attempt of the same number would admit.
	latest uint64
	// latestDecode is the decode engine that registered latest (Abandon checks it).
	latestDecode string
	// counted is the request's cost as the table's held has it (recount).
	counted int
}

// Table is the prefill agent's rendezvous table. A request lives in it from its first
// part or registration until it is over: delivered, failed and drained, or its source
// expired; the table then drops it by itself.
type Table struct {
	cfg     Config
	mu      sync.Mutex
	reqs    map[string]*request
	retired map[string]retired
	epochs  map[string]uint64
	// declines counts the retired entries that are declines (bounded by maxDeclined).
	declines int
	// held is the positions the requests hold (Config.MaxPositions).
	held int
}

// retired is what is kept of a request that is over: its latest attempt, until a
// registration from before it can no longer arrive.
type retired struct {
	attempt uint64
	// failed: the prefill engine was told and frees the request's blocks, so parts and
	// registrations still on their way are refused (ErrSourceGone) rather than paired.
	failed bool
	// declined: decode takes none of the request's KV. Its source is dropped when it
	// comes (told: the prefill engine was sent SourceDeclined), and registrations refused.
	declined, told bool
	until          time.Time
}

// New returns an empty table.
func New(cfg Config) *Table {
	return &Table{cfg: cfg, reqs: map[string]*request{}, retired: map[string]retired{}, epochs: map[string]uint64{}}
}

// request returns a request's state, creating it unless the request failed a moment ago
// (nil then).
func (t *Table) request(id string) *request {
	r, ok := t.reqs[id]
	if !ok {
		if rt := t.retired[id]; rt.failed || rt.declined {
			return nil
		}
		// The retired entry stays until it expires: a call that is refused leaves the
		// request empty, and recount drops it again.
		r = &request{id: id, final: -1, latest: t.retired[id].attempt}
		r.dropSource()
		t.reqs[id] = r
	}
	return r
}

// source is one position's source block and which of its regions are ready (a bit per
// region index; each is reported once).
type source struct {
	block uint32
	ready []uint64
}

// dropSource forgets the request's source parts.
func (r *request) dropSource() {
	r.src, r.parts, r.final = nil, nil, -1
}

// Len is how many requests the table keeps open (retired ones not counted).
func (t *Table) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.reqs)
}

// regions is how many regions every block is written into.
func (t *Table) regions() int { return max(t.cfg.Regions, 1) }

// cost is what a request holds, in positions: its source slots and the destination
// blocks of its attempts, live and draining.
func (r *request) cost() int {
	n := len(r.src)
	if r.current != nil {
		n += len(r.current.reg.Blocks)
	}
	for _, a := range r.old {
		n += len(a.reg.Blocks)
	}
	return n
}

// recount brings held up to date with r after a change, whether r is still in the table
// or was just dropped from it. Every method that changes a request calls it.
func (t *Table) recount(r *request) {
	if t.reqs[r.id] == r && r.current == nil && len(r.old) == 0 && r.final < 0 && len(r.parts) == 0 && !r.failed {
		delete(t.reqs, r.id) // made by a call that was refused: its retired entry, if any, remembers it
	}
	c := 0
	if t.reqs[r.id] == r {
		c = r.cost()
	}
	t.held += c - r.counted
	r.counted = c
}

// afford refuses n more positions over the table's budget.
func (t *Table) afford(n int) error {
	if t.cfg.MaxPositions > 0 && t.held+n > t.cfg.MaxPositions {
		return fmt.Errorf("%w: %d held, %d more asked for, at most %d", ErrOverBudget, t.held, n, t.cfg.MaxPositions)
	}
	return nil
}

// positions is how many token-order positions the source side has named so far.
func (r *request) positions() int {
	return max(r.final, len(r.src))
}

// Register records decode's registration. A newer attempt fences the current one; its
// transfers start once the older attempt has drained.
func (t *Table) Register(now time.Time, reg Registration) ([]Action, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if reg.Request == "" || len(reg.Blocks) == 0 || reg.First < 0 {
		return nil, fmt.Errorf("%w: a registration needs a request id, blocks and a first position ≥ 0", ErrBadBlocks)
	}
	if e := t.epochs[reg.Decode.ID]; reg.Decode.Epoch < e {
		return nil, ErrStaleEpoch
	}
	r := t.request(reg.Request)
	if r == nil || r.failed {
		return nil, ErrSourceGone
	}
	defer t.recount(r)
	if err := t.afford(len(reg.Blocks)); err != nil {
		return nil, err
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
			acts = append(acts, t.fence(now, r, cur, CancelAcked{Request: reg.Request, Attempt: cur.reg.Attempt, Decode: cur.reg.Decode})...)
		}
	}
	if need := r.positions(); reg.end() < need {
		return nil, fmt.Errorf("%w: destination blocks for positions %d..%d, source blocks for 0..%d", ErrBadBlocks, reg.First, reg.end()-1, need-1)
	}
	r.current = &attempt{reg: reg, registered: now, leaseEnd: now.Add(t.cfg.Lease)}
	r.latest, r.latestDecode = reg.Attempt, reg.Decode.ID
	r.waiting = time.Time{}
	return append(acts, t.progress(now, r)...), nil
}

// SourceReady records a part of prefill's blocks. A part of a declined request is
// dropped; the first final one of them gets SourceDeclined.
func (t *Table) SourceReady(now time.Time, p Part) ([]Action, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if rt, ok := t.retired[p.Request]; ok && rt.declined {
		if !p.Final || rt.told {
			return nil, nil
		}
		rt.told = true
		t.retired[p.Request] = rt
		return []Action{SourceDeclined{Request: p.Request}}, nil
	}
	r := t.request(p.Request)
	if r == nil || r.failed {
		return nil, ErrSourceGone
	}
	defer t.recount(r)
	end := p.Offset + len(p.Blocks)
	if p.Offset < 0 || (r.final >= 0 && end > r.final) || (r.current != nil && end > r.current.reg.end()) {
		return nil, fmt.Errorf("%w: positions %d..%d", ErrBadBlocks, p.Offset, end)
	}
	if err := t.afford(end - len(r.src)); err != nil {
		return nil, err
	}
	if p.Regions == (Span{}) {
		p.Regions = Span{0, t.regions()}
	}
	if p.Regions.Lo < 0 || p.Regions.Lo >= p.Regions.Hi || p.Regions.Hi > t.regions() {
		return nil, fmt.Errorf("%w: regions %d..%d of %d", ErrBadBlocks, p.Regions.Lo, p.Regions.Hi, t.regions())
	}
	// Check the whole part before recording any of it: a refused part changes nothing.
	for i, b := range p.Blocks {
		if p.Offset+i >= len(r.src) {
			break
		}
		src := r.src[p.Offset+i]
		if src == nil {
			continue
		}
		if reg, twice := anySet(src.ready, p.Regions); twice {
			return nil, fmt.Errorf("%w: position %d region %d reported twice", ErrBadBlocks, p.Offset+i, reg)
		}
		if src.block != b {
			return nil, fmt.Errorf("%w: position %d was block %d in an earlier part, now %d", ErrBadBlocks, p.Offset+i, src.block, b)
		}
	}
	// New positions share two allocations per part, not two each: a 16k-token part is
	// 1024 positions, recorded on the rank's pump.
	words := (t.regions() + 63) / 64
	if end > len(r.src) {
		r.src = append(r.src, make([]*source, end-len(r.src))...)
	}
	var fresh []source
	var bitsets []uint64
	for i, b := range p.Blocks {
		src := r.src[p.Offset+i]
		if src == nil {
			if fresh == nil {
				fresh, bitsets = make([]source, len(p.Blocks)), make([]uint64, len(p.Blocks)*words)
			}
			src = &fresh[i]
			src.block, src.ready = b, bitsets[i*words:(i+1)*words:(i+1)*words]
			r.src[p.Offset+i] = src
		}
		setAll(src.ready, p.Regions)
	}
	r.parts = append(r.parts, p)
	if r.first.IsZero() {
		r.first = now
	}
	if p.Final {
		r.final = end
		if r.current == nil {
			r.waiting = now
		}
	}
	return t.progress(now, r), nil
}

// progress hands the current attempt's newly pairable positions to the writer, and
// reports delivery when everything is written. A current attempt waits while an older
// one drains.
func (t *Table) progress(now time.Time, r *request) []Action {
	cur := r.current
	if cur == nil || cur.fenced || cur.done || len(r.old) > 0 {
		return nil
	}
	// The parts not yet handed to this attempt go out as one transfer per span of
	// regions, in the order the spans first arrived: a layer group is written before the
	// next, and runs of positions with the same span merge into one transfer.
	var trs []*Transfer
	bySpan := map[Span]*Transfer{}
	positions := map[Span]int{}
	for _, p := range r.parts[cur.sent:] {
		positions[p.Regions] += len(p.Blocks)
	}
	for _, p := range r.parts[cur.sent:] {
		tr := bySpan[p.Regions]
		if tr == nil {
			n := positions[p.Regions]
			tr = &Transfer{Request: cur.reg.Request, Attempt: cur.reg.Attempt, Decode: cur.reg.Decode, Regions: p.Regions,
				Src: make([]uint32, 0, n), Dst: make([]uint32, 0, n)}
			bySpan[p.Regions] = tr
			trs = append(trs, tr)
		}
		// Positions before the registration's first are decode's cached prefix.
		for i := max(cur.reg.First-p.Offset, 0); i < len(p.Blocks); i++ {
			tr.Src = append(tr.Src, p.Blocks[i])
			tr.Dst = append(tr.Dst, cur.reg.Blocks[p.Offset+i-cur.reg.First])
		}
	}
	cur.sent = len(r.parts)
	var acts []Action
	for _, tr := range trs {
		if len(tr.Src) == 0 {
			continue
		}
		if !cur.paired {
			cur.paired, tr.Paired = true, true
			if !r.first.IsZero() {
				tr.SourceWait = max(now.Sub(r.first), 0)
			}
		}
		acts = append(acts, *tr)
	}
	return append(acts, t.maybeDelivered(now, r)...)
}

func (t *Table) maybeDelivered(now time.Time, r *request) []Action {
	cur := r.current
	if cur == nil || cur.fenced || cur.done || r.final < 0 || cur.inFlight > 0 || cur.completed < max(r.final-cur.reg.First, 0)*t.regions() {
		return nil
	}
	cur.done = true
	t.maybeRetire(now, r)
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
func (t *Table) Completed(now time.Time, req string, att uint64, n int) ([]Action, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.reqs[req]
	a := t.find(req, att)
	if a == nil || n > a.inFlight {
		return nil, fmt.Errorf("%w: %d completions for %s attempt %d", ErrUnknown, n, req, att)
	}
	defer t.recount(r)
	a.inFlight -= n
	a.completed += n
	if a.fenced {
		return t.drained(now, r), nil
	}
	return t.maybeDelivered(now, r), nil
}

// Withdraw takes back the admission of n blocks whose write was not posted after all (the
// provider said "again"); a fenced attempt that has drained by that is acknowledged.
func (t *Table) Withdraw(now time.Time, req string, att uint64, n int) ([]Action, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	a := t.find(req, att)
	if a == nil || n > a.inFlight {
		return nil, fmt.Errorf("%w: withdrawing %d blocks of %s attempt %d", ErrUnknown, n, req, att)
	}
	a.inFlight -= n
	if a.fenced {
		r := t.reqs[req]
		defer t.recount(r)
		return t.drained(now, r), nil
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
func (t *Table) Cancel(now time.Time, req string, att uint64) ([]Action, error) {
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
	defer t.recount(r)
	acts := t.fence(now, r, cur, CancelAcked{Request: req, Attempt: att, Decode: cur.reg.Decode})
	if len(r.old) == 0 && len(r.parts) == 0 && r.final < 0 {
		// No source and nothing left of the attempt: over, as a delivered request would be
		// (else a decode engine that registers and cancels requests prefill never sources
		// would grow the table).
		t.retire(now, r)
	}
	return acts, nil
}

// Expire is the watchdog: it fences every attempt whose lease or registration timeout has
// passed at now, reporting Failed once each has drained, and drops finished sources that
// waited a blocks TTL for a registration (SourceExpired).
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
		acts = append(acts, t.fence(now, r, cur, f)...)
		t.recount(r)
	}
	for id, r := range t.reqs {
		if r.current == nil && len(r.old) == 0 && !r.failed && !r.waiting.IsZero() && !now.Before(r.waiting.Add(t.cfg.BlocksTTL)) {
			r.failed = true
			t.maybeRetire(now, r)
			t.recount(r)
			acts = append(acts, SourceExpired{Request: id, Reason: fmt.Sprintf("no decode registration within the blocks TTL of %s", t.cfg.BlocksTTL)})
		}
	}
	for id, r := range t.retired {
		if !now.Before(r.until) {
			delete(t.retired, id)
			if r.declined {
				t.declines--
			}
		}
	}
	return acts
}

// EngineRestarted drops the state of older epochs of a decode engine: their memory is
// gone, so their attempts are fenced (and acknowledged once drained).
func (t *Table) EngineRestarted(now time.Time, e Engine) []Action {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e.Epoch <= t.epochs[e.ID] {
		return nil
	}
	t.epochs[e.ID] = e.Epoch
	var acts []Action
	for id, r := range t.reqs {
		if cur := r.current; cur != nil && cur.reg.Decode.ID == e.ID && cur.reg.Decode.Epoch < e.Epoch && !cur.fenced {
			acts = append(acts, t.fence(now, r, cur, Failed{Request: id, Attempt: cur.reg.Attempt, Decode: cur.reg.Decode,
				Code: CodeEngineRestarted, Reason: "decode engine restarted"})...)
			t.recount(r)
		}
	}
	return acts
}

// Fail fences an attempt for a reason of the agent's own (a write error, a lost peer):
// Failed comes once its writes have drained. An attempt already fenced or finished is
// left as it is.
func (t *Table) Fail(now time.Time, req string, att uint64, code, reason string) []Action {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.reqs[req]
	if r == nil || r.current == nil || r.current.reg.Attempt != att || r.current.done {
		return nil
	}
	defer t.recount(r)
	return t.fence(now, r, r.current, Failed{Request: req, Attempt: att, Decode: r.current.reg.Decode, Code: code, Reason: reason})
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

// CancelSource is the prefill engine giving up a request: a live attempt is failed
// (Failed once drained) and the source dropped. It reports whether the request was known;
// a declined one is (a push whose decode side answered first gets its prefill leg
// cancelled by the router).
func (t *Table) CancelSource(now time.Time, req string) ([]Action, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.reqs[req]
	if r == nil {
		return nil, t.retired[req].declined
	}
	defer t.recount(r)
	if cur := r.current; cur != nil && !cur.done {
		return t.fence(now, r, cur, Failed{Request: req, Attempt: cur.reg.Attempt, Decode: cur.reg.Decode, Code: CodeSourceCancelled,
			Reason: "the prefill engine cancelled the request"}), true
	}
	r.dropSource()
	r.failed = true
	t.maybeRetire(now, r)
	return nil, true
}

// Abandon is a decode engine's end after it cancelled its attempt: no attempt of the
// request follows from it, so the source is dropped and the request fails (Failed, with
// CodeEngineGone; once drained if the attempt is still draining). It applies only to the
// latest attempt, registered by that engine, of a request neither delivered nor failed.
func (t *Table) Abandon(now time.Time, req string, att uint64, decode string) []Action {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.reqs[req]
	if r == nil || r.failed || r.latest != att || r.latestDecode != decode || (r.current != nil && r.current.done) {
		return nil
	}
	defer t.recount(r)
	const reason = "the decode engine ended before the transfer finished"
	if cur := r.current; cur != nil {
		// Its Cancel comes first on the same connection: a decode agent that sent none.
		return t.fence(now, r, cur, Failed{Request: req, Attempt: att, Decode: cur.reg.Decode, Code: CodeEngineGone, Reason: reason})
	}
	r.dropSource()
	r.failed = true
	t.maybeRetire(now, r)
	return []Action{Failed{Request: req, Attempt: att, Decode: Engine{ID: decode}, Code: CodeEngineGone, Reason: reason}}
}

// Decline records that decode takes none of a request's KV: it computes the request
// itself. A source already reported is dropped now (SourceDeclined), one still to come
// when its final part arrives; registrations of the request are refused from here on
// (ErrSourceGone) until the table forgets it. A request that is over is left as it is,
// and so is one with a registration, live or draining (ErrRegistered): its decode engine
// cancels it instead.
func (t *Table) Decline(now time.Time, req string) ([]Action, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.reqs[req]
	if _, over := t.retired[req]; over && r == nil {
		return nil, nil // delivered, failed or declined: its blocks are freed or being freed
	}
	if r != nil && (r.current != nil || len(r.old) > 0) {
		return nil, ErrRegistered
	}
	if t.declines >= maxDeclined {
		return nil, ErrTooMany
	}
	t.declines++
	// Kept while the source may still come (a blocks TTL), and as long as any retired
	// request keeps its attempt number.
	rt := retired{declined: true, until: now.Add(max(t.cfg.BlocksTTL, t.cfg.RegistrationTimeout) + t.cfg.Lease)}
	var acts []Action
	if r != nil {
		rt.attempt, rt.told = r.latest, r.final >= 0
		delete(t.reqs, req)
		t.recount(r)
		if rt.told {
			acts = append(acts, SourceDeclined{Request: req})
		}
	}
	t.retired[req] = rt
	return acts, nil
}

// maybeRetire drops a request that is over — delivered, or failed with every attempt
// drained — keeping only its latest attempt number for a while: an attempt number is
// never accepted twice, since a writer or a confused decode agent may still hold the
// old attempt's state. A decode agent gives up on a registration after the registration
// timeout and its quarantine, so remembering it for the timeout and a lease more covers
// every registration that can still be in flight.
func (t *Table) maybeRetire(now time.Time, r *request) {
	over := (r.current != nil && r.current.done) || (r.current == nil && r.failed)
	if over && len(r.old) == 0 {
		t.retire(now, r)
	}
}

// retire drops a request that is over, keeping its latest attempt (see maybeRetire).
func (t *Table) retire(now time.Time, r *request) {
	delete(t.reqs, r.id)
	t.retired[r.id] = retired{attempt: r.latest, failed: r.failed, until: now.Add(t.cfg.RegistrationTimeout + t.cfg.Lease)}
}

// fence stops an attempt from writing and queues its outcome for when it has drained.
//
// A Failed outcome also drops the request's source: the agent tells the prefill engine as
// well, which then frees those blocks, so no later attempt may be paired with them, and
// later parts and registrations of the request are refused (ErrSourceGone) until the agent
// forgets it. A cancel keeps the source: the prefill engine was not told, and a retried
// attempt takes the same blocks.
func (t *Table) fence(now time.Time, r *request, a *attempt, outcome Action) []Action {
	a.fenced, a.outcome = true, outcome
	if r.current == a {
		r.current = nil
	}
	if _, failed := outcome.(Failed); failed {
		r.dropSource()
		r.failed = true
	}
	r.old = append(r.old, a)
	return t.drained(now, r)
}

// drained reports the outcomes of fenced attempts with nothing in flight, then lets the
// current attempt proceed once no older attempt is draining.
func (t *Table) drained(now time.Time, r *request) []Action {
	var acts []Action
	keep := r.old[:0]
	for _, a := range r.old {
		if a.inFlight == 0 {
			acts = append(acts, a.outcome)
			if _, ok := a.outcome.(CancelAcked); ok && r.current == nil && r.final >= 0 {
				// A decode engine that aborted the request for good never retries: the
				// source waits one blocks TTL from now for a new registration.
				r.waiting = now
			}
			continue
		}
		keep = append(keep, a)
	}
	r.old = keep
	acts = append(acts, t.progress(now, r)...)
	t.maybeRetire(now, r)
	return acts
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

// spanMask is the bits of span that fall in word i of a region bitset.
func spanMask(i int, span Span) uint64 {
	lo, hi := max(span.Lo-64*i, 0), min(span.Hi-64*i, 64)
	if lo >= hi {
		return 0
	}
	return (^uint64(0) >> (64 - (hi - lo))) << lo
}

// anySet finds a region of span already set in set.
func anySet(set []uint64, span Span) (int, bool) {
	for i, w := range set {
		if hit := w & spanMask(i, span); hit != 0 {
			return 64*i + bits.TrailingZeros64(hit), true
		}
	}
	return 0, false
}

// setAll sets span's regions in set.
func setAll(set []uint64, span Span) {
	for i := range set {
		set[i] |= spanMask(i, span)
	}
}
