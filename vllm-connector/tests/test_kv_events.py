"""The prefix index from vLLM's own KV cache events, with real vLLM engines: each engine
publishes its events to a kv-events sidecar (the kv-events binary), which
the router follows. Conversations whose first turn reached a decode engine without the
router (as through another router replica) must have their next turn sent to that engine,
moving only the blocks it lacks; and what engines evict must leave the router's index."""

import math

import pytest

import tinymodel
from stack import Stack, engine_metric, kv_moved, until, wait_idle

BLOCK = 32
# A small decode cache (24 blocks of 32 tokens), so that a few prompts evict.
ENGINE_ARGS = ["--block-size", str(BLOCK)]
DECODE_ARGS = ["--num-gpu-blocks-override", "24", "--max-model-len", "480"]
HEAD_BLOCKS = 6
CONVERSATIONS = 4


def home(c: int) -> int:
    """Conversation c's decode engine: 0, 0, 1, 1 (a choice by load alone alternates)."""
    return c // 2 % 2
VOCAB = 500  # within the tiny model's vocabulary


def ids(c: int, n: int, start: int = 0) -> list[int]:
    """Conversation c's own token ids (no two conversations share a first block)."""
    return [1 + (c * 131 + 7 * i) % VOCAB for i in range(start, start + n)]


@pytest.fixture(scope="module")
def stack(bins, tiny_model, tmp_path_factory):
    s = Stack(bins, tiny_model, str(tmp_path_factory.mktemp("kv-events")), "push", decodes=2, engine_args=ENGINE_ARGS,
              decode_extra=DECODE_ARGS, kv_events=True, routing={"decodeChoice": "PrefixAware", "overlapWeight": 4, "loadWeight": 1})
    yield s
    s.stop()


def complete(addr: str, prompt: list[int]):
    import json
    import urllib.request

    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    req = urllib.request.Request(f"http://{addr}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def test_a_turn_goes_where_its_head_is_held_whoever_sent_the_head(stack):
    s = stack
    until("the router following every engine's events", lambda: s.r.metric("kvhandoff_router_kv_events_live_engines") == 3, 30)
    head = HEAD_BLOCKS * BLOCK
    # Each conversation's first turn goes straight to a decode engine: the router never
    # saw it, so only the engine's events can tell it where the head is.
    for c in range(CONVERSATIONS):
        d = s.ds[home(c)]
        complete(d.addr, ids(c, head))
        wait_idle(d)
    held = lambda: sum(x.metric("kvhandoff_kv_events_blocks") for x in s.sidecars.values())
    until("the sidecars holding every head", lambda: held() >= CONVERSATIONS * HEAD_BLOCKS)
    until("the router holding what the sidecars hold", lambda: s.r.metric("kvhandoff_router_kv_events_blocks") == held())
    assert s.r.metric("kvhandoff_router_prefix_index_blocks") == 0, "routing history knew the heads"

    per_token = tinymodel.kv_bytes_per_token("tiny", 4)
    for c in range(CONVERSATIONS):
        want = home(c)
        prompt = ids(c, head + 40)  # the head and a tail of 40 tokens
        served = [engine_metric(d, "vllm:request_success_total") for d in s.ds]
        hits = engine_metric(s.ds[want], "vllm:prefix_cache_hits_total")
        moved, before = kv_moved(s.agents, "push"), s.sidecars[want].metric("kvhandoff_kv_events_blocks")
        complete(s.r.addr, prompt)
        done = lambda: [i for i, d in enumerate(s.ds) if engine_metric(d, "vllm:request_success_total") > served[i]]
        until("a decode engine to count the request", done)
        where = f"conversation {c}\n{s.logs()}"
        assert done() == [want], f"served on decode-{done()}, its head on decode-{want}: {where}"
        wait_idle(s.p)
        cached = engine_metric(s.ds[want], "vllm:prefix_cache_hits_total") - hits
        assert cached == head, f"{cached} tokens reused, the head is {head}: {where}"
        # Only the blocks after the head moved.
        tail_blocks = math.ceil(len(prompt) / BLOCK) - HEAD_BLOCKS
        assert kv_moved(s.agents, "push") - moved == tail_blocks * BLOCK * per_token, where
        # The blocks pushed in are reported by the engine that received them, as its own.
        until(f"decode-{want}'s events naming the pushed blocks: {where}",
              lambda: s.sidecars[want].metric("kvhandoff_kv_events_blocks") >= before + 1)
    assert s.r.metric('kvhandoff_router_prefix_lookups_total{source="events"}') > 0


def test_what_an_engine_evicts_leaves_the_router(stack):
    s = stack
    d, side = s.ds[0], s.sidecars[0]
    removed = side.metric('kvhandoff_kv_events_total{kind="BlockRemoved"}')
    # Three prompts of 14 blocks each through a 24-block cache: earlier blocks go.
    for c in range(10, 13):
        complete(d.addr, ids(c, 14 * BLOCK))
        wait_idle(d)
    until("the engine evicting", lambda: side.metric('kvhandoff_kv_events_total{kind="BlockRemoved"}') > removed)
    held = lambda: sum(x.metric("kvhandoff_kv_events_blocks") for x in s.sidecars.values())
    assert side.metric("kvhandoff_kv_events_blocks") <= 24
    until("the router holding what the sidecars hold", lambda: s.r.metric("kvhandoff_router_kv_events_blocks") == held())
    for reason in ("no_parent", "unkeyed", "malformed"):
        assert side.metric(f'kvhandoff_kv_events_blocks_skipped_total{{reason="{reason}"}}') == 0, reason
