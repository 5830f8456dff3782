"""The connector's CUDA KV path on real GPUs: two worker sides register CUDA KV caches
laid out as vLLM's FlashAttention backend lays them out, (2, blocks, block size, KV
heads, head size) per layer, through the real transfer agent, which moves blocks between
them, push and pull, every byte checked. The caches are allocated as vLLM's GPU worker
allocates them: one int8 tensor per layer inside the connector's memory pool context
(vLLM 0.31-0.33: passed to the agent as file descriptors) and outside it by PyTorch (vLLM
0.26-0.30: legacy IPC handles), and as vLLM 0.34's extensible KV cache lays them out (one
address reservation, one physical allocation per layer, created exportable: passed as fds).

Needs an NVIDIA GPU (KVH_CUDA_PEER names the decode GPU, default 1 when there are two) and
the agent binary in KVHANDOFF_BIN_DIR; `make test-gpu` runs it. Not part of `make test`:
CI has no GPU.
"""

import ctypes
import os
import signal
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

from kvhandoff_vllm import memory  # noqa: E402
from kvhandoff_vllm._api import agent_pb2 as pb  # noqa: E402
from kvhandoff_vllm.config import Config  # noqa: E402
from kvhandoff_vllm.metadata import KVHandoffMetadata, Stream  # noqa: E402
from kvhandoff_vllm.worker import WorkerSide  # noqa: E402
from stack import Agent, go_binaries, next_event, until  # noqa: E402

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 64, 16, 8, 128


@pytest.fixture(scope="module")
def agent():
    d = tempfile.mkdtemp(prefix="kvh-gpu-")
    a = Agent(go_binaries(d), "agent", d)
    yield a
    a.stop()


def worker_side(agent, mode: str, role: str, own_pool: bool = True) -> WorkerSide:
    cfg = Config.from_fields(f"{role}-{mode}.gpu", {"mode": mode, "role": role, "socket": agent.socket,
                                                    "kv_lease_duration": 30, "push_registration_timeout": 60,
                                                    "decoder_kv_blocks_ttl": 60, "same_node": True})
    return WorkerSide(cfg, rank=0, tp_size=1, block_size=BLOCK_SIZE, kv_heads=HEADS, head_dim=HEAD_DIM, own_pool=own_pool)


def extensible(device: str, n: int, layers: int) -> list[torch.Tensor]:
    """layers tensors of n bytes laid out as vLLM 0.34's extensible KV cache lays out a
    layer-outermost cache: one address reservation, each layer's segment one physical
    allocation mapped into it, created exportable as a POSIX fd (the connector's
    kv_cache_access is EXPORTS_FD)."""
    lib, ordinal = memory._libcuda(), torch.device(device).index
    torch.cuda.init()
    prop = memory._AllocationProp(type=memory._PINNED, requested_handle_types=memory._POSIX_FD, location_type=memory._ON_DEVICE,
                                  location_id=ordinal)
    gran = ctypes.c_size_t()
    assert lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0) == 0
    seg = -(-n // gran.value) * gran.value
    base = ctypes.c_uint64()
    assert lib.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(seg * (layers + 1)), ctypes.c_size_t(0), ctypes.c_uint64(0),
                                   ctypes.c_ulonglong(0)) == 0  # a segment more than mapped, as vLLM reserves ahead
    for i in range(layers):
        h = ctypes.c_uint64()
        assert lib.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(seg), ctypes.byref(prop), ctypes.c_ulonglong(0)) == 0
        assert lib.cuMemMap(ctypes.c_uint64(base.value + i * seg), ctypes.c_size_t(seg), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)) == 0
        lib.cuMemRelease(h)
    access = memory._AccessDesc(location_type=memory._ON_DEVICE, location_id=ordinal, flags=memory._READ_WRITE)
    assert lib.cuMemSetAccess(ctypes.c_uint64(base.value), ctypes.c_size_t(seg * layers), ctypes.byref(access), ctypes.c_size_t(1)) == 0
    whole = torch.as_tensor(memory._Mapped(base.value, seg * layers), device=device)
    whole.zero_()
    return [whole[i * seg:i * seg + n] for i in range(layers)]


def kv_caches(w: WorkerSide, device: str, fill: bool, memory_kind: str) -> dict:
    """One tensor per layer, each its own allocation as vLLM's GPU worker makes them: a
    1-D int8 torch.zeros viewed as the layer's shape, in the connector's memory pool
    context (passed-fd) or not (legacy-ipc); or segments of an extensible KV cache."""
    shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    n = 2 * BLOCKS * BLOCK_SIZE * HEADS * HEAD_DIM * 2
    caches = {}
    segments = extensible(device, n, LAYERS) if memory_kind == "extensible" else None
    for i in range(LAYERS):
        if segments:
            raw = segments[i]
        elif memory_kind == "passed-fd":
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
    return next_event(w, key, log=lambda: f"; the agent's log:\n{agent.log()[-4000:]}")


def decode_device() -> str:
    n = torch.cuda.device_count()
    return f"cuda:{int(os.environ.get('KVH_CUDA_PEER', 1 if n > 1 else 0))}"


