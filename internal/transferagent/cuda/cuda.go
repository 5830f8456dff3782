// Package cuda is kvhandoff's only use of the CUDA driver API, loaded at run time
// (dlopen of libcuda.so.1) so that the project builds, and its CPU tests run, on
// machines without CUDA. It offers what moving KV between GPUs of one node needs:
// device memory, CUDA IPC handles (export in the engine, open in the agent), copies on a
// stream and completion by events.
//
// A CUDA context belongs to a thread, and Go moves goroutines between threads: every
// call here makes its context current within the same C call (cuda.c), so callers never
// pin threads.
package cuda

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include <string.h>
#include "cuda.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"unsafe"
)

// ErrNoDriver means libcuda.so.1 could not be loaded: no NVIDIA driver on this machine,
// or none visible to this container (NVIDIA_VISIBLE_DEVICES, the driver's libraries).
var ErrNoDriver = errors.New("cuda: no NVIDIA driver (libcuda.so.1) could be loaded")

// Error is a failed driver call.
type Error struct {
	Op   string
	Code int
	Msg  string
}

func (e *Error) Error() string { return fmt.Sprintf("cuda: %s: %s (%d)", e.Op, e.Msg, e.Code) }

func check(op string, r C.int) error {
	if r == C.KVH_CUDA_SUCCESS {
		return nil
	}
	return &Error{Op: op, Code: int(r), Msg: C.GoString(C.kvh_cu_error(r))}
}

var loaded struct {
	once sync.Once
	err  error
}

// Load loads and initialises the driver, once: libcuda.so.1, or the file named by
// KVHANDOFF_LIBCUDA.
func Load() error {
	loaded.once.Do(func() {
		path := os.Getenv("KVHANDOFF_LIBCUDA")
		if path == "" {
			path = "libcuda.so.1"
		}
		loaded.err = load(path)
	})
	return loaded.err
}

func load(path string) error {
	p := C.CString(path)
	defer C.free(unsafe.Pointer(p))
	var missing [256]C.char
	switch r := C.kvh_cu_load(p, &missing[0], C.size_t(len(missing))); r {
	case C.KVH_CUDA_SUCCESS:
	case C.KVH_NO_DRIVER:
		return fmt.Errorf("%w: %s", ErrNoDriver, C.GoString(&missing[0]))
	default:
		return fmt.Errorf("%w: %s lacks %s (a driver older than CUDA 11?)", ErrNoDriver, path, C.GoString(&missing[0]))
	}
	return check("cuInit", C.kvh_cu_init())
}

// BatchCopies reports whether the driver submits a batch of copies in one call
// (cuMemcpyBatchAsync, CUDA 13 drivers); CopyAll queues them one by one otherwise.
func BatchCopies() bool { return Load() == nil && C.kvh_cu_has_batch() != 0 }

// DeviceCount is how many GPUs this process sees.
func DeviceCount() (int, error) {
	if err := Load(); err != nil {
		return 0, err
	}
	var n C.int
	return int(n), check("cuDeviceGetCount", C.kvh_cu_device_count(&n))
}

// UUID is a GPU's identity across processes and containers, which number GPUs each their
// own way.
type UUID [16]byte

// DeviceByUUID is the ordinal, in this process, of the GPU with that UUID.
func DeviceByUUID(u UUID) (int, error) {
	n, err := DeviceCount()
	if err != nil {
		return 0, err
	}
	for i := range n {
		got, err := DeviceUUID(i)
		if err != nil {
			return 0, err
		}
		if got == u {
			return i, nil
		}
	}
	return 0, fmt.Errorf("cuda: no GPU with UUID %x among the %d this process sees", u[:], n)
}

// DeviceUUID is GPU ordinal's UUID.
func DeviceUUID(ordinal int) (UUID, error) {
	if err := Load(); err != nil {
		return UUID{}, err
	}
	var got [16]C.uchar
	err := check("cuDeviceGetUuid", C.kvh_cu_device_uuid(C.int(ordinal), &got[0]))
	return UUID(C.GoBytes(unsafe.Pointer(&got[0]), 16)), err
}

