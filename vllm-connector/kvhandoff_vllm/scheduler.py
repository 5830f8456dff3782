"""The scheduler side: which requests load or send KV, and when blocks may be freed.

It speaks the kv_transfer_params contract of vLLM's NIXL connectors, so the kvhandoff
router (and vLLM's own P/D proxies) drive it unchanged:

- prefill leg: ``{"do_remote_decode": true, ...}`` (push adds ``transfer_id``). When the
  request finishes, its blocks are held (``request_finished`` returns True) and handed
  to the worker, which reports them ready to the agent; they are freed when the agent
  says it is done with them (SOURCE_DONE, or FAILED once its lease or TTL ended).
  In pull the response carries ``remote_block_ids``, ``remote_engine_id``,
  ``remote_request_id`` and the agent's address as ``remote_host``/``remote_port``.
- decode leg: ``{"do_remote_prefill": true, "remote_host", "remote_port",
  "remote_engine_id", ...}``; push names ``transfer_id`` and no blocks, pull the prefill's
  ``remote_block_ids`` and ``remote_request_id``. The request waits for its KV
  (WAITING_FOR_REMOTE_KVS) while the agent brings it; an abort meanwhile cancels through
  the agent, and vLLM frees the blocks only once the agent acknowledged.

In push, a prefill request whose whole prompt is scheduled in one step is handed to the
workers in that step (metadata.streams). With layer_streaming they report each layer to the
agent as the forward pass computes it; without, the whole prompt once that step's forward is
over, rather than a step later, when vLLM has finished the request. A prompt computed in
chunks is reported whole when the request finishes.
"""

from __future__ import annotations

import logging
import os

from .config import Config
from .metadata import Decline, Handshake, KVHandoffMetadata, Receive, Send, Stream
from .timeline import Timeline

log = logging.getLogger("kvhandoff_vllm")

# Where the count of requests holding blocks for a transfer is kept, for the engine pod's
# drain hook (kvhandoff's manager renders it; unset, no count is kept).
HELD_FILE_ENV = "KVHANDOFF_HELD_FILE"

# An attempt number for the agent. A retried request is a new request of the router's,
# with a new key (transfer_id), so every key sees one attempt.
ATTEMPT = 1


