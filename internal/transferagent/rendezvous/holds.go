package rendezvous

import (
	"errors"
	"fmt"
	"time"
)

// ErrNotReady is a pull of blocks not held (yet): the request's blocks were not reported
// ready, or not all of them and its final part is still to come. They may be on their
// way (the prefill engine's answer can reach the router, and the decode engine's pull
// this agent, before the engine's worker reports them), so the caller may wait.
var ErrNotReady = errors.New("not reported ready")

// Holds is the prefill agent's pull side: a request's ready blocks, held for one decode
// attempt to read under a lease. The blocks stay held until that attempt releases them,
// until its lease ends (its reads are then no longer trusted by the decode side, which
// counts the same lease from before it asked), or, unacquired, for a blocks TTL. Like
// Table it is pure; P identifies the peer agent connection that acquired a hold.
type Holds[P comparable] struct {
	ttl, lease time.Duration
	// max bounds the positions held in all (0: none), held counts them.
	max, held int
	m         map[string]*hold[P]
	// draining are acquired holds whose lease ended before their release: the engine
	// was told to free the blocks, but the acquirer's reads may still be in flight, and
	// on providers with manual progress (tcp;ofi_rxm) they complete only while this side
	// polls. The decode agent does not trust them and releases the hold once they are
	// done; until then (or until its connection is lost, or a drain limit) this side
	// keeps polling, or those reads, and the decode request waiting on them, never end.
	draining map[drainKey[P]]time.Time
	acquired int // holds a decode agent may be reading now, draining ones included
}

// drainKey names a draining hold: the request, the attempt and the connection reading it.
type drainKey[P comparable] struct {
	req     string
	attempt uint64
	by      P
}

// DrainLimit bounds how long a draining hold keeps this side polling for a decode agent
// that never releases it (a broken peer, not a slow one: reads end within their bytes'
// time once this side polls).
const DrainLimit = time.Minute

type hold[P comparable] struct {
	positions map[uint32]bool // position → present
	blocks    map[uint32]bool // block ids held
	final     bool
	ttlEnd    time.Time
	acquired  bool
	// read is how many of the blocks the acquirer reads: all of them, or the tail after a
	// prefix the decode engine holds.
	read    int
	attempt uint64
	by      P
	// reader names the engine rank that reads (of another tensor-parallel size, it reads
	// only the KV heads both ranks hold).
	reader string
	until  time.Time
}

// NewHolds returns an empty set of holds that hold at most maxPositions positions in all
// (0: no bound; a part beyond it is refused with ErrOverBudget).
func NewHolds[P comparable](blocksTTL, lease time.Duration, maxPositions int) *Holds[P] {
	return &Holds[P]{ttl: blocksTTL, lease: lease, max: maxPositions, m: map[string]*hold[P]{}, draining: map[drainKey[P]]time.Time{}}
}

// drop forgets a hold.
func (h *Holds[P]) drop(req string, o *hold[P]) {
	delete(h.m, req)
	h.held -= len(o.positions)
}

// Ready holds a part of a request's blocks; the blocks TTL counts from its first part.
func (h *Holds[P]) Ready(now time.Time, p Part) error {
	if h.max > 0 && h.held+len(p.Blocks) > h.max {
		return fmt.Errorf("%w: %d held, %d more asked for, at most %d", ErrOverBudget, h.held, len(p.Blocks), h.max)
	}
	o := h.m[p.Request]
	if o == nil {
		o = &hold[P]{positions: map[uint32]bool{}, blocks: map[uint32]bool{}, ttlEnd: now.Add(h.ttl)}
		h.m[p.Request] = o
	}
	if o.final {
		return fmt.Errorf("request_id: %s already had its final part", p.Request)
	}
	for i := range p.Blocks {
		if o.positions[uint32(p.Offset+i)] {
			return fmt.Errorf("offset: position %d of %s was reported twice", p.Offset+i, p.Request)
		}
	}
	for i, b := range p.Blocks {
		o.positions[uint32(p.Offset+i)] = true
		o.blocks[b] = true
	}
	h.held += len(p.Blocks)
	o.final = p.Final
	return nil
}

