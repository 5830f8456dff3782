// Package fabric is kvhandoff's only use of libfabric (through cgo): an FI_EP_RDM endpoint
// with RMA, registered memory, peers, RMA writes and completions. It links libfabric
// dynamically, so a node uses its own (the AWS EFA installer's on EFA nodes); tests run
// on Debian's 1.17 with the tcp;ofi_rxm and shm providers.
//
// Pitfalls this API is shaped by (docs/design.md#libfabric-pitfalls): both sides must poll
// their completion queue for data to move; a local write completion is not delivery, so
// decode is signalled with a remote-CQ-data write after the data; providers do not check
// keys, bounds or iov limits, so callers must (Region.Write checks the local side).
package fabric

/*
#cgo LDFLAGS: -lfabric
#include <stdlib.h>
#include "fabric.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

// rxmSharedRx is libfabric's FI_OFI_RXM_USE_SRX: whether ofi_rxm (the tcp;ofi_rxm stack)
// posts its receive buffers on one shared receive context per endpoint. With it (1.17's
// default over tcp) each endpoint posts 4096 bounce buffers of 16 KiB when it opens,
// whether or not anything is ever received: measured here, 70 MB of agent memory per
// engine session. The agent receives only zero-length signals over the fabric, so it
// turns the shared context off, and buffers come with each connection (128 of them).
// An operator's own setting wins. EFA does not use ofi_rxm.
const rxmSharedRx = "FI_OFI_RXM_USE_SRX"

func init() {
	// Before the first fi_getinfo: libfabric reads its variables once.
	if _, set := os.LookupEnv(rxmSharedRx); !set {
		os.Setenv(rxmSharedRx, "0")
	}
}

// ErrAgain means the provider cannot take the operation now (queue full, or a connection
// still forming): poll completions, then post it again.
var ErrAgain = errors.New("fabric: provider busy, poll and retry")

func fiError(op string, ret C.ssize_t) error {
	if ret == -C.FI_EAGAIN {
		return ErrAgain
	}
	return fmt.Errorf("fabric: %s: %s (%d)", op, C.GoString(C.fi_strerror(C.int(-ret))), int(-ret))
}

// Endpoint is an RDM endpoint with its own address vector and completion queue, on one
// or more rails: a rail is one provider endpoint (on EFA, one NIC). Writes and reads are
// spread over the rails a peer shares with this endpoint, each on the rail with the
// fewest bytes in flight; completions of every rail come back through Poll and Wait. It
// is not safe for concurrent use: one goroutine (a writer) owns it.
//
// On providers that make progress inside a kernel wait (tcp;ofi_rxm), every rail beyond
// the first has a thread of its own asleep in its provider's wait, moving its data and
// handing its completions to the owner: one thread cannot sleep in several providers at
// once, and polling them in turn starved each rail between polls (0.4 GB/s against 2.9
// on one rail, measured here). Such rails are opened thread-safe.
type Endpoint struct {
	rails  []*C.kvh_ep
	limits Limits // read once at Open; they do not change

	peers [][]C.fi_addr_t // by Peer: its address on each rail both sides have
	load  []uint64        // bytes posted and not complete, by rail (under mu: rail threads complete operations)
	sent  []uint64        // bytes completed, by rail, since Open (under mu)
	first int             // the rail Poll reads first, rotated so none starves
	last  int             // the rail of the last operation: ties go to the next
	// done carries the completions the rail threads read; stop ends those threads.
	done    chan Completion
	stop    atomic.Bool
	threads sync.WaitGroup

	mu   sync.Mutex
	ctxs map[unsafe.Pointer]op // operation contexts in flight
}

// op is an operation in flight: its id, and the rail and bytes it occupies.
type op struct {
	id    uint64
	rail  int
	bytes uint64
}

// MaxRails bounds an endpoint's rails (a P5en GPU has two EFA NICs; a node 16).
const MaxRails = 16

// Open opens an endpoint on the named provider ("efa", "tcp;ofi_rxm", "shm"). It fails,
// never falls back, when the provider is not there: a silent fallback to TCP is the
// commonest EFA failure in the field.
func Open(provider string) (*Endpoint, error) { return OpenRails(provider, 1) }

// OpenRails opens an endpoint of n rails, all on the provider's first domain. With more
// than one, every rail completes a write only once its data is placed at the target
// (FI_DELIVERY_COMPLETE): a request's signal travels on rail 0 after its writes completed,
// and writes on another rail have no ordering with it otherwise. A provider that cannot
// promise that is refused.
func OpenRails(provider string, n int) (*Endpoint, error) { return open(provider, n, nil) }

// OpenDomains opens an endpoint of one rail on each named domain, in order: the NICs a
// rank's traffic should use (efa's rdmap79s0-rdm; tcp's eth0). Rails as in OpenRails.
func OpenDomains(provider string, domains []string) (*Endpoint, error) {
	if len(domains) == 0 {
		return nil, errors.New("fabric: no domains named")
	}
	return open(provider, len(domains), domains)
}

// Domains lists the provider's domains (its NICs), each once.
func Domains(provider string) ([]string, error) {
	name := C.CString(provider)
	defer C.free(unsafe.Pointer(name))
	buf := make([]byte, 4096)
	for {
		n := C.kvh_domains(name, (*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)))
		if n < 0 {
			return nil, fiError("listing the domains of provider "+provider, C.ssize_t(n))
		}
		if int(n) < len(buf) {
			return strings.Fields(string(buf[:n])), nil
		}
		buf = make([]byte, int(n)+1)
	}
}

func open(provider string, n int, domains []string) (*Endpoint, error) {
	if n < 1 || n > MaxRails {
		return nil, fmt.Errorf("fabric: %d rails (1 to %d)", n, MaxRails)
	}
	if n > 1 && provider == "shm" {
		// Rails are NICs; shm has none, and its delivery-complete writes stalled after
		// the first few here (libfabric 1.17).
		return nil, errors.New("fabric: shm moves memory within a node and has no rails; use one")
	}
	e := &Endpoint{ctxs: map[unsafe.Pointer]op{}, load: make([]uint64, n), sent: make([]uint64, n)}
	name := C.CString(provider)
	defer C.free(unsafe.Pointer(name))
	for i := range n {
		c := (*C.kvh_ep)(C.calloc(1, C.sizeof_kvh_ep))
		var domain *C.char
		if domains != nil {
			domain = C.CString(domains[i])
		}
		ret := C.kvh_open(name, domain, C.int(min(n-1, 1)), c)
		C.free(unsafe.Pointer(domain))
		if ret != 0 {
			C.kvh_close(c)
			C.free(unsafe.Pointer(c))
			e.Close()
			what := "opening provider " + provider
			if n > 1 {
				what = fmt.Sprintf("opening rail %d of %d (with delivery-complete writes) on provider %s", i, n, provider)
			}
			if domains != nil {
				what += " on domain " + domains[i]
			}
			return nil, fiError(what, C.ssize_t(ret))
		}
		e.rails = append(e.rails, c)
	}
	if n > 1 && e.rails[0].waitable != 0 {
		e.done = make(chan Completion, 4096)
		for r := 1; r < n; r++ {
			e.threads.Add(1)
			go e.progress(r)
		}
	}
	c := e.rails[0]
	mode := uint64(C.kvh_mr_mode(c))
	e.limits = Limits{
		Provider:    C.GoString(C.kvh_provider(c)),
		RMAIovLimit: int(C.kvh_rma_iov_limit(c)),
		IOVLimit:    int(C.kvh_iov_limit(c)),
		MaxMsgSize:  uint64(C.kvh_max_msg_size(c)),
		CQDataSize:  int(C.kvh_cq_data_size(c)),
		VirtAddr:    mode&C.FI_MR_VIRT_ADDR != 0,
	}
	return e, nil
}

// progress is rail r's thread: asleep in its provider, which moves the rail's data while
// it waits, it hands what completes to the owner and wakes the owner's Wait.
func (e *Endpoint) progress(r int) {
	defer e.threads.Done()
	buf := make([]Completion, 16)
	for !e.stop.Load() {
		n := e.read(r, buf, 100)
		for _, c := range buf[:n] {
			e.done <- c
		}
		if n > 0 {
			C.kvh_signal(e.rails[0])
		}
	}
}

// Quiesce stops the rail threads, so no data moves into registered memory any more:
// call it before closing regions whose memory is then unmapped. Close calls it too.
func (e *Endpoint) Quiesce() {
	if e.done == nil || e.stop.Swap(true) {
		return
	}
	for _, c := range e.rails[1:] {
		C.kvh_signal(c)
	}
	go func() { // a thread blocked handing over a completion nobody will read
		for range e.done {
		}
	}()
	e.threads.Wait()
	close(e.done)
}

// Close releases the endpoint. Regions must be closed first (after Quiesce).
func (e *Endpoint) Close() {
	e.Quiesce()
	for _, c := range e.rails {
		C.kvh_close(c)
		C.free(unsafe.Pointer(c))
	}
	e.rails = nil
	e.mu.Lock()
	for p := range e.ctxs {
		C.free(p)
	}
	e.ctxs = nil
	e.mu.Unlock()
}

// Rails is how many rails the endpoint has.
func (e *Endpoint) Rails() int { return len(e.rails) }

// Domains are the domains (NICs) the rails opened, by rail.
func (e *Endpoint) Domains() []string {
	out := make([]string, len(e.rails))
	for i, c := range e.rails {
		out[i] = C.GoString(C.kvh_domain(c))
	}
	return out
}

// Limits are what the provider accepts.
type Limits struct {
	Provider    string
	RMAIovLimit int
	IOVLimit    int
	MaxMsgSize  uint64
	// CQDataSize is how many bytes of remote CQ data a write can carry (EFA: 4).
	CQDataSize int
	// VirtAddr: remote addresses are virtual addresses (else offsets into the region).
	VirtAddr bool
}

// Limits reports the provider's limits.
func (e *Endpoint) Limits() Limits { return e.limits }

// Address is the endpoint's fabric address on rail 0, for a peer's AddPeer.
func (e *Endpoint) Address() ([]byte, error) {
	addrs, err := e.Addresses()
	if err != nil {
		return nil, err
	}
	return addrs[0], nil
}

// Addresses are the endpoint's fabric addresses, one per rail.
func (e *Endpoint) Addresses() ([][]byte, error) {
	out := make([][]byte, len(e.rails))
	for i, c := range e.rails {
		buf := make([]byte, 256)
		n := C.size_t(len(buf))
		if ret := C.kvh_getname(c, unsafe.Pointer(&buf[0]), &n); ret != 0 {
			return nil, fiError(fmt.Sprintf("getname on rail %d", i), C.ssize_t(ret))
		}
		out[i] = buf[:n]
	}
	return out, nil
}

// Peer is a remote endpoint in this endpoint's address vectors.
type Peer uint64

// AddPeer inserts a peer's addresses, one per rail (its Addresses). Operations with it
// use the rails both sides have: a peer with fewer rails, or an endpoint with fewer than
// the peer, simply uses fewer.
func (e *Endpoint) AddPeer(addrs ...[]byte) (Peer, error) {
	if len(addrs) == 0 {
		return 0, errors.New("fabric: no peer address")
	}
	fis := make([]C.fi_addr_t, min(len(addrs), len(e.rails)))
	for i := range fis {
		if len(addrs[i]) == 0 {
			return 0, fmt.Errorf("fabric: empty peer address on rail %d", i)
		}
		c := C.CBytes(addrs[i])
		ret := C.kvh_av_insert(e.rails[i], c, &fis[i])
		C.free(c)
		if ret != 0 {
			return 0, fiError(fmt.Sprintf("inserting a peer address on rail %d", i), C.ssize_t(ret))
		}
	}
	e.peers = append(e.peers, fis)
	return Peer(len(e.peers) - 1), nil
}

// Memory is a buffer outside the Go heap (an anonymous mapping), which the garbage
// collector never moves: the only kind of memory that may be registered.
type Memory []byte

// Alloc maps size bytes of memory for registration.
func Alloc(size int) (Memory, error) {
	b, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("fabric: mapping %d bytes: %w", size, err)
	}
	return b, nil
}

// Free unmaps memory from Alloc.
func (m Memory) Free() error { return syscall.Munmap(m) }

// Access says what a region may be used for.
type Access uint64

const (
	// Source: local writes read from it.
	Source Access = C.FI_WRITE
	// Target: peers write into it.
	Target Access = C.FI_REMOTE_WRITE
	// ReadTarget: local reads land in it (pull, decode side).
	ReadTarget Access = C.FI_READ
	// ReadSource: peers read from it (pull, prefill side).
	ReadSource Access = C.FI_REMOTE_READ
)

// Device is the memory a dmabuf exports.
type Device int

const (
	CUDA   Device = C.FI_HMEM_CUDA
	Neuron Device = C.FI_HMEM_NEURON
)

// ErrNoDmabuf means this build's libfabric headers lack FI_MR_DMABUF (added in 1.20;
// Debian's 1.17 lacks it), so device memory cannot be registered.
var ErrNoDmabuf = errors.New("fabric: this agent was built against a libfabric without FI_MR_DMABUF (needs >= 1.20); device memory cannot be registered")

// HasDmabuf reports whether device memory can be registered by dmabuf.
func HasDmabuf() bool { return C.kvh_has_dmabuf() != 0 }

// Version is the libfabric loaded at run time, as major and minor.
func Version() (major, minor int) {
	v := uint32(C.fi_version())
	return int(v >> 16), int(v & 0xffff)
}

// Region is registered memory, registered on every rail of its endpoint.
type Region struct {
	e    *Endpoint
	mrs  []*C.struct_fid_mr
	mem  []byte // nil for device memory
	size uint64
	// Keys are the region's keys, by rail: a peer addresses it with Keys[rail].
	Keys  []uint64
	descs []unsafe.Pointer
}

var nextKey struct {
	sync.Mutex
	n uint64
}

// Register registers mem, which must not be on the Go heap (see Alloc, or memory mapped
// from a file or fd the engine passed).
func (e *Endpoint) Register(mem []byte, access Access) (*Region, error) {
	if len(mem) == 0 {
		return nil, errors.New("fabric: registering empty memory")
	}
	r := &Region{e: e, mem: mem, size: uint64(len(mem))}
	return r.register("registering memory", func(c *C.kvh_ep, mr **C.struct_fid_mr) C.int {
		return C.kvh_mr_reg(c, unsafe.Pointer(&mem[0]), C.size_t(len(mem)), C.uint64_t(access), C.uint64_t(requestKey()), mr)
	})
}

// requestKey is a key to ask for; providers with FI_MR_PROV_KEY choose their own.
func requestKey() uint64 {
	nextKey.Lock()
	defer nextKey.Unlock()
	nextKey.n++
	return nextKey.n
}

// register registers the region on every rail with reg; a failure on any rail undoes the
// others, so a region is registered everywhere or nowhere.
func (r *Region) register(op string, reg func(*C.kvh_ep, **C.struct_fid_mr) C.int) (*Region, error) {
	for i, c := range r.e.rails {
		var mr *C.struct_fid_mr
		if ret := reg(c, &mr); ret != 0 {
			_ = r.Close()
			if len(r.e.rails) > 1 {
				op = fmt.Sprintf("%s on rail %d", op, i)
			}
			return nil, fiError(op, C.ssize_t(ret))
		}
		r.mrs = append(r.mrs, mr)
		r.Keys = append(r.Keys, uint64(C.kvh_mr_key(mr)))
		r.descs = append(r.descs, C.kvh_mr_desc(mr))
	}
	return r, nil
}

// RegisterDmabuf registers size bytes at offset of a device-memory dmabuf.
func (e *Endpoint) RegisterDmabuf(fd int, offset, size uint64, dev Device, access Access) (*Region, error) {
	if !HasDmabuf() {
		return nil, ErrNoDmabuf
	}
	r := &Region{e: e, size: size} // registered with base address 0
	return r.register("registering a dmabuf", func(c *C.kvh_ep, mr **C.struct_fid_mr) C.int {
		return C.kvh_mr_reg_dmabuf(c, C.int(fd), C.uint64_t(offset), C.size_t(size), C.int(dev), C.uint64_t(access), C.uint64_t(requestKey()), mr)
	})
}

// Close deregisters the region from every rail.
func (r *Region) Close() error {
	var first error
	for _, mr := range r.mrs {
		if ret := C.kvh_mr_close(mr); ret != 0 && first == nil {
			first = fiError("deregistering memory", C.ssize_t(ret))
		}
	}
	r.mrs = nil
	return first
}

// RemoteAddr is the address a peer writes to for offset off of this region: its virtual
// address where the provider addresses by virtual address, else the offset.
func (r *Region) RemoteAddr(off uint64) uint64 {
	if r.e.limits.VirtAddr && r.mem != nil {
		return uint64(uintptr(unsafe.Pointer(&r.mem[0]))) + off
	}
	return off
}

// Size is the region's length.
func (r *Region) Size() uint64 { return r.size }

func (e *Endpoint) context(o op) unsafe.Pointer {
	// Providers with FI_CONTEXT modes scribble in the context: it must be real memory
	// outside the Go heap, freed when the operation completes.
	p := C.calloc(1, 64)
	e.mu.Lock()
	e.ctxs[p] = o
	e.load[o.rail] += o.bytes
	e.mu.Unlock()
	return p
}

// release frees an operation's context, when it completed (done: its bytes count as
// carried) or failed or was never taken.
func (e *Endpoint) release(p unsafe.Pointer, done bool) uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	o, ok := e.ctxs[p]
	if ok {
		delete(e.ctxs, p)
		C.free(p)
		e.load[o.rail] -= o.bytes
		if done {
			e.sent[o.rail] += o.bytes
		}
	}
	return o.id
}

// RailBytes is how many bytes of writes and reads each rail has completed since Open.
func (e *Endpoint) RailBytes() []uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.sent)
}

// rail picks the rail for an operation with peer under keys: of the rails the peer, the
// keys and this endpoint all have, the one with the fewest bytes in flight, ties going
// round the rails.
func (e *Endpoint) rail(peer Peer, keys []uint64) (int, C.fi_addr_t, error) {
	if int(peer) >= len(e.peers) {
		return 0, 0, fmt.Errorf("fabric: unknown peer %d", peer)
	}
	fis := e.peers[peer]
	n := min(len(fis), len(keys))
	switch n {
	case 0:
		return 0, 0, errors.New("fabric: no remote key")
	case 1: // one rail: nothing to choose, and no lock to take on every write
		return 0, fis[0], nil
	}
	e.mu.Lock() // the rail threads' completions lower the loads
	defer e.mu.Unlock()
	best := (e.last + 1) % n
	for i := range n {
		if r := (e.last + 1 + i) % n; e.load[r] < e.load[best] {
			best = r
		}
	}
	e.last = best
	return best, fis[best], nil
}

// local is the address of length bytes at off of the region, for an operation's local
// side, checked against the region's bounds.
func (r *Region) local(op string, off, length uint64) (unsafe.Pointer, error) {
	if r.mem == nil {
		return nil, fmt.Errorf("fabric: a %s with device memory on the local side needs its virtual address, which this agent does not track", op)
	}
	if off > r.Size() || length > r.Size()-off {
		return nil, fmt.Errorf("fabric: %s of %d bytes at offset %d is outside the %d-byte local region", op, length, off, r.Size())
	}
	return unsafe.Pointer(&r.mem[off]), nil
}

// Write posts an RMA write of length bytes from offset srcOff of src to dstAddr (see
// RemoteAddr) of the peer's region whose keys, by rail, are dstKeys. id comes back in its
// completion. It checks the local bounds; the caller checks the remote ones, which the
// provider does not.
func (e *Endpoint) Write(peer Peer, src *Region, srcOff, length, dstAddr uint64, dstKeys []uint64, id uint64) error {
	buf, err := src.local("write", srcOff, length)
	if err != nil {
		return err
	}
	rail, fi, err := e.rail(peer, dstKeys)
	if err != nil {
		return err
	}
	ctx := e.context(op{id: id, rail: rail, bytes: length})
	ret := C.kvh_write(e.rails[rail], buf, C.size_t(length), src.descs[rail], fi, C.uint64_t(dstAddr), C.uint64_t(dstKeys[rail]), ctx)
	if ret != 0 {
		e.release(ctx, false)
		return fiError("write", ret)
	}
	return nil
}

// Read posts an RMA read of length bytes from srcAddr of the peer's region whose keys,
// by rail, are srcKeys, into offset dstOff of dst (pull). A read's local completion means
// its data has arrived.
func (e *Endpoint) Read(peer Peer, dst *Region, dstOff, length, srcAddr uint64, srcKeys []uint64, id uint64) error {
	buf, err := dst.local("read", dstOff, length)
	if err != nil {
		return err
	}
	rail, fi, err := e.rail(peer, srcKeys)
	if err != nil {
		return err
	}
	ctx := e.context(op{id: id, rail: rail, bytes: length})
	ret := C.kvh_read(e.rails[rail], buf, C.size_t(length), dst.descs[rail], fi, C.uint64_t(srcAddr), C.uint64_t(srcKeys[rail]), ctx)
	if ret != 0 {
		e.release(ctx, false)
		return fiError("read", ret)
	}
	return nil
}

// WriteData posts a zero-length write on rail 0 that delivers data to the peer's
// completion queue as remote CQ data. Posted after a request's writes completed, it tells
// decode the KV has landed: on every provider here it arrived only after the data on its
// own rail, and writes on other rails complete only once delivered (OpenRails).
func (e *Endpoint) WriteData(peer Peer, data, dstAddr uint64, dstKeys []uint64, id uint64) error {
	if int(peer) >= len(e.peers) || len(dstKeys) == 0 {
		return fmt.Errorf("fabric: unknown peer %d or no remote key", peer)
	}
	ctx := e.context(op{id: id})
	ret := C.kvh_writedata(e.rails[0], nil, 0, nil, C.uint64_t(data), e.peers[peer][0], C.uint64_t(dstAddr), C.uint64_t(dstKeys[0]), ctx)
	if ret != 0 {
		e.release(ctx, false)
		return fiError("writedata", ret)
	}
	return nil
}

// Completion is a finished local operation, or a remote write that carried CQ data.
type Completion struct {
	// ID is the id the operation was posted with; 0 for a remote write.
	ID uint64
	// Remote: a peer's write delivered Data here.
	Remote bool
	Data   uint64
	// Err is set when the operation failed.
	Err error
}

// Poll reads completions of every rail into out and returns how many it read. Call it on
// both sides: some providers move data only while the target polls.
func (e *Endpoint) Poll(out []Completion) int {
	if e.done != nil {
		got := e.read(0, out, -1)
		return got + e.handed(out[got:])
	}
	got := 0
	for i := range e.rails {
		r := (e.first + i) % len(e.rails)
		got += e.read(r, out[got:], -1)
		if got == len(out) {
			break
		}
	}
	e.first = (e.first + 1) % len(e.rails)
	return got
}

// handed moves completions the rail threads read into out.
func (e *Endpoint) handed(out []Completion) int {
	n := 0
	for n < len(out) && !e.stop.Load() {
		select {
		case c := <-e.done:
			out[n] = c
			n++
		default:
			return n
		}
	}
	return n
}

// Waitable reports whether Wait can sleep in the kernel; otherwise it is Poll. With
// several rails, the owner sleeps in rail 0's provider and the other rails' threads wake
// it (sleeping on all their wait fds at once, FI_WAIT_FD with fi_trywait and poll(2),
// moved no data on tcp;ofi_rxm 1.17 here).
func (e *Endpoint) Waitable() bool { return e.rails[0].waitable != 0 }

// Wait is Poll, but sleeps up to timeout until the provider has something: a completion,
// or (on providers with file-descriptor progress, such as tcp;ofi_rxm) data to move,
// which it moves while it waits. Wake ends it early.
func (e *Endpoint) Wait(out []Completion, timeout time.Duration) int {
	if !e.Waitable() || len(e.done) > 0 {
		return e.Poll(out)
	}
	got := e.read(0, out, max(int(timeout.Milliseconds()), 1))
	if e.done != nil {
		got += e.handed(out[got:])
	}
	return got
}

// Wake makes a Wait return now, or the next one return at once. Safe from any goroutine.
func (e *Endpoint) Wake() {
	if e.Waitable() {
		C.kvh_signal(e.rails[0])
	}
}

// read polls (timeoutMs < 0) or waits on one rail.
func (e *Endpoint) read(rail int, out []Completion, timeoutMs int) int {
	var entries [16]C.struct_fi_cq_data_entry
	n := min(len(out), len(entries))
	if n == 0 {
		return 0
	}
	var errCtx unsafe.Pointer
	var errCode C.int
	var ret C.ssize_t
	c := e.rails[rail]
	if timeoutMs < 0 {
		ret = C.kvh_poll(c, &entries[0], C.size_t(n), &errCtx, &errCode)
	} else {
		ret = C.kvh_sread(c, &entries[0], C.size_t(n), C.int(timeoutMs), &errCtx, &errCode)
	}
	if ret == -C.FI_EAVAIL {
		id := e.release(errCtx, false)
		out[0] = Completion{ID: id, Err: fmt.Errorf("fabric: operation %d failed: %s", id, C.GoString(C.fi_strerror(errCode)))}
		return 1
	}
	if ret < 0 {
		out[0] = Completion{Err: fiError("reading completions", ret)}
		return 1
	}
	for i := range int(ret) {
		en := entries[i]
		if en.flags&C.FI_REMOTE_CQ_DATA != 0 {
			out[i] = Completion{Remote: true, Data: uint64(en.data)}
			continue
		}
		id := e.release(en.op_context, true)
		out[i] = Completion{ID: id}
	}
	return int(ret)
}
