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
from stack import GPU, MAX_TOKENS, PROMPTS, TIMINGS, Engine, Stack, complete, go_binaries, http_ok, wait_idle  # noqa: E402

BLOCK = 16  # vLLM's CUDA block size (the default)
ON_GPU = GPU(share=0.2, kv_bytes=1 << 30, max_model_len=4096)


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
        return {p: complete(e.port, p, MAX_TOKENS) for p in PROMPTS}
    finally:
        e.stop()


@pytest.fixture(scope="module", params=["push", "push-layered", "pull"])
def stack(request, bins, model, tmp_path_factory):
    s = Stack(bins, model, str(tmp_path_factory.mktemp(request.param)), request.param, gpu=ON_GPU)
    yield request.param, s
    s.stop()


def prompt_tokens(port: int, prompt: str) -> int:
    import json
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", json.dumps({"model": "m", "prompt": prompt}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["count"]


def moved(s: Stack, mode: str) -> float:
    return s.a.metrics().get(f'kvhandoff_agent_transferred_bytes_total{{mode="{mode.removesuffix("-layered")}"}}', 0)


def test_p_d_on_one_gpu_generates_what_one_engine_does_and_moves_every_prompt_block(stack, reference):
    mode, s = stack
    before, want = moved(s, mode), 0
    for p in PROMPTS:
        assert complete(s.r.port, p, MAX_TOKENS) == reference[p], f"{mode}: prompt {p[:30]!r}\n{s.logs()}"
        # Decode loads every prompt token's KV: each block the prompt fills, whole.
        want += math.ceil(prompt_tokens(s.p.port, p) / BLOCK) * BLOCK * tinymodel.kv_bytes_per_token("tiny")
    wait_idle(s.p)
    # The agent counts a push's bytes once (its prefill side writes them); a pull's twice,
    # once as the decode side's reads and once as the prefill side's blocks served, both
    # sides being this one agent.
    sides = 2 if mode == "pull" else 1
    assert moved(s, mode) - before == sides * want, s.logs()
    assert http_ok(f"http://127.0.0.1:{s.d.port}/health")