// Context is a GPU's primary context, retained.
type Context struct {
	Ordinal int
	c       C.kvh_CUcontext
}

// Open retains the primary context of GPU ordinal.
func Open(ordinal int) (*Context, error) {
	if err := Load(); err != nil {
		return nil, err
	}
	c := &Context{Ordinal: ordinal}
	if err := check(fmt.Sprintf("retaining GPU %d's context", ordinal), C.kvh_cu_primary_ctx(C.int(ordinal), &c.c)); err != nil {
		return nil, err
	}
	return c, nil
}

// Close releases the context.
func (c *Context) Close() error {
	return check("releasing the context", C.kvh_cu_release_ctx(C.int(c.Ordinal)))
}

// Ptr is a device address (CUdeviceptr).
type Ptr uint64

// Alloc allocates n bytes of device memory.
func (c *Context) Alloc(n uint64) (Ptr, error) {
	var p C.kvh_CUdeviceptr
	err := check(fmt.Sprintf("allocating %d bytes on GPU %d", n, c.Ordinal), C.kvh_cu_alloc(c.c, &p, C.size_t(n)))
	return Ptr(p), err
}

// Free frees memory from Alloc.
func (c *Context) Free(p Ptr) error {
	return check("freeing", C.kvh_cu_free(c.c, C.kvh_CUdeviceptr(p)))
}

// IPCHandle names an allocation to another process (cuIpcGetMemHandle).
type IPCHandle [64]byte

// Export is the IPC handle of an allocation from Alloc (its start: CUDA IPC names whole
// allocations).
func (c *Context) Export(p Ptr) (IPCHandle, error) {
	var h C.kvh_CUipcMemHandle
	err := check("cuIpcGetMemHandle", C.kvh_cu_ipc_get(c.c, &h, C.kvh_CUdeviceptr(p)))
	var out IPCHandle
	copy(out[:], C.GoBytes(unsafe.Pointer(&h), 64))
	return out, err
}

// Import maps another process's allocation into this context (lazily enabling peer
// access when it lives on another GPU).
func (c *Context) Import(h IPCHandle) (Ptr, error) {
	var ch C.kvh_CUipcMemHandle
	C.memcpy(unsafe.Pointer(&ch), unsafe.Pointer(&h[0]), 64)
	var p C.kvh_CUdeviceptr
	err := check("cuIpcOpenMemHandle", C.kvh_cu_ipc_open(c.c, &p, &ch))
	return Ptr(p), err
}

// Extent is the size of the allocation p points into, from p on: what a region starting
// at p may span.
func (c *Context) Extent(p Ptr) (uint64, error) {
	var base C.kvh_CUdeviceptr
	var size C.size_t
	if err := check("cuMemGetAddressRange", C.kvh_cu_address_range(c.c, C.kvh_CUdeviceptr(p), &base, &size)); err != nil {
		return 0, err
	}
	return uint64(base) + uint64(size) - uint64(p), nil
}

// Unimport unmaps an allocation from Import.
func (c *Context) Unimport(p Ptr) error {
	return check("cuIpcCloseMemHandle", C.kvh_cu_ipc_close(c.c, C.kvh_CUdeviceptr(p)))
}

// Upload copies b to device memory at dst, synchronously.
func (c *Context) Upload(dst Ptr, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	return check("copying to the GPU", C.kvh_cu_htod(c.c, C.kvh_CUdeviceptr(dst), unsafe.Pointer(&b[0]), C.size_t(len(b))))
}

// Download copies len(b) bytes from device memory at src into b, synchronously.
func (c *Context) Download(b []byte, src Ptr) error {
	if len(b) == 0 {
		return nil
	}
	return check("copying from the GPU", C.kvh_cu_dtoh(c.c, unsafe.Pointer(&b[0]), C.kvh_CUdeviceptr(src), C.size_t(len(b))))
}

