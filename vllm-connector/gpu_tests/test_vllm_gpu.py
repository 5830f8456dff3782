"""Real vLLM engines on a GPU handing their KV through the transfer agent: a prefill and a
decode engine as two processes on GPU 0 (each its share of the memory), both registered
with one agent (one node), which moves the KV from the prefill engine's CUDA KV cache into
the decode engine's with CUDA copies. Push, push with layer streaming and pull must give
the token ids of one engine alone (greedy), and the agent's byte counter must match the KV
the prompts hold. `make test-gpu-vllm` runs it on a GPU host with the GPU tier's vLLM
installed (hack/gpu-vllm.sh); it is not part of `make test`: CI has no GPU."""

import math
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import tinymodel  # noqa: E402
from stack import (GPU, MAX_TOKENS, PROMPTS, TIMINGS, Engine, Stack, block_size, complete, engine_metric, go_binaries, kv_moved,  # noqa: E402
                   prompt_tokens, wait_idle)

ON_GPU = GPU(share=0.2, kv_bytes=1 << 30, max_model_len=4096)

# A conversation's two turns: the second prompt extends the first, so the decode engine
# that served the first holds the head of the second.
TURNS = [" ".join(f"turn one {i} says" for i in range(200)), " ".join(f"turn one {i} says" for i in range(200)) + " and then turn two asks more"]


@pytest.fixture(scope="module")
def bins(tmp_path_factory):
    return go_binaries(str(tmp_path_factory.mktemp("bin")))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tinymodel.make(str(tmp_path_factory.mktemp("model")), "tiny")


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    e = Engine("alone", model, str(tmp_path_factory.mktemp("alone")), 0, gpu=ON_GPU)
    try:
        TIMINGS["GPU engine start (alone)"] = e.ready(600)
        return {p: complete(e.addr, p, MAX_TOKENS) for p in PROMPTS + TURNS}
    finally:
        e.stop()


@pytest.fixture(scope="module", params=["push", "push-layered", "pull"])
def stack(request, bins, model, tmp_path_factory):
    s = Stack(bins, model, str(tmp_path_factory.mktemp(request.param)), request.param, gpu=ON_GPU)
    yield request.param, s
    s.stop()


def test_p_d_on_one_gpu_generates_what_one_engine_does_and_moves_every_prompt_block(stack, reference):
    mode, s = stack
    kind = mode.removesuffix("-layered")
    before, want, block = kv_moved(s.agents, kind), 0, block_size(s.d)
    for p in PROMPTS:
        assert complete(s.r.addr, p, MAX_TOKENS) == reference[p], f"{mode}: prompt {p[:30]!r}\n{s.logs()}"
        # Decode loads every prompt token's KV: each block the prompt fills, whole.
        want += math.ceil(prompt_tokens(s.p, p) / block) * block * tinymodel.kv_bytes_per_token("tiny")
    # Every prefill's blocks come back once the agent is done with them, even on an engine
    # that has nothing left to compute; then the counters are final.
    wait_idle(s.p, 30)
    assert kv_moved(s.agents, kind) - before == (2 if kind == "pull" else 1) * want, s.logs()


def test_a_turn_whose_head_decode_holds_moves_only_its_tail(stack, reference):
    """The second turn's prompt extends the first's: the decode engine holds the first's
    whole blocks in its prefix cache, registers (push) or reads (pull) only the blocks after
    them, and answers as one engine alone does. The bytes the agent moves are the tail's,
    counted from the decode engine's own prefix-cache hits."""
    mode, s = stack
    kind = mode.removesuffix("-layered")
    first, second = TURNS
    assert complete(s.r.addr, first, MAX_TOKENS) == reference[first], s.logs()
    wait_idle(s.p, 30)
    moved, hits = kv_moved(s.agents, kind), engine_metric(s.d, "vllm:prefix_cache_hits_total")
    assert complete(s.r.addr, second, MAX_TOKENS) == reference[second], f"{mode}\n{s.logs()}"
    wait_idle(s.p, 30)
    block, n = block_size(s.d), prompt_tokens(s.p, second)
    cached = engine_metric(s.d, "vllm:prefix_cache_hits_total") - hits
    assert cached == prompt_tokens(s.p, first) // block * block, f"decode held {cached} of {n} tokens\n{s.logs()}"
    tail = (math.ceil(n / block) - cached // block) * block * tinymodel.kv_bytes_per_token("tiny")
    assert kv_moved(s.agents, kind) - moved == (2 if kind == "pull" else 1) * tail, s.logs()
