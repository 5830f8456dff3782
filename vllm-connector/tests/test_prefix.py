"""Multi-turn conversations through the router with prefix-aware routing, real vLLM
engines and the transfer agents (one prefill and two decode engines, on loopback): each
turn's prompt extends the last turn's prompt and answer. The router must send a
conversation's later turns to the decode engine that holds its earlier ones; the agents
must move only the blocks that engine lacks (the tail after its cached prefix, in push,
push with layer streaming, and pull); a turn whose new part is short must take no prefill
leg at all; and every answer must be what one engine alone gives."""

import json
import math
import urllib.request

import pytest

import tinymodel
from stack import Stack, block_size, engine_metric, kv_moved, prompt_tokens, until, wait_idle

# The engines' KV block (the CPU backend's default, 128, would make every tail up to a
# block long), and under how many uncached tokens a turn is served on its decode engine
# alone.
ENGINE_ARGS = ["--block-size", "32"]
MIN_PREFILL = 64


def system(c: int) -> str:
    """Conversation c's own opening: the router may send a first turn anywhere."""
    return " ".join(f"the quick brown fox {c} {i} jumps over the lazy dog" for i in range(30))


# Each conversation's user turns: long ones (a prefill pays) and short ones (it does not).
TURNS = [
    lambda c: f" user {c} asks: " + " ".join(f"lazy dog {c} {i}" for i in range(40)),
    lambda c: f" user {c} says: thanks",
    lambda c: f" user {c} asks again: " + " ".join(f"brown fox {c} {i}" for i in range(40)),
]
SHORT = {1}  # the turns whose new part is short
CONVERSATIONS = 3  # more than decode engines: load alone would move a conversation
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["push", "push-layered", "pull"])
def stack(request, bins, tiny_model, tmp_path_factory):
    mode = request.param
    s = Stack(bins, tiny_model, str(tmp_path_factory.mktemp(f"prefix-{mode}")), mode, decodes=2, engine_args=ENGINE_ARGS,
              routing={"decodeChoice": "PrefixAware", "overlapWeight": 4, "loadWeight": 1, "minPrefillTokens": MIN_PREFILL})
    yield mode, s
    s.stop()


def complete(addr: str, prompt: str):
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(f"http://{addr}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        choice = json.load(r)["choices"][0]
        return choice["text"], list(choice["token_ids"]), r.headers


def routed(s: Stack, request_id: str) -> dict | None:
    """The router's log line of a request, once written."""
    for line in s.r.log().splitlines():
        if request_id in line:
            rec = json.loads(line)
            if rec.get("msg") == "request" and rec.get("request_id") == request_id:
                return rec
    return None


def test_conversations_stay_on_their_decode_engine_and_move_only_what_it_lacks(stack, alone):
    mode, s = stack
    kind = mode.removesuffix("-layered")
    block = block_size(s.d)
    per_token = tinymodel.kv_bytes_per_token("tiny", 4)
    prompts = {c: system(c) for c in range(CONVERSATIONS)}
    before = {c: 0 for c in range(CONVERSATIONS)}  # tokens of the conversation's last prompt
    home = {}  # the decode engine of each conversation's first turn
    for turn, user in enumerate(TURNS):
        for c in range(CONVERSATIONS):
            prompt = prompts[c] + user(c)
            # One request at a time: every counter's change is this request's.
            hits = [engine_metric(d, "vllm:prefix_cache_hits_total") for d in s.ds]
            served = [engine_metric(d, "vllm:request_success_total") for d in s.ds]
            prefilled, moved = engine_metric(s.p, "vllm:request_success_total"), kv_moved(s.agents, kind)
            text, tokens, headers = complete(s.r.addr, prompt)
            # An engine counts a request a moment after its response: wait for one to.
            done = lambda: [i for i, e in enumerate(s.ds) if engine_metric(e, "vllm:request_success_total") > served[i]]
            until("a decode engine to count the request", done)
            (d,) = done()
            where = f"{mode}, turn {turn}, conversation {c}\n{s.logs()}"
            if turn == 0:
                home[c] = d
            assert d == home[c], f"served on decode-{d}, its earlier turns on decode-{home[c]}: {where}"
            wait_idle(s.p)
            cached = engine_metric(s.ds[d], "vllm:prefix_cache_hits_total") - hits[d]
            n = prompt_tokens(s.p, prompt)
            if turn in SHORT:
                # The new part is under MIN_PREFILL: decode computes it, prefill never sees it.
                assert headers.get("x-kvhandoff-decode-only") == "prefix_cached", where
                until(f"the router's log of the request: {where}", lambda: routed(s, headers["X-Request-Id"]) is not None)
                assert routed(s, headers["X-Request-Id"])["prefill"] == "", where
                assert engine_metric(s.p, "vllm:request_success_total") == prefilled, where
                assert kv_moved(s.agents, kind) == moved, where
            else:
                # A prefill leg was sent (the router's log; the prefill engine's own counter
                # misses a push leg the router cancelled once decode had answered).
                assert "x-kvhandoff-decode-only" not in headers, where
                until(f"the router's log of the request: {where}", lambda: routed(s, headers["X-Request-Id"]) is not None)
                assert routed(s, headers["X-Request-Id"])["prefill"] == "prefill-0.default", where
                # Exactly the blocks after what the decode engine held: none of the cached
                # prefix moves (pull counts each block twice: read, and been read).
                # The decode engine holds the last turn's prompt (all but a block at its end,
                # where the answer's tokens may have merged with the next).
                assert cached % block == 0 and cached >= (before[c] // block - 1) * block, f"{cached} tokens cached: {where}"
                want = (math.ceil(n / block) - cached // block) * block * per_token
                assert kv_moved(s.agents, kind) - moved == (2 if kind == "pull" else 1) * want, f"{n} tokens, {cached} cached: {where}"
            # The answer one engine alone gives to the same prompt.
            assert tokens == complete(alone.addr, prompt)[1], where
            prompts[c], before[c] = prompt + text, n
    assert len(set(home.values())) == 2, f"first turns all on one decode engine: {home}"
