"""make bench-kv-events: where the prefix index comes from, with two router replicas in front
of real vLLM engines (the CPU backend, the tiny model: one prefill and two decode engines,
each publishing its KV cache events to a kv-events sidecar). Multi-turn conversations of
token ids whose turns alternate between the two routers, as a load balancer in front of
router replicas sends them; prefix-aware routing from routing history (each router knows
only the turns it routed) against the engines' own KV cache events (both routers see every
block), on the same conversations, in push. Reports TTFT p50/p90, the KV moved a request,
prefill legs and the decode engines' prefix-cache hit rate; a table on stdout, JSON and
markdown in --out."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import tinymodel  # noqa: E402
from bench_prefix import play, workload_args  # noqa: E402
from bench_vllm import pct, stream  # noqa: E402
from stack import Router, Stack, endpoint, engine_metric, go_binaries, kv_moved, wait_idle  # noqa: E402

ENGINE_ARGS = ["--block-size", "32"]
VOCAB = 500  # within the tiny model's vocabulary


def conversations(seed: int, n: int, turns: int, system: int, user: int, short: int) -> list[list[list[int]]]:
    """Each conversation's user turns as token ids; every conversation opens with one shared system prompt."""
    rng = random.Random(seed)
    head = [rng.randrange(1, VOCAB) for _ in range(system)]
    return [[(head if t == 0 else []) + [rng.randrange(1, VOCAB) for _ in range(short if t % 2 else user)] for t in range(turns)]
            for _ in range(n)]


def run(source: str, bins: str, model: str, convs, max_tokens: int, think: float, rate: float, seed: int, min_prefill: int) -> dict:
    d = tempfile.mkdtemp(prefix=f"kvhandoff-kv-events-{source}-")
    routing = {"decodeChoice": "PrefixAware", "overlapWeight": 4, "loadWeight": 1, "minPrefillTokens": min_prefill, "prefixSource": source}
    s = Stack(bins, model, d, "push", decodes=2, engine_args=ENGINE_ARGS, routing=routing, kv_events=source == "KVEvents")
    try:
        # A second router replica over the same engines.
        host, _, port = s.a.peer.rpartition(":")
        p = endpoint(s.p, "prefill", host, int(port))
        ds = [endpoint(e, "decode", index=i) for i, e in enumerate(s.ds)]
        if source == "KVEvents":
            for ep, e in zip([p, *ds], s.sidecars):
                ep["kvEventsURL"] = s.sidecars[e].url
        d2 = os.path.join(d, "router-2")
        os.makedirs(d2)
        r2 = s._add(Router(bins, d2, "push", p, ds, routing, 32))
        routers = [s.r, r2]
        moved = kv_moved(s.agents, "push")
        hits = sum(engine_metric(e, "vllm:prefix_cache_hits_total") for e in s.ds)
        queries = sum(engine_metric(e, "vllm:prefix_cache_queries_total") for e in s.ds)
        # A conversation's turns alternate between the two routers.
        results = play(convs, rate, think, seed, lambda c, n, prompt: stream(routers[(c + n) % 2].addr, prompt, max_tokens), "ids")
        wait_idle(s.p)
        ok = [(n, o) for n, o in results if not o["error"]]
        ttft = [o["ttft"] for _, o in ok]
        later = [o["ttft"] for n, o in ok if n]
        return {
            "source": source, "requests": len(results), "failed": len(results) - len(ok),
            "ttft_ms": {"p50": pct(ttft, 0.5), "p90": pct(ttft, 0.9)},
            "later_turns_ms": {"p50": pct(later, 0.5), "p90": pct(later, 0.9)},
            "kv_bytes_per_request": (kv_moved(s.agents, "push") - moved) / max(len(results), 1),
            "prefill_legs": sum(1 for _, o in ok if not o["decode_only"]),
            "decode_hit_rate": (sum(engine_metric(e, "vllm:prefix_cache_hits_total") for e in s.ds) - hits) /
            max(1.0, sum(engine_metric(e, "vllm:prefix_cache_queries_total") for e in s.ds) - queries),
            "lookups_from_events": sum(r.metric('kvhandoff_router_prefix_lookups_total{source="events"}') for r in routers),
            "lookups_from_history": sum(r.metric('kvhandoff_router_prefix_lookups_total{source="history"}') for r in routers),
        }
    finally:
        s.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    workload_args(ap)
    a = ap.parse_args()
    bins = os.environ.get("KVHANDOFF_BIN_DIR") or go_binaries(tempfile.mkdtemp(prefix="kvhandoff-bins-"))
    model = tinymodel.make(tempfile.mkdtemp(prefix="kvhandoff-tiny-"))
    convs = conversations(a.seed, a.conversations, a.turns, 320, 160, 6)
    rows = []
    for source in ("RoutingHistory", "KVEvents"):
        r = run(source, bins, model, convs, a.max_tokens, a.think, a.rate, a.seed, a.min_prefill)
        print(json.dumps(r), file=sys.stderr, flush=True)
        rows.append(r)
    os.makedirs(a.out, exist_ok=True)
    head = (f"{a.conversations} conversations × {a.turns} turns of token ids (a shared 320-token system prompt, user turns of 160 tokens, "
            f"follow-ups of 6, answers of {a.max_tokens}) through two router replicas, turns alternating between them; prefix-aware push "
            f"routing, decode alone under {a.min_prefill} uncached tokens; the tiny model on vLLM's CPU backend (block size 32), one prefill "
            f"and two decode engines on {os.cpu_count()} cores; conversations start at {a.rate}/s, {a.think} s think time.\n\n")
    table = ["| prefix source | TTFT p50 / p90 (ms) | turns after the first | KV moved a request | prefill legs | decode hit rate | lookups from events | failed |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda p: f"{p['p50']:.0f} / {p['p90']:.0f}" if p["p50"] is not None else "–"  # noqa: E731
        share = r["lookups_from_events"] / max(1.0, r["lookups_from_events"] + r["lookups_from_history"])
        table.append(f"| {r['source']} | {f(r['ttft_ms'])} | {f(r['later_turns_ms'])} | {r['kv_bytes_per_request'] / 1e6:.3f} MB | "
                     f"{r['prefill_legs']:.0f} of {r['requests']} | {100 * r['decode_hit_rate']:.0f}% | {100 * share:.0f}% | {r['failed']} |")
    md = head + "\n".join(table) + "\n"
    print(md)
    with open(os.path.join(a.out, "vllm-cpu-kv-events.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "vllm-cpu-kv-events.json"), "w") as f:
        json.dump({"recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