@pytest.mark.parametrize("memory", ["passed-fd", "legacy-ipc", "extensible"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_blocks_move_between_cuda_kv_caches_through_the_agent(agent, mode, memory, caplog):
    own_pool = memory != "extensible"
    p, d = worker_side(agent, mode, "prefill", own_pool), worker_side(agent, mode, "decode", own_pool)
    src_caches, dst_caches = kv_caches(p, "cuda:0", True, memory), kv_caches(d, decode_device(), False, memory)
    torch.cuda.synchronize()
    assert len(p.memory) == len(d.memory) == (LAYERS if memory == "passed-fd" else 0)
    with caplog.at_level("INFO", logger="kvhandoff_vllm"):
        p.register_kv_caches(src_caches)
        d.register_kv_caches(dst_caches)
    # Each layer's allocation found apart (not the reservation around them) and passed as an
    # fd; cudaMalloc's (however the caching allocator packed the layers) named by handles.
    want = ", 0 passed as fds" if memory == "legacy-ipc" else f"{LAYERS} CUDA allocations, {LAYERS} passed as fds"
    assert caplog.text.count(want) == 2, caplog.text
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


@pytest.mark.parametrize("layer_streaming", [False, True])
def test_a_push_reported_while_the_gpu_still_computes_its_kv_moves_the_final_kv(agent, layer_streaming):
    """The step enqueues the forward's kernels and reports its KV long before the GPU has
    written it (vLLM's wait_for_save and save_kv_layer run when the launches are done):
    the agent must copy the KV the kernels write, not what the blocks held before."""
    cfg = Config.from_fields("prefill-race.gpu", {"mode": "push", "role": "prefill", "socket": agent.socket, "same_node": True,
                                                   "layer_streaming": layer_streaming})
    p = WorkerSide(cfg, rank=0, tp_size=1, block_size=BLOCK_SIZE, kv_heads=HEADS, head_dim=HEAD_DIM)
    d = worker_side(agent, "push", "decode")
    src_caches, dst_caches = kv_caches(p, "cuda:0", False, "passed-fd"), kv_caches(d, decode_device(), False, "passed-fd")
    torch.cuda.synchronize()
    p.register_kv_caches(src_caches)
    d.register_kv_caches(dst_caches)
    try:
        key, src, dst = f"race-{layer_streaming}", [2, 3, 4], [10, 11, 12]
        d.session.register_destination(key, 1, dst, p.session.ref)
        meta = KVHandoffMetadata(streams=[Stream(req_id="r", key=key, blocks=src)])
        for name, t in src_caches.items():  # the forward writing each layer's KV, enqueued
            for _ in range(200):  # a layer's kernels: 200 of about 0.5 ms, as a long prompt's
                torch.cuda._sleep(1_000_000)
            t[:, src] = 1.5
            p.save_layer(meta, name)
        p.save(meta)
        assert event(agent, d, key).type == pb.Event.DELIVERED
        for name, t in dst_caches.items():
            assert bool((t[:, dst] == 1.5).all()), f"{name}: the agent copied the blocks before the GPU wrote them"
    finally:
        p.close()
        d.close()


def test_idle_ranks_register_their_cuda_kv_again_once_a_restarted_agent_is_back(tmp_path):
    """The agent SIGKILLed and started again on the same socket (its pod replaced): each rank
    registers its CUDA KV again from a thread of its own, with no step (the driver calls
    that export the KV run there), and the blocks move as before."""
    d_ = str(tmp_path)
    bins = go_binaries(d_)
    agent = Agent(bins, "agent", d_)
    p, d = worker_side(agent, "push", "prefill"), worker_side(agent, "push", "decode")
    src_caches, dst_caches = kv_caches(p, "cuda:0", True, "passed-fd"), kv_caches(d, decode_device(), False, "passed-fd")
    torch.cuda.synchronize()
    p.register_kv_caches(src_caches)
    d.register_kv_caches(dst_caches)
    try:
        agent._signal(signal.SIGKILL)
        agent.p.wait()
        agent = Agent(bins, "agent-restarted", d_)
        until("both idle ranks registered with the restarted agent",
              lambda: sum(v for k, v in agent.metrics().items() if k.startswith("kvhandoff_agent_engine_sessions")) == 2,
              timeout=60)
        until("both ranks' steps took their new sessions",
              lambda: p.results(set()) == d.results(set()) == (set(), set(), set()) and p.stats["reconnects"] == d.stats["reconnects"] == 1)
        key, src, dst = "after-restart", [3, 4, 5], [40, 41, 7]
        d.session.register_destination(key, 1, dst, p.session.ref)
        p.session.source_ready(key, src)
        assert event(agent, d, key).type == pb.Event.DELIVERED
        for name, s in src_caches.items():
            assert torch.equal(dst_caches[name][:, dst].cpu(), s[:, src].cpu()), f"{name}: blocks {dst} differ from prefill's {src}"
    finally:
        p.close()
        d.close()
        agent.stop()
