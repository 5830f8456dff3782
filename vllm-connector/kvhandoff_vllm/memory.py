"""KV memory the transfer agent can reach: a sealed memfd (host KV), or CUDA allocations
passed as file descriptors or, legacy, named by IPC handles (GPU KV, for pairs on one node).

vLLM allocates an engine's whole KV cache as one int8 buffer (``allocate_kv_cache`` in
vllm/v1/worker/utils.py) and views every layer into it. Inside the connector's memory
pool context that one allocation is served from a memfd instead of the heap, so the
tensors vLLM computes into *are* the memory the agent writes and reads: no copy, ever.

The memfd is sealed (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL) before anyone maps it:
the agent maps it too, and refuses memory that could shrink under its mapping.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import weakref

import torch


class SealedMemory:
    """size bytes of zeroed host memory in a sealed memfd, mapped shared, as an int8 tensor."""

    def __init__(self, name: str, size: int):
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # Every page allocated here, charged to the engine: the agent maps only memory
            # that exists.
            os.posix_fallocate(self.fd, 0, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self._map, dtype=torch.int8)

    @property
    def base(self) -> int:
        return self.tensor.data_ptr()

    def offset_of(self, t: torch.Tensor) -> int | None:
        """The byte offset of t's first element in this memory, or None if t is elsewhere."""
        p = t.data_ptr()
        if self.base <= p < self.base + self.size:
            return p - self.base
        return None


@contextlib.contextmanager
def kv_allocation(name: str, sink: list):
    """Serves vLLM's KV cache allocations (1-D int8 ``torch.zeros``) from memory the agent
    can be given: on the CPU, one SealedMemory, which replaces sink's content; on a GPU,
    a PassedCudaMemory each, appended to sink. Every other allocation is left alone."""
    zeros = torch.zeros
    served = False

    def shared_zeros(*size, dtype=None, device=None, **kwargs):
        nonlocal served
        n = size[0] if len(size) == 1 else None
        kind = torch.device(device).type if device is not None else "cpu"
        if isinstance(n, int) and n > 0 and dtype == torch.int8 and not kwargs:
            if kind == "cpu" and not served:
                # One allocation per context: the latest one is the KV cache in use.
                served = True
                mem = SealedMemory(name, n)
                sink[:] = [mem]
                return mem.tensor
            if kind == "cuda":
                mem = PassedCudaMemory(n, torch.device(device))
                sink.append(mem)
                return mem.tensor[:n]
        return zeros(*size, dtype=dtype, device=device, **kwargs)

    torch.zeros = shared_zeros
    try:
        yield
    finally:
        torch.zeros = zeros


# CUDA KV is handed to the transfer agent as a file descriptor over the memory socket
# wherever the driver allocated it (CUDA virtual memory management), so the memory itself
# is handed over, to the agent alone: vLLM 0.31-0.33 enter the connector's memory pool
# context, where the KV tensors come from PassedCudaMemory; vLLM 0.34 allocates them itself
# in its extensible KV cache, exportable (CudaAllocation finds them). KV from cudaMalloc
# (PyTorch's caching allocator: vLLM 0.26-0.30, which allocate KV outside any connector
# context) is named by a legacy CUDA IPC handle: a name any process of the node that learns
# it can open. Nothing of CUDA is imported at module load: the CPU backend and CPU-only
# machines never touch it.

_LIBCUDA = None

# cuda.h's constants this module uses: CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
# CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
# CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE.
_POINTER_DEVICE_ORDINAL = 9
_PINNED, _POSIX_FD, _ON_DEVICE, _READ_WRITE = 1, 1, 1, 3