// Acquire grants attempt (over by) the blocks for a lease from now. Only one attempt
// holds a request at a time; it may ask again (the same lease is renewed).
func (h *Holds[P]) Acquire(now time.Time, req string, attempt uint64, by P, reader string, blocks []uint32) (time.Duration, error) {
	o := h.m[req]
	switch {
	case o == nil:
		return 0, fmt.Errorf("request %s holds no blocks here (%w, expired or released)", req, ErrNotReady)
	case o.acquired && (o.attempt != attempt || o.by != by):
		return 0, fmt.Errorf("request %s is being pulled by attempt %d", req, o.attempt)
	}
	for _, b := range blocks {
		if !o.blocks[b] {
			if !o.final {
				return 0, fmt.Errorf("block %d of request %s: %w", b, req, ErrNotReady)
			}
			return 0, fmt.Errorf("block %d is not among request %s's ready blocks", b, req)
		}
	}
	if !o.acquired {
		h.acquired++
	}
	o.acquired, o.attempt, o.by, o.reader, o.until, o.read = true, attempt, by, reader, now.Add(h.lease), len(blocks)
	return h.lease, nil
}

// Release ends the hold its acquirer releases, returning how many blocks it read and the
// reader it named; ok is false when there was no such hold, or it was draining (the
// engine already heard that its lease ended).
func (h *Holds[P]) Release(req string, attempt uint64, by P) (n int, reader string, ok bool) {
	if k := (drainKey[P]{req, attempt, by}); !h.draining[k].IsZero() {
		delete(h.draining, k)
		h.acquired--
		return 0, "", false
	}
	o := h.m[req]
	if o == nil || !o.acquired || o.attempt != attempt || o.by != by {
		return 0, "", false
	}
	h.drop(req, o)
	h.acquired--
	return o.read, o.reader, true
}

// Cancel drops a request's hold unless a decode agent is reading it (its lease then
// ends it). It reports whether a hold was dropped.
func (h *Holds[P]) Cancel(req string) bool {
	if o := h.m[req]; o != nil && !o.acquired {
		h.drop(req, o)
		return true
	}
	return false
}

// Expire drops holds whose lease ended before a release, or that nobody acquired within
// the blocks TTL; the prefill engine is told to free them.
func (h *Holds[P]) Expire(now time.Time) []SourceExpired {
	var out []SourceExpired
	for req, o := range h.m {
		var reason string
		switch {
		case o.acquired && !now.Before(o.until):
			reason = fmt.Sprintf("pull lease of %s ended before the decode agent released the blocks", h.lease)
		case !o.acquired && !now.Before(o.ttlEnd):
			reason = fmt.Sprintf("no pull within the blocks TTL of %s", h.ttl)
		default:
			continue
		}
		h.drop(req, o)
		if o.acquired {
			h.draining[drainKey[P]{req, o.attempt, o.by}] = now.Add(DrainLimit) // still counted in acquired
		}
		out = append(out, SourceExpired{Request: req, Reason: reason})
	}
	for k, limit := range h.draining {
		if !now.Before(limit) {
			delete(h.draining, k)
			h.acquired--
		}
	}
	return out
}

// PeerLost ends the draining holds of a lost connection: nobody is left to read them.
// (Its live holds keep their blocks until their lease ends, since its reads may still be
// in flight; they drain no further once it is gone.)
func (h *Holds[P]) PeerLost(by P) {
	for k := range h.draining {
		if k.by == by {
			delete(h.draining, k)
			h.acquired--
		}
	}
}

// Lease is the lease a grant gives.
func (h *Holds[P]) Lease() time.Duration { return h.lease }

// Len is how many requests' sources are held.
func (h *Holds[P]) Len() int { return len(h.m) }

// Acquired reports whether a decode agent may be reading now. The session's pump asks on
// every turn, so it is a counter, not a scan.
func (h *Holds[P]) Acquired() bool { return h.acquired > 0 }