def split_agent(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def join_agent(host, port) -> str:
    host = str(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class SchedulerSide:
    def __init__(self, cfg: Config, tp_size: int, block_size: int):
        self.cfg = cfg
        self.tp_size = tp_size
        self.block_size = block_size
        # Push prefill requests not yet scheduled (request id -> key), and those the
        # workers report in the step that computes them (streams).
        self._streamable: dict[str, str] = {}
        self._streamed: set[str] = set()
        self.agent: str | None = None  # this engine's agent, from the workers' handshake
        self._meta = KVHandoffMetadata()
        # Decode requests whose KV is on its way: request id -> key.
        self._receiving: dict[str, str] = {}
        # Decode requests told their KV is in, until their second step (timeline only):
        # request id -> (key, whether its first step was scheduled).
        self._resumed: dict[str, tuple[str, bool]] = {}
        # Decode requests about to be allocated: request id -> tokens of its prompt cached here.
        self._cached: dict[str, int] = {}
        self.timeline = Timeline(f"{cfg.engine_id}-scheduler")
        # Finished prefill requests whose blocks are held until the agent is done with
        # them. The drain hook of a terminating engine waits for none to be left: the
        # engine's exit would end its agent session and fail their transfers.
        self._held: set[str] = set()
        self._held_file = os.environ.get(HELD_FILE_ENV)
        self._publish_held()

    def _publish_held(self) -> None:
        if not self._held_file:
            return
        tmp = self._held_file + ".tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"{len(self._held)}\n")
            os.replace(tmp, self._held_file)
        except OSError as e:
            log.warning("kvhandoff: cannot write %s (%s): a drain would not wait for held blocks", self._held_file, e)

    def set_handshake(self, metadata: dict) -> None:
        for meta in metadata.values():
            if isinstance(meta, Handshake):
                self.agent = meta.agent
                return

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.cfg.role != "decode" or not params or not params.get("do_remote_prefill"):
            return 0, False
        n = len(request.prompt_token_ids or ()) - num_computed_tokens
        if n <= 0:
            # Nothing to bring (vLLM recomputes at least a prompt's last token, so this is
            # defensive): a push is declined, so the prefill agent frees its blocks now.
            if self.cfg.mode == "push":
                self._decline(params)
            return 0, False
        if request.request_id not in self._cached:
            self.timeline.mark("arrived", str(params.get("transfer_id") or params.get("remote_request_id")))
        # Blocks this engine already holds (a prefix-cache hit, num_computed_tokens, always
        # whole blocks) are shared and never written: the push registers, and the pull
        # reads, the blocks after them only. vLLM sets the request's own count only after
        # the allocation, so it is kept here for update_state_after_alloc (the last ask
        # before it is the one the allocation follows).
        self._cached[request.request_id] = num_computed_tokens
        return n, True

    def _decline(self, params: dict) -> None:
        try:
            d = Decline(key=str(params.get("transfer_id") or params["remote_request_id"]),
                        source_agent=join_agent(params["remote_host"], params["remote_port"]),
                        source_engine=str(params["remote_engine_id"]))
            self._meta.declines.append(d)
            self.timeline.mark("declined", d.key)
        except (KeyError, TypeError) as e:
            log.warning("kvhandoff: cannot decline a push whose kv_transfer_params lack %s; the prefill agent frees its blocks after their TTL", e)
        # Once: vLLM asks again while the request waits to be scheduled.
        params["do_remote_prefill"] = False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self.cfg.mode == "push" and self.cfg.role == "prefill" and params and params.get("do_remote_decode"):
            self._streamable[request.request_id] = str(params.get("transfer_id") or request.request_id)
            return
        if self.cfg.role != "decode" or not params or not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        local = list(blocks.get_unhashed_block_ids())
        cached = self._cached.pop(request.request_id, 0)
        # The positions before the new blocks are this engine's cached prefix.
        first = cached // self.block_size
        r = Receive(req_id=request.request_id, key="", blocks=local, first=first)
        try:
            if cached % self.block_size:
                raise ValueError(f"a prefix of {cached} cached tokens is not whole blocks of {self.block_size}")
            r.source_agent = join_agent(params["remote_host"], params["remote_port"])
            r.source_engine = str(params["remote_engine_id"])
            if self.cfg.mode == "pull":
                r.key = str(params["remote_request_id"])
                remote = list(params.get("remote_block_ids") or ())
                if len(remote) < first + len(local):
                    raise ValueError(f"remote_block_ids: {len(remote)} blocks for {first} cached and {len(local)} new ones")
                # Locally cached blocks are a prefix: the blocks to read are the tail.
                r.src_blocks = remote[first:first + len(local)]
            else:
                r.key = str(params.get("transfer_id") or params["remote_request_id"])
        except (KeyError, TypeError, ValueError) as e:
            r.error = f"kv_transfer_params: {e!s} missing or invalid"
        self._meta.receives.append(r)
        self._receiving[request.request_id] = r.key
        self.timeline.mark("allocated", r.key)
        # Processed: a re-entry (preemption and reschedule) must not register again.
        params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output) -> KVHandoffMetadata:
        meta, self._meta = self._meta, KVHandoffMetadata()
        for rid in [r for r in self._resumed if r in scheduler_output.num_scheduled_tokens]:
            # The first step that computes a resumed request samples its first token. The
            # next is scheduled once that step is launched (vLLM's async scheduling) or once
            # its token has gone out (without).
            key, first_done = self._resumed[rid]
            if first_done:
                self.timeline.mark("stepped", key)
                del self._resumed[rid]
            else:
                self.timeline.mark("scheduled", key)
                self._resumed[rid] = (key, True)
        for new in scheduler_output.scheduled_new_reqs:
            key = self._streamable.pop(new.req_id, None)
            if key is None:
                continue
            prompt = len(new.prompt_token_ids or ())
            if new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0) < prompt:
                continue  # computed in chunks: reported whole when it finishes
            n = -(-prompt // self.block_size)  # the prompt's blocks, which decode registers
            meta.streams.append(Stream(req_id=new.req_id, key=key, blocks=list(new.block_ids[0][:n])))
            self._streamed.add(new.req_id)
        return meta

    def request_finished(self, request, block_ids: list[int]):
        params = request.kv_transfer_params
        if not params:
            return False, None
        rid = request.request_id
        self._streamable.pop(rid, None)
        self._resumed.pop(rid, None)
        self._cached.pop(rid, None)
        streamed = rid in self._streamed
        self._streamed.discard(rid)
        if rid in self._receiving:
            # Finished (aborted) while its KV was on its way: vLLM holds the blocks until
            # the worker reports the receive over, which the agent's acknowledgement of
            # this cancel (or the transfer's own end) brings.
            self._meta.cancels.append((rid, self._receiving.pop(rid)))
            return False, None
        if self.cfg.role != "prefill" or not params.get("do_remote_decode"):
            return False, None
        from vllm.v1.request import RequestStatus

        key = str(params.get("transfer_id") or rid)
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            # Aborted before its blocks were ready: a decode registration may be waiting
            # for them at the agent; cancelling fails it now instead of at its timeout.
            if self.cfg.mode == "push":
                self._meta.cancels.append((rid, key))
            return False, None
        blocks = list(block_ids)
        if not blocks:
            return False, None
        self._meta.sends.append(Send(req_id=rid, key=key, blocks=blocks, streamed=streamed))
        self.timeline.mark("finished", key)
        self._held.add(rid)
        self._publish_held()
        if self.cfg.mode == "push":
            return True, None
        if self.agent is None:
            raise RuntimeError("kvhandoff connector: no agent address from the workers' handshake")
        host, port = split_agent(self.agent)
        return True, dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.cfg.engine_id,
            remote_host=host,
            remote_port=port,
            remote_block_ids=blocks,
            remote_request_id=key,
            tp_size=self.tp_size,
        )

    def update_connector_output(self, connector_output) -> None:
        sent = set(connector_output.finished_sending or ()) & self._held
        if sent:
            self._held -= sent
            self._publish_held()
        for rid in connector_output.finished_recving or ():
            key = self._receiving.pop(rid, None)
            if key is not None:
                self.timeline.mark("resumed", key)
                if self.timeline.on:
                    self._resumed[rid] = (key, False)
