"""One engine rank's session with the node's transfer agent (its engine API over gRPC).

The protocol is the agent's: transferagent/api/v1/agent.proto for the calls, and
transferagent/api/v1/memory.go for the memory socket, which carries what gRPC cannot —
the memfd holding host KV, passed with SCM_RIGHTS. GPU KV travels in RegisterRegion as
CUDA IPC handles.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time

import grpc

from ._api import agent_pb2 as pb
from ._api import agent_pb2_grpc as pbg
from .doorbell import KIND_PULL, KIND_SOURCE_READY, Doorbell, DoorbellError, supported

log = logging.getLogger("kvhandoff_vllm")

MEMORY_SOCKET_NAME = "memory.sock"
DOORBELL_PREFIX = "doorbell "  # agentv1.DoorbellPrefix
CUDA_PREFIX = "cuda "  # agentv1.CUDAPrefix

# Set by kvhandoff's device plugin in containers given GPU+EFA bundles, and by its DRA
# driver's CDI specs: each accelerator with its EFAs, "<accelerator>=<efa>,<efa>;…"
# (internal/deviceplugin/server EnvAcceleratorEFAs). An engine whose devices take several
# claims gets one variable per claim: the first unsuffixed, the claim starting at
# accelerator i as KVHANDOFF_ACCELERATOR_EFAS_<i> (internal/deviceplugin/dra EnvVar).
ACCELERATOR_EFAS_ENV = "KVHANDOFF_ACCELERATOR_EFAS"


def accelerator_efas(environ) -> str | None:
    """Every claim's rails, in accelerator order, as one value of the device plugin's format."""
    parts = []
    for name, value in environ.items():
        if name == ACCELERATOR_EFAS_ENV:
            parts.append((0, value))
        elif name.startswith(ACCELERATOR_EFAS_ENV + "_") and name[len(ACCELERATOR_EFAS_ENV) + 1:].isdigit():
            parts.append((int(name[len(ACCELERATOR_EFAS_ENV) + 1:]), value))
    return ";".join(v for _, v in sorted(parts) if v) if parts else None


def rank_nics(env: str | None, accelerator: str | None, index: int) -> list[str]:
    """The libfabric domains of a rank's own EFAs (efa names an RDM domain <device>-rdm):
    those of its GPU (by UUID) where it has one, else those of the index-th accelerator;
    none without the device plugin's bundles, and the agent's --rails apply."""
    groups = [g.partition("=") for g in (env or "").split(";") if g]
    for i, (acc, _, nics) in enumerate(groups):
        if (acc == accelerator) if accelerator else (i == index):
            return [n + "-rdm" for n in nics.split(",") if n]
    return []


class AgentError(RuntimeError):
    """The agent refused a call; the message is the agent's (it names the field)."""


def _call(fn, request, timeout: float = 30.0):
    try:
        return fn(request, timeout=timeout)
    except grpc.RpcError as e:
        raise AgentError(f"{type(request).__name__}: {e.code().name}: {e.details()}") from e


def _register(stub, request, timeout: float):
    """RegisterEngine, waiting up to timeout for an agent that is not there yet (its socket
    not open) or not ready yet (UNAVAILABLE: a restarted agent before its provider and pod
    cache are up). An engine that gave up at once would exit and be restarted by the
    kubelet with its back-off (10 s, then 20 s, ...)."""
    deadline, wait = time.monotonic() + timeout, 0.1
    while True:
        try:
            return stub.RegisterEngine(request, timeout=max(deadline - time.monotonic(), 0.001), wait_for_ready=True)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + wait > deadline:
                raise
        time.sleep(wait)
        wait = min(2 * wait, 2.0)


