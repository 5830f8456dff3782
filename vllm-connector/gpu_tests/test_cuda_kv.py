"""The connector's CUDA KV path on real GPUs: two worker sides register CUDA KV caches
laid out as vLLM's FlashAttention backend lays them out, (2, blocks, block size, KV
heads, head size) per layer, through the real transfer agent, which moves blocks between
them, push and pull, every byte checked. The caches are allocated as vLLM's GPU worker
allocates them, one int8 tensor per layer: inside the connector's memory pool context
(passed to the agent as file descriptors), and outside it by PyTorch (legacy IPC handles).

Needs an NVIDIA GPU (KVH_CUDA_PEER names the decode GPU, default 1 when there are two) and
the agent binary in KVHANDOFF_BIN_DIR; `make test-gpu` runs it. Not part of `make test`:
CI has no GPU.
"""

import os
import queue
import sys
import tempfile
import time

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


def worker_side(agent, mode: str, role: str) -> WorkerSide:
    cfg = Config.from_fields(f"{role}-{mode}.gpu", {"mode": mode, "role": role, "socket": agent.socket,
                                                    "kv_lease_duration": 30, "push_registration_timeout": 60,
                                                    "decoder_kv_blocks_ttl": 60, "same_node": True})
    return WorkerSide(cfg, rank=0, tp_size=1, block_size=BLOCK_SIZE, kv_heads=HEADS, head_dim=HEAD_DIM)


def kv_caches(w: WorkerSide, device: str, fill: bool, passed: bool) -> dict:
    """One tensor per layer, each its own allocation as vLLM's GPU worker makes them: a
    1-D int8 torch.zeros viewed as the layer's shape, in the connector's memory pool
    context when passed."""
    shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    n = 2 * BLOCKS * BLOCK_SIZE * HEADS * HEAD_DIM * 2
    caches = {}
    for i in range(LAYERS):
        if passed:
            with w.mem_pool_context():
                raw = torch.zeros(n, dtype=torch.int8, device=device)
        else:
            raw = torch.zeros(n, dtype=torch.int8, device=device)
        t = raw.view(torch.bfloat16).view(shape)
        if fill:
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(torch.bfloat16))
        caches[f"model.layers.{i}.self_attn.attn"] = t
    return caches


def event(agent, w: WorkerSide, key: str) -> pb.Event:
    """The session's next event, from its doorbell's ring (drained into the queue the
    event stream feeds) or its event stream."""
    deadline = time.monotonic() + 20
    while True:
        for ev in w.session.poll_events():
            w.session.events.put(ev)
        try:
            ev = w.session.events.get(timeout=0.01)
            break
        except queue.Empty:
            if time.monotonic() > deadline:
                pytest.fail(f"no event for {key} within 20 s; the agent's log:\n{agent.log()[-4000:]}")
    assert ev is not None, f"the agent ended the session: {w.session.error}"
    assert ev.request_id == key, ev
    return ev


def decode_device() -> str:
    n = torch.cuda.device_count()
    return f"cuda:{int(os.environ.get('KVH_CUDA_PEER', 1 if n > 1 else 0))}"


@pytest.mark.parametrize("memory", ["passed-fd", "legacy-ipc"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_blocks_move_between_cuda_kv_caches_through_the_agent(agent, mode, memory):
    passed = memory == "passed-fd"
    p, d = worker_side(agent, mode, "prefill"), worker_side(agent, mode, "decode")
    src_caches, dst_caches = kv_caches(p, "cuda:0", True, passed), kv_caches(d, decode_device(), False, passed)
    torch.cuda.synchronize()
    assert len(p.memory) == len(d.memory) == (LAYERS if passed else 0)
    p.register_kv_caches(src_caches)
    d.register_kv_caches(dst_caches)
    try:
        # K and V of every layer are regions: 8, in layer order.
        assert p._regions == d._regions == 2 * LAYERS
        assert d._region_of["model.layers.1.self_attn.attn"] == [2, 3]
        for n, (src, dst) in enumerate([([3, 4, 5, 9], [40, 41, 7, 8]), ([0, 63], [63, 0])]):
            key = f"{mode}-{memory}-{n}"
            if mode == "push":
                d.session.register_destination(key, 1, dst, p.session.ref)
                p.session.source_ready(key, src)
            else:
                p.session.source_ready(key, src)
                d.session.pull(key, 1, p.session.ref, src, dst)
            assert event(agent, d, key).type == pb.Event.DELIVERED
            assert event(agent, p, key).type == pb.Event.SOURCE_DONE
            for name, s in src_caches.items():
                got = dst_caches[name][:, dst].cpu()
                assert torch.equal(got, s[:, src].cpu()), f"{name}: blocks {dst} differ from prefill's {src}"
        untouched = sorted(set(range(BLOCKS)) - {40, 41, 7, 8, 63, 0})
        for name, t in dst_caches.items():
            assert not t[:, untouched].any(), f"{name}: a block no request named was written"
    finally:
        p.close()
        d.close()