// CanAccessPeer reports whether this GPU can address peer's memory directly (NVLink or
// PCIe peer to peer).
func (c *Context) CanAccessPeer(peer int) (bool, error) {
	var can C.int
	err := check("cuDeviceCanAccessPeer", C.kvh_cu_can_access_peer(&can, C.int(c.Ordinal), C.int(peer)))
	return can != 0, err
}

// EnablePeer lets this context address memory allocated in peer's, and its copies reach
// peer's GPU directly: within one process, copies from GPU 0 into GPU 1's allocations ran
// at 202 GB/s without it and 317 GB/s with it (two H200s, NVLink). Into an allocation
// opened from an IPC handle (whose lazy peer access maps it) they ran at about 200 GB/s
// either way. Enabling it again is no error.
func (c *Context) EnablePeer(peer *Context) error {
	r := C.kvh_cu_enable_peer(c.c, peer.c)
	if r == C.KVH_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
		return nil
	}
	return check("cuCtxEnablePeerAccess", r)
}

// Stream is a non-blocking stream of c.
type Stream struct {
	ctx *Context
	s   C.kvh_CUstream
}

// NewStream creates a stream.
func (c *Context) NewStream() (*Stream, error) {
	s := &Stream{ctx: c}
	return s, check("cuStreamCreate", C.kvh_cu_stream_create(c.c, &s.s))
}

// Close destroys the stream once its work is done.
func (s *Stream) Close() error {
	return check("cuStreamDestroy", C.kvh_cu_stream_destroy(s.ctx.c, s.s))
}

// Copy queues a copy of n bytes from src to dst, which may be on different GPUs (unified
// addressing: the driver picks the peer path).
func (s *Stream) Copy(dst, src Ptr, n uint64) error {
	return check("cuMemcpyAsync", C.kvh_cu_copy_async(s.ctx.c, C.kvh_CUdeviceptr(dst), C.kvh_CUdeviceptr(src), C.size_t(n), s.s))
}

// Copies is a batch of copies for CopyAll: Dst[i] ← Src[i], Len[i] bytes.
type Copies struct{ Dst, Src, Len []uint64 }

// Add appends a copy.
func (c *Copies) Add(dst, src Ptr, n uint64) {
	c.Dst, c.Src, c.Len = append(c.Dst, uint64(dst)), append(c.Src, uint64(src)), append(c.Len, n)
}

// Reset empties the batch, keeping its memory.
func (c *Copies) Reset() { c.Dst, c.Src, c.Len = c.Dst[:0], c.Src[:0], c.Len[:0] }

// CopyAll queues a batch of copies in one call (a request's merged writes are a hundred
// or more; each call from Go and each context switch costs microseconds), submitted as one
// batch where the driver can (BatchCopies). The copies may run in any order among
// themselves, after what the stream ran before. It returns how many were queued before an
// error.
func (s *Stream) CopyAll(c *Copies) (int, error) {
	if len(c.Dst) == 0 {
		return 0, nil
	}
	var queued C.int
	r := C.kvh_cu_copy_batch(s.ctx.c, (*C.uint64_t)(unsafe.Pointer(&c.Dst[0])), (*C.uint64_t)(unsafe.Pointer(&c.Src[0])),
		(*C.uint64_t)(unsafe.Pointer(&c.Len[0])), C.int(len(c.Dst)), s.s, &queued)
	return int(queued), check("cuMemcpyAsync", r)
}

// Sync waits until everything queued on the stream is done.
func (s *Stream) Sync() error {
	return check("cuStreamSynchronize", C.kvh_cu_stream_sync(s.ctx.c, s.s))
}

// Event marks a point in a stream: done once everything queued before it is.
type Event struct {
	ctx *Context
	e   C.kvh_CUevent
}

