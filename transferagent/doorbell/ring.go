// Package doorbell is the engine API's data path without RPCs: two single-producer,
// single-consumer rings in a memfd that an engine rank and its agent both map, and two
// bells: Unix stream socket pairs the agent makes, one a direction, whose other ends it
// keeps. The engine writes its SourceReady reports and its Pulls into the submit ring and
// rings the first bell (writes any bytes: 8 bytes of 1, as an eventfd write, is what
// connectors write; a full bell need not be written, it will be read); the agent writes
// the session's events (DELIVERED, SOURCE_DONE, ...) into the events ring, which the
// engine reads at each of its steps, and rings the second (an engine may wait on it, or
// close it; the agent's end is shut for reading). An engine that closes the first ends its
// session. gRPC stays for everything else: registration, the other calls, and the event
// stream that is the engine's liveness.
//
// # Layout
//
// All integers are little-endian; offsets are in bytes from the memfd's start.
//
//	0     magic    u64  "KVHBELL1"
//	8     capacity u64  C: the size of each ring's data, a power of two in [MinCapacity, MaxCapacity]
//	64    submit head u64 (the agent's: bytes consumed)
//	128   submit tail u64 (the engine's: bytes produced)
//	192   events head u64 (the engine's)
//	256   events tail u64 (the agent's)
//	4096  submit data, C bytes
//	4096+C events data, C bytes
//
// The memfd is exactly 4096+2C bytes, every page allocated, and sealed against shrinking
// and growing (F_SEAL_SHRINK, F_SEAL_GROW), so neither side's mapping can lose pages.
//
// # Records
//
// head and tail count bytes ever consumed and produced; a record starts at tail mod C.
// A record is a u32 length n (1 ≤ n ≤ MaxRecord), a u32 kind, then n bytes of a protobuf
// message, padded with zeros to a multiple of 8. A record never wraps: where it would not
// fit before the ring's end, the producer writes the u32 wrapMark there and continues at
// the ring's start. Submit records are agentv1.SourceReadyRequest (KindSourceReady) or
// agentv1.PullRequest (KindPull), their session field ignored: the ring is the session's.
// Events records are agentv1.Event (KindEvent). A kind the agent does not know breaks the
// ring.
//
// # Ordering
//
// The producer writes a record's bytes, then stores tail; the consumer loads tail, then
// reads the records below it, then stores head. Stores and loads of head and tail are
// single aligned 8-byte accesses: x86-64's total store order then makes a record visible
// no later than the tail that covers it, so a producer without atomic instructions (the
// vLLM connector's Python) is correct there. Engines on other architectures must use
// release stores and acquire loads, or keep to gRPC.
//
// # Trust
//
// The agent trusts nothing in the memfd: it keeps its own copies of capacity and of the
// indexes it owns, copies each record out before parsing it, and treats an index or
// length out of bounds as a corrupt ring (ErrCorrupt), which ends the session.
package doorbell

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"
)

const (
	// Magic starts a doorbell memfd.
	Magic = 0x314c4c4542484b56 // "KVHBELL1" read little-endian

	// HeaderSize is the header's size; the rings' data follows it.
	HeaderSize = 4096
	// MinCapacity and MaxCapacity bound each ring's size.
	MinCapacity = 64 << 10
	MaxCapacity = 16 << 20
	// DefaultCapacity is what the Go client and the vLLM connector use: room for
	// hundreds of reports of 10k-block prompts.
	DefaultCapacity = 1 << 20
	// MaxRecord bounds one record's message: a report of 60k blocks.
	MaxRecord = 256 << 10

	offMagic      = 0
	offCapacity   = 8
	offSubmitHead = 64
	offSubmitTail = 128
	offEventsHead = 192
	offEventsTail = 256

	recordHeader = 8
	wrapMark     = 0xffffffff
)

// Kind says what message a record holds.
type Kind uint32

// The record kinds: in the submit ring, reports and pulls; in the events ring, events.
const (
	KindSourceReady Kind = 0
	KindPull        Kind = 1
	KindEvent       Kind = 0
)

// ErrFull says a ring has no room for a record now; the consumer frees room as it reads.
var ErrFull = errors.New("doorbell: ring full")

// ErrCorrupt says a ring's indexes or records break the layout: the other side is broken
// or hostile.
var ErrCorrupt = errors.New("doorbell: corrupt ring")

// Size is the memfd size for rings of capacity bytes.
func Size(capacity uint64) uint64 { return HeaderSize + 2*capacity }

// CheckCapacity checks a capacity against the layout's rules.
func CheckCapacity(c uint64) error {
	if c < MinCapacity || c > MaxCapacity || c&(c-1) != 0 {
		return fmt.Errorf("doorbell: capacity %d is not a power of two in [%d, %d]", c, MinCapacity, MaxCapacity)
	}
	return nil
}

// Init writes a fresh header into mem (the engine, before passing the memfd).
func Init(mem []byte, capacity uint64) error {
	if err := CheckCapacity(capacity); err != nil {
		return err
	}
	if uint64(len(mem)) != Size(capacity) {
		return fmt.Errorf("doorbell: %d bytes mapped for a %d-byte layout", len(mem), Size(capacity))
	}
	clear(mem[:HeaderSize])
	binary.LittleEndian.PutUint64(mem[offMagic:], Magic)
	binary.LittleEndian.PutUint64(mem[offCapacity:], capacity)
	return nil
}

