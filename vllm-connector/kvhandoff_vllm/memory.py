"""Host KV memory the transfer agent can map: a sealed memfd.

vLLM allocates an engine's whole KV cache as one int8 buffer (``allocate_kv_cache`` in
vllm/v1/worker/utils.py) and views every layer into it. Inside the connector's memory
pool context that one allocation is served from a memfd instead of the heap, so the
tensors vLLM computes into *are* the memory the agent writes and reads: no copy, ever.

The memfd is sealed (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL) before anyone maps it:
the agent maps it too, and refuses memory that could shrink under its mapping.
"""

from __future__ import annotations

import contextlib
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
