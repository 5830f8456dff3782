"""What of the CUDA KV path runs without a GPU: the split of vLLM's CUDA layouts into
block-major regions, and the error a missing driver gives. gpu_tests/ runs the rest on GPUs."""

import pytest
import torch

from kvhandoff_vllm import memory
from kvhandoff_vllm.config import Config
from kvhandoff_vllm.worker import WorkerSide


def test_a_flash_attention_layer_is_two_block_major_regions():
    t = torch.zeros((2, 10, 16, 4, 8), dtype=torch.bfloat16)
    k, v = memory.block_major(t, split_kv=True)
    block = 16 * 4 * 8 * 2
    assert k.shape[0] == v.shape[0] == 10
    assert k.stride(0) * k.element_size() == block
    assert v.data_ptr() - k.data_ptr() == 10 * block


def test_other_layouts_are_one_region():
    blocks_first = torch.zeros((10, 2, 16, 4, 8))
    assert memory.block_major(blocks_first, split_kv=True)[0] is blocks_first
    host = torch.zeros((2, 10, 16, 4, 8))
    assert memory.block_major(host, split_kv=False)[0] is host


def test_cuda_kv_without_the_driver_names_the_library(monkeypatch):
    monkeypatch.setattr(memory, "_LIBCUDA", None)
    monkeypatch.setenv("KVHANDOFF_LIBCUDA", "/nonexistent/libcuda.so.1")
    with pytest.raises(RuntimeError, match="CUDA KV needs the driver's /nonexistent/libcuda.so.1"):
        memory.CudaAllocation(0x1000)


class OnAGPU:
    """Stands in for a CUDA tensor: the check comes before anything touches the memory."""

    is_cuda = True


def test_cuda_kv_is_refused_at_start_when_pairs_never_share_a_node():
    cfg = Config.from_fields("prefill-0.default", {"mode": "push", "role": "prefill"})
    w = WorkerSide(cfg, rank=0, tp_size=1, block_size=16, kv_heads=1, head_dim=1)
    with pytest.raises(RuntimeError, match="set the KVTransferPolicy's sameNode: Allow or Prefer"):
        w.register_kv_caches({"model.layers.0.self_attn.attn": OnAGPU()})
    assert w.session is None


def test_a_rank_names_its_own_accelerators_efas():
    from kvhandoff_vllm.agent import rank_nics

    env = "GPU-aa=rdmap79s0,rdmap80s0;GPU-bb=rdmap81s0,rdmap82s0"
    assert rank_nics(env, "GPU-bb", 0) == ["rdmap81s0-rdm", "rdmap82s0-rdm"]
    assert rank_nics(env, None, 0) == ["rdmap79s0-rdm", "rdmap80s0-rdm"]  # host KV: by rank
    assert rank_nics(env, "GPU-cc", 0) == []  # not this container's GPU
    assert rank_nics(None, "GPU-aa", 0) == []  # no bundles: the agent's --rails


def test_the_rails_of_an_engines_claims_read_as_one():
    from kvhandoff_vllm.agent import accelerator_efas, rank_nics

    # A p5 TP8 engine's two claims: accelerators 0-5, then 6-7 (a claim holds 32 devices).
    environ = {"KVHANDOFF_ACCELERATOR_EFAS_6": "GPU-6=e24,e25,e26,e27;GPU-7=e28,e29,e30,e31",
               "KVHANDOFF_ACCELERATOR_EFAS": ";".join(f"GPU-{i}=e{4*i}" for i in range(6)), "KVHANDOFF_ACCELERATOR_EFAS_X": "GPU-9=e9",
               "PATH": "/bin"}
    merged = accelerator_efas(environ)
    assert rank_nics(merged, "GPU-7", 0) == ["e28-rdm", "e29-rdm", "e30-rdm", "e31-rdm"]
    assert rank_nics(merged, None, 6) == ["e24-rdm", "e25-rdm", "e26-rdm", "e27-rdm"]  # host KV: by position
    assert rank_nics(merged, "GPU-9", 0) == []  # not a claim's variable
    assert accelerator_efas({"PATH": "/bin"}) is None


def test_a_gpu_uuid_reads_as_nvidia_writes_it():
    raw = bytes.fromhex("a312809c85eeabecaeaab8ea1ba91857")
    assert memory.gpu_uuid_string(raw) == "GPU-a312809c-85ee-abec-aeaa-b8ea1ba91857"
