"""The engine's side of a doorbell: the agent's data path without RPCs.

The layout and the rules are the agent's (transferagent/doorbell/ring.go): a sealed memfd
holding two single-producer, single-consumer rings — SourceReady reports and Pulls to the
agent, events back — and a bell the agent made and watches (one end of a Unix socket pair
whose other end the agent keeps). The connector writes a record and rings; it reads its
events at each step, where the gRPC stream would have had a thread hand them over.

Head and tail are stored and loaded as single aligned 8-byte words (memoryview "Q"), after
the record's bytes and before reading them: on x86-64, whose stores are seen in order,
that is the release and acquire the rings need. Other architectures keep to gRPC.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import platform
import struct
import threading
import time

from ._api import agent_pb2 as pb

MAGIC = 0x314C4C4542484B56  # "KVHBELL1"
HEADER = 4096
CAPACITY = 1 << 20
MAX_RECORD = 256 << 10
WRAP = 0xFFFFFFFF
# Record kinds: in the submit ring, reports and pulls; in the events ring, events.
KIND_SOURCE_READY, KIND_PULL = 0, 1
# Word indexes (offset / 8) of the header's fields.
_MAGIC, _CAPACITY, _SUBMIT_HEAD, _SUBMIT_TAIL, _EVENTS_HEAD, _EVENTS_TAIL = 0, 1, 8, 16, 24, 32
# What a ring writes to the bell (any bytes would do): 8 bytes of 1, as an eventfd write.
RING = (1).to_bytes(8, "little")
# How long a report waits for the agent to free room in a full ring.
FULL_WAIT = 5.0


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


class DoorbellError(RuntimeError):
    pass


def _record_len(n: int) -> int:
    return 8 + ((n + 7) & ~7)


class Doorbell:
    """The rings, and the bell the agent answers with."""

    def __init__(self):
        size = HEADER + 2 * CAPACITY
        self.fd = os.memfd_create("kvhandoff-doorbell", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            os.posix_fallocate(self.fd, 0, size)  # the agent maps only memory that exists
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        view = memoryview(self._map)
        self._words = view[:HEADER].cast("Q")
        self._submit = view[HEADER:HEADER + CAPACITY]
        self._events = view[HEADER + CAPACITY:]
        self._words[_MAGIC], self._words[_CAPACITY] = MAGIC, CAPACITY
        self._tail = 0  # the submit ring's, ours
        self._head = 0  # the events ring's, ours
        self._lock = threading.Lock()  # reports come from the step and from the sender thread
        self.ring = -1  # the bell the agent made, once attached

    def attach(self, ring: int) -> None:
        """Takes the bell the agent answered with, and drops the memfd: the mappings
        keep the memory. The bell is non-blocking: a ring never waits on the agent."""
        os.set_blocking(ring, False)
        self.ring = ring
        os.close(self.fd)
        self.fd = -1

    def put(self, kind: int, msg: bytes) -> bool:
        """Writes one record (a report or a pull) and rings the agent; False if it is too
        large for a record (it then goes by RPC)."""
        n = len(msg)
        if n == 0 or n > MAX_RECORD:
            return False
        need = _record_len(n)
        deadline = None
        with self._lock:
            while True:
                used = self._tail - self._words[_SUBMIT_HEAD]
                if used < 0 or used > CAPACITY:
                    raise DoorbellError(f"doorbell: the agent's head is {used} bytes behind the tail")
                pos = self._tail % CAPACITY
                pad = CAPACITY - pos if pos + need > CAPACITY else 0
                if used + pad + need <= CAPACITY:
                    break
                # Full: wait for the agent to drain it, rather than send this by RPC,
                # since a request's parts must reach the agent in order.
                deadline = deadline or time.monotonic() + FULL_WAIT
                if time.monotonic() > deadline:
                    raise DoorbellError(f"doorbell: the ring stayed full for {FULL_WAIT} s")
                time.sleep(50e-6)
            if pad:
                struct.pack_into("<I", self._submit, pos, WRAP)
                pos = 0
            struct.pack_into("<II", self._submit, pos, n, kind)
            self._submit[pos + 8:pos + 8 + n] = msg
            self._tail += pad + need
            self._words[_SUBMIT_TAIL] = self._tail  # after the record: publishes it
        try:
            os.write(self.ring, RING)
        except BlockingIOError:
            pass  # rings the agent has not read yet: it will, and drain this record too
        except OSError as e:
            # The agent's end of the bell is gone (it exited, or its pod was replaced):
            # EPIPE, or ECONNRESET. The caller fails the report as one the agent refused;
            # the session's end comes by its stream.
            raise DoorbellError(f"doorbell: the agent is gone ({e.strerror})") from e
        return True

    def poll(self) -> list:
        """The events the agent wrote since the last poll, in order."""
        tail = self._words[_EVENTS_TAIL]
        if not 0 <= tail - self._head <= CAPACITY:
            raise DoorbellError(f"doorbell: the agent's events tail {tail} is out of bounds (head {self._head})")
        out = []
        while self._head != tail:
            pos = self._head % CAPACITY
            (n,) = struct.unpack_from("<I", self._events, pos)
            if n == WRAP:
                self._head += CAPACITY - pos
                continue
            out.append(pb.Event.FromString(bytes(self._events[pos + 8:pos + 8 + n])))
            self._head += _record_len(n)
        if out:
            self._words[_EVENTS_HEAD] = self._head
        return out

    def close(self) -> None:
        for v in (self._words, self._submit, self._events):
            v.release()
        self._map.close()
        if self.ring >= 0:
            os.close(self.ring)
        if self.fd >= 0:
            os.close(self.fd)
