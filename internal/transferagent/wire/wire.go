// Package wire is the framing of messages between transfer agents: the handshake, the
// exchange of engine memory (fabric address, region keys), and the push and pull control
// messages. Frames are small and decoded strictly — a peer's bytes are never trusted:
// every length is bounded before anything is allocated, and a malformed frame is an
// error, never a panic (FuzzDecode checks that).
//
// A frame is: length (uint32, big endian, of what follows) | version (1 byte) |
// kind (1 byte) | fields, each an unsigned varint, a varint-length-prefixed string, or a
// varint count followed by that many varint block ids, in the order of the message's
// fields method.
package wire

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strconv"
)

// Version is the framing version this package speaks.
const Version = 1

// Limits on what a peer may send.
const (
	// MaxFrame bounds a frame: a registration of MaxBlocks blocks fits (at most 5 bytes
	// each).
	MaxFrame = 2 << 20
	// MaxBlocks bounds the blocks of one message: a 16k-token request is 1024, and 1<<18
	// is a 4M-token request at block size 16 (2M at 8). A higher bound costs memory an
	// agent must be ready to buffer per request in flight, for every engine of its node.
	MaxBlocks = 1 << 18
	// MaxString bounds a request id, engine id, address or reason.
	MaxString = 1024
	// MaxRegions bounds the regions of one engine (vLLM has 2 per layer).
	MaxRegions = 4096
	// MaxRails bounds an engine rank's endpoints (one per NIC).
	MaxRails = 16
)

// Kind says what a frame carries.
type Kind uint8

const (
	KindHello Kind = iota + 1
	KindAuth
	KindEngineInfo
	KindRegister
	KindHeartbeat
	KindCancel
	KindCancelAcked
	KindFailed
	KindAcquire
	KindAcquired
	KindRelease
	KindWriting
	KindRails
	KindGPU
	KindDecline
	KindAbandon
	KindSignalled
	KindResignal
	KindRegisterTail
	KindHeads
)

// Message is a pointer to one of the message structs below.
type Message interface {
	Kind() Kind
	fields(c codec)
}

// Hello opens a connection, from both sides: the agent's name, its epoch (new at every
// start, so a peer can drop what it knew of the previous run) and a nonce the other side
// must answer with Auth.
type Hello struct {
	Agent string
	Epoch uint64
	Nonce string
}

// Auth proves the sender holds the shared token: Proof of its role and the connection's
// two Hellos.
type Auth struct{ MAC string }

// The roles a handshake proof is made for: the side that dialled proves first.
const (
	RoleDialer   = "dialer"
	RoleAcceptor = "acceptor"
)

