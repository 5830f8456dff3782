"""make bench-vllm: real vLLM engines (the real-vLLM tier's CPU backend and tiny model) on one
seeded load, back to back: one engine alone, stock NixlConnector pull (as shipped, and with
its thread placement undone), stock NixlPushConnector push, kvhandoff pull and push. Every
configuration is first checked token for token against the engine alone, then timed on the
same arrivals, prompts and output lengths. For kvhandoff's configurations each request's
handoff is also taken apart (timeline()): the connector's timestamps ($KVHANDOFF_TIMELINE),
the router's request log and the agents' stage histograms. Results: a table on stdout, JSON
in --out; with several --qps rates, a sweep (every configuration at every rate, each rate's
tokens checked against the engine alone's at that rate) and its SVG plot.

With --gpu (make bench-vllm-gpu, on a GPU host): the engines run on GPU 0 in bf16, sharing
it (kvhandoff's through one agent, which moves their KV with CUDA copies; stock NIXL's
through its UCX backend), and the model is Qwen3-8B-shaped (--shape) with random weights, so
that the prompts (--prompt-tokens, 16k by default) move the KV an 8B model's do. Each engine
takes --gpu-share of the GPU's memory and --kv-gib of KV (defaults that fit an 80 GB H100 with
two engines); before a configuration starts, the GPU's memory must be back where it was
before the first (the wait is measured). The engines run eager with the engine core in
the API server's process, as the GPU tests run them, or with --served as vLLM is served
(stack.GPU.served). The model is written once per run, and the run's
folder (model, logs) is removed at the end unless --keep. A configuration that fails to
start reports the failing process's own error."""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import psutil  # noqa: E402  (vLLM's own dependency)
import tinymodel  # noqa: E402
from stack import GPU, Engine, NixlStack, Stack, go_binaries  # noqa: E402

GPU_CONFIGS = "one engine,kvhandoff pull,kvhandoff push,kvhandoff push-layered,nixl pull,nixl push"
CPU_CONFIGS = "one engine,nixl pull,nixl pull (placement undone),nixl push,nixl push (placement undone),kvhandoff pull,kvhandoff push,kvhandoff push-layered"

IDENTITY = 6  # prompts checked one at a time before each configuration is timed
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
    """One configuration: its processes and the address (host:port) clients send to."""

    def __init__(self, name, procs, addr, agents=(), router_log=None, timeline=None, engines=None):
        self.name, self.procs, self.addr, self.agents = name, procs, addr, list(agents)
        self.router_log, self.timeline = router_log, timeline
        self.engines = engines or {}  # role -> Engine, whose vLLM metrics engine_stages reads

    def engine_histograms(self) -> dict[str, str]:
        """Each engine's /metrics text, by role."""
        out = {}
        for role, e in self.engines.items():
            with urllib.request.urlopen(f"http://{e.addr}/metrics", timeout=5) as r:
                out[role] = r.read().decode()
        return out

    def agent_counters(self) -> tuple[float, float, dict[str, list[float]]]:
        """kvhandoff's agents, one scrape each: attempts that ended without delivery (the
        engines recompute those), RMA operations or device copies posted, and the handoff
        stage histograms (stage -> [sum of seconds, count])."""
        failures, descriptors, stages = 0.0, 0.0, {}
        for a in self.agents:
            for k, v in a.metrics().items():
                if k.startswith("kvhandoff_agent_failures_total"):
                    failures += v
                if k.startswith("kvhandoff_agent_descriptors_total"):
                    descriptors += v
                for suffix, i in (("_sum{", 0), ("_count{", 1)):
                    if k.startswith("kvhandoff_agent_handoff_stage_seconds" + suffix):
                        stage = k.split('stage="')[1].split('"')[0]
                        stages.setdefault(stage, [0.0, 0.0])[i] += v
        return failures, descriptors, stages

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


