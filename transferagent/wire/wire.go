// Package wire is the framing of messages between transfer agents: a decode agent
// forwards registrations, heartbeats and cancels to the prefill agent, which answers with
// acknowledgements, deliveries and failures. Frames are small and decoded strictly — a
// peer's bytes are never trusted: every length is bounded before anything is allocated,
// and a malformed frame is an error, never a panic (FuzzDecode checks that).
//
// A frame is: length (uint32, big endian, of what follows) | version (1 byte) |
// kind (1 byte) | fields, each an unsigned varint or a varint-length-prefixed string,
// in the order of the message's struct.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Version is the framing version this package speaks.
const Version = 1

// Limits on what a peer may send.
const (
	// MaxFrame bounds a frame: a registration of MaxBlocks blocks fits.
	MaxFrame = 8 << 20
	// MaxBlocks bounds the blocks of one registration (a 16k-token request is 1024).
	MaxBlocks = 1 << 20
	// MaxString bounds a request id, engine id or reason.
	MaxString = 1024
)

// Kind says what a frame carries.
type Kind uint8

const (
	KindRegister Kind = iota + 1
	KindHeartbeat
	KindCancel
	KindCancelAcked
	KindDelivered
	KindFailed
)

// Message is one of the message structs below.
type Message interface{ kind() Kind }

// Register forwards decode's registration to the prefill agent.
type Register struct {
	Request     string
	Attempt     uint64
	Engine      string
	EngineEpoch uint64
	Blocks      []uint32
}

// Heartbeat renews a registration's lease.
type Heartbeat struct {
	Request string
	Attempt uint64
}

// Cancel fences an attempt.
type Cancel struct {
	Request string
	Attempt uint64
}

// CancelAcked says a cancelled attempt has drained: its blocks may be reused.
type CancelAcked struct {
	Request string
	Attempt uint64
}

// Delivered says every block of an attempt has landed (sent after the data's signal).
type Delivered struct {
	Request string
	Attempt uint64
}

// Failed says an attempt ended without delivery, after draining.
type Failed struct {
	Request string
	Attempt uint64
	Reason  string
}

func (Register) kind() Kind    { return KindRegister }
func (Heartbeat) kind() Kind   { return KindHeartbeat }
func (Cancel) kind() Kind      { return KindCancel }
func (CancelAcked) kind() Kind { return KindCancelAcked }
func (Delivered) kind() Kind   { return KindDelivered }
func (Failed) kind() Kind      { return KindFailed }

// ErrMalformed wraps every decoding error.
var ErrMalformed = errors.New("wire: malformed frame")

// Encode appends m's frame to b.
func Encode(b []byte, m Message) ([]byte, error) {
	body := []byte{Version, byte(m.kind())}
	var err error
	str := func(s string) {
		if len(s) > MaxString && err == nil {
			err = fmt.Errorf("wire: string of %d bytes exceeds %d", len(s), MaxString)
		}
		body = binary.AppendUvarint(body, uint64(len(s)))
		body = append(body, s...)
	}
	num := func(v uint64) { body = binary.AppendUvarint(body, v) }
	switch m := m.(type) {
	case Register:
		if len(m.Blocks) > MaxBlocks {
			return nil, fmt.Errorf("wire: %d blocks exceed %d", len(m.Blocks), MaxBlocks)
		}
		str(m.Request)
		num(m.Attempt)
		str(m.Engine)
		num(m.EngineEpoch)
		num(uint64(len(m.Blocks)))
		for _, blk := range m.Blocks {
			num(uint64(blk))
		}
	case Heartbeat:
		str(m.Request)
		num(m.Attempt)
	case Cancel:
		str(m.Request)
		num(m.Attempt)
	case CancelAcked:
		str(m.Request)
		num(m.Attempt)
	case Delivered:
		str(m.Request)
		num(m.Attempt)
	case Failed:
		str(m.Request)
		num(m.Attempt)
		str(m.Reason)
	default:
		return nil, fmt.Errorf("wire: cannot encode %T", m)
	}
	if err != nil {
		return nil, err
	}
	if len(body) > MaxFrame {
		return nil, fmt.Errorf("wire: frame of %d bytes exceeds %d", len(body), MaxFrame)
	}
	b = binary.BigEndian.AppendUint32(b, uint32(len(body)))
	return append(b, body...), nil
}

// Read reads one frame from r and decodes it. It reads no more than the frame's length,
// after checking that length against MaxFrame.
func Read(r io.Reader) (Message, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > MaxFrame {
		return nil, fmt.Errorf("%w: length %d exceeds %d", ErrMalformed, n, MaxFrame)
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(r, body); err != nil {
		return nil, fmt.Errorf("%w: truncated body: %v", ErrMalformed, err)
	}
	return Decode(body)
}

// Decode decodes a frame's body (what follows the length).
func Decode(body []byte) (Message, error) {
	d := decoder{b: body}
	if len(body) < 2 {
		return nil, fmt.Errorf("%w: %d bytes", ErrMalformed, len(body))
	}
	if body[0] != Version {
		return nil, fmt.Errorf("%w: version %d, this agent speaks %d", ErrMalformed, body[0], Version)
	}
	kind := Kind(body[1])
	d.b = body[2:]
	var m Message
	switch kind {
	case KindRegister:
		r := Register{Request: d.str(), Attempt: d.num(), Engine: d.str(), EngineEpoch: d.num()}
		n := d.num()
		if n > MaxBlocks || n > uint64(len(d.b)) { // every block takes at least one byte
			return nil, fmt.Errorf("%w: %d blocks", ErrMalformed, n)
		}
		r.Blocks = make([]uint32, n)
		for i := range r.Blocks {
			v := d.num()
			if v > 1<<32-1 {
				d.fail("block id %d overflows 32 bits", v)
			}
			r.Blocks[i] = uint32(v)
		}
		m = r
	case KindHeartbeat:
		m = Heartbeat{Request: d.str(), Attempt: d.num()}
	case KindCancel:
		m = Cancel{Request: d.str(), Attempt: d.num()}
	case KindCancelAcked:
		m = CancelAcked{Request: d.str(), Attempt: d.num()}
	case KindDelivered:
		m = Delivered{Request: d.str(), Attempt: d.num()}
	case KindFailed:
		m = Failed{Request: d.str(), Attempt: d.num(), Reason: d.str()}
	default:
		return nil, fmt.Errorf("%w: unknown kind %d", ErrMalformed, kind)
	}
	if d.err != nil {
		return nil, d.err
	}
	if len(d.b) != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the last field", ErrMalformed, len(d.b))
	}
	return m, nil
}

// decoder reads fields, remembering the first error; later reads return zero values.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: "+format, append([]any{ErrMalformed}, args...)...)
	}
}

func (d *decoder) num() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("bad varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) str() string {
	n := d.num()
	if d.err != nil {
		return ""
	}
	if n > MaxString || n > uint64(len(d.b)) {
		d.fail("string of %d bytes (%d left, limit %d)", n, len(d.b), MaxString)
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}
