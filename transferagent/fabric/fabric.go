// Package fabric is kvhandoff's only use of libfabric (through cgo): an FI_EP_RDM endpoint
// with RMA, registered memory, peers, RMA writes and completions. It links libfabric
// dynamically, so a node uses its own (the AWS EFA installer's on EFA nodes); tests run
// on Debian's 1.17 with the tcp;ofi_rxm and shm providers.
//
// Pitfalls this API is shaped by (../shared/LIBFABRIC-NOTES.md): both sides must poll
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
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// ErrAgain means the provider cannot take the operation now (queue full, or a connection
// still forming): poll completions, then post it again.
var ErrAgain = errors.New("fabric: provider busy, poll and retry")

func fiError(op string, ret C.ssize_t) error {
	if ret == -C.FI_EAGAIN {
		return ErrAgain
	}
	return fmt.Errorf("fabric: %s: %s (%d)", op, C.GoString(C.fi_strerror(C.int(-ret))), int(-ret))
}

// Endpoint is an RDM endpoint with its own address vector and completion queue.
// It is not safe for concurrent use: one goroutine (a writer) owns it.
type Endpoint struct {
	c      *C.kvh_ep
	limits Limits // read once at Open; they do not change

	mu   sync.Mutex
	ctxs map[unsafe.Pointer]uint64 // operation contexts in flight → operation ids
}

