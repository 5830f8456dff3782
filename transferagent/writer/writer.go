package writer

import (
	"errors"
	"fmt"

	"github.com/kvhandoff/kvhandoff/transferagent/fabric"
	"github.com/kvhandoff/kvhandoff/transferagent/rendezvous"
)

// RemoteRegion is a destination region as a peer agent announced it: its layout, the
// address its provider expects for offset 0, and its key.
type RemoteRegion struct {
	Region
	Addr, Key uint64
}

// Destination is one decode agent's memory, exchanged once per peer.
type Destination struct {
	Peer    fabric.Peer
	Regions []RemoteRegion
	// byID indexes Regions by region ID, built by AddDestination.
	byID map[int]RemoteRegion
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
	dests   map[string]Destination
	queue   []queued
	pending map[uint64]queued
	nextID  uint64
	buf     []fabric.Completion
	reaped  []fabric.Completion // completions read while making room for a signal
	// afterPost, when set (by tests), runs after each write is posted and before any
	// completion is reaped: the moment a cancel must be able to land in.
	afterPost func()
}

type queued struct {
	req     string
	attempt uint64
	dest    Destination
	w       Write
}

// New returns a writer posting from the local regions (by Region.ID).
func New(ep *fabric.Endpoint, table *rendezvous.Table, local map[int]*fabric.Region, layout []Region) *Writer {
	return &Writer{
		ep: ep, table: table, MaxInFlight: 64, MaxMessage: ep.Limits().MaxMsgSize,
		src: local, layout: layout, dests: map[string]Destination{},
		pending: map[uint64]queued{}, buf: make([]fabric.Completion, 64),
	}
}

// AddDestination records a decode engine's memory.
func (w *Writer) AddDestination(engine string, d Destination) {
	d.byID = make(map[int]RemoteRegion, len(d.Regions))
	for _, r := range d.Regions {
		d.byID[r.ID] = r
	}
	w.dests[engine] = d
}

// Submit plans a transfer and queues its writes. A transfer that does not fit the
// regions is refused whole.
func (w *Writer) Submit(t rendezvous.Transfer) error {
	d, ok := w.dests[t.Decode.ID]
	if !ok {
		return fmt.Errorf("writer: no memory known for decode engine %s", t.Decode.ID)
	}
	dst := make([]Region, len(d.Regions))
	for i, r := range d.Regions {
		dst[i] = r.Region
	}
	writes, err := Plan(t, w.layout, dst, w.MaxMessage)
	if err != nil {
		return err
	}
	for _, x := range writes {
		w.queue = append(w.queue, queued{req: t.Request, attempt: t.Attempt, dest: d, w: x})
	}
	return nil
}

// Idle reports whether nothing is queued or in flight.
func (w *Writer) Idle() bool { return len(w.queue) == 0 && len(w.pending) == 0 }

// Poll posts queued writes up to MaxInFlight — each admitted by the table first, so a
// fenced attempt's queued writes are dropped, never posted — and reaps completions into
// the table, returning the actions that result (Delivered, CancelAcked, Failed).
func (w *Writer) Poll() ([]rendezvous.Action, error) {
	var acts []rendezvous.Action
	for len(w.queue) > 0 && len(w.pending) < w.MaxInFlight {
		q := w.queue[0]
		if err := w.table.Posted(q.req, q.attempt, q.w.Blocks); err != nil {
			if !errors.Is(err, rendezvous.ErrFenced) && !errors.Is(err, rendezvous.ErrUnknown) {
				return acts, err
			}
			w.drop(q.req, q.attempt)
			continue
		}
		remote := q.dest.byID[q.w.Region] // Plan checked every region exists on both sides
		w.nextID++
		err := w.ep.Write(q.dest.Peer, w.src[q.w.Region], q.w.SrcOff, q.w.Len, remote.Addr+q.w.DstOff, remote.Key, w.nextID)
		if errors.Is(err, fabric.ErrAgain) {
			// Not posted: hand the admission back, reap, and post it on a later Poll.
			a, werr := w.table.Withdraw(q.req, q.attempt, q.w.Blocks)
			acts = append(acts, a...)
			if werr != nil {
				return acts, werr
			}
			break
		}
		if err != nil {
			return acts, err
		}
		w.queue = w.queue[1:]
		w.pending[w.nextID] = q
		w.Stats.Writes++
		w.Stats.Bytes += q.w.Len
		if w.afterPost != nil {
			w.afterPost()
		}
	}
	n := w.ep.Poll(w.buf)
	done := append(w.reaped, w.buf[:n]...)
	w.reaped = nil
	for _, c := range done {
		q, ok := w.pending[c.ID]
		if !ok {
			continue
		}
		delete(w.pending, c.ID)
		if c.Err != nil {
			return acts, fmt.Errorf("writer: request %s attempt %d: %w", q.req, q.attempt, c.Err)
		}
		a, err := w.table.Completed(q.req, q.attempt, q.w.Blocks)
		if err != nil {
			return acts, err
		}
		acts = append(acts, a...)
	}
	return acts, nil
}

// Signal tells a decode engine's agent that a delivered request's KV has landed: a
// zero-length write carrying data (the request's token) into its completion queue.
// Posted after the request's writes completed, it arrives after their data; the local
// completion of a write alone does not mean the data is there.
func (w *Writer) Signal(engine string, data uint64) error {
	d, ok := w.dests[engine]
	if !ok || len(d.Regions) == 0 {
		return fmt.Errorf("writer: no memory known for decode engine %s", engine)
	}
	for {
		w.nextID++
		err := w.ep.WriteData(d.Peer, data, d.Regions[0].Addr, d.Regions[0].Key, w.nextID)
		if !errors.Is(err, fabric.ErrAgain) {
			return err
		}
		// Reap to make room; completions of other requests' writes are kept for Poll.
		w.reaped = append(w.reaped, w.buf[:w.ep.Poll(w.buf)]...)
	}
}

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