// Proof is the MAC an Auth carries: HMAC-SHA256 under the cluster token of the prover's
// role and both Hellos, dialer's first, every field length-prefixed so no two
// transcripts encode alike. Bound to role and both nonces, a proof is good for one
// direction of one connection only.
func Proof(token []byte, role string, dialer, acceptor *Hello) string {
	h := hmac.New(sha256.New, token)
	field := func(s string) {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	field("kvhandoff-peer-auth-v2")
	field(role)
	for _, hello := range []*Hello{dialer, acceptor} {
		field(hello.Agent)
		field(strconv.FormatUint(hello.Epoch, 10))
		field(hello.Nonce)
	}
	return string(h.Sum(nil))
}

// RegionInfo is one registered region as a peer may address it.
type RegionInfo struct {
	ID       uint64
	BlockLen uint64
	Blocks   uint64
	Addr     uint64 // the address the provider expects for offset 0
	Key      uint64
}

// EngineInfo tells a peer how to reach an engine rank's memory: its fabric address and
// regions. It is sent once per connection and engine epoch, before the first message
// naming the engine.
type EngineInfo struct {
	Engine  string
	Epoch   uint64
	Address string
	Regions []RegionInfo

	// Rails are the engine's further rails, and GPU its GPU memory, from the Rails and GPU
	// messages that follow this one (they are not part of EngineInfo's frame).
	Rails []Rail
	GPU   *GPU
	Heads *Heads
}

// GPU says an engine rank's regions are GPU memory, sent right after its EngineInfo (whose
// region addresses and keys then mean nothing). To the engine's own agent (a pair on one
// node, over the in-process pipe) it carries each region's CUDA IPC handle and offset, so
// the agent can copy to and from it; to any other agent none, since a handle opens only
// on its own node: that agent learns the memory is out of its reach.
type GPU struct {
	Engine string
	Epoch  uint64
	// Device is the GPU's UUID (16 bytes).
	Device string
	// Handles and Offsets are, by region in EngineInfo's order, the allocation holding it
	// (its IPC handle, 64 bytes, or the agent's number of an allocation passed as an fd, 8
	// bytes little-endian) and where in it the region starts; sent only within the agent.
	Handles []string
	Offsets []uint64
}

// WithGPU returns a copy of m with its GPU description, or an error when g does not
// describe m's engine and epoch or names other than one handle and offset per region.
func (m *EngineInfo) WithGPU(g *GPU) (*EngineInfo, error) {
	switch {
	case g.Engine != m.Engine || g.Epoch != m.Epoch:
		return nil, fmt.Errorf("wire: GPU memory of %s epoch %d follows the memory of %s epoch %d", g.Engine, g.Epoch, m.Engine, m.Epoch)
	case len(g.Device) != 16:
		return nil, fmt.Errorf("wire: GPU memory of %s names a %d-byte device UUID", g.Engine, len(g.Device))
	case len(g.Handles) != len(g.Offsets) || (len(g.Handles) != 0 && len(g.Handles) != len(m.Regions)):
		return nil, fmt.Errorf("wire: GPU memory of %s has %d handles and %d offsets for %d regions", g.Engine, len(g.Handles), len(g.Offsets), len(m.Regions))
	}
	for i, h := range g.Handles {
		if len(h) != 64 && len(h) != 8 {
			return nil, fmt.Errorf("wire: GPU memory of %s: region %d's handle has %d bytes, not 64 (an IPC handle) or 8 (a passed allocation)", g.Engine, i, len(h))
		}
	}
	c := *m
	c.GPU = g
	return &c, nil
}

// Heads says which of the model's KV heads an engine rank holds, sent right after its
// EngineInfo (and Rails and GPU): peers of another tensor-parallel size move only the
// heads both ranks hold, a slice of HeadBytes per head of every block (the HND layout).
// An agent from before it skips it; its engines are then taken to hold the same heads as
// the rank they are paired with, which is what equal sizes mean.
type Heads struct {
	Engine       string
	Epoch        uint64
	First, Count uint64
	HeadBytes    uint64
}

// WithHeads returns a copy of m with h, or an error when h does not describe m's engine
// and epoch or its heads do not fill every region's blocks.
func (m *EngineInfo) WithHeads(h *Heads) (*EngineInfo, error) {
	if h.Engine != m.Engine || h.Epoch != m.Epoch {
		return nil, fmt.Errorf("wire: heads of %s epoch %d follow the memory of %s epoch %d", h.Engine, h.Epoch, m.Engine, m.Epoch)
	}
	if h.Count == 0 || h.Count > 1<<16 || h.First > 1<<16 || h.HeadBytes == 0 || h.HeadBytes > 1<<32 {
		return nil, fmt.Errorf("wire: heads of %s: %d heads from %d of %d bytes", h.Engine, h.Count, h.First, h.HeadBytes)
	}
	for _, r := range m.Regions {
		if r.BlockLen != h.Count*h.HeadBytes {
			return nil, fmt.Errorf("wire: heads of %s: region %d's %d-byte blocks are not %d heads of %d bytes", h.Engine, r.ID, r.BlockLen, h.Count, h.HeadBytes)
		}
	}
	c := *m
	c.Heads = h
	return &c, nil
}

// Rails describes an engine rank's endpoints beyond the first (one per NIC), sent right
// after its EngineInfo when it has more than one. It is a message of its own so that
// EngineInfo's frame stays what agents without rails speak; an agent that predates it
// refuses the frame (unknown kind), so rails are turned on only once every agent of the
// cluster knows it. (Agents since Decline skip a kind they do not know instead.)
type Rails struct {
	Engine string
	Epoch  uint64
	Rails  []Rail
}

// Rail is one further rail: its fabric address, and the keys of the engine's regions on
// it in EngineInfo's region order.
type Rail struct {
	Address string
	Keys    []uint64
}

// Addresses are the engine's fabric addresses, by rail.
func (m *EngineInfo) Addresses() [][]byte {
	out := [][]byte{[]byte(m.Address)}
	for _, r := range m.Rails {
		out = append(out, []byte(r.Address))
	}
	return out
}

// Keys are region i's keys, by rail.
func (m *EngineInfo) Keys(i int) []uint64 {
	out := []uint64{m.Regions[i].Key}
	for _, r := range m.Rails {
		out = append(out, r.Keys[i])
	}
	return out
}

// WithRails returns a copy of m with r's rails, or an error when r does not describe
// m's engine and epoch, or names a region key count other than m's.
func (m *EngineInfo) WithRails(r *Rails) (*EngineInfo, error) {
	if r.Engine != m.Engine || r.Epoch != m.Epoch {
		return nil, fmt.Errorf("wire: rails of %s epoch %d follow the memory of %s epoch %d", r.Engine, r.Epoch, m.Engine, m.Epoch)
	}
	for i, rail := range r.Rails {
		if len(rail.Keys) != len(m.Regions) {
			return nil, fmt.Errorf("wire: rail %d of %s has %d region keys for %d regions", i+1, r.Engine, len(rail.Keys), len(m.Regions))
		}
	}
	c := *m
	c.Rails = r.Rails
	return &c, nil
}

// Register forwards decode's registration to the prefill agent. Token is what the
// prefill agent's signal carries back to name this attempt.
type Register struct {
	Request     string
	Attempt     uint64
	Engine      string
	EngineEpoch uint64
	Source      string
	Token       uint64
	Blocks      []uint32
}

// RegisterTail is a Register whose Blocks are the destinations of token-order positions
// First, First+1, …: decode's prefix cache holds the positions before First, which are
// not written. A kind of its own rather than a field of Register: an agent that predates
// it skips it (the registration then times out and fails, reported) instead of reading
// it as a registration from position 0, which would write the prompt's head into the
// tail's blocks.
type RegisterTail struct {
	Register
	First uint64
}

// Heartbeat renews a registration's (or an acquired pull's) lease.
type Heartbeat struct {
	Request string
	Attempt uint64
	Source  string
}

// Cancel fences a registered attempt.
type Cancel struct {
	Request string
	Attempt uint64
	Source  string
}

// CancelAcked says a cancelled attempt has drained. Signalled: a fence signal was posted
// after its last write, and the decode agent acknowledges only once it has arrived.
type CancelAcked struct {
	Request   string
	Attempt   uint64
	Engine    string
	Signalled uint64
}

// Failed says an attempt ended without delivery, after draining (Signalled as above), or
// that a pull's acquire was refused.
type Failed struct {
	Request   string
	Attempt   uint64
	Engine    string
	Reason    string
	Signalled uint64
}

// Acquire asks the prefill agent to hold a request's source blocks for a pull.
type Acquire struct {
	Request     string
	Attempt     uint64
	Engine      string
	EngineEpoch uint64
	Source      string
	Blocks      []uint32
}

// Acquired grants an Acquire: the blocks are held for LeaseMillis from its receipt.
type Acquired struct {
	Request     string
	Attempt     uint64
	Engine      string
	LeaseMillis uint64
}

// Release ends a pull: the decode agent has read (or given up on) the blocks.
type Release struct {
	Request string
	Attempt uint64
	Source  string
	Failed  uint64 // nonzero: the pull did not complete
}

// Decline tells a prefill agent (push) that the decode engine will take none of a
// request's KV: it computes the request itself, its prefix cache holding part of the
// prompt. The source's blocks are freed at once instead of after the blocks TTL.
type Decline struct {
	Request string
	Source  string
}

// Signalled tells the decode agent that an attempt's delivery signal was posted. A signal
// can be lost or stall in a provider (seen under CPU starvation); a decode agent that
// holds this message but has seen no signal within a grace asks for it again (Resignal),
// and a duplicate signal is harmless. Agents that do not know either message skip them.
type Signalled struct {
	Request string
	Attempt uint64
	Engine  string // the decode engine
}

// Resignal asks the prefill agent to post an attempt's delivery signal again.
type Resignal struct {
	Request string
	Attempt uint64
	Source  string
}

// Abandon says the decode engine that registered an attempt has ended, after its
// Cancel: no attempt of the request follows from it (a retry elsewhere is a new request),
// so the prefill agent drops the source and tells its engine, which frees the blocks now
// rather than after the blocks TTL. An agent that does not know it skips it (the source
// then waits out the TTL, as before).
type Abandon struct {
	Request string
	Attempt uint64
	Engine  string // the decode engine, as in its Register
	Source  string
}

// Writing tells the decode agent that an attempt's writes are starting, so it polls its
// endpoint without pause while they arrive (providers such as tcp;ofi_rxm move data
// only while the target polls, and an incoming write raises no completion to notice).
type Writing struct {
	Request string
	Attempt uint64
	Engine  string
}

func (*Hello) Kind() Kind        { return KindHello }
func (*Writing) Kind() Kind      { return KindWriting }
func (*Auth) Kind() Kind         { return KindAuth }
func (*EngineInfo) Kind() Kind   { return KindEngineInfo }
func (*Register) Kind() Kind     { return KindRegister }
func (*Heartbeat) Kind() Kind    { return KindHeartbeat }
func (*Cancel) Kind() Kind       { return KindCancel }
func (*CancelAcked) Kind() Kind  { return KindCancelAcked }
func (*Failed) Kind() Kind       { return KindFailed }
func (*Acquire) Kind() Kind      { return KindAcquire }
func (*Acquired) Kind() Kind     { return KindAcquired }
func (*Release) Kind() Kind      { return KindRelease }
func (*Rails) Kind() Kind        { return KindRails }
func (*GPU) Kind() Kind          { return KindGPU }
func (*Decline) Kind() Kind      { return KindDecline }
func (*Abandon) Kind() Kind      { return KindAbandon }
func (*Signalled) Kind() Kind    { return KindSignalled }
func (*Resignal) Kind() Kind     { return KindResignal }
func (*RegisterTail) Kind() Kind { return KindRegisterTail }
func (*Heads) Kind() Kind        { return KindHeads }

func (m *Hello) fields(c codec) { c.str(&m.Agent); c.num(&m.Epoch); c.str(&m.Nonce) }
func (m *Auth) fields(c codec)  { c.str(&m.MAC) }
func (m *EngineInfo) fields(c codec) {
	c.str(&m.Engine)
	c.num(&m.Epoch)
	c.str(&m.Address)
	n := uint64(len(m.Regions))
	c.count(&n, MaxRegions, 5)
	if uint64(len(m.Regions)) != n {
		m.Regions = make([]RegionInfo, n)
	}
	for i := range m.Regions {
		r := &m.Regions[i]
		c.num(&r.ID)
		c.num(&r.BlockLen)
		c.num(&r.Blocks)
		c.num(&r.Addr)
		c.num(&r.Key)
	}
}
func (m *Rails) fields(c codec) {
	c.str(&m.Engine)
	c.num(&m.Epoch)
	n := uint64(len(m.Rails))
	c.count(&n, MaxRails-1, 2)
	if uint64(len(m.Rails)) != n {
		m.Rails = make([]Rail, n)
	}
	for i := range m.Rails {
		r := &m.Rails[i]
		c.str(&r.Address)
		k := uint64(len(r.Keys))
		c.count(&k, MaxRegions, 1)
		if uint64(len(r.Keys)) != k {
			r.Keys = make([]uint64, k)
		}
		for j := range r.Keys {
			c.num(&r.Keys[j])
		}
	}
}
func (m *GPU) fields(c codec) {
	c.str(&m.Engine)
	c.num(&m.Epoch)
	c.str(&m.Device)
	n := uint64(len(m.Handles))
	c.count(&n, MaxRegions, 10) // at least an 8-byte allocation number and its offset
	if uint64(len(m.Handles)) != n {
		m.Handles, m.Offsets = make([]string, n), make([]uint64, n)
	}
	for i := range m.Handles {
		c.str(&m.Handles[i])
		c.num(&m.Offsets[i])
	}
}
func (m *Heads) fields(c codec) {
	c.str(&m.Engine)
	c.num(&m.Epoch)
	c.num(&m.First)
	c.num(&m.Count)
	c.num(&m.HeadBytes)
}
func (m *Register) fields(c codec) {
	c.str(&m.Request)
	c.num(&m.Attempt)
	c.str(&m.Engine)
	c.num(&m.EngineEpoch)
	c.str(&m.Source)
	c.num(&m.Token)
	c.blocks(&m.Blocks)
}
func (m *RegisterTail) fields(c codec) { m.Register.fields(c); c.num(&m.First) }
func (m *Heartbeat) fields(c codec)    { c.str(&m.Request); c.num(&m.Attempt); c.str(&m.Source) }
func (m *Cancel) fields(c codec)       { c.str(&m.Request); c.num(&m.Attempt); c.str(&m.Source) }
func (m *CancelAcked) fields(c codec) {
	c.str(&m.Request)
	c.num(&m.Attempt)
	c.str(&m.Engine)
	c.num(&m.Signalled)
}
func (m *Failed) fields(c codec) {
	c.str(&m.Request)
	c.num(&m.Attempt)
	c.str(&m.Engine)
	c.str(&m.Reason)
	c.num(&m.Signalled)
}
func (m *Acquire) fields(c codec) {
	c.str(&m.Request)
	c.num(&m.Attempt)
	c.str(&m.Engine)
	c.num(&m.EngineEpoch)
	c.str(&m.Source)
	c.blocks(&m.Blocks)
}
func (m *Acquired) fields(c codec) {
	c.str(&m.Request)
	c.num(&m.Attempt)
	c.str(&m.Engine)
	c.num(&m.LeaseMillis)
}
func (m *Writing) fields(c codec)   { c.str(&m.Request); c.num(&m.Attempt); c.str(&m.Engine) }
func (m *Decline) fields(c codec)   { c.str(&m.Request); c.str(&m.Source) }
func (m *Signalled) fields(c codec) { c.str(&m.Request); c.num(&m.Attempt); c.str(&m.Engine) }
func (m *Resignal) fields(c codec)  { c.str(&m.Request); c.num(&m.Attempt); c.str(&m.Source) }
func (m *Abandon) fields(c codec) {
	c.str(&m.Request)
	c.num(&m.Attempt)
	c.str(&m.Engine)
	c.str(&m.Source)
}
func (m *Release) fields(c codec) {
	c.str(&m.Request)
	c.num(&m.Attempt)
	c.str(&m.Source)
	c.num(&m.Failed)
}

// newMessage returns an empty message of a kind.
func newMessage(k Kind) Message {
	switch k {
	case KindHello:
		return &Hello{}
	case KindAuth:
		return &Auth{}
	case KindEngineInfo:
		return &EngineInfo{}
	case KindRegister:
		return &Register{}
	case KindHeartbeat:
		return &Heartbeat{}
	case KindCancel:
		return &Cancel{}
	case KindCancelAcked:
		return &CancelAcked{}
	case KindFailed:
		return &Failed{}
	case KindAcquire:
		return &Acquire{}
	case KindAcquired:
		return &Acquired{}
	case KindRelease:
		return &Release{}
	case KindWriting:
		return &Writing{}
	case KindRails:
		return &Rails{}
	case KindGPU:
		return &GPU{}
	case KindDecline:
		return &Decline{}
	case KindAbandon:
		return &Abandon{}
	case KindSignalled:
		return &Signalled{}
	case KindResignal:
		return &Resignal{}
	case KindRegisterTail:
		return &RegisterTail{}
	case KindHeads:
		return &Heads{}
	}
	return nil
}

// codec visits a message's fields: the encoder reads them, the decoder sets them.
type codec interface {
	num(*uint64)
	str(*string)
	blocks(*[]uint32)
	// count is a list length; min is the fewest bytes one element takes encoded.
	count(n *uint64, limit uint64, min int)
}

// ErrMalformed wraps every decoding error.
var ErrMalformed = errors.New("wire: malformed frame")

// ErrUnknownKind also wraps the error for a well-framed message of a kind this agent does
// not know: one a newer agent sends. The frame was read whole, so a reader may skip it and
// go on with the next.
var ErrUnknownKind = errors.New("wire: unknown kind")

// Encode appends m's frame to b.
func Encode(b []byte, m Message) ([]byte, error) {
	e := encoder{body: []byte{Version, byte(m.Kind())}}
	m.fields(&e)
	if e.err != nil {
		return nil, e.err
	}
	if len(e.body) > MaxFrame {
		return nil, fmt.Errorf("wire: frame of %d bytes exceeds %d", len(e.body), MaxFrame)
	}
	b = binary.BigEndian.AppendUint32(b, uint32(len(e.body)))
	return append(b, e.body...), nil
}

type encoder struct {
	body []byte
	err  error
}

func (e *encoder) fail(format string, args ...any) {
	if e.err == nil {
		e.err = fmt.Errorf("wire: "+format, args...)
	}
}

func (e *encoder) num(v *uint64) { e.body = binary.AppendUvarint(e.body, *v) }

func (e *encoder) str(s *string) {
	if len(*s) > MaxString {
		e.fail("string of %d bytes exceeds %d", len(*s), MaxString)
	}
	e.body = binary.AppendUvarint(e.body, uint64(len(*s)))
	e.body = append(e.body, *s...)
}

func (e *encoder) blocks(b *[]uint32) {
	n := uint64(len(*b))
	e.count(&n, MaxBlocks, 1)
	for _, blk := range *b {
		e.body = binary.AppendUvarint(e.body, uint64(blk))
	}
}

func (e *encoder) count(n *uint64, limit uint64, _ int) {
	if *n > limit {
		e.fail("%d elements exceed %d", *n, limit)
	}
	e.num(n)
}

// Read reads one frame from r and decodes it. It reads no more than the frame's length,
// after checking that length against MaxFrame.
func Read(r io.Reader) (Message, error) { return ReadLimit(r, MaxFrame) }

// MaxHandshakeFrame bounds the frames of a handshake (Hello, Auth): before a peer has
// proved itself, the agent allocates no more than this for it.
const MaxHandshakeFrame = 4 << 10

// ReadLimit is Read with a smaller bound on the frame's length.
func ReadLimit(r io.Reader, limit uint32) (Message, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > min(limit, MaxFrame) {
		return nil, fmt.Errorf("%w: length %d exceeds %d", ErrMalformed, n, min(limit, MaxFrame))
	}
	body, err := readBody(r, int(n))
	if err != nil {
		return nil, fmt.Errorf("%w: truncated body: %v", ErrMalformed, err)
	}
	return Decode(body)
}

// readBody reads a frame's n-byte body. A large body's buffer grows as its bytes arrive,
// so a peer that announces a large frame and stalls holds only what it sent.
func readBody(r io.Reader, n int) ([]byte, error) {
	const small = 64 << 10
	if n <= small {
		body := make([]byte, n)
		_, err := io.ReadFull(r, body)
		return body, err
	}
	var buf bytes.Buffer
	buf.Grow(small)
	got, err := buf.ReadFrom(io.LimitReader(r, int64(n)))
	if err == nil && got < int64(n) {
		err = io.ErrUnexpectedEOF
	}
	return buf.Bytes(), err
}

// Decode decodes a frame's body (what follows the length).
func Decode(body []byte) (Message, error) {
	if len(body) < 2 {
		return nil, fmt.Errorf("%w: %d bytes", ErrMalformed, len(body))
	}
	if body[0] != Version {
		return nil, fmt.Errorf("%w: version %d, this agent speaks %d", ErrMalformed, body[0], Version)
	}
	m := newMessage(Kind(body[1]))
	if m == nil {
		return nil, fmt.Errorf("%w: %w %d", ErrMalformed, ErrUnknownKind, body[1])
	}
	d := decoder{b: body[2:]}
	m.fields(&d)
	if d.err != nil {
		return nil, d.err
	}
	if len(d.b) != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the last field", ErrMalformed, len(d.b))
	}
	return m, nil
}