def start(name, bins, model, d, gpu: GPU | None) -> Config:
    os.makedirs(d, exist_ok=True)
    if name == "one engine":
        e = Engine("alone", model, d, 0, gpu=gpu)
        e.ready(900)
        return Config(name, [e], e.addr, engines={"alone": e})
    if name.startswith("kvhandoff"):
        timeline = os.path.join(d, "timeline")
        os.environ["KVHANDOFF_TIMELINE"] = timeline  # the engines' connectors write there
        try:
            # "(gRPC)": the engines' reports and events over gRPC, not their doorbells.
            s = Stack(bins, model, d, name.split()[1], doorbell="(gRPC)" not in name, gpu=gpu)
        finally:
            del os.environ["KVHANDOFF_TIMELINE"]
        return Config(name, s.procs, s.r.addr, agents=s.agents, router_log=s.r.log_path, timeline=timeline,
                      engines={"prefill": s.p, "decode": s.d})
    s = NixlStack(bins, model, d, "push" if "push" in name else "pull", keep_affinity="placement undone" in name, gpu=gpu,
                  ucx_threads=ucx_threads(name))
    return Config(name, s.procs, s.r.addr, engines={"prefill": s.p, "decode": s.d})


def ucx_threads(name: str) -> int | None:
    """The UCX worker threads a NIXL configuration's name asks for ("nixl pull (1 UCX thread)":
    vLLM's num_threads for NIXL's UCX backend); None for vLLM's default (4)."""
    m = re.search(r"\((\d+) UCX threads?\)", name)
    return int(m.group(1)) if m else None


def gpu_used_mib() -> int:
    """GPU 0's memory in use (MiB), as nvidia-smi counts it: every process's, this one's none."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def wait_gpu_freed(baseline_mib: int, timeout: float = 180, slack_mib: int = 1024) -> float:
    """Waits until GPU 0's memory in use is back within slack_mib of baseline_mib (what it was
    before the first configuration): the stopped engines' processes have exited and the
    driver has freed their memory. Returns the seconds it took; raises past timeout, since
    the next configuration's engines would not fit."""
    t0 = time.monotonic()
    while (used := gpu_used_mib()) > baseline_mib + slack_mib:
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"GPU memory still {used} MiB in use {timeout:.0f} s after the configuration stopped "
                               f"(baseline {baseline_mib} MiB): a process of it outlived its stop")
        time.sleep(0.5)  # polling the driver's count, which nothing signals
    return time.monotonic() - t0