// Capacity reads and checks the header of a mapped memfd of size bytes (the agent, once,
// when the memfd is passed).
func Capacity(mem []byte) (uint64, error) {
	if len(mem) < HeaderSize {
		return 0, fmt.Errorf("doorbell: %d bytes is smaller than the header", len(mem))
	}
	if m := binary.LittleEndian.Uint64(mem[offMagic:]); m != Magic {
		return 0, fmt.Errorf("doorbell: magic %#x, want %#x (KVHBELL1)", m, uint64(Magic))
	}
	c := binary.LittleEndian.Uint64(mem[offCapacity:])
	if err := CheckCapacity(c); err != nil {
		return 0, err
	}
	if uint64(len(mem)) != Size(c) {
		return 0, fmt.Errorf("doorbell: the memfd has %d bytes; capacity %d needs exactly %d", len(mem), c, Size(c))
	}
	return c, nil
}

// Ring is one direction of a doorbell memfd, as one side sees it. A Ring is used by one
// goroutine at a time.
type Ring struct {
	data     []byte
	capacity uint64
	head     *uint64 // shared: the consumer's
	tail     *uint64 // shared: the producer's
	// own is this side's copy of the index it owns (head as consumer, tail as producer):
	// the shared word is only ever stored from it, never read back.
	own uint64
}

// Submit returns the submit ring (engine → agent) of a mapped doorbell memfd whose
// capacity was checked.
func Submit(mem []byte, capacity uint64) *Ring {
	return newRing(mem, capacity, offSubmitHead, offSubmitTail, HeaderSize)
}

// Events returns the events ring (agent → engine).
func Events(mem []byte, capacity uint64) *Ring {
	return newRing(mem, capacity, offEventsHead, offEventsTail, HeaderSize+capacity)
}

func newRing(mem []byte, capacity uint64, head, tail, data uint64) *Ring {
	return &Ring{
		data: mem[data : data+capacity], capacity: capacity,
		head: (*uint64)(unsafe.Pointer(&mem[head])), tail: (*uint64)(unsafe.Pointer(&mem[tail])),
	}
}

// AsProducer and AsConsumer start this side's own index from the shared word, for a
// side that attaches to a ring already in use (the agent attaches to fresh rings: 0).
func (r *Ring) AsProducer() *Ring { r.own = atomic.LoadUint64(r.tail); return r }
func (r *Ring) AsConsumer() *Ring { r.own = atomic.LoadUint64(r.head); return r }

func recordLen(n int) uint64 { return recordHeader + (uint64(n)+7)&^7 }

// Put writes one record (the producer). It returns ErrFull when the consumer has not
// freed room for it yet, and ErrCorrupt when the consumer's head is impossible.
func (r *Ring) Put(kind Kind, msg []byte) error {
	if len(msg) == 0 || len(msg) > MaxRecord {
		return fmt.Errorf("doorbell: a record of %d bytes; records hold 1 to %d", len(msg), MaxRecord)
	}
	head := atomic.LoadUint64(r.head)
	used := r.own - head
	if used > r.capacity {
		return fmt.Errorf("%w: head %d is more than the capacity behind tail %d", ErrCorrupt, head, r.own)
	}
	need := recordLen(len(msg))
	pos := r.own % r.capacity
	pad := uint64(0)
	if pos+need > r.capacity {
		pad = r.capacity - pos // to the ring's end, marked, then the record at its start
	}
	if used+pad+need > r.capacity {
		return ErrFull
	}
	if pad > 0 {
		binary.LittleEndian.PutUint32(r.data[pos:], wrapMark)
		pos = 0
	}
	rec := r.data[pos : pos+need]
	binary.LittleEndian.PutUint32(rec, uint32(len(msg)))
	binary.LittleEndian.PutUint32(rec[4:], uint32(kind))
	n := copy(rec[recordHeader:], msg)
	clear(rec[recordHeader+n:])
	r.own += pad + need
	atomic.StoreUint64(r.tail, r.own)
	return nil
}

// Drain calls fn with the kind and a copy of each record the producer has published, in
// order, then frees their room (the consumer). It stops at the first error: fn's, or ErrCorrupt for
// a record or tail that breaks the layout, after which the ring must not be used again.
func (r *Ring) Drain(fn func(kind Kind, msg []byte) error) (int, error) {
	tail := atomic.LoadUint64(r.tail)
	if tail-r.own > r.capacity {
		return 0, fmt.Errorf("%w: tail %d is more than the capacity ahead of head %d", ErrCorrupt, tail, r.own)
	}
	count := 0
	var err error
	for r.own != tail && err == nil {
		pos := r.own % r.capacity
		left := tail - r.own // pos is a multiple of 8: own only ever moves by such
		n := binary.LittleEndian.Uint32(r.data[pos:])
		if n == wrapMark {
			skip := r.capacity - pos
			if skip > left {
				return count, fmt.Errorf("%w: a wrap at %d past the tail", ErrCorrupt, pos)
			}
			r.own += skip
			continue
		}
		need := recordLen(int(n))
		if n == 0 || n > MaxRecord || pos+need > r.capacity || need > left {
			return count, fmt.Errorf("%w: a record of %d bytes at %d, %d bytes before the tail", ErrCorrupt, n, pos, left)
		}
		// A copy: the producer may write the shared bytes while they are parsed.
		kind := Kind(binary.LittleEndian.Uint32(r.data[pos+4:]))
		msg := make([]byte, n)
		copy(msg, r.data[pos+recordHeader:])
		r.own += need
		count++
		err = fn(kind, msg)
	}
	atomic.StoreUint64(r.head, r.own)
	return count, err
}
