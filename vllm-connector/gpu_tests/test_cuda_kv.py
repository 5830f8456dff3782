"""The connector's CUDA KV path on real GPUs: two worker sides register torch CUDA KV
caches laid out as vLLM's FlashAttention backend lays them out, (2, blocks, block size,
KV heads, head size) per layer, through the real transfer agent; the agent opens their
IPC handles and moves blocks between them, push and pull, and every byte is checked.

Needs an NVIDIA GPU (KVH_CUDA_PEER names the decode GPU, default 1 when there are two) and
the agent binary in KVHANDOFF_BIN_DIR; `make test-gpu` runs it. Not part of `make test`:
CI has no GPU.
"""

import os
import queue
import sys
import tempfile

import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

try:
    import vllm  # noqa: F401
except ImportError:
    # A GPU host without vLLM (this test needs none of it: it drives the worker side
    # directly): the two base classes the connector's metadata derives from.
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})
    base.KVConnectorHandshakeMetadata = type("KVConnectorHandshakeMetadata", (), {})
    for name in ("vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
                 "vllm.distributed.kv_transfer.kv_connector.v1"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules[base.__name__] = base

from kvhandoff_vllm._api import agent_pb2 as pb  # noqa: E402
from kvhandoff_vllm.config import Config  # noqa: E402
from kvhandoff_vllm.worker import WorkerSide  # noqa: E402
from stack import Agent, go_binaries  # noqa: E402

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 64, 16, 8, 128


@pytest.fixture(scope="module")
def agent():
    d = tempfile.mkdtemp(prefix="kvh-gpu-")
    a = Agent(go_binaries(d), "agent", d)
    yield a
    a.stop()


def kv_caches(device: str, fill: bool) -> dict:
    """One tensor per layer, each its own allocation as vLLM's GPU worker makes them."""
    caches = {}
    for i in range(LAYERS):
        t = torch.zeros((2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device)
        if fill:
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(torch.bfloat16))
        caches[f"model.layers.{i}.self_attn.attn"] = t
    return caches


def worker(agent, mode: str, role: str, caches: dict) -> WorkerSide:
    cfg = Config.from_fields(f"{role}-{mode}.gpu", {"mode": mode, "role": role, "socket": agent.socket,
                                                    "kv_lease_duration": 30, "push_registration_timeout": 60,
                                                    "decoder_kv_blocks_ttl": 60, "same_node": True})
    w = WorkerSide(cfg, rank=0, tp_size=1, block_size=BLOCK_SIZE, kv_heads=HEADS, head_dim=HEAD_DIM)
    w.register_kv_caches(caches)
    return w


def event(w: WorkerSide, key: str) -> pb.Event:
    try:
        ev = w.session.events.get(timeout=60)
    except queue.Empty:
        pytest.fail(f"no event for {key} within 60 s")
    assert ev is not None, f"the agent ended the session: {w.session.error}"
    assert ev.request_id == key, ev
    return ev


def decode_device() -> str:
    n = torch.cuda.device_count()
    return f"cuda:{int(os.environ.get('KVH_CUDA_PEER', 1 if n > 1 else 0))}"


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_blocks_move_between_cuda_kv_caches_through_the_agent(agent, mode):
    src_caches, dst_caches = kv_caches("cuda:0", fill=True), kv_caches(decode_device(), fill=False)
    torch.cuda.synchronize()
    p, d = worker(agent, mode, "prefill", src_caches), worker(agent, mode, "decode", dst_caches)
    try:
        # K and V of every layer are regions: 8, in layer order.
        assert p._regions == d._regions == 2 * LAYERS
        assert d._region_of["model.layers.1.self_attn.attn"] == [2, 3]
        for n, (src, dst) in enumerate([([3, 4, 5, 9], [40, 41, 7, 8]), ([0, 63], [63, 0])]):
            key = f"{mode}-{n}"
            if mode == "push":
                d.session.register_destination(key, 1, dst, p.session.ref)
                p.session.source_ready(key, src)
            else:
                p.session.source_ready(key, src)
                d.session.pull(key, 1, p.session.ref, src, dst)
            assert event(d, key).type == pb.Event.DELIVERED
            assert event(p, key).type == pb.Event.SOURCE_DONE
            for name, s in src_caches.items():
                got = dst_caches[name][:, dst].cpu()
                assert torch.equal(got, s[:, src].cpu()), f"{name}: blocks {dst} differ from prefill's {src}"
        untouched = sorted(set(range(BLOCKS)) - {40, 41, 7, 8, 63, 0})
        for name, t in dst_caches.items():
            assert not t[:, untouched].any(), f"{name}: a block no request named was written"
    finally:
        p.close()
        d.close()
