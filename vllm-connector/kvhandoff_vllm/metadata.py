"""What the scheduler-side connector tells the workers each step, and what the workers
tell it once at start (the handshake)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)


@dataclass
class Receive:
    """Decode: bring a request's KV into blocks, which hold token-order positions first,
    first+1, … (this engine's prefix cache holds the positions before). src_blocks is None
    for push (the prefill agent writes when prefill ends); for pull they are the prefill's
    blocks of the same positions. error, when set, fails the receive at once (the
    parameters made it impossible)."""

    req_id: str
    key: str
    blocks: list[int]
    first: int = 0
    source_agent: str = ""
    source_engine: str = ""
    src_blocks: list[int] | None = None
    error: str = ""


@dataclass
class Send:
    """Prefill: a finished request's blocks are ready for the decode side."""

    req_id: str
    key: str
    blocks: list[int]
    # streamed: its layers were reported as they were computed; only the bookkeeping is left.
    streamed: bool = False


@dataclass
class Stream:
    """Push prefill with layer streaming: a request whose prefill completes in this step;
    the worker reports each layer's blocks to the agent as the forward computes it."""

    req_id: str
    key: str
    blocks: list[int]


@dataclass
class Decline:
    """Decode, push: the request is computed here (the whole prompt is cached here), so the
    prefill engine's blocks are freed at once instead of waiting for a registration."""

    key: str
    source_agent: str
    source_engine: str


@dataclass
class KVHandoffMetadata(KVConnectorMetadata):
    receives: list[Receive] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)
    # (request id, key): a decode request aborted while its KV was on its way, or a
    # prefill request aborted before its blocks were ready.
    cancels: list[tuple[str, str]] = field(default_factory=list)
    declines: list[Decline] = field(default_factory=list)


@dataclass
class Handshake(KVConnectorHandshakeMetadata):
    """A worker's agent address (host:port of its peer listener), which the prefill side
    returns to the router as remote_host/remote_port."""

    agent: str
    engine_id: str
