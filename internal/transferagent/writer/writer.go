package writer

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/internal/transferagent/rendezvous"
)

// RemoteRegion is a destination region as a peer agent announced it: its layout, the
// address its provider expects for offset 0, and its keys by rail.
type RemoteRegion struct {
	Region
	Addr uint64
	Keys []uint64
}

// Destination is one decode engine's memory, exchanged once per peer and engine epoch.
type Destination struct {
	Peer    fabric.Peer
	Regions []RemoteRegion
	// Notify, when set, makes this a destination of device copies (a pair on one node):
	// the regions' Addr are device addresses in this process, the writer's Copier moves
	// the bytes, and Notify delivers the signal in place of a write carrying data.
	Notify func(data uint64) error
	// Slice is the part of each block written when the decode rank holds other KV heads
	// than this rank (the zero Slice: whole blocks).
	Slice Slice
	// byID indexes Regions by region ID and layout lists them for the planner, both
	// built once by AddDestination.
	byID   map[int]RemoteRegion
	layout []Region
}

// Writer is the background writer of one TP rank. One goroutine owns it: it calls Submit
// for the table's transfers and Poll in a loop; the engine's calls never wait on it.
type Writer struct {
	ep    *fabric.Endpoint
	table *rendezvous.Table
	// MaxInFlight bounds the writes posted and not yet complete.
	MaxInFlight int
	// MaxMessage caps one write's size (default: the provider's max message size).
	MaxMessage uint64

	// Stats counts what was posted: writes (descriptors after merging) and bytes.
	Stats struct{ Writes, Bytes uint64 }

	src     map[int]*fabric.Region
	layout  []Region
	dests   map[rendezvous.Engine]Destination
	queue   []queued
	pending map[uint64]queued
	// signals are the signals posted and not yet complete. Until their completions are
	// reaped the writer is not idle, so its rank keeps driving the endpoint: a provider
	// with manual progress (tcp;ofi_rxm) may hold a posted signal in its send queue until
	// the initiator polls again, and nothing else would poll an idle rank's endpoint.
	signals map[uint64]struct{}
	// OnSignalError, when set, hears of a posted signal that then failed: its decode agent
	// will not see it.
	OnSignalError func(error)
	nextID        uint64
	buf           []fabric.Completion
	reaped        []fabric.Completion // completions read while making room for a signal
	// OnPost, when set, runs after each write is posted and before any completion is
	// reaped (the agent times the post stage with it; tests land a cancel there).
	OnPost func(req string, attempt uint64)
	// SignalPatience bounds how long Signal waits for the provider to take a signal.
	SignalPatience time.Duration

	// copier and srcDev move bytes to destinations with Notify (UseCopier).
	copier Copier
	srcDev map[int]uint64
}

// Copier moves bytes by device copies (CUDA within a node) in place of RMA writes. A copy
// completes, appended by Reap, once its bytes are in the destination's memory.
type Copier interface {
	Copy(dst, src, n, id uint64) error
	Reap(done []fabric.Completion) []fabric.Completion
}

// UseCopier lets the writer serve destinations with Notify: c copies from the local
// regions, whose device addresses by region ID are src.
func (w *Writer) UseCopier(c Copier, src map[int]uint64) { w.copier, w.srcDev = c, src }

// DefaultSignalPatience: a live peer's queue makes room within microseconds of reaping; a
// provider that refuses a signal for a second is facing an endpoint that is gone (a
// decode engine restarted mid-transfer), and waiting longer would stall the rank's pump,
// and every request on it, for good.
const DefaultSignalPatience = time.Second

type queued struct {
	req     string
	attempt uint64
	dest    Destination
	w       Write
}

// New returns a writer posting from the local regions (by Region.ID).
func New(ep *fabric.Endpoint, table *rendezvous.Table, local map[int]*fabric.Region, layout []Region) *Writer {
	return &Writer{
		ep: ep, table: table, MaxInFlight: 64, MaxMessage: ep.Limits().MaxMsgSize, SignalPatience: DefaultSignalPatience,
		src: local, layout: layout, dests: map[rendezvous.Engine]Destination{},
		pending: map[uint64]queued{}, signals: map[uint64]struct{}{}, buf: make([]fabric.Completion, 64),
	}
}