def stream(addr: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: time to first token, the gaps between tokens, token ids, text,
    and (routers with routing.minPrefillTokens) why it was served on decode alone."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True}
    req = urllib.request.Request(f"http://{addr}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    sent, t0 = time.time(), time.monotonic()
    out = {"ttft": None, "itl": [], "ids": [], "text": "", "error": None, "sent": sent, "id": None, "decode_only": None}
    last = None
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            out["id"] = r.headers.get("X-Request-Id")
            out["decode_only"] = r.headers.get("X-Kvhandoff-Decode-Only")
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for c in json.loads(line[6:]).get("choices", []):
                    out["text"] += c.get("text") or ""
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


# vLLM's own per-request stages, histograms each engine exports: (name, metric). The queue
# time of a decode engine includes waiting for the remote KV; its prefill time is the step
# that computes the last prompt token over the transferred KV.
ENGINE_STAGES = [
    ("API server: arrival → first token", "vllm:time_to_first_token_seconds"),
    ("engine core: queued → scheduled", "vllm:request_queue_time_seconds"),
    ("engine core: scheduled → first token", "vllm:request_prefill_time_seconds"),
]


def engine_stages(before: dict[str, str], after: dict[str, str]) -> dict[str, dict[str, float]]:
    """Mean ms per request of each of ENGINE_STAGES on each engine between two scrapes
    (Config.engine_histograms), from the histograms' _sum and _count."""
    def sums(text: str, metric: str) -> tuple[float, float]:
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith(metric + "_sum"):
                total += float(line.rpartition(" ")[2])
            elif line.startswith(metric + "_count"):
                count += float(line.rpartition(" ")[2])
        return total, count
    out = {}
    for role in after:
        for name, metric in ENGINE_STAGES:
            (s0, c0), (s1, c1) = sums(before.get(role, ""), metric), sums(after[role], metric)
            if c1 > c0:
                out.setdefault(role, {})[name] = round(1000 * (s1 - s0) / (c1 - c0), 2)
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else None


def run_load(cfg: Config, load) -> dict:
    results = [None] * len(load)
    threads = []
    (failed0, desc0, stages0), hist0 = cfg.agent_counters(), cfg.engine_histograms()
    cpu0, t0 = cfg.cpu_seconds(), time.monotonic()
    for i, (at, prompt, n) in enumerate(load):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the arrival schedule, not synchronisation
        th = threading.Thread(target=lambda i=i, p=prompt, n=n: results.__setitem__(i, stream(cfg.addr, p, n)))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    wall, cpu, (failed, desc, stages) = time.monotonic() - t0, cfg.cpu_seconds() - cpu0, cfg.agent_counters()
    hist = cfg.engine_histograms()
    ok = [r for r in results if r["error"] is None and r["ttft"] is not None]
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    return {"requests": len(load), "failed": len(load) - len(ok), "ttft_ms": {q: pct(ttft, v) for q, v in (("p50", .5), ("p90", .9), ("p99", .99))},
            "itl_ms": {"p50": pct(itl, .5), "p90": pct(itl, .9)}, "cpu_s": round(cpu, 1), "cpu_s_per_request": round(cpu / len(load), 2),
            "wall_s": round(wall, 1), "ids": [r["ids"] for r in results], "agent_transfer_failures": failed - failed0,
            "agent_descriptors_per_request": round((desc - desc0) / len(load), 1),
            "errors": sorted({r["error"] for r in results if r["error"]})[:5], "results": results,
            "engine_mean_ms": engine_stages(hist0, hist),
            "agent_stage_mean_ms": {k: round(1000 * (v[0] - stages0.get(k, [0, 0])[0]) / (v[1] - stages0.get(k, [0, 0])[1]), 2)
                                    for k, v in stages.items() if v[1] > stages0.get(k, [0, 0])[1]}}


# A handoff's segments: (name, from point, to point), each point "<role>:<event>" from the
# connector's timeline or "client:sent" / "client:first" from the bench. In pull the decode
# side starts only when the prefill response came back through the router.
SEGMENTS = [
    ("prefill leg: sent → prefill finished", "client:sent", "prefill:finished"),
    ("prefill: finished → SourceReady sent", "prefill:finished", "prefill:ready_call"),
    ("prefill: SourceReady call", "prefill:ready_call", "prefill:ready_done"),
    ("decode: sent → blocks allocated", "client:sent", "decode:allocated"),
    ("decode: sent → at the scheduler", "client:sent", "decode:arrived"),
    ("pull: prefill finished → decode at the scheduler", "prefill:finished", "decode:arrived"),
    ("pull: prefill finished → decode allocated", "prefill:finished", "decode:allocated"),
    ("pull: prefill finished → the router has its response", "prefill:finished", "router:prefill_back"),
    ("pull: the router has the response → decode at the scheduler", "router:prefill_back", "decode:arrived"),
    ("decode: allocated → load call", "decode:allocated", "decode:load_call"),
    ("decode: load call (RegisterDestination / Pull)", "decode:load_call", "decode:load_done"),
    ("handoff: last of (source ready, load) → DELIVERED at the engine", "handoff:start", "decode:event_delivered"),
    ("decode: DELIVERED → taken by a step", "decode:event_delivered", "decode:drained"),
    ("decode: taken → scheduler told", "decode:drained", "decode:resumed"),
    ("decode: scheduler told → first token at the client", "decode:resumed", "client:first"),
    ("decode: scheduler told → scheduled to compute", "decode:resumed", "decode:scheduled"),
    ("decode: scheduled → the next step scheduled", "decode:scheduled", "decode:stepped"),
    ("decode: next step → first token at the client", "decode:stepped", "client:first"),
]


def timeline(cfg: Config, results: list[dict], alone: list[dict] | None) -> dict:
    """Each request's handoff, segment by segment: p50 and p90 per segment (ms) over the
    requests that have both points, and the P/D overhead over the engine alone."""
    points: dict[str, dict[str, float]] = {}
    for path in glob.glob(os.path.join(cfg.timeline or "", "*.jsonl")):
        role = "prefill" if os.path.basename(path).startswith("prefill") else "decode"
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                # The first time a point is reached counts (an event may repeat on retries).
                points.setdefault(rec["key"], {}).setdefault(f"{role}:{rec['ev']}", rec["t"])
    transfer, prefill_s = {}, {}
    with open(cfg.router_log) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("msg") == "request":
                transfer[rec["request_id"]] = rec.get("transfer_id")
                if rec.get("prefill_ms"):
                    prefill_s[rec["request_id"]] = rec["prefill_ms"] / 1000
    per: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    over = []
    for i, r in enumerate(results):
        if r["error"] or r["ttft"] is None or not r["id"]:
            continue
        key = transfer.get(r["id"]) or next((k for k in points if r["id"] in k), None)
        p = dict(points.get(key, {}))
        p["client:sent"], p["client:first"] = r["sent"], r["sent"] + r["ttft"]
        if r["id"] in prefill_s:
            # The router sends the prefill leg as the client's request comes in (its own
            # work is under a millisecond): the leg's time from there is when it has the
            # prefill engine's whole response.
            p["router:prefill_back"] = r["sent"] + prefill_s[r["id"]]
        ready = p.get("prefill:ready_done") or p.get("prefill:finished")
        if ready and "decode:load_done" in p:
            p["handoff:start"] = max(ready, p["decode:load_done"])
        for name, a, b in SEGMENTS:
            if a in p and b in p:
                per[name].append(p[b] - p[a])
        if alone and alone[i]["ttft"] is not None:
            over.append(r["ttft"] - alone[i]["ttft"])
    out = {name: {"p50": round(pct(v, .5), 2), "p90": round(pct(v, .9), 2), "n": len(v)} for name, v in per.items() if v}
    if over:
        out["TTFT − the engine alone's, same request"] = {"p50": round(pct(over, .5), 2), "p90": round(pct(over, .9), 2), "n": len(over)}
    return out


def sweep_svg(sweep: dict, title: str) -> str:
    """A line chart of TTFT p50 (solid) and p90 (dashed) against the arrival rate, one colour
    per configuration: plain SVG, so the bench needs no plotting package."""
    w, h, left, top, right, bottom = 720, 420, 70, 40, 230, 50
    rates = sorted({q for by in sweep.values() for q in by})
    ymax = max(v["ttft_ms"]["p90"] for by in sweep.values() for v in by.values()) * 1.1
    x = lambda q: left + (w - left - right) * (rates.index(q) / max(len(rates) - 1, 1))  # noqa: E731
    y = lambda v: top + (h - top - bottom) * (1 - v / ymax)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<text x="{left}" y="20" font-size="14">{title}</text>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
           f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">arrivals per second (QPS)</text>',
           f'<text x="16" y="{(top + h - bottom) / 2}" transform="rotate(-90 16 {(top + h - bottom) / 2})" text-anchor="middle">TTFT (ms)</text>']
    for q in rates:
        out.append(f'<text x="{x(q):.0f}" y="{h - bottom + 16}" text-anchor="middle">{q:g}</text>')
    for i in range(5):
        v = ymax * i / 4
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.0f}" text-anchor="end">{v:.0f}</text>')
        out.append(f'<line x1="{left}" y1="{y(v):.0f}" x2="{w - right}" y2="{y(v):.0f}" stroke="#ddd"/>')
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    for i, (name, by) in enumerate(sweep.items()):
        c = colours[i % len(colours)]
        for q_key, dash in (("p50", ""), ("p90", ' stroke-dasharray="5,4"')):
            pts = " ".join(f"{x(q):.0f},{y(by[q]['ttft_ms'][q_key]):.0f}" for q in rates if q in by)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
        ly = top + 18 * i
        out.append(f'<line x1="{w - right + 12}" y1="{ly}" x2="{w - right + 36}" y2="{ly}" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{w - right + 42}" y="{ly + 4}">{name}</text>')
    out.append(f'<text x="{w - right + 12}" y="{top + 18 * len(sweep) + 10}">solid p50, dashed p90</text>')
    return "\n".join(out + ["</svg>", ""])