// Record marks the stream's current end.
func (s *Stream) Record() (*Event, error) {
	e := &Event{ctx: s.ctx}
	if err := check("cuEventCreate", C.kvh_cu_event_create(s.ctx.c, &e.e)); err != nil {
		return nil, err
	}
	if err := check("cuEventRecord", C.kvh_cu_event_record(s.ctx.c, e.e, s.s)); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

// Done reports, without waiting, whether the work before the event has finished; an
// error is a copy that failed.
func (e *Event) Done() (bool, error) {
	r := C.kvh_cu_event_query(e.ctx.c, e.e)
	if r == C.KVH_CUDA_ERROR_NOT_READY {
		return false, nil
	}
	return true, check("cuEventQuery", r)
}

// Close destroys the event.
func (e *Event) Close() error { return check("cuEventDestroy", C.kvh_cu_event_destroy(e.ctx.c, e.e)) }

// ErrNoVMM: the driver lacks virtual memory management, by which engines pass GPU memory
// as file descriptors.
var ErrNoVMM = errors.New("cuda: the driver has no virtual memory management (cuMemImportFromShareableHandle)")

func loadVMM() error {
	if err := Load(); err != nil {
		return err
	}
	if C.kvh_cu_has_vmm() == 0 {
		return ErrNoVMM
	}
	return nil
}

// Shared is an allocation another process passed as a POSIX file descriptor
// (cuMemExportToShareableHandle), opened and not yet mapped: Map it or Release it.
type Shared struct {
	h           C.kvh_CUmemGenericAllocationHandle
	Ordinal     int    // the GPU that holds it, in this process's numbering
	Granularity uint64 // what a mapping's size must be a multiple of
}

// ImportFD opens the allocation fd passes; fd stays the caller's. A file that is not a
// CUDA allocation's is refused by the driver.
func ImportFD(fd int) (*Shared, error) {
	if err := loadVMM(); err != nil {
		return nil, err
	}
	s := &Shared{}
	var ordinal C.int
	var gran C.size_t
	if err := check("cuMemImportFromShareableHandle", C.kvh_cu_vmm_import(C.int(fd), &s.h, &ordinal, &gran)); err != nil {
		return nil, err
	}
	s.Ordinal, s.Granularity = int(ordinal), uint64(gran)
	return s, nil
}

// Release gives up an allocation that was not mapped.
func (s *Shared) Release() { C.kvh_cu_vmm_release(s.h) }

// Map maps the first size bytes of s at a new address of this process, readable and
// writable from GPUs devs, and consumes s. The driver refuses a size beyond the
// allocation, so an engine cannot name more memory than it passed.
func (c *Context) Map(s *Shared, size uint64, devs []int) (Ptr, error) {
	if size == 0 || size%s.Granularity != 0 {
		s.Release()
		return 0, fmt.Errorf("cuda: mapping %d bytes: must be a positive multiple of the allocation's granularity, %d", size, s.Granularity)
	}
	cdevs := make([]C.int, len(devs))
	for i, d := range devs {
		cdevs[i] = C.int(d)
	}
	var p C.kvh_CUdeviceptr
	err := check(fmt.Sprintf("mapping %d bytes of a passed allocation", size),
		C.kvh_cu_vmm_map(c.c, s.h, C.size_t(size), &cdevs[0], C.int(len(cdevs)), &p))
	return Ptr(p), err
}

// Unmap undoes Map.
func (c *Context) Unmap(p Ptr, size uint64) error {
	return check("cuMemUnmap", C.kvh_cu_vmm_unmap(c.c, C.kvh_CUdeviceptr(p), C.size_t(size)))
}

// AllocShareable allocates at least n bytes on this context's GPU as an engine's KV cache
// is allocated to be passed to the agent: rounded up to the granularity (2 MiB on an
// H200), mapped here, and exported as a POSIX fd (the caller's to close). It returns the
// address, the size and the fd; Unmap frees it.
func (c *Context) AllocShareable(n uint64) (Ptr, uint64, int, error) {
	if err := loadVMM(); err != nil {
		return 0, 0, -1, err
	}
	var p C.kvh_CUdeviceptr
	var fd C.int
	size := C.size_t(n)
	err := check(fmt.Sprintf("allocating %d shareable bytes on GPU %d", n, c.Ordinal), C.kvh_cu_vmm_alloc(c.c, C.int(c.Ordinal), &size, &p, &fd))
	return Ptr(p), uint64(size), int(fd), err
}