class _AllocationProp(ctypes.Structure):
    """CUmemAllocationProp."""

    _fields_ = [("type", ctypes.c_int), ("requested_handle_types", ctypes.c_int), ("location_type", ctypes.c_int),
                ("location_id", ctypes.c_int), ("win32_handle_meta_data", ctypes.c_void_p),
                ("compression_type", ctypes.c_ubyte), ("gpu_direct_rdma_capable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):
    """CUmemAccessDesc."""

    _fields_ = [("location_type", ctypes.c_int), ("location_id", ctypes.c_int), ("flags", ctypes.c_int)]


def _libcuda():
    global _LIBCUDA
    if _LIBCUDA is None:
        path = os.environ.get("KVHANDOFF_LIBCUDA", "libcuda.so.1")
        try:
            _LIBCUDA = ctypes.CDLL(path)
        except OSError as e:
            raise RuntimeError(f"kvhandoff connector: CUDA KV needs the driver's {path}: {e}") from e
    return _LIBCUDA


def _check(rc: int, call: str, hint: str = "") -> None:
    if rc == 0:
        return
    name = ctypes.c_char_p()
    _libcuda().cuGetErrorName(rc, ctypes.byref(name))
    what = name.value.decode() if name.value else f"CUresult {rc}"
    raise RuntimeError(f"kvhandoff connector: {call}: {what}{hint}")


def _device_uuid(ordinal: int) -> bytes:
    lib, dev = _libcuda(), ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    uuid = ctypes.create_string_buffer(16)
    _check(lib.cuDeviceGetUuid_v2(uuid, dev), "cuDeviceGetUuid")
    return uuid.raw


class _Mapped:
    """A driver mapping as torch.as_tensor takes it (__cuda_array_interface__); unmapped
    when the last tensor viewing it is freed."""

    def __init__(self, base: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|i1", "data": (base, False), "version": 2}
        weakref.finalize(self, _unmap, base, size)


def _unmap(base: int, size: int) -> None:
    lib = _libcuda()
    lib.cuMemUnmap(ctypes.c_uint64(base), ctypes.c_size_t(size))
    lib.cuMemAddressFree(ctypes.c_uint64(base), ctypes.c_size_t(size))


class PassedCudaMemory:
    """At least size bytes of zeroed memory on a GPU, allocated by the driver so that it can
    be passed to the agent as a POSIX fd (fd), as an int8 tensor; size is rounded up to the
    allocation granularity (2 MiB on an H200)."""

    handle = b""  # no legacy IPC handle: passed as fd

    def __init__(self, size: int, device: torch.device):
        lib = _libcuda()
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()  # the driver and this device's primary context, as torch uses them
        prop = _AllocationProp(type=_PINNED, requested_handle_types=_POSIX_FD, location_type=_ON_DEVICE, location_id=ordinal)
        gran = ctypes.c_size_t()
        _check(lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0), "cuMemGetAllocationGranularity")
        self.size = -(-size // gran.value) * gran.value
        handle, base, fd = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int(-1)
        _check(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(prop), ctypes.c_ulonglong(0)),
               "cuMemCreate", f" ({self.size} bytes on GPU {ordinal})")
        try:
            _check(lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, _POSIX_FD, ctypes.c_ulonglong(0)), "cuMemExportToShareableHandle")
            _check(lib.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(self.size), ctypes.c_size_t(0), ctypes.c_uint64(0),
                                           ctypes.c_ulonglong(0)), "cuMemAddressReserve")
            mapped = _Mapped(base.value, self.size)  # from here on, unmapped when the tensor goes
            _check(lib.cuMemMap(base, ctypes.c_size_t(self.size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)), "cuMemMap")
            access = _AccessDesc(location_type=_ON_DEVICE, location_id=ordinal, flags=_READ_WRITE)
            _check(lib.cuMemSetAccess(base, ctypes.c_size_t(self.size), ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
        except BaseException:
            if fd.value >= 0:
                os.close(fd.value)
            raise
        finally:
            lib.cuMemRelease(handle)  # the mapping and the fd hold the memory now
        self.fd = fd.value
        os.set_inheritable(self.fd, False)
        self.base = base.value
        self.device_uuid = _device_uuid(ordinal)
        self.tensor = torch.as_tensor(mapped, device=device)
        self.tensor.zero_()

    def offset_of(self, t: torch.Tensor) -> int | None:
        """The byte offset of t's first element in this allocation, or None if t is elsewhere."""
        p = t.data_ptr()
        if self.base <= p < self.base + self.size:
            return p - self.base
        return None


class CudaAllocation:
    """The CUDA allocation holding the device pointer ptr, found by its address: its base and
    size, its GPU's UUID (16 bytes), and how the agent is given it. Memory the driver mapped
    (cuMemCreate: vLLM 0.34's extensible KV cache, created exportable because the connector
    says it exports fds) is passed as a POSIX fd (fd, until close); memory from cudaMalloc
    (PyTorch's caching allocator, vLLM before 0.31) has no fd and is named by a legacy IPC
    handle (64 bytes)."""

    def __init__(self, ptr: int):
        lib = _libcuda()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        # For driver-mapped memory this is the one mapping holding ptr (one physical
        # allocation), not the whole address reservation around it.
        _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)), "cuMemGetAddressRange")
        self.base, self.size = base.value, size.value
        ordinal = ctypes.c_int()
        _check(lib.cuPointerGetAttribute(ctypes.byref(ordinal), _POINTER_DEVICE_ORDINAL, ctypes.c_uint64(ptr)), "cuPointerGetAttribute")
        self.device_uuid = _device_uuid(ordinal.value)
        self.fd, self.handle = None, b""
        allocation = ctypes.c_uint64()
        if lib.cuMemRetainAllocationHandle(ctypes.byref(allocation), ctypes.c_void_p(self.base)) == 0:
            fd = ctypes.c_int(-1)
            try:
                _check(lib.cuMemExportToShareableHandle(ctypes.byref(fd), allocation, _POSIX_FD, ctypes.c_ulonglong(0)),
                       "cuMemExportToShareableHandle",
                       " (driver-mapped KV can be passed only if it was created exportable as a POSIX fd: vLLM's extensible KV "
                       "cache is, for this connector; PyTorch's expandable_segments:True and vLLM's sleep-mode pool are not)")
            finally:
                lib.cuMemRelease(allocation)  # the mapping holds the memory; the fd, its own reference
            self.fd = fd.value
            os.set_inheritable(self.fd, False)
            return
        handle = ctypes.create_string_buffer(64)
        _check(lib.cuIpcGetMemHandle(handle, ctypes.c_uint64(self.base)), "cuIpcGetMemHandle")
        self.handle = handle.raw

    def close(self) -> None:
        """Closes the fd once it was passed: the agent holds its own reference."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = -1

    def offset_of(self, t: torch.Tensor) -> int | None:
        """The byte offset of t's first element in this allocation, or None if t is elsewhere."""
        p = t.data_ptr()
        if self.base <= p < self.base + self.size:
            return p - self.base
        return None


def gpu_uuid_string(raw: bytes) -> str:
    """A GPU's 16-byte UUID as NVIDIA names it (NVIDIA_VISIBLE_DEVICES, nvidia-smi -L)."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def block_major(t: torch.Tensor, split_kv: bool) -> list[torch.Tensor]:
    """The views of one layer's KV cache whose first dimension is the block. vLLM's CUDA
    attention backends of the FlashAttention kind lay a layer out as (2, blocks, block size,
    heads, head size): K and V apart, each block-major, so each is a region of its own
    (as NIXL registers them)."""
    if split_kv and t.dim() == 5 and t.shape[0] == 2:
        return [t[0], t[1]]
    return [t]


def is_head_major(v: torch.Tensor, heads: int) -> bool:
    """Whether every block of v (a block-major view) holds its heads one after another, so
    one head's share of a block is contiguous: its head dimension (of size heads; the
    outermost such) is the outermost within a block. What an engine of another
    tensor-parallel size reads or writes is such a share of every block."""
    if heads <= 1:
        return True
    dims = [i for i in range(1, v.dim()) if v.shape[i] == heads]
    if not dims:
        return False
    i = max(dims, key=v.stride)
    return v.stride(i) * heads == v.stride(0)
