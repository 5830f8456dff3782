"""make bench-vllm: real vLLM engines (the real-vLLM tier's CPU backend and tiny model) on one
seeded load, back to back: one engine alone, stock NixlConnector pull (as shipped, and with
its thread placement undone), stock NixlPushConnector push, kvhandoff pull and push. Every
configuration is first checked token for token against the engine alone, then timed on the
same arrivals, prompts and output lengths. Results: a table on stdout, JSON in --out."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import psutil  # noqa: E402  (vLLM's own dependency)
import tinymodel  # noqa: E402
from stack import Engine, NixlStack, Stack, go_binaries  # noqa: E402

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"] + [str(i) for i in range(100)]


def prompts(rng: random.Random, model: str, n: int, lo: int, hi: int) -> list[str]:
    """n prompts of lo..hi tokens of the tiny model's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for _ in range(n):
        want = rng.randint(lo, hi)
        ids = tok(" ".join(rng.choice(WORDS) for _ in range(want)))["input_ids"][:want]
        out.append(tok.decode(ids))
    return out


class Config:
    """One configuration: its processes and the port clients send to."""

    def __init__(self, name, procs, port, agents=()):
        self.name, self.procs, self.port, self.agents = name, procs, port, list(agents)

    def agent_failures(self) -> float:
        """kvhandoff's agents: attempts that ended without delivery (the engines recompute those)."""
        return sum(v for a in self.agents for k, v in a.metrics().items() if k.startswith("kvhandoff_agent_failures_total"))

    def cpu_seconds(self) -> float:
        total = 0.0
        for p in self.procs:
            try:
                for q in [psutil.Process(p.p.pid)] + psutil.Process(p.p.pid).children(recursive=True):
                    t = q.cpu_times()
                    total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self):
        for p in reversed(self.procs):
            p.stop()


def start(name, bins, model, d) -> Config:
    os.makedirs(d, exist_ok=True)
    if name == "one engine":
        e = Engine("alone", model, d, 0)
        e.ready()
        return Config(name, [e], e.port)
    if name.startswith("kvhandoff"):
        s = Stack(bins, model, d, name.split()[1])
        return Config(name, s.procs, s.r.port, agents=[s.a, s.b])
    s = NixlStack(bins, model, d, "push" if "push" in name else "pull", keep_affinity="placement undone" in name)
    return Config(name, s.procs, s.r.port)


def stream(port: int, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: time to first token, the gaps between tokens, token ids."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    out = {"ttft": None, "itl": [], "ids": [], "error": None, "prompt_tokens": 0}
    last = None
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    out["prompt_tokens"] = ev["usage"]["prompt_tokens"]
                for c in ev.get("choices", []):
                    ids = c.get("token_ids") or []
                    if not ids:
                        continue
                    now = time.monotonic()
                    if out["ttft"] is None:
                        out["ttft"] = now - t0
                    elif last is not None:
                        out["itl"].append(now - last)
                    last = now
                    out["ids"] += ids
    except Exception as e:  # a failed request is counted, not fatal
        out["error"] = str(e)
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else None


def run_load(cfg: Config, load) -> dict:
    results = [None] * len(load)
    threads = []
    cpu0, failed0, t0 = cfg.cpu_seconds(), cfg.agent_failures(), time.monotonic()
    for i, (at, prompt, n) in enumerate(load):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the arrival schedule, not synchronisation
        th = threading.Thread(target=lambda i=i, p=prompt, n=n: results.__setitem__(i, stream(cfg.port, p, n)))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    wall, cpu, transfer_failures = time.monotonic() - t0, cfg.cpu_seconds() - cpu0, cfg.agent_failures() - failed0
    ok = [r for r in results if r["error"] is None and r["ttft"] is not None]
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    return {"requests": len(load), "failed": len(load) - len(ok), "ttft_ms": {q: pct(ttft, v) for q, v in (("p50", .5), ("p90", .9), ("p99", .99))},
            "itl_ms": {"p50": pct(itl, .5), "p90": pct(itl, .9)}, "cpu_s": round(cpu, 1), "cpu_s_per_request": round(cpu / len(load), 2),
            "wall_s": round(wall, 1), "ids": [r["ids"] for r in results], "agent_transfer_failures": transfer_failures,
            "errors": sorted({r["error"] for r in results if r["error"]})[:5]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--qps", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--configs", default="one engine,nixl pull,nixl pull (placement undone),nixl push,nixl push (placement undone),kvhandoff pull,kvhandoff push,kvhandoff push-layered")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-vllm-")
    bins = go_binaries(work)
    model = tinymodel.make(os.path.join(work, "model"))
    rng = random.Random(a.seed)
    ps = prompts(rng, model, a.requests, 237, 1893)
    at, load = 0.0, []
    for p in ps:
        at += rng.expovariate(a.qps)
        load.append((at, p, rng.randint(16, 64)))
    report = {"recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": {"cpus": os.cpu_count()},
              "load": {"requests": a.requests, "qps": a.qps, "seed": a.seed, "prompt_tokens": [237, 1893], "output_tokens": [16, 64]}, "configs": {}}
    reference = None
    for name in [c.strip() for c in a.configs.split(",")]:
        print(f"== {name}", flush=True)
        try:
            cfg = start(name, bins, model, os.path.join(work, name.replace(" ", "-").replace("(", "").replace(")", "")))
        except Exception as e:
            report["configs"][name] = {"error": f"did not start: {str(e)[-2000:]}"}
            print(f"   did not start: {str(e)[-600:]}", flush=True)
            continue
        try:
            # Identity first: each prompt alone, greedy, against the engine alone.
            ids = [stream(cfg.port, p, n)["ids"] for _, p, n in load[:6]]
            if reference is None:
                reference = ids
            same = sum(x == y for x, y in zip(ids, reference))
            res = run_load(cfg, load)
            if name == "one engine":
                report["reference_ids"] = res["ids"]
            timed_same = sum(x == y for x, y in zip(res["ids"], report.get("reference_ids", res["ids"])))
            res.pop("ids")
            res["identical"] = {"alone": f"{same}/{len(ids)}", "under_load": f"{timed_same}/{len(load)}"}
            report["configs"][name] = res
            print(f"   {json.dumps(res)}", flush=True)
        finally:
            cfg.stop()
    report.pop("reference_ids", None)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"vllm-{os.cpu_count()}cpu.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print("\n| configuration | TTFT p50 / p90 / p99 (ms) | ITL p50 (ms) | CPU s / request | failed | identical (alone, under load) |")
    print("|---|---|---|---|---|---|")
    for name, r in report["configs"].items():
        if "error" in r:
            print(f"| {name} | did not start | | | | |")
            continue
        t = r["ttft_ms"]
        f = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        print(f"| {name} | {f(t['p50'])} / {f(t['p90'])} / {f(t['p99'])} | {f(r['itl_ms']['p50'])} | {r['cpu_s_per_request']} | "
              f"{r['failed']} | {r['identical']['alone']}, {r['identical']['under_load']} |")
    print(f"\n{path}")


if __name__ == "__main__":
    main()
