"""KV memory the transfer agent can reach: a sealed memfd (host KV), or CUDA allocations
exported as IPC handles (GPU KV, for pairs on one node).

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
    """Serves vLLM's KV cache allocation (a 1-D int8 ``torch.zeros`` on the CPU) from a
    SealedMemory, which replaces sink's content; every other allocation is left alone."""
    zeros = torch.zeros
    served = False

    def shared_zeros(*size, dtype=None, device=None, **kwargs):
        nonlocal served
        n = size[0] if len(size) == 1 else None
        on_cpu = device is None or torch.device(device).type == "cpu"
        if isinstance(n, int) and n > 0 and dtype == torch.int8 and on_cpu and not kwargs and not served:
            # One allocation per context: the latest one is the KV cache in use.
            served = True
            mem = SealedMemory(name, n)
            sink[:] = [mem]
            return mem.tensor
        return zeros(*size, dtype=dtype, device=device, **kwargs)

    torch.zeros = shared_zeros
    try:
        yield
    finally:
        torch.zeros = zeros


# CUDA KV: vLLM's GPU workers allocate each layer's KV cache with the PyTorch caching
# allocator (cudaMalloc underneath). Those allocations are exported to the transfer agent
# as legacy CUDA IPC handles; the agent opens them on its own node and copies between the
# GPUs of a same-node pair. Nothing of CUDA is imported at module load: the CPU backend and
# CPU-only machines never touch it.

_LIBCUDA = None

# cuPointerGetAttribute's CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL (cuda.h).
_POINTER_DEVICE_ORDINAL = 9


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


class CudaAllocation:
    """The CUDA allocation holding the device pointer ptr, exported for the transfer agent:
    its base and size, its legacy IPC handle (64 bytes) and its GPU's UUID (16 bytes)."""

    def __init__(self, ptr: int):
        lib = _libcuda()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)), "cuMemGetAddressRange")
        self.base, self.size = base.value, size.value
        handle = ctypes.create_string_buffer(64)
        # Memory from cuMemCreate (PyTorch's expandable segments, vLLM's sleep mode) has no
        # legacy IPC handle.
        _check(lib.cuIpcGetMemHandle(handle, ctypes.c_uint64(self.base)), "cuIpcGetMemHandle",
               " (the KV cache must come from cudaMalloc: run without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and without --enable-sleep-mode)")
        self.handle = handle.raw
        ordinal, dev = ctypes.c_int(), ctypes.c_int()
        _check(lib.cuPointerGetAttribute(ctypes.byref(ordinal), _POINTER_DEVICE_ORDINAL, ctypes.c_uint64(ptr)), "cuPointerGetAttribute")
        _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        uuid = ctypes.create_string_buffer(16)
        _check(lib.cuDeviceGetUuid_v2(uuid, dev), "cuDeviceGetUuid")
        self.device_uuid = uuid.raw

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