// decoder sets fields, remembering the first error; later fields get zero values.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: "+format, append([]any{ErrMalformed}, args...)...)
	}
}

func (d *decoder) num(v *uint64) {
	*v = 0
	if d.err != nil {
		return
	}
	x, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("bad varint")
		return
	}
	d.b = d.b[n:]
	*v = x
}

func (d *decoder) str(s *string) {
	var n uint64
	d.num(&n)
	*s = ""
	if d.err != nil {
		return
	}
	if n > MaxString || n > uint64(len(d.b)) {
		d.fail("string of %d bytes (%d left, limit %d)", n, len(d.b), MaxString)
		return
	}
	*s = string(d.b[:n])
	d.b = d.b[n:]
}

func (d *decoder) count(n *uint64, limit uint64, min int) {
	d.num(n)
	// Every element takes at least min bytes: a count beyond what is left is refused
	// before anything is allocated for it.
	if d.err == nil && (*n > limit || *n > uint64(len(d.b)/min)) {
		d.fail("%d elements (limit %d, %d bytes left)", *n, limit, len(d.b))
	}
	if d.err != nil {
		*n = 0
	}
}

func (d *decoder) blocks(b *[]uint32) {
	var n uint64
	d.count(&n, MaxBlocks, 1)
	if n == 0 {
		*b = nil
		return
	}
	*b = make([]uint32, n)
	for i := range *b {
		var v uint64
		d.num(&v)
		if v > 1<<32-1 {
			d.fail("block id %d overflows 32 bits", v)
		}
		(*b)[i] = uint32(v)
	}
}