class Session:
    """A registered engine rank: its session id, its address for peers (``ref``) and the
    stream of outcomes (``events``, a queue of agentv1 Events; None once it ended)."""

    def __init__(self, socket_path: str, request: pb.RegisterEngineRequest, timeout: float = 60.0, timeline=None,
                 doorbell: bool = False, on_end=None):
        self.socket_path = socket_path
        self._timeline = timeline
        # on_end(session) is called from the events thread once the agent ended the
        # session (not when close() did); ended is set before it.
        self._on_end, self._closing, self.ended = on_end, False, False
        self._channel = grpc.insecure_channel("unix://" + socket_path)
        self._stub = pbg.AgentStub(self._channel)
        try:
            resp = _register(self._stub, request, timeout)
        except grpc.RpcError as e:
            self._channel.close()
            raise AgentError(f"RegisterEngine at {socket_path}: {e.code().name}: {e.details()}") from e
        self.session: str = resp.session
        self.epoch: int = resp.epoch
        self.ref: pb.EngineRef = resp.self
        self.provider: str = resp.provider
        self.events: queue.Queue = queue.Queue()
        self.error: Exception | None = None
        # The stream is the engine's liveness for the agent: while it is open the session
        # lives; when this process dies the agent fences what it had outstanding.
        self._stream = self._stub.Events(pb.EventsRequest(session=self.session))
        self._thread = threading.Thread(target=self._pump, name="kvhandoff-events", daemon=True)
        self._thread.start()
        # With a doorbell, reports and events go through shared rings (doorbell.py); the
        # stream stays open as the session's liveness and for what comes before it.
        self.bell: Doorbell | None = None
        if doorbell and supported():
            bell = Doorbell()
            try:
                # The agent makes the bells and answers with them: the one to ring,
                # and the one it rings, which this connector has no use for (it polls).
                _, efds = self._pass_fds(DOORBELL_PREFIX + self.session, [bell.fd], want_fds=2)
            except AgentError as e:
                bell.close()
                log.warning("kvhandoff: the agent took no doorbell (%s); reports and events go by gRPC", e)
            else:
                os.close(efds[1])
                bell.attach(efds[0])
                self.bell = bell

    def _pump(self) -> None:
        try:
            for ev in self._stream:
                if self._timeline is not None:
                    self._timeline.mark("event_" + pb.Event.Type.Name(ev.type).lower(), ev.request_id)
                self.events.put(ev)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e
        finally:
            self.events.put(None)
            self.ended = True
            if self._on_end is not None and not self._closing:
                self._on_end(self)

    def pass_memory(self, fd: int) -> int:
        """Hands a sealed memfd to the agent; returns the handle RegisterRegion names."""
        return self._pass_fds(self.session, [fd])[0]

    def _pass_fds(self, text: str, fds: list[int], want_fds: int = 0) -> tuple[int, list[int]]:
        """Sends fds with text over the memory socket; returns the answer's handle and the
        want_fds fds the answer must carry."""
        path = os.path.join(os.path.dirname(self.socket_path), MEMORY_SOCKET_NAME)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(30)
            s.connect(path)
            socket.send_fds(s, [text.encode()], fds)
            data, got, _, _ = socket.recv_fds(s, 512, max(want_fds, 1))
        answer = data.decode(errors="replace")
        if answer.startswith("ok ") and len(got) == want_fds:
            for fd in got:
                os.set_inheritable(fd, False)
            return int(answer[3:]), got
        for fd in got:
            os.close(fd)
        if answer.startswith("ok "):
            raise AgentError(f"memory socket {path}: the answer carried {len(got)} fds, not {want_fds}")
        raise AgentError(f"memory socket {path}: {answer.removeprefix('error ')}")

    def poll_events(self) -> list:
        """The events the doorbell's ring holds (none without a doorbell)."""
        if self.bell is None:
            return []
        try:
            evs = self.bell.poll()
        except DoorbellError as e:
            raise AgentError(str(e)) from e
        if self._timeline is not None:
            for ev in evs:
                self._timeline.mark("event_" + pb.Event.Type.Name(ev.type).lower(), ev.request_id)
        return evs

    def _submit(self, kind: int, r, rpc) -> None:
        # Through the doorbell the agent answers a refused report or pull with a FAILED event.
        if self.bell is not None:
            try:
                if self.bell.put(kind, r.SerializeToString()):
                    return
            except DoorbellError as e:
                raise AgentError(f"{type(r).__name__}: {e}") from e
        _call(rpc, r)

    def register_region(self, region_id: int, fd: int, offset: int, size: int, block_len: int, block_count: int) -> None:
        handle = self.pass_memory(fd)
        _call(self._stub.RegisterRegion, pb.RegisterRegionRequest(
            session=self.session, region_id=region_id, kind=pb.MEMORY_KIND_HOST, memory_handle=handle,
            offset=offset, size=size, block_len=block_len, block_count=block_count))

    def pass_cuda(self, fd: int, size: int) -> int:
        """Hands the agent a GPU allocation of size bytes as the POSIX fd
        cuMemExportToShareableHandle made; returns the handle its regions name."""
        return self._pass_fds(f"{CUDA_PREFIX}{self.session} {size}", [fd])[0]

    def register_cuda_region(self, region_id: int, memory_handle: int, ipc_handle: bytes, device_uuid: bytes, offset: int,
                             size: int, block_len: int, block_count: int) -> None:
        """Registers GPU memory, for a peer engine on the same node: part of an allocation
        passed with pass_cuda (memory_handle), or, legacy, named by its CUDA IPC handle."""
        _call(self._stub.RegisterRegion, pb.RegisterRegionRequest(
            session=self.session, region_id=region_id, kind=pb.MEMORY_KIND_CUDA, memory_handle=memory_handle,
            cuda_ipc_handle=ipc_handle, cuda_device_uuid=device_uuid, offset=offset, size=size, block_len=block_len,
            block_count=block_count))

    def register_destination(self, key: str, attempt: int, blocks: list[int], source: pb.EngineRef, first: int = 0) -> None:
        """blocks hold positions first, first+1, …: this engine's prefix cache holds the rest."""
        _call(self._stub.RegisterDestination, pb.RegisterDestinationRequest(
            session=self.session, request_id=key, attempt=attempt, block_ids=blocks, source=source, first_position=first))

    def source_ready(self, key: str, blocks: list[int], offset: int = 0, final: bool = True) -> None:
        self._submit(KIND_SOURCE_READY, pb.SourceReadyRequest(
            session=self.session, request_id=key, offset=offset, block_ids=blocks, final=final), self._stub.SourceReady)

    def source_regions_ready(self, key: str, blocks: list[int], first: int, count: int, final: bool) -> None:
        """One layer group of a push: regions first .. first+count-1 of every block."""
        self._submit(KIND_SOURCE_READY, pb.SourceReadyRequest(
            session=self.session, request_id=key, block_ids=blocks, final=final,
            first_region=first, region_count=count), self._stub.SourceReady)

    def pull(self, key: str, attempt: int, source: pb.EngineRef, src: list[int], dst: list[int]) -> None:
        self._submit(KIND_PULL, pb.PullRequest(
            session=self.session, request_id=key, attempt=attempt, source=source,
            source_block_ids=src, destination_block_ids=dst), self._stub.Pull)

    def decline(self, key: str, source: pb.EngineRef) -> None:
        """Push, decode: this engine computes the request itself; the prefill agent frees its blocks."""
        _call(self._stub.Decline, pb.DeclineRequest(session=self.session, request_id=key, source=source))

    def cancel(self, key: str, attempt: int) -> bool:
        """Fences an attempt; False when the agent has nothing outstanding for it."""
        try:
            self._stub.Cancel(pb.CancelRequest(session=self.session, request_id=key, attempt=attempt), timeout=30)
            return True
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise AgentError(f"Cancel: {e.code().name}: {e.details()}") from e

    def heartbeat(self) -> None:
        _call(self._stub.Heartbeat, pb.HeartbeatRequest(session=self.session))

    def close(self) -> None:
        self._closing = True
        self._stream.cancel()
        self._channel.close()
        self._thread.join(timeout=30)
        if self.bell is not None:
            self.bell.close()
            self.bell = None


class LostSession:
    """Stands in for a session the agent ended until the rank has registered again: every
    call is refused with AgentError, as the agent refuses one, so a request that comes
    meanwhile fails by the same paths (a receive fails, a report's send is over) instead of
    waiting for an agent that is not there. It has no events and no doorbell."""

    bell = None

    def __init__(self, ref: pb.EngineRef, why: str):
        self.ref, self.why = ref, why
        self.session, self.error = "", None
        self.events: queue.Queue = queue.Queue()

    def __getattr__(self, name: str):
        def refused(*_args, **_kwargs):
            raise AgentError(f"{name}: the agent session ended ({self.why}); the connector registers again once the agent is back")
        return refused

    def poll_events(self) -> list:
        return []

    def close(self) -> None:
        pass


def engine_ref(agent: str, engine_id: str, tp_rank: int, tp_size: int = 0) -> pb.EngineRef:
    """A peer engine's rank; tp_size 0 says the peer has the caller's tensor-parallel size."""
    return pb.EngineRef(agent=agent, engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size)
