"""Real vLLM engines of different tensor-parallel sizes through the agents: a TP1 prefill
engine against a TP2 decode engine and the reverse, push (TP1 to TP2 also with layer streaming) and pull, on the CPU backend (the
tiny model's 2 KV heads: one a rank at TP2). Each decode rank takes its head from the prefill
rank holding it, a slice of every block; the token ids must be those of one engine alone,
and the agents must have moved the prompts' KV exactly once (pull: read and served)."""

import math

import pytest

import tinymodel
from stack import MAX_TOKENS, PROMPTS, Stack, block_size, complete, kv_moved, prompt_tokens, wait_idle


@pytest.fixture(scope="module", params=["push 1>2", "push-layered 1>2", "pull 1>2", "push 2>1", "pull 2>1"])
def stack(request, bins, tiny_model, tmp_path_factory):
    mode, _, sizes = request.param.partition(" ")
    p, _, d = sizes.partition(">")
    s = Stack(bins, tiny_model, str(tmp_path_factory.mktemp(f"{mode}-tp{p}-tp{d}")), mode, tp=(int(p), int(d)))
    yield request.param, mode, s
    s.stop()


def test_engines_of_different_tensor_parallel_sizes_generate_what_one_engine_does(stack, reference):
    name, mode, s = stack
    kind = mode.removesuffix("-layered")
    before, want, block = kv_moved(s.agents, kind), 0, block_size(s.d)
    for p in PROMPTS:
        assert complete(s.r.addr, p, MAX_TOKENS) == reference[p], f"{name}: prompt {p[:30]!r}\n{s.logs()}"
        want += math.ceil(prompt_tokens(s.p, p) / block) * block * tinymodel.kv_bytes_per_token("tiny", 4)
    wait_idle(s.p)
    # Every head of every block crossed once: the ranks' slices add up to the blocks.
    assert kv_moved(s.agents, kind) - before == (2 if kind == "pull" else 1) * want, s.logs()