// AddDestination records the memory of one incarnation of a decode engine. Destinations
// are keyed by engine id *and* epoch: an engine id survives a pod restart, and a write or
// signal meant for the old incarnation must never reach the new one's memory or
// completion queue. A newer epoch drops the older ones: what is still queued for them
// keeps its own copy, and their signals fail instead of reaching the newcomer.
func (w *Writer) AddDestination(engine rendezvous.Engine, d Destination) {
	d.byID = make(map[int]RemoteRegion, len(d.Regions))
	d.layout = make([]Region, len(d.Regions))
	for i, r := range d.Regions {
		d.byID[r.ID] = r
		d.layout[i] = r.Region
	}
	for e := range w.dests {
		if e.ID == engine.ID && e.Epoch < engine.Epoch {
			delete(w.dests, e)
		}
	}
	w.dests[engine] = d
}

// HasDestination reports whether this incarnation's memory is known.
func (w *Writer) HasDestination(engine rendezvous.Engine) bool {
	_, ok := w.dests[engine]
	return ok
}

// Submit plans a transfer into its span of regions (the zero span: all) and queues its
// writes, returning how many writes (descriptors after merging) and bytes it queued. A
// transfer that does not fit the regions is refused whole.
func (w *Writer) Submit(t rendezvous.Transfer) (writes int, bytes uint64, err error) {
	d, ok := w.dests[t.Decode]
	if !ok {
		return 0, 0, fmt.Errorf("writer: no memory known for decode engine %s epoch %d", t.Decode.ID, t.Decode.Epoch)
	}
	src := w.layout
	if t.Regions != (rendezvous.Span{}) {
		if t.Regions.Lo < 0 || t.Regions.Lo >= t.Regions.Hi || t.Regions.Hi > len(src) {
			return 0, 0, fmt.Errorf("writer: regions %d..%d of %d", t.Regions.Lo, t.Regions.Hi, len(src))
		}
		src = src[t.Regions.Lo:t.Regions.Hi]
	}
	plan, err := Plan(t, src, d.layout, w.MaxMessage, d.Slice)
	if err != nil {
		return 0, 0, err
	}
	for _, x := range plan {
		w.queue = append(w.queue, queued{req: t.Request, attempt: t.Attempt, dest: d, w: x})
		bytes += x.Len
	}
	return len(plan), bytes, nil
}

// Failure is a write the provider failed: the agent fails its attempt.
type Failure struct {
	Request string
	Attempt uint64
	Err     error
}

// Absorb hands the writer completions its endpoint returned to someone else (a Wait);
// the next Poll processes them.
func (w *Writer) Absorb(cs []fabric.Completion) { w.reaped = append(w.reaped, cs...) }

// Idle reports whether nothing is queued or in flight, signals included.
func (w *Writer) Idle() bool { return len(w.queue) == 0 && len(w.pending) == 0 && len(w.signals) == 0 }

