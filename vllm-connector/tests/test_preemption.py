"""Preemption on a real decode engine whose KV arrives through the agents."""

import concurrent.futures

from stack import MAX_TOKENS, PROMPTS, Stack, complete, engine_metric


def test_preemption_on_the_decode_engine_returns_the_same_tokens(bins, tiny_model, tmp_path_factory, reference):
    # 12 blocks of 128 tokens on the decode side (a 1024-token max-model-len needs 9):
    # eight concurrent multi-block requests cannot all hold their KV, so vLLM preempts
    # some and recomputes them locally.
    d = str(tmp_path_factory.mktemp("preempt"))
    s = Stack(bins, tiny_model, d, "push", decode_extra=["--num-gpu-blocks-override", "12", "--max-model-len", "1024"])
    try:
        work = [p for p in PROMPTS if len(p) > 400] * 4
        with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
            got = list(pool.map(lambda p: complete(s.r.addr, p, MAX_TOKENS), work))
        preemptions = engine_metric(s.d, "vllm:num_preemptions_total")
        assert preemptions > 0, "the decode engine never preempted: the test does not test preemption"
        for p, tokens in zip(work, got):
            assert tokens == reference[p], f"prompt {p[:30]!r} under preemption ({preemptions:.0f} preemptions)"
    finally:
        s.stop()
