"""make bench-prefix-vllm: multi-turn conversations sharing a system prompt through the
router to real vLLM engines (the CPU backend and the tiny model: one prefill and two
decode engines, each engine with its agent's KV path on loopback), load-only against
prefix-aware routing on the same conversations, in push and pull. Each configuration gets
fresh engines (empty prefix caches). Reports TTFT p50/p90 (all turns, the short
follow-ups, the long turns after the first), the KV the agents moved per request, the
prefill legs taken and the decode engines' prefix-cache hit rate; a table on stdout, JSON
and markdown in --out."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import tinymodel  # noqa: E402
from bench_vllm import pct, stream  # noqa: E402
from stack import Stack, engine_metric, go_binaries, kv_moved, wait_idle  # noqa: E402

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"] + [str(i) for i in range(100)]
ENGINE_ARGS = ["--block-size", "32"]


def words(rng: random.Random, n: int) -> str:
    return " " + " ".join(rng.choice(WORDS) for _ in range(n))


def conversations(seed: int, n: int, turns: int, system_words: int, user_words: int, short_words: int) -> list[list[str]]:
    """Each conversation's user messages; every conversation opens with one shared system prompt."""
    rng = random.Random(seed)
    system = "system:" + words(rng, system_words)
    return [[(system if t == 0 else "") + f" user {c}:" + words(rng, short_words if t % 2 else user_words) for t in range(turns)]
            for c in range(n)]


def play(convs: list, rate: float, think: float, seed: int, ask, answer: str) -> list[tuple[int, dict]]:
    """Plays conversations: each arrives at a Poisson rate, then sends its turns one after
    another with think time between, each turn's prompt the last one's, its answer (the
    answer's key: "text" or "ids") and the new user turn. ask(conversation, turn, prompt)
    sends a turn and returns its stream result. Returns (turn, result) as they finished."""
    results, lock = [], threading.Lock()
    rng = random.Random(seed)
    starts, t = [], 0.0
    for _ in convs:
        t += rng.expovariate(rate)
        starts.append(t)
    begin = time.monotonic()

    def converse(c: int):
        time.sleep(max(0.0, begin + starts[c] - time.monotonic()))  # the conversation's arrival
        prompt = type(convs[c][0])()
        for n, user in enumerate(convs[c]):
            if n:
                time.sleep(think)  # the user's think time, not a synchronisation
            prompt += user
            out = ask(c, n, prompt)
            with lock:
                results.append((n, out))
            if out["error"]:
                return
            prompt += out[answer]

    threads = [threading.Thread(target=converse, args=(c,)) for c in range(len(convs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results


def run(mode: str, routing: dict, bins: str, model: str, convs: list[list[str]], max_tokens: int, think: float, rate: float, seed: int) -> dict:
    d = tempfile.mkdtemp(prefix=f"kvhandoff-prefix-{mode}-")
    s = Stack(bins, model, d, mode, decodes=2, engine_args=ENGINE_ARGS, routing=routing)
    kind = mode.removesuffix("-layered")
    try:
        moved = kv_moved(s.agents, kind)
        hits = sum(engine_metric(e, "vllm:prefix_cache_hits_total") for e in s.ds)
        queries = sum(engine_metric(e, "vllm:prefix_cache_queries_total") for e in s.ds)
        results = play(convs, rate, think, seed, lambda c, n, prompt: stream(s.r.addr, prompt, max_tokens), "text")
        wait_idle(s.p)
        ok = [(n, o) for n, o in results if not o["error"]]
        ttft = [o["ttft"] for _, o in ok]
        return {
            "mode": mode, "routing": routing, "requests": len(results), "failed": len(results) - len(ok),
            "ttft_ms": {"p50": pct(ttft, 0.5), "p90": pct(ttft, 0.9)},
            "follow_ups_ms": {"p50": pct([o["ttft"] for n, o in ok if n % 2], 0.5), "p90": pct([o["ttft"] for n, o in ok if n % 2], 0.9)},
            "long_turns_ms": {"p50": pct([o["ttft"] for n, o in ok if n and not n % 2], 0.5),
                              "p90": pct([o["ttft"] for n, o in ok if n and not n % 2], 0.9)},
            # A pull's bytes are counted by both agents: once here.
            "kv_bytes_per_request": (kv_moved(s.agents, kind) - moved) / (2 if kind == "pull" else 1) / max(len(results), 1),
            # By the router's answer: a push's prefill leg is cancelled once decode answered,
            # which the prefill engine's own counters do not always show.
            "prefill_legs": sum(1 for _, o in ok if not o["decode_only"]),
            "decode_hit_rate": (sum(engine_metric(e, "vllm:prefix_cache_hits_total") for e in s.ds) - hits) /
            max(1.0, sum(engine_metric(e, "vllm:prefix_cache_queries_total") for e in s.ds) - queries),
        }
    finally:
        s.stop()


def workload_args(ap: argparse.ArgumentParser) -> None:
    """The conversations' shape and pace, as both prefix reports take them."""
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rate", type=float, default=0.5, help="conversations starting a second (Poisson)")
    ap.add_argument("--think", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--min-prefill", type=int, default=64)
    ap.add_argument("--seed", type=int, default=7)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    workload_args(ap)
    a = ap.parse_args()
    bins = os.environ.get("KVHANDOFF_BIN_DIR") or go_binaries(tempfile.mkdtemp(prefix="kvhandoff-bins-"))
    model = tinymodel.make(tempfile.mkdtemp(prefix="kvhandoff-tiny-"))
    convs = conversations(a.seed, a.conversations, a.turns, 300, 120, 4)
    configs = [("load only", {"decodeChoice": "LoadOnly", "loadWeight": 1}),
               (f"prefix-aware, decode alone under {a.min_prefill}",
                {"decodeChoice": "PrefixAware", "overlapWeight": 4, "loadWeight": 1, "minPrefillTokens": a.min_prefill})]
    rows = []
    for mode in ("push", "pull"):
        for name, routing in configs:
            r = run(mode, routing, bins, model, convs, a.max_tokens, a.think, a.rate, a.seed)
            r["name"] = name
            print(json.dumps(r), file=sys.stderr, flush=True)
            rows.append(r)
    os.makedirs(a.out, exist_ok=True)
    head = (f"{a.conversations} conversations × {a.turns} turns of the tiny model on vLLM's CPU backend (block size 32), one prefill and two "
            f"decode engines on {os.cpu_count()} cores, each conversation opening with one shared system prompt; user turns ~120 words, "
            f"follow-ups 4, answers {a.max_tokens} tokens; conversations start at {a.rate}/s, {a.think} s think time.\n\n")
    table = ["| mode | routing | TTFT p50 / p90 (ms) | follow-ups | long turns after the first | KV moved a request | prefill legs | decode hit rate | failed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda p: f"{p['p50']:.0f} / {p['p90']:.0f}" if p["p50"] is not None else "–"  # noqa: E731
        table.append(f"| {r['mode']} | {r['name']} | {f(r['ttft_ms'])} | {f(r['follow_ups_ms'])} | {f(r['long_turns_ms'])} | "
                     f"{r['kv_bytes_per_request'] / 1e6:.2f} MB | {r['prefill_legs']:.0f} of {r['requests']} | {100 * r['decode_hit_rate']:.0f}% | {r['failed']} |")
    md = head + "\n".join(table) + "\n"
    print(md)
    with open(os.path.join(a.out, "vllm-cpu.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "vllm-cpu.json"), "w") as f:
        json.dump({"recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