// Poll posts queued writes up to MaxInFlight — each admitted by the table first, so a
// fenced attempt's queued writes are dropped, never posted — and reaps completions into
// the table, returning the actions that result (Delivered, CancelAcked, Failed) and the
// writes the provider failed, whose attempts the caller fails. An error means the
// writer's state disagrees with the table's: a bug, not a fabric fault.
func (w *Writer) Poll(now time.Time) ([]rendezvous.Action, []Failure, error) {
	var acts []rendezvous.Action
	var failed []Failure
	for len(w.queue) > 0 && len(w.pending) < w.MaxInFlight {
		q := w.queue[0]
		if err := w.table.Posted(q.req, q.attempt, q.w.Blocks); err != nil {
			if !errors.Is(err, rendezvous.ErrFenced) && !errors.Is(err, rendezvous.ErrUnknown) {
				return acts, failed, err
			}
			w.drop(q.req, q.attempt)
			continue
		}
		remote := q.dest.byID[q.w.Region] // Plan checked every region exists on both sides
		w.nextID++
		var err error
		if q.dest.Notify != nil {
			if w.copier == nil {
				err = errors.New("writer: a destination of device copies, but this rank's memory is not on a GPU")
			} else {
				err = w.copier.Copy(remote.Addr+q.w.DstOff, w.srcDev[q.w.Region]+q.w.SrcOff, q.w.Len, w.nextID)
			}
		} else {
			err = w.ep.Write(q.dest.Peer, w.src[q.w.Region], q.w.SrcOff, q.w.Len, remote.Addr+q.w.DstOff, remote.Keys, w.nextID)
		}
		if err != nil {
			// Not posted: hand the admission back. "Again" is retried on a later Poll,
			// after reaping; anything else fails the attempt.
			a, werr := w.table.Withdraw(now, q.req, q.attempt, q.w.Blocks)
			acts = append(acts, a...)
			if werr != nil {
				return acts, failed, werr
			}
			if errors.Is(err, fabric.ErrAgain) {
				break
			}
			failed = append(failed, Failure{Request: q.req, Attempt: q.attempt, Err: err})
			w.drop(q.req, q.attempt)
			continue
		}
		w.queue = w.queue[1:]
		w.pending[w.nextID] = q
		w.Stats.Writes++
		w.Stats.Bytes += q.w.Len
		if w.OnPost != nil {
			w.OnPost(q.req, q.attempt)
		}
	}
	n := w.ep.Poll(w.buf)
	done := append(w.reaped, w.buf[:n]...)
	if w.copier != nil {
		done = w.copier.Reap(done)
	}
	w.reaped = nil
	for _, c := range done {
		if _, ok := w.signals[c.ID]; ok {
			delete(w.signals, c.ID)
			if c.Err != nil && w.OnSignalError != nil {
				w.OnSignalError(c.Err)
			}
			continue
		}
		q, ok := w.pending[c.ID]
		if !ok {
			continue
		}
		delete(w.pending, c.ID)
		if c.Err != nil {
			// The write is no longer in flight either way; the caller fails its attempt.
			failed = append(failed, Failure{Request: q.req, Attempt: q.attempt, Err: c.Err})
		}
		a, err := w.table.Completed(now, q.req, q.attempt, q.w.Blocks)
		if err != nil {
			return acts, failed, err
		}
		acts = append(acts, a...)
	}
	return acts, failed, nil
}

// Signal tells a decode engine's agent that a delivered request's KV has landed: a
// zero-length write carrying data (the request's token) into its completion queue.
// Posted after the request's writes completed, it arrives after their data; the local
// completion of a write alone does not mean the data is there. A provider that does not
// take it within SignalPatience makes it an error: the caller reports the attempt failed.
func (w *Writer) Signal(engine rendezvous.Engine, data uint64) error {
	d, ok := w.dests[engine]
	if !ok || len(d.Regions) == 0 {
		return fmt.Errorf("writer: no memory known for decode engine %s epoch %d", engine.ID, engine.Epoch)
	}
	if d.Notify != nil {
		return d.Notify(data) // the copies before it completed: their bytes are in place
	}
	deadline := time.Now().Add(w.SignalPatience)
	for {
		w.nextID++
		err := w.ep.WriteData(d.Peer, data, d.Regions[0].Addr, d.Regions[0].Keys, w.nextID)
		if err == nil {
			w.signals[w.nextID] = struct{}{}
		}
		if !errors.Is(err, fabric.ErrAgain) {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("writer: the provider did not take the signal for decode engine %s within %s: %w", engine.ID, w.SignalPatience, err)
		}
		// Reap to make room; completions of other requests' writes are kept for Poll.
		w.reaped = append(w.reaped, w.buf[:w.ep.Poll(w.buf)]...)
	}
}

// Discard removes an attempt's queued writes once the table has reported its outcome, so
// none is left behind for a later registration of the same request to admit.
func (w *Writer) Discard(req string, attempt uint64) { w.drop(req, attempt) }

// drop removes an attempt's queued writes.
func (w *Writer) drop(req string, attempt uint64) {
	keep := w.queue[:0]
	for _, q := range w.queue {
		if q.req != req || q.attempt != attempt {
			keep = append(keep, q)
		}
	}
	w.queue = keep
}
