"""The worker side: the rank's session with the agent, its KV memory, and the calls the
scheduler side asks for each step.

Data path (host KV, the CPU backend): vLLM allocates the rank's whole KV cache inside
``mem_pool_context`` — one sealed memfd (memory.py). ``register_kv_caches`` passes that
memfd to the agent (memory socket, SCM_RIGHTS) and registers one region per layer (its
blocks at their stride in the memfd); the agent maps the same pages. Nothing is copied:
prefill's attention writes the KV the agent then sends, and the agent writes (push) or
reads (pull) straight into the blocks decode's attention reads.

Data path (CUDA KV, pairs on one node): ``register_kv_caches`` finds the CUDA allocation
behind each layer's KV, passes it to the agent as a file descriptor where it can be exported
as one (memory.py says which allocations can), else names it by a legacy IPC handle, and
registers K and V of every layer as regions in it. The node's agent maps the memory and
moves KV between the pair's GPUs with device copies (NVLink on P5en).

Push prefill reports a request whose prefill completes in a step (a stream) from that step,
through a sender thread, so the forward never waits on the agent. With layer streaming,
``save_layer`` reports each layer's region right after the forward pass wrote it (vLLM calls
``save_kv_layer`` after each attention layer); the agent writes that layer while the next
computes, and tells decode only once every layer has landed. Without it, ``save`` reports the
whole prompt once the forward is over, a step before vLLM finishes the request. On a GPU
"written" and "over" mean a CUDA event recorded there has passed: the step only enqueues
the kernels, and the sender thread holds each report until the GPU has run them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import torch

from ._api import agent_pb2 as pb
from .agent import AgentError, LostSession, Session, accelerator_efas, engine_ref, rank_nics
from .config import Config
from .heads import ShardError, check_shards, destinations, pair_request_id, sources
from .memory import CudaAllocation, PassedCudaMemory, SealedMemory, block_major, gpu_uuid_string, is_head_major, kv_allocation
from .metadata import Handshake, KVHandoffMetadata
from .scheduler import ATTEMPT
from .timeline import Timeline

log = logging.getLogger("kvhandoff_vllm")

_RECV_OVER = (pb.Event.DELIVERED, pb.Event.FAILED, pb.Event.CANCEL_ACKED)
_SEND_OVER = (pb.Event.SOURCE_DONE, pb.Event.FAILED)

# Registering again after the agent was lost, from a thread of the rank's own: each try
# waits this long for the agent at most (seconds), and the tries space out from the first
# gap to the last.
REJOIN_WAIT, REJOIN_FIRST, REJOIN_MAX = 30.0, 0.25, 2.0


class WorkerSide:
    def __init__(self, cfg: Config, rank: int, tp_size: int, block_size: int, kv_heads: int, head_dim: int,
                 own_pool: bool = True):
        self.cfg = cfg
        # own_pool: the connector serves the KV allocation (mem_pool_context). vLLM 0.34's
        # extensible KV cache allocates it itself, exportable as fds, and refuses a pool.
        self.own_pool = own_pool
        self.rank, self.tp_size = rank, tp_size
        self.block_size, self.kv_heads, self.head_dim = block_size, kv_heads, head_dim
        self.local_heads = max(1, kv_heads // tp_size)  # vLLM's: a head replicated where heads < ranks
        self.memory: list = []  # a SealedMemory (host KV), or PassedCudaMemory each (GPU KV)
        self.session: Session | None = None
        self._kv_caches: dict | None = None  # what restore() registers again
        self._gpu_kv = False  # the KV is in GPU memory, written asynchronously to the step
        # pair key -> (request id, "recv" | "send"): what the agent's events are about. A
        # request's key names one transfer per rank pair (heads.pair_request_id: the key
        # itself where both engines have one tensor-parallel size); _pairs holds a key's
        # pairs still outstanding, _broken the keys one of whose pairs failed. A request is
        # over only when all its pairs are: a receive's blocks go back to vLLM only once no
        # pair can still write into them.
        self._keys: dict[str, tuple[str, str]] = {}
        self._pairs: dict[str, set[str]] = {}
        self._pair_of: dict[str, str] = {}  # pair key -> key
        self._fan: dict[str, tuple[str, ...]] = {}  # key -> all its pairs (read by the sender thread)
        self._broken: dict[str, str] = {}  # key -> "failed" | "cancelled"
        self.peer_tp = cfg.peer_tp_size or tp_size
        if self.peer_tp != tp_size:
            # Checked at start: a pair whose heads cannot be mapped would fail every request.
            try:
                check_shards(kv_heads, tp_size)
                check_shards(kv_heads, self.peer_tp)
            except ShardError as e:
                raise RuntimeError(
                    f"kvhandoff connector: this engine's tensor-parallel size is {tp_size} and its peers' (peer_tp_size) "
                    f"{self.peer_tp}, and {e}: each decode rank must take whole KV heads from the prefill ranks holding them; "
                    "give both pools sizes that divide the model's KV heads (or exceed them, replicating each head)") from e
        self._beating: set[str] = set()  # push registrations whose leases need heartbeats
        self._last_beat = 0.0
        self._sending: set[str] = set()  # prefill requests whose blocks the agent holds
        self._sent: set[str] = set()  # ... and those the agent is done with
        self._recvd: set[str] = set()
        self._failed: set[str] = set()
        self._recv_blocks: dict[str, list[int]] = {}  # receives in flight: their blocks
        self._failed_blocks: set[int] = set()  # blocks of failed receives, for vLLM < 0.30
        self._finished: set[str] = set()  # of those, the ones the scheduler has finished
        self.stats = {"delivered": 0, "failed": 0, "cancelled": 0, "sent": 0, "layers_streamed": 0, "reconnects": 0}
        # Registering again after the agent was lost (_rejoin): the session the rejoining
        # thread opened, waiting for the step to take it; whether that thread runs; and
        # the generation of sessions it serves (close() starts a new one, whose rejoins
        # must not revive what was closed).
        self._lock = threading.Lock()
        self._replacement: Session | None = None
        self._rejoining, self._generation = False, 0
        # Layer streaming: each layer's region indexes (by vLLM's layer name; K and V are
        # two regions in CUDA layouts), the regions reported so far per request key in this
        # step, and the sender thread's queue (FIFO, so a request's final layer goes out last).
        self._region_of: dict[str, list[int]] = {}
        self._regions = 0
        self._layers_sent: dict[str, set[int]] = {}
        # Streamed prefills vLLM does not hold yet (request id -> key): their end at the
        # agent is kept for when it does (their Send), and dropped if vLLM aborts them —
        # it then frees their blocks and forgets the request, and must never hear of it.
        self._streaming: dict[str, str] = {}
        self._outbox: queue.Queue | None = None
        self._sender: threading.Thread | None = None
        self.timeline = Timeline(f"{cfg.engine_id}-rank{rank}")

    def mem_pool_context(self):
        if not self.own_pool:
            return None
        return kv_allocation(f"kvhandoff-kv-{self.cfg.engine_id}-{self.rank}", self.memory)

    def register_kv_caches(self, kv_caches: dict, wait: float = 60.0) -> None:
        """Registers the rank and its KV with the agent, waiting up to wait seconds for an
        agent not there or not ready yet."""
        self._kv_caches = kv_caches
        self.session = self._open_session(kv_caches, wait)

    def _open_session(self, kv_caches: dict, wait: float) -> Session:
        """A session with every region of kv_caches registered; the rank's session
        until then is untouched."""
        cuda = any(t.is_cuda for t in kv_caches.values())
        self._gpu_kv = cuda
        if cuda and not self.cfg.same_node:
            raise RuntimeError(
                "kvhandoff connector: the agent moves KV held in GPU memory only between engines on one node "
                "(CUDA copies), and this engine's policy keeps pairs on different nodes, where GPU KV needs the "
                "agent's EFA dmabuf path, which it does not have; set the KVTransferPolicy's sameNode: Allow or Prefer")
        if not cuda and not isinstance(self.memory[0] if self.memory else None, SealedMemory):
            raise RuntimeError(
                "kvhandoff connector: the KV cache was not allocated through the connector's memory pool "
                "context, so the agent cannot map it; on vLLM's CPU backend the connector needs a vLLM that "
                "enters that context around its KV allocation (0.31 and later)")
        # Each region is one block-major view of a layer's KV: (memory, offset, size, block
        # length, block count), keyed by its address so that layers sharing a KV cache share
        # its regions. Host regions are numbered in memfd order; CUDA regions, spread over
        # allocations whose addresses differ between engines, in vLLM's layer order.
        regions, layers, dtype_bytes, head_major = {}, {}, 0, True
        allocations: list = [m for m in self.memory if isinstance(m, PassedCudaMemory)] if cuda else []
        for name, t in kv_caches.items():
            layers[name] = []
            for v in block_major(t, split_kv=cuda):
                p = v.data_ptr()
                layers[name].append(p)
                if p in regions:
                    continue
                mem = self._cuda_allocation(allocations, v) if cuda else self.memory[0]
                off = mem.offset_of(v)
                if off is None:
                    raise RuntimeError(f"kvhandoff connector: layer {name}'s KV is outside the shared memory")
                block_len = v.stride(0) * v.element_size()
                regions[p] = (mem, off, block_len * v.shape[0], block_len, v.shape[0])
                dtype_bytes = v.element_size()
                head_major = head_major and is_head_major(v, self.local_heads)
        if self.peer_tp != self.tp_size and not head_major:
            raise RuntimeError(
                f"kvhandoff connector: this engine's tensor-parallel size is {self.tp_size} and its peers' {self.peer_tp}, so each "
                "rank sends or receives a slice of every block, its share of the KV heads, and this attention backend does not "
                "lay a block out head by head; on GPUs set VLLM_KV_CACHE_LAYOUT=HND (the manager renders it for such pools)")
        order = list(regions) if cuda else sorted(regions)
        index = {p: i for i, p in enumerate(order)}
        self._region_of = {name: [index[p] for p in ptrs] for name, ptrs in layers.items()}
        self._regions = len(order)
        session = Session(self.cfg.socket, pb.RegisterEngineRequest(
            engine_id=self.cfg.engine_id,
            role=pb.ROLE_PREFILL if self.cfg.role == "prefill" else pb.ROLE_DECODE,
            mode=pb.MODE_PUSH if self.cfg.mode == "push" else pb.MODE_PULL,
            tp_rank=self.rank, tp_size=self.tp_size,
            layout=pb.KVLayout(layers=len(order), block_size=self.block_size, kv_heads=self.kv_heads,
                               head_dim=self.head_dim, dtype_bytes=dtype_bytes, head_major=head_major),
            lease_millis=self.cfg.lease * 1000, registration_timeout_millis=self.cfg.registration_timeout * 1000,
            blocks_ttl_millis=self.cfg.blocks_ttl * 1000,
            # The rank's rails on its own accelerator's EFAs, where the device plugin's
            # bundles or the DRA driver's claims say which those are.
            fabric_domains=rank_nics(accelerator_efas(os.environ),
                                     gpu_uuid_string(allocations[0].device_uuid) if cuda else None, self.rank)),
            timeout=wait, timeline=self.timeline, doorbell=self.cfg.doorbell, on_end=self._rejoin_later)
        try:
            passed = self._register_regions(session, regions, order, allocations, cuda)
        except BaseException:
            session.close()
            raise
        finally:
            for a in allocations:
                if isinstance(a, CudaAllocation):
                    a.close()  # the agent holds its own reference to what was passed
        legacy = sum(1 for a in allocations if a.fd is None) if cuda else 0
        if legacy:
            log.warning("kvhandoff: %s rank %d: %d KV allocations came from cudaMalloc, which has no file descriptor to pass, and "
                        "are named to the agent by legacy CUDA IPC handles, names any process of the node that learns them can "
                        "open (vLLM before 0.31 does not let the connector allocate its KV)",
                        self.cfg.engine_id, self.rank, legacy)
        where = f"{len(allocations)} CUDA allocations, {passed} passed as fds" if cuda else f"{self.memory[0].size >> 20} MiB of host memory"
        log.info("kvhandoff: %s rank %d registered %d regions (%s) with the agent at %s (%s)",
                 self.cfg.engine_id, self.rank, len(order), where, session.ref.agent, session.provider)
        return session

    @staticmethod
    def _register_regions(session: Session, regions: dict, order: list, allocations: list, cuda: bool) -> int:
        """Registers every region with session; returns how many allocations were passed as fds."""
        passed: dict[int, int] = {}  # allocation's base -> the agent's handle for it
        for i, p in enumerate(order):
            mem, off, size, block_len, count = regions[p]
            if not cuda:
                session.register_region(i, mem.fd, off, size, block_len, count)
                continue
            if mem.fd is not None and mem.base not in passed:
                passed[mem.base] = session.pass_cuda(mem.fd, mem.size)
            session.register_cuda_region(i, passed.get(mem.base, 0), mem.handle, mem.device_uuid, off, size, block_len, count)
        return len(passed)

    def unregister(self) -> None:
        """Ends the session with the agent before vLLM releases or remaps the KV memory
        (sleep, a weight update that borrows it): the agent unmaps it, and nothing can be
        outstanding past this point. Idempotent."""
        if self.session is None:
            return
        self.close()
        self.session = None
        self._end_outstanding()

    def restore(self) -> None:
        """Registers the KV caches again after unregister: the same views, whose memory may
        now be other physical pages behind the same addresses (passed again). Idempotent."""
        if self.session is None and self._kv_caches is not None:
            self.register_kv_caches(self._kv_caches)

    @staticmethod
    def _cuda_allocation(known: list, t):
        """The allocation holding t: one the connector made (PassedCudaMemory), or one found
        behind t's address (CudaAllocation), once however many layers share it."""
        for a in known:
            if a.offset_of(t) is not None:
                return a
        a = CudaAllocation(t.data_ptr())
        known.append(a)
        return a

    def handshake(self) -> Handshake | None:
        if self.session is None:
            return None
        return Handshake(agent=self.session.ref.agent, engine_id=self.cfg.engine_id)

    def start_load(self, meta: KVHandoffMetadata) -> None:
        self._reconnect()
        self._finished_prefills(meta)
        for r in meta.receives:
            self._recv_blocks[r.req_id] = r.blocks
            if r.error:
                log.error("kvhandoff: request %s cannot load its KV: %s", r.req_id, r.error)
                self._recv_over(r.req_id, failed=True)
                continue
            self.timeline.mark("load_call", r.key)
            pairs = self._open(r.key, r.req_id, "recv")
            for src_rank, pk in pairs:
                src = self._peer(r.source_agent, r.source_engine, src_rank)
                try:
                    if r.src_blocks is None:
                        self.session.register_destination(pk, ATTEMPT, r.blocks, src, r.first)
                        self._beating.add(pk)
                    else:
                        self.session.pull(pk, ATTEMPT, src, r.src_blocks, r.blocks)
                except AgentError as e:
                    log.error("kvhandoff: request %s: %s", r.req_id, e)
                    self._pair_over(pk, failed=True)
                    break
            self.timeline.mark("load_done", r.key)
        for d in meta.declines:
            for src_rank in self._sources():
                try:
                    self.session.decline(pair_request_id(d.key, src_rank, self.rank, self.peer_tp, self.tp_size),
                                         self._peer(d.source_agent, d.source_engine, src_rank))
                except AgentError as e:
                    log.warning("kvhandoff: declining the push of %s: %s", d.key, e)
        for rid, key in meta.cancels:
            for pk in sorted(self._pairs.get(key, {key})):
                try:
                    self.session.cancel(pk, ATTEMPT)
                except AgentError as e:
                    log.warning("kvhandoff: cancelling request %s: %s", rid, e)
            if self._streaming.pop(rid, None) is not None:
                self._sent.discard(rid)  # vLLM asserts a finished send's request exists
        self._heartbeat()

    def _finished_prefills(self, meta: KVHandoffMetadata) -> None:
        """Reports the prefills vLLM finished at the start of the step that tells of them:
        vLLM finishes a request after the forward that produced its last token, so their
        blocks are complete in memory. Not at the step's end (wait_for_save): a step with
        nothing to compute has none (vLLM's no-forward path), and an idle engine's last
        prefill would wait for the next request."""
        for s in meta.sends:
            if s.streamed:
                self._streaming.pop(s.req_id, None)
                self._sending.add(s.req_id)  # reported layer by layer; now vLLM holds it
                continue
            self._sending.add(s.req_id)
            self.timeline.mark("ready_call", s.key)
            for _, pk in self._open(s.key, s.req_id, "send"):
                try:
                    self.session.source_ready(pk, s.blocks)
                except AgentError as e:
                    log.error("kvhandoff: request %s: %s", s.req_id, e)
                    self._pair_over(pk, failed=True)
            self.timeline.mark("ready_done", s.key)

    def _heartbeat(self) -> None:
        # The decode agent forwards heartbeats to the prefill agents, renewing the leases
        # of push registrations: three per lease (every 5 s when the agent's flag sets it).
        every = self.cfg.lease / 3 if self.cfg.lease else 5.0
        if self._beating and time.monotonic() - self._last_beat >= every:
            self._last_beat = time.monotonic()
            try:
                self.session.heartbeat()
            except AgentError as e:
                log.warning("kvhandoff: heartbeat: %s", e)

    def save_layer(self, meta: KVHandoffMetadata, layer_name: str) -> None:
        """Reports one layer of this step's streamed requests: its KV is in the cache now."""
        regions = self._region_of.get(layer_name)
        if regions is None or not meta.streams or not self.cfg.layer_streaming:
            return
        for s in meta.streams:
            self._stream(s, regions)

    def _stream(self, s, regions: list[int]) -> None:
        sent = self._layers_sent.get(s.key)
        if sent is None:
            sent = self._layers_sent[s.key] = set()
            self._track(s)
        for idx in regions:
            if idx in sent:
                continue  # layers sharing one KV cache: one region
            sent.add(idx)
            self._send_later(s.key, s.blocks, idx, final=len(sent) == self._regions)

    def _track(self, s) -> None:
        # Its events are ours from now on; it counts as sending (reported to vLLM once
        # over) only when vLLM holds its blocks, at its Send.
        self._open(s.key, s.req_id, "send")
        self._streaming[s.req_id] = s.key

    def _sources(self) -> list[int]:
        """Decode: the prefill ranks this rank takes its heads from (its own number at one size)."""
        if self.peer_tp == self.tp_size:
            return [self.rank]
        return sources(self.kv_heads, self.peer_tp, self.tp_size, self.rank)

    def _peer(self, agent: str, engine: str, rank: int) -> pb.EngineRef:
        return engine_ref(agent, engine, rank, self.peer_tp if self.peer_tp != self.tp_size else 0)

    def _open(self, key: str, rid: str, kind: str) -> list[tuple[int, str]]:
        """Starts tracking a request's rank pairs: (peer rank, pair key) each."""
        if kind == "recv":
            pairs = [(i, pair_request_id(key, i, self.rank, self.peer_tp, self.tp_size)) for i in self._sources()]
        elif self.peer_tp == self.tp_size:
            pairs = [(self.rank, key)]
        else:
            pairs = [(j, pair_request_id(key, self.rank, j, self.tp_size, self.peer_tp))
                     for j in destinations(self.kv_heads, self.tp_size, self.peer_tp, self.rank)]
        self._pairs[key] = {pk for _, pk in pairs}
        self._fan[key] = tuple(pk for _, pk in pairs)
        for _, pk in pairs:
            self._keys[pk] = (rid, kind)
            self._pair_of[pk] = key
        return pairs

    def _send_later(self, key: str, blocks: list[int], region: int | None, final: bool) -> None:
        """Reports KV the step's forward is computing: one region of every block, or
        (region None) the whole blocks. Host KV is written when the call comes (the CPU
        backend computes synchronously): through a doorbell the report costs microseconds
        and is written at once, from the step; else the sender thread makes the RPC. GPU
        KV is written only when the GPU gets there, long after the call that enqueued its
        kernels: the report waits, in the sender thread, for a CUDA event recorded on the
        forward's stream now, so the agent never copies blocks the GPU has yet to write
        (the forward goes on meanwhile)."""
        ready = None
        if self._gpu_kv:
            ready = torch.cuda.Event()
            ready.record()
        elif self.session.bell is not None:
            self._send_one((key, blocks, region, final))
            return
        if self._outbox is None:
            self._outbox = queue.Queue()
            self._sender = threading.Thread(target=self._send_loop, name="kvhandoff-sender", daemon=True)
            self._sender.start()
        self._outbox.put((key, blocks, region, final, ready))

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            *report, ready = item
            if ready is not None:
                ready.synchronize()
            self._send_one(tuple(report))

    def _send_one(self, item) -> None:
        key, blocks, region, final = item
        if final:
            self.timeline.mark("ready_call", key)
        for pk in self._fan.get(key, ()):
            try:
                if region is None:
                    self.session.source_ready(pk, blocks)
                else:
                    self.session.source_regions_ready(pk, blocks, region, 1, final)
            except AgentError as e:
                if region is not None:
                    # The agent answers for the request through its events (FAILED).
                    log.warning("kvhandoff: streaming layer %d of %s: %s", region, pk, e)
                    continue
                # A refused report left nothing at the agent, which will never answer for
                # it: the send failed, and the blocks go back once vLLM holds them.
                log.error("kvhandoff: reporting %s: %s", pk, e)
                self.session.events.put(pb.Event(type=pb.Event.FAILED, request_id=pk, reason=str(e)))
        if region is not None:
            self.stats["layers_streamed"] += 1
        if final:
            self.timeline.mark("ready_done", key)

    def save(self, meta: KVHandoffMetadata) -> None:
        # This step's streams: the forward is over, so their blocks are complete now. With
        # layer streaming, what remains are layers that did not pass through save_layer
        # (vLLM skips it for a layer without attention metadata).
        for s in meta.streams:
            if self.cfg.layer_streaming:
                self._stream(s, list(range(self._regions)))  # sends only what is missing
                del self._layers_sent[s.key]
            else:
                # The forward that computed the whole prompt is over: its blocks are final.
                self._track(s)
                self._send_later(s.key, s.blocks, None, final=True)

    def results(self, finished_req_ids) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        self._finished |= set(finished_req_ids or ()) & self._sending
        if self.session is not None:
            self._drain()
            self._reconnect()
        # A send is reported only once the scheduler has finished the request.
        sent = self._sent & self._finished
        self._sent -= sent
        self._finished -= sent
        self._sending -= sent
        recvd, failed = self._recvd, self._failed
        self._recvd, self._failed = set(), set()
        return sent, recvd, failed

    def load_errors(self) -> set[int]:
        """The blocks of receives that failed since the last call: how vLLM before 0.30
        (no get_transfer_results) learns that a receive it sees finished brought no KV."""
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def _events(self):
        """The session's events: the stream's (before a doorbell, or without one), then
        the doorbell's; None once the session ended."""
        while True:
            try:
                ev = self.session.events.get_nowait()
            except queue.Empty:
                break
            yield ev
            if ev is None:
                return
        try:
            yield from self.session.poll_events()
        except AgentError as e:
            self.session.error = e
            yield None

    def _drain(self) -> None:
        for ev in self._events():
            if ev is None:
                self._agent_lost()
                return
            entry = self._keys.get(ev.request_id)
            if entry is None:
                continue
            rid, kind = entry
            if kind == "recv" and ev.type in _RECV_OVER:
                self._beating.discard(ev.request_id)
                if ev.type == pb.Event.FAILED:
                    log.warning("kvhandoff: request %s: KV did not arrive: %s", ev.request_id, ev.reason)
                self._pair_over(ev.request_id, failed=ev.type != pb.Event.DELIVERED, cancelled=ev.type == pb.Event.CANCEL_ACKED)
            elif kind == "send" and ev.type in _SEND_OVER:
                if ev.type == pb.Event.FAILED:
                    log.warning("kvhandoff: request %s: the decode side did not take its KV: %s", ev.request_id, ev.reason)
                self._pair_over(ev.request_id, failed=ev.type == pb.Event.FAILED)

    def _pair_over(self, pk: str, failed: bool, cancelled: bool = False) -> None:
        """One rank pair of a request is over; the request is once all its pairs are. The
        first pair of a receive to fail cancels the others (the request cannot be delivered
        now); those the agent holds nothing of are over at once."""
        rid, kind = self._keys.pop(pk)
        key = self._pair_of.pop(pk)
        left = self._pairs.get(key, set())
        left.discard(pk)
        if failed and key not in self._broken:
            self._broken[key] = "cancelled" if cancelled else "failed"
            for other in sorted(left) if kind == "recv" else ():
                try:
                    if self.session.cancel(other, ATTEMPT):
                        continue
                except AgentError as e:
                    log.warning("kvhandoff: cancelling %s: %s", other, e)
                if other in self._keys:
                    self._pair_over(other, failed=True)
        if left:
            return
        self._pairs.pop(key, None)
        self._fan.pop(key, None)
        broken = self._broken.pop(key, None)
        self.timeline.mark("drained", key)
        if kind == "recv":
            self._recv_over(rid, failed=broken is not None)
            self.stats[broken or "delivered"] += 1
        elif rid in self._sending or rid in self._streaming:  # else a streamed prefill vLLM aborted
            self._sent.add(rid)
            self.stats["sent"] += 1

    def _recv_over(self, rid: str, failed: bool) -> None:
        self._recvd.add(rid)
        blocks = self._recv_blocks.pop(rid, ())
        if failed:
            self._failed.add(rid)
            self._failed_blocks.update(blocks)

    def _agent_lost(self) -> None:
        """The agent ended the session (it restarted, or its pod was replaced): what was
        outstanding fails, and the rank registers again with the agent that comes back
        (_rejoin, _reconnect). Meanwhile a LostSession refuses every call, so requests fail
        by the paths a refused call takes instead of waiting on an agent that is not there."""
        lost = self.session
        log.error("kvhandoff: %s rank %d: the agent session ended (%s); registering again once the agent is back",
                  self.cfg.engine_id, self.rank, lost.error)
        lost.close()
        self.session = LostSession(lost.ref, str(lost.error or "the agent closed it"))
        self._end_outstanding()
        self._rejoin_later()  # the events thread started it already, unless a doorbell saw the loss first

    def _rejoin_later(self, ended=None) -> None:
        """Starts registering again in a thread of its own: an engine steps only while it
        has requests, and an idle one must be registered when its next request comes,
        which its pair's other engine may already be waiting on. Not while a rejoin runs,
        or a session it opened waits for the step: the agent refuses a second session of a
        rank whose session is live. ended is the session whose end asks (the events
        thread's); one this rank no longer holds or waits on asks nothing."""
        with self._lock:
            waiting = self._replacement
            if (self._rejoining or self._kv_caches is None or (waiting is not None and not waiting.ended)
                    or (ended is not None and ended is not self.session and ended is not waiting)):
                return
            self._rejoining = True
            generation = self._generation
        threading.Thread(target=self._rejoin, args=(generation,), name="kvhandoff-rejoin", daemon=True).start()

    def _rejoin(self, generation: int) -> None:
        """Opens a session with the agent that comes back, trying again with back-off, and
        leaves it for the step to take (_reconnect): only the step thread changes what
        the rank has outstanding. One that ends before the step takes it (the agent went
        again) is replaced."""
        gap = REJOIN_FIRST
        try:
            if self._gpu_kv:
                # The driver calls that export the KV need the device's context current on
                # this thread, as it is on the step's.
                torch.cuda.set_device(next(iter(self._kv_caches.values())).device)
            while self._generation == generation:
                try:
                    session = self._open_session(self._kv_caches, REJOIN_WAIT)
                except (AgentError, OSError) as e:
                    log.debug("kvhandoff: %s rank %d: registering again: %s", self.cfg.engine_id, self.rank, e)
                    time.sleep(gap)
                    gap = min(2 * gap, REJOIN_MAX)
                    continue
                with self._lock:
                    stale = session
                    if self._generation == generation:
                        stale, self._replacement = self._replacement, session  # an older one, ended
                if stale is not None:
                    stale.close()
                if not session.ended:
                    return
        finally:
            with self._lock:
                self._rejoining = False

    def _reconnect(self) -> None:
        """Takes the session the rejoining thread opened, once this rank's session was lost:
        first ending what the lost one had outstanding, where the events thread saw the loss
        and no step has since."""
        if self.session is None or (not isinstance(self.session, LostSession) and not self.session.ended):
            return
        if not isinstance(self.session, LostSession):
            self._drain()  # reads the lost session's end: _agent_lost
            if not isinstance(self.session, LostSession):
                return
        with self._lock:
            session, self._replacement = self._replacement, None
        if session is None:
            self._rejoin_later()  # where a rejoin of a closed generation held the flag then
            return
        lost, self.session = self.session, session
        self.stats["reconnects"] += 1
        log.info("kvhandoff: %s rank %d registered again with the agent (session %s), lost since: %s",
                 self.cfg.engine_id, self.rank, session.session, lost.why)

    def _end_outstanding(self) -> None:
        # The session is over: nothing outstanding can complete. Receives fail (the
        # policy decides recompute or fail); sends are over.
        for key, (rid, kind) in self._keys.items():
            if kind == "recv":
                self._recv_over(rid, failed=True)
            else:
                self._sent.add(rid)
        self._keys.clear()
        self._pairs.clear()
        self._pair_of.clear()
        self._fan.clear()
        self._broken.clear()
        self._beating.clear()

    def close(self) -> None:
        with self._lock:
            self._generation += 1  # a rejoin under way ends, and closes what it opened
            replacement, self._replacement = self._replacement, None
        if replacement is not None:
            replacement.close()
        if self._outbox is not None:
            self._outbox.put(None)
            self._sender.join(timeout=30)
            self._outbox = self._sender = None
        if self.session is not None:
            self.session.close()