def gpu_name(device: str) -> str:
    """A file name's part for a GPU: "h100" for "NVIDIA H100 80GB HBM3"."""
    return next((w.lower() for w in device.split() if w[:1] in "HABLGTV" and any(c.isdigit() for c in w)), "gpu")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--qps", default="0.5", help="arrival rate; a comma-separated list runs each configuration at every rate in "
                    "turn (a sweep: the arrival pattern scaled, fresh prompts of the same lengths per rate), results in vllm-<cpus>cpu-sweep.json/.svg")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--configs", default="")
    ap.add_argument("--gpu", action="store_true", help="engines on GPU 0, a Qwen3-8B-shaped model")
    ap.add_argument("--shape", default="", help=f"the model's shape, one of {', '.join(tinymodel.SHAPES)} (default tiny; with --gpu qwen3-8b)")
    ap.add_argument("--gpu-share", type=float, default=0.45, help="with --gpu: the share of the GPU's memory each engine may take")
    ap.add_argument("--kv-gib", type=float, default=12, help="with --gpu: each engine's KV cache in GiB (two engines with "
                    "Qwen3-8B's 16 GB of weights and 12 GiB of KV each fit an 80 GB GPU)")
    ap.add_argument("--served", action="store_true", help="with --gpu: engines as vLLM is served (stack.GPU.served: each "
                    "engine core in its own process, decode steps as full CUDA graphs); default eager, as the GPU tests run them")
    ap.add_argument("--keep", action="store_true", help="keep the run's folder (model, logs) instead of removing it")
    ap.add_argument("--prompt-tokens", default="", help="lo,hi: prompt lengths (default 237,1893; with --gpu 15872,16384)")
    a = ap.parse_args()
    a.configs = a.configs or (GPU_CONFIGS if a.gpu else CPU_CONFIGS)
    lo, hi = (int(x) for x in (a.prompt_tokens or ("15872,16384" if a.gpu else "237,1893")).split(","))
    work = tempfile.mkdtemp(prefix="bench-vllm-")
    try:
        run(a, work, lo, hi)
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)  # the model alone is 16 GB on a GPU run


