"""Real vLLM engines through the transfer agents: greedy generation on one engine alone,
then on a prefill and a decode engine behind the kvhandoff router, each engine with its
own agent (two "nodes" on loopback, tcp;ofi_rxm), in push, in push with the prefill engine
streaming its layers, and in pull. The token ids must be identical, request by request,
also under concurrency, cancels and preemption."""

import concurrent.futures
import http.client
import json
import math
import random
import time

import pytest

import tinymodel
from stack import MAX_TOKENS, PROMPTS, Stack, block_size, complete, engine_metric, kv_moved, prompt_tokens, until, wait_idle


# The connector's reports and events go through doorbells, except in push-grpc, which
# keeps them on gRPC.
@pytest.fixture(scope="module", params=["push", "push-layered", "pull", "push-grpc"])
def stack(request, bins, tiny_model, tmp_path_factory):
    mode = request.param
    s = Stack(bins, tiny_model, str(tmp_path_factory.mktemp(mode)), mode.removesuffix("-grpc"), doorbell=not mode.endswith("-grpc"))
    yield mode, s
    s.stop()


def bell_records(s: Stack) -> float:
    return sum(v for a in (s.a, s.b) for k, v in a.metrics().items() if k.startswith("kvhandoff_agent_doorbell_records_total"))


def id_legs(s: Stack) -> int:
    """Requests whose decode leg carried the prompt as token ids (the router's log)."""
    return sum(r.get("decode_prompt") == "token_ids" for r in s.r.records())


def layer_groups(s: Stack) -> float:
    return s.a.metrics().get('kvhandoff_agent_source_parts_total{kind="layer_group"}', 0)


def test_p_d_through_the_agents_generates_what_one_engine_does(stack, reference):
    mode, s = stack
    kind = mode.removesuffix("-grpc").removesuffix("-layered")
    before, groups, records, with_ids = kv_moved(s.agents, kind), layer_groups(s), bell_records(s), id_legs(s)
    want, block = 0, block_size(s.d)
    for p in PROMPTS:
        assert complete(s.r.addr, p, MAX_TOKENS) == reference[p], f"{mode}: prompt {p[:30]!r}\n{s.logs()}"
        want += math.ceil(prompt_tokens(s.p, p) / block) * block * tinymodel.kv_bytes_per_token("tiny", 4)
    # The KV crossed through the agents, every block each prompt fills (once the prefill
    # engine holds no block, the counters are final); push-layered's layer by layer (the
    # tiny model's two layers: two layer groups per prompt), the others' whole. The reports
    # and events crossed the doorbells, or (push-grpc) none did.
    wait_idle(s.p)
    assert kv_moved(s.agents, kind) - before == (2 if kind == "pull" else 1) * want, s.logs()
    if mode.endswith("-grpc"):
        assert bell_records(s) == records == 0
    else:
        assert bell_records(s) > records, s.logs()
    # Pull's decode legs carried each prompt as the prefill engine's token ids, and the
    # tokens are still one engine's (the router logs a request once it has ended).
    if kind == "pull":
        until("every pull decode leg carried token ids", lambda: id_legs(s) - with_ids == len(PROMPTS))
    else:
        assert id_legs(s) == 0
    if mode == "push-layered":
        assert layer_groups(s) - groups == 2 * len(PROMPTS), s.logs()
    else:
        assert layer_groups(s) == groups


def test_concurrent_requests_each_get_their_own_tokens(stack, reference):
    mode, s = stack
    work = PROMPTS * 3
    with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
        got = list(pool.map(lambda p: complete(s.r.addr, p, MAX_TOKENS), work))
    for p, tokens in zip(work, got):
        assert tokens == reference[p], f"{mode}: prompt {p[:30]!r}"


def send_then_drop(addr: str, prompt: str, after: float) -> None:
    """A client that goes away `after` seconds into its request: while its KV is on its
    way, during the transfer or while it decodes."""
    c = http.client.HTTPConnection(addr, timeout=60)
    body = {"model": "m", "prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True}
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    time.sleep(after)  # the client's own timing, not a synchronisation
    c.close()


def test_cancelled_requests_leave_the_others_and_later_ones_correct(stack, reference):
    mode, s = stack
    rng = random.Random(7)
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        drops = [pool.submit(send_then_drop, s.r.addr, p, rng.uniform(0, 0.3)) for p in PROMPTS * 2]
        kept = {p: pool.submit(complete, s.r.addr, p, MAX_TOKENS) for p in PROMPTS}
        for f in drops:
            f.result()
        for p, f in kept.items():
            assert f.result() == reference[p], f"{mode}: prompt {p[:30]!r} beside cancelled requests"
    # After the cancels, the blocks that came back to both engines' pools are reused.
    for p in PROMPTS:
        assert complete(s.r.addr, p, MAX_TOKENS) == reference[p], f"{mode}: prompt {p[:30]!r} after the cancels"


def test_a_prompt_decode_has_cached_moves_only_its_tail(stack):
    """The decode engine caches the prompt's blocks from its first request, so the second
    brings only what it lacks: vLLM computes at least a prompt's last token, so the blocks
    after what it holds move — registered from their position (push) or read (pull) — and
    its cached blocks do not. Nothing is declined, nothing fails, the answer is the
    first's. (Before, a push whose prompt decode held was computed there whole and
    declined.) After the cancels' test: a prefill engine's Cancel can reach its agent before
    its own report of the same request (the RPC overtakes the doorbell record); the agent
    refuses the late report rather than keep the source a blocks TTL and fail it, which
    would be counted here."""
    mode, s = stack
    kind = mode.removesuffix("-grpc").removesuffix("-layered")

    def count(name: str) -> float:
        return sum(v for a in s.agents for k, v in a.metrics().items() if k.startswith(name))

    def generate() -> list[int]:
        return complete(s.r.addr, prompt, max_tokens=200, min_tokens=200)

    prompt = " ".join(f"cached {i} prefix" for i in range(120))  # 1719 tokens: 13 full blocks
    first = generate()
    wait_idle(s.p)
    declines, failures = count("kvhandoff_agent_declines_total"), count("kvhandoff_agent_failures_total")
    moved, hits = kv_moved(s.agents, kind), engine_metric(s.d, "vllm:prefix_cache_hits_total")
    assert generate() == first, s.logs()
    wait_idle(s.p, timeout=20)  # the prefill engine's blocks came back, well inside the TTL
    block, n = block_size(s.d), prompt_tokens(s.p, prompt)
    cached = engine_metric(s.d, "vllm:prefix_cache_hits_total") - hits
    assert cached == (n - 1) // block * block, f"decode held {cached} of {n} tokens\n{s.logs()}"
    tail = (math.ceil(n / block) - cached // block) * block * tinymodel.kv_bytes_per_token("tiny", 4)
    assert kv_moved(s.agents, kind) - moved == (2 if kind == "pull" else 1) * tail, s.logs()
    assert count("kvhandoff_agent_declines_total") == declines, s.logs()
    assert count("kvhandoff_agent_failures_total") == failures, s.logs()