// Open opens an endpoint on the named provider ("efa", "tcp;ofi_rxm", "shm"). It fails,
// never falls back, when the provider is not there: a silent fallback to TCP is the
// commonest EFA failure in the field.
func Open(provider string) (*Endpoint, error) {
	c := (*C.kvh_ep)(C.calloc(1, C.sizeof_kvh_ep))
	name := C.CString(provider)
	defer C.free(unsafe.Pointer(name))
	if ret := C.kvh_open(name, c); ret != 0 {
		C.kvh_close(c)
		C.free(unsafe.Pointer(c))
		return nil, fiError("opening provider "+provider, C.ssize_t(ret))
	}
	e := &Endpoint{c: c, ctxs: map[unsafe.Pointer]uint64{}}
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

// Close releases the endpoint. Regions must be closed first.
func (e *Endpoint) Close() {
	C.kvh_close(e.c)
	C.free(unsafe.Pointer(e.c))
	e.mu.Lock()
	for p := range e.ctxs {
		C.free(p)
	}
	e.ctxs = nil
	e.mu.Unlock()
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

// Address is the endpoint's fabric address, for a peer's AddPeer.
func (e *Endpoint) Address() ([]byte, error) {
	buf := make([]byte, 256)
	n := C.size_t(len(buf))
	if ret := C.kvh_getname(e.c, unsafe.Pointer(&buf[0]), &n); ret != 0 {
		return nil, fiError("getname", C.ssize_t(ret))
	}
	return buf[:n], nil
}

// Peer is a remote endpoint in this endpoint's address vector.
type Peer uint64

// AddPeer inserts a peer's address.
func (e *Endpoint) AddPeer(addr []byte) (Peer, error) {
	if len(addr) == 0 {
		return 0, errors.New("fabric: empty peer address")
	}
	c := C.CBytes(addr)
	defer C.free(c)
	var out C.fi_addr_t
	if ret := C.kvh_av_insert(e.c, c, &out); ret != 0 {
		return 0, fiError("inserting a peer address", C.ssize_t(ret))
	}
	return Peer(out), nil
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

// Region is registered memory.
type Region struct {
	e    *Endpoint
	mr   *C.struct_fid_mr
	mem  []byte // nil for device memory
	size uint64
	Key  uint64
	desc unsafe.Pointer
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
	ret := C.kvh_mr_reg(e.c, unsafe.Pointer(&mem[0]), C.size_t(len(mem)), C.uint64_t(access), C.uint64_t(requestKey()), &r.mr)
	return r.registered("registering memory", ret)
}

// requestKey is a key to ask for; providers with FI_MR_PROV_KEY choose their own.
func requestKey() uint64 {
	nextKey.Lock()
	defer nextKey.Unlock()
	nextKey.n++
	return nextKey.n
}

// registered completes a registration that returned ret.
func (r *Region) registered(op string, ret C.int) (*Region, error) {
	if ret != 0 {
		return nil, fiError(op, C.ssize_t(ret))
	}
	r.Key = uint64(C.kvh_mr_key(r.mr))
	r.desc = C.kvh_mr_desc(r.mr)
	return r, nil
}

// RegisterDmabuf registers size bytes at offset of a device-memory dmabuf.
func (e *Endpoint) RegisterDmabuf(fd int, offset, size uint64, dev Device, access Access) (*Region, error) {
	if !HasDmabuf() {
		return nil, ErrNoDmabuf
	}
	r := &Region{e: e, size: size} // registered with base address 0
	ret := C.kvh_mr_reg_dmabuf(e.c, C.int(fd), C.uint64_t(offset), C.size_t(size), C.int(dev), C.uint64_t(access), C.uint64_t(requestKey()), &r.mr)
	return r.registered("registering a dmabuf", ret)
}

// Close deregisters the region.
func (r *Region) Close() error {
	if ret := C.kvh_mr_close(r.mr); ret != 0 {
		return fiError("deregistering memory", C.ssize_t(ret))
	}
	return nil
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

func (e *Endpoint) context(id uint64) unsafe.Pointer {
	// Providers with FI_CONTEXT modes scribble in the context: it must be real memory
	// outside the Go heap, freed when the operation completes.
	p := C.calloc(1, 64)
	e.mu.Lock()
	e.ctxs[p] = id
	e.mu.Unlock()
	return p
}

func (e *Endpoint) release(p unsafe.Pointer) (uint64, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	id, ok := e.ctxs[p]
	if ok {
		delete(e.ctxs, p)
		C.free(p)
	}
	return id, ok
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
// RemoteAddr) under dstKey at peer. id comes back in its completion. It checks the local
// bounds; the caller checks the remote ones, which the provider does not.
func (e *Endpoint) Write(peer Peer, src *Region, srcOff, length, dstAddr, dstKey, id uint64) error {
	buf, err := src.local("write", srcOff, length)
	if err != nil {
		return err
	}
	ctx := e.context(id)
	ret := C.kvh_write(e.c, buf, C.size_t(length), src.desc, C.fi_addr_t(peer), C.uint64_t(dstAddr), C.uint64_t(dstKey), ctx)
	if ret != 0 {
		e.release(ctx)
		return fiError("write", ret)
	}
	return nil
}

// Read posts an RMA read of length bytes from srcAddr under srcKey at peer into offset
// dstOff of dst (pull). A read's local completion means its data has arrived.
func (e *Endpoint) Read(peer Peer, dst *Region, dstOff, length, srcAddr, srcKey, id uint64) error {
	buf, err := dst.local("read", dstOff, length)
	if err != nil {
		return err
	}
	ctx := e.context(id)
	ret := C.kvh_read(e.c, buf, C.size_t(length), dst.desc, C.fi_addr_t(peer), C.uint64_t(srcAddr), C.uint64_t(srcKey), ctx)
	if ret != 0 {
		e.release(ctx)
		return fiError("read", ret)
	}
	return nil
}

// WriteData posts a zero-length write that delivers data to the peer's completion queue
// as remote CQ data. Posted after a request's writes completed, it tells decode the KV
// has landed: on every provider here it arrived only after the data.
func (e *Endpoint) WriteData(peer Peer, data, dstAddr, dstKey, id uint64) error {
	ctx := e.context(id)
	ret := C.kvh_writedata(e.c, nil, 0, nil, C.uint64_t(data), C.fi_addr_t(peer), C.uint64_t(dstAddr), C.uint64_t(dstKey), ctx)
	if ret != 0 {
		e.release(ctx)
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

// Poll reads completions into out and returns how many it read. Call it on both sides:
// some providers move data only while the target polls.
func (e *Endpoint) Poll(out []Completion) int { return e.read(out, -1) }

// Waitable reports whether Wait can sleep in the kernel; otherwise it is Poll.
func (e *Endpoint) Waitable() bool { return e.c.waitable != 0 }

// Wait is Poll, but sleeps up to timeout until the provider has something: a completion,
// or (on providers with file-descriptor progress, such as tcp;ofi_rxm) data to move,
// which it moves while it waits. Wake ends it early.
func (e *Endpoint) Wait(out []Completion, timeout time.Duration) int {
	if !e.Waitable() {
		return e.Poll(out)
	}
	return e.read(out, max(int(timeout.Milliseconds()), 1))
}

// Wake makes a Wait return now, or the next one return at once. Safe from any goroutine.
func (e *Endpoint) Wake() {
	if e.Waitable() {
		C.kvh_signal(e.c)
	}
}

// read polls (timeoutMs < 0) or waits.
func (e *Endpoint) read(out []Completion, timeoutMs int) int {
	var entries [16]C.struct_fi_cq_data_entry
	n := min(len(out), len(entries))
	if n == 0 {
		return 0
	}
	var errCtx unsafe.Pointer
	var errCode C.int
	var ret C.ssize_t
	if timeoutMs < 0 {
		ret = C.kvh_poll(e.c, &entries[0], C.size_t(n), &errCtx, &errCode)
	} else {
		ret = C.kvh_sread(e.c, &entries[0], C.size_t(n), C.int(timeoutMs), &errCtx, &errCode)
	}
	if ret == -C.FI_EAVAIL {
		id, _ := e.release(errCtx)
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
		id, _ := e.release(en.op_context)
		out[i] = Completion{ID: id}
	}
	return int(ret)
}