def run(a, work: str, lo: int, hi: int) -> None:
    bins = go_binaries(work)
    shape = a.shape or ("qwen3-8b" if a.gpu else "tiny")
    model = tinymodel.make(os.path.join(work, "model"), shape)
    # Two engines share the GPU: each its share of memory and KV for a few 16k prompts at once.
    gpu = GPU(share=a.gpu_share, kv_bytes=int(a.kv_gib * (1 << 30)), max_model_len=hi + 1024, served=a.served) if a.gpu else None
    baseline = gpu_used_mib() if a.gpu else 0
    rng = random.Random(a.seed)
    # The identity checks' prompts are their own: were they the load's, decode engines
    # would hold them in their prefix caches when the load comes (push then computes them
    # there, and the prefill agent holds the unclaimed blocks until their TTL).
    ps = prompts(rng, model, a.requests + IDENTITY, lo, hi)
    checks, ps = [(p, 32) for p in ps[:IDENTITY]], ps[IDENTITY:]
    rates = [float(q) for q in a.qps.split(",")]
    # Unit-rate gaps (the same random draws as expovariate at any rate), scaled per rate.
    unit = [(rng.expovariate(1.0), p, rng.randint(16, 64)) for p in ps]

    def load_at(qps: float) -> list:
        """The load at a rate: the first rate's prompts are the seed's; every other rate gets
        prompts of its own (the same lengths), or the engines' prefix caches would hold
        them all from the first, and the arrival pattern scaled to the rate."""
        fresh = ps if qps == rates[0] else prompts(random.Random(f"{a.seed}-{qps}"), model, len(ps), lo, hi)
        at, out = 0.0, []
        for (gap, _, n), p in zip(unit, fresh):
            at += gap / qps
            out.append((at, p, n))
        return out

    loads = {q: load_at(q) for q in rates}
    host = {"cpus": os.cpu_count()}
    if a.gpu:
        import torch

        host.update(gpu=torch.cuda.get_device_name(0), model=f"{shape}, random weights, bf16",
                    kv_bytes_per_token=tinymodel.kv_bytes_per_token(shape), engines="served" if a.served else "eager",
                    gpu_share=a.gpu_share, kv_gib_per_engine=a.kv_gib, gpu_memory_in_use_before_mib=baseline)
    report = {"recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": host,
              "load": {"requests": a.requests, "qps": rates[0] if len(rates) == 1 else rates, "seed": a.seed, "prompt_tokens": [lo, hi],
                       "output_tokens": [16, 64]}, "configs": {}}
    if len(rates) > 1:
        report["sweep"] = {}
    # The engine alone's identity answers and, per rate, its timed results: what every
    # configuration's tokens are checked against.
    # cached: its answers again from its own prefix cache; first_pd: the first P/D
    # configuration's answers, which every other P/D configuration computes the same way.
    reference, alone, cached, first_pd = None, {}, None, None
    freed = {}  # configuration -> seconds its engines' GPU memory took to come back
    for name in [c.strip() for c in a.configs.split(",")]:
        print(f"== {name}", flush=True)
        try:
            cfg = start(name, bins, model, os.path.join(work, name.replace(" ", "-").replace("(", "").replace(")", "")), gpu)
        except Exception as e:
            # The stack's error begins with the failing process's own (stack.cause).
            report["configs"][name] = {"error": f"did not start: {str(e)[:3000]}"}
            print(f"   did not start: {str(e)[:1500]}", flush=True)
            if a.gpu:
                freed[name] = round(wait_gpu_freed(baseline), 1)
            continue
        try:
            # Identity first: each prompt alone, greedy, against the engine alone.
            # The control for P/D's identity: the engine alone answering each prompt again
            # at once, from its own prefix cache, computes only the prompt's tail past its
            # last full block over cached KV, as a decode engine computes the last token,
            # with no transfer at all. At once: six 16k-token prompts need more KV than a
            # 12 GiB cache holds, and answered after all six, most would be computed again.
            ids, again = [], []
            for p, n in checks:
                ids.append(stream(cfg.addr, p, n)["ids"])
                if name == "one engine":
                    again.append(stream(cfg.addr, p, n)["ids"])
            if reference is None:
                reference = ids
            if name == "one engine":
                cached = again
            elif first_pd is None:
                first_pd = (name, ids)
            same = sum(x == y for x, y in zip(ids, reference))

            def agree(other, ids=ids):
                return f"{sum(x == y for x, y in zip(ids, other))}/{len(ids)}"
            for qps in rates:
                res = run_load(cfg, loads[qps])
                results, got = res.pop("results"), res.pop("ids")
                if name == "one engine":
                    alone[qps] = results
                timed_same = sum(x == y["ids"] for x, y in zip(got, alone.get(qps, results)))
                res["identical"] = {"alone": f"{same}/{len(ids)}", "under_load": f"{timed_same}/{len(got)}"}
                if cached is not None:
                    # P/D's decode computes over cached KV, as the engine from its cache does.
                    key = "alone_from_its_prefix_cache" if name == "one engine" else "the_engine_alone_from_its_prefix_cache"
                    res["identical"][key] = agree(cached)
                if first_pd is not None and first_pd[0] != name:
                    res["identical"][first_pd[0]] = agree(first_pd[1])
                if qps == rates[0]:
                    if cfg.timeline:
                        res["timeline_ms"] = timeline(cfg, results, alone.get(qps))
                    report["configs"][name] = res
                    print(f"   {json.dumps(res)}", flush=True)
                if len(rates) > 1:
                    row = {k: res[k] for k in ("ttft_ms", "itl_ms", "cpu_s_per_request", "failed", "identical")}
                    report["sweep"].setdefault(name, {})[qps] = row
                    print(f"   at {qps} QPS: {json.dumps(row)}", flush=True)
        finally:
            cfg.stop()
            if a.gpu:
                freed[name] = round(wait_gpu_freed(baseline), 1)
                print(f"   GPU memory back in {freed[name]} s", flush=True)
    if freed:
        report["gpu_memory_freed_s"] = freed
    os.makedirs(a.out, exist_ok=True)
    where = gpu_name(host["gpu"]) if a.gpu else f"{os.cpu_count()}cpu"
    path = os.path.join(a.out, f"vllm-{where}{'-sweep' if len(rates) > 1 else ''}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    if len(rates) > 1:
        with open(path.removesuffix(".json") + ".svg", "w") as f:
            f.write(sweep_svg(report["sweep"], f"TTFT by arrival rate, {os.cpu_count()} CPUs, {a.requests} requests per rate"))
        print("\n| configuration | " + " | ".join(f"{q} QPS: TTFT p50 / p90 (ms)" for q in rates) + " |")
        print("|---|" + "---|" * len(rates))
        for name, by in report["sweep"].items():
            print(f"| {name} | " + " | ".join(f"{by[q]['ttft_ms']['p50']:.0f} / {by[q]['ttft_ms']['p90']:.0f}" for q in rates) + " |")
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
    for name, r in report["configs"].items():
        if r.get("timeline_ms"):
            print(f"\n{name}: where the time goes (ms, p50 / p90 over requests; agent stage means {r['agent_stage_mean_ms']}; "
                  f"{r['agent_descriptors_per_request']} copies or RMA operations a request; identical {r['identical']})")
            for seg, v in r["timeline_ms"].items():
                print(f"  {v['p50']:8.2f} / {v['p90']:8.2f}  {seg} (n={v['n']})")
    print(f"\n{path}")


if __name__ == "__main__":
    main()
