"""The connector's settings, read from vLLM's --kv-transfer-config.

The manager renders them (internal/render/kvconfig.go); by hand they look like:

    {"kv_connector": "KVHandoffConnector",
     "kv_connector_module_path": "kvhandoff_vllm.connector",
     "kv_role": "kv_both", "engine_id": "prefill-0.default",
     "kv_connector_extra_config": {"mode": "push", "role": "prefill",
        "socket": "/var/run/kvhandoff/agent.sock", "kv_lease_duration": 30,
        "push_registration_timeout": 480, "decoder_kv_blocks_ttl": 480,
        "layer_streaming": true, "same_node": false, "peer_tp_size": 2}}

layer_streaming (push prefill only) reports a request's KV to the agent layer by layer as
the forward pass computes it, so the agent writes each layer while the next computes.
same_node says the policy lets a pair share a node (sameNode: Allow or Prefer): only then
can the agent move KV held in GPU memory (CUDA IPC), so without it GPU KV is refused at
start. doorbell (default true) moves the reports of ready blocks and the agent's events
onto shared rings (kvhandoff_vllm/doorbell.py); false keeps them on gRPC. peer_tp_size is
the tensor-parallel size of the engines on the other side of the handoff (0: this engine's):
where it differs, each rank exchanges KV with the peer ranks that hold its heads
(kvhandoff_vllm/heads.py).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SOCKET = "/var/run/kvhandoff/agent.sock"


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names it."""


@dataclass(frozen=True)
class Config:
    engine_id: str
    mode: str  # "push" or "pull"
    role: str  # "prefill" or "decode"
    socket: str
    # The policy's timeouts in seconds (0: the agent's flags apply).
    lease: int
    registration_timeout: int
    blocks_ttl: int
    # layer_streaming: push prefill reports each layer's KV as it is computed.
    layer_streaming: bool = False
    # same_node: pairs may share a node, the only place GPU KV can move today.
    same_node: bool = False
    # doorbell: reports and events go through shared rings with the agent instead of
    # gRPC (x86-64 only; false keeps to gRPC).
    doorbell: bool = True
    # peer_tp_size: the other side's tensor-parallel size (0: the same as this engine's).
    peer_tp_size: int = 0

    @classmethod
    def from_vllm(cls, vllm_config) -> "Config":
        kv = vllm_config.kv_transfer_config
        if kv is None:
            raise ConfigError("kv_transfer_config: the kvhandoff connector needs one")
        extra = dict(kv.kv_connector_extra_config or {})
        return cls.from_fields(kv.engine_id, extra)

    @classmethod
    def from_fields(cls, engine_id: str | None, extra: dict) -> "Config":
        if not engine_id:
            raise ConfigError("kv_transfer_config.engine_id: must name the engine (the manager renders pod.namespace)")
        mode = str(extra.get("mode", "")).lower()
        if mode not in ("push", "pull"):
            raise ConfigError(f"kv_connector_extra_config.mode: must be push or pull, not {extra.get('mode')!r}")
        role = str(extra.get("role", "")).lower()
        if role not in ("prefill", "decode"):
            raise ConfigError(f"kv_connector_extra_config.role: must be prefill or decode, not {extra.get('role')!r}")

        def seconds(name: str) -> int:
            v = extra.get(name, 0)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 86400:
                raise ConfigError(f"kv_connector_extra_config.{name}: must be whole seconds in 0..86400, not {v!r}")
            return v

        streaming = extra.get("layer_streaming", False)
        if not isinstance(streaming, bool):
            raise ConfigError(f"kv_connector_extra_config.layer_streaming: must be true or false, not {streaming!r}")
        if streaming and mode != "push":
            raise ConfigError("kv_connector_extra_config.layer_streaming: streams layers into a push; a pull reads whole blocks once prefill is over")
        same_node = extra.get("same_node", False)
        if not isinstance(same_node, bool):
            raise ConfigError(f"kv_connector_extra_config.same_node: must be true or false, not {same_node!r}")
        doorbell = extra.get("doorbell", True)
        if not isinstance(doorbell, bool):
            raise ConfigError(f"kv_connector_extra_config.doorbell: must be true or false, not {doorbell!r}")
        peer_tp = extra.get("peer_tp_size", 0)
        if not isinstance(peer_tp, int) or isinstance(peer_tp, bool) or peer_tp < 0 or peer_tp > 1024:
            raise ConfigError(f"kv_connector_extra_config.peer_tp_size: must be a tensor-parallel size in 0..1024 (0: this engine's), not {peer_tp!r}")
        return cls(
            engine_id=engine_id,
            mode=mode,
            role=role,
            socket=str(extra.get("socket") or DEFAULT_SOCKET),
            lease=seconds("kv_lease_duration"),
            registration_timeout=seconds("push_registration_timeout"),
            blocks_ttl=seconds("decoder_kv_blocks_ttl"),
            layer_streaming=streaming,
            same_node=same_node,
            doorbell=doorbell,
            peer_tp_size=peer_tp,
        )
