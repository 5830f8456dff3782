"""Processes for the real-vLLM tests: vLLM OpenAI servers, transfer agents and the
kvhandoff router, each on loopback, with its log kept for failures."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

# Lengths from a few tokens to several 128-token blocks (the CPU backend's block size).
PROMPTS = [
    "the quick brown fox",
    "lazy dog 17 jumps over",
    " ".join(f"fox {i}" for i in range(40)),
    " ".join(f"the dog {i} jumps" for i in range(90)),
    "over the lazy",
    " ".join(f"brown {i} quick" for i in range(150)),
]
MAX_TOKENS = 48


# Measured start-up times, written to $KVHANDOFF_VLLM_REPORT at the end (conftest).
TIMINGS: dict[str, float] = {}

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOKEN = "kvhandoff-loopback-token-0123456789"


# Each engine, router and sidecar runs on a loopback host of its own, with the ports it
# has in a pod (a sidecar shares its engine's host, as it shares its pod's loopback). No
# port is ever found free, released and handed to a process: another could take it
# meanwhile (that race failed a cold make test). A host is claimed as the Go tests'
# test/loopback claims it: a UDP socket bound to CLAIM_PORT on an address of
# 127.128.0.0/9, held for the session; while it is held no other claimant gets that host,
# and its TCP ports below the kernel's ephemeral range (32768 and up) are taken by no
# other process's bind to port 0 or outgoing connection.
CLAIM_PORT = 1999
_CLAIMS: list[socket.socket] = []

# The ports of a pod, as the manager renders them.
ENGINE_PORT, SIDE_CHANNEL_PORT, KV_EVENTS_PORT, KV_EVENTS_ZMQ_PORT = 8000, 5600, 8102, 5557
ROUTER_PORT, ROUTER_ADMIN_PORT = 8000, 8001


def loopback_host() -> str:
    """A loopback address of this session's own (see CLAIM_PORT)."""
    start = random.randrange(1 << 23)
    for i in range(4096):
        n = (127 << 24 | 128 << 16) + (start + i) % (1 << 23)
        ip = socket.inet_ntoa(n.to_bytes(4, "big"))
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind((ip, CLAIM_PORT))
        except OSError as e:
            s.close()
            if e.errno == errno.EADDRINUSE:
                continue  # someone else's
            raise
        _CLAIMS.append(s)
        return ip
    raise RuntimeError("no free loopback host in 4096 tries of 127.128.0.0/9")


def go_binaries(tmp: str) -> str:
    """The agent, router and kv-events binaries: KVHANDOFF_BIN_DIR (make builds them), else built here."""
    d = os.environ.get("KVHANDOFF_BIN_DIR")
    if d:
        return d
    subprocess.run(["go", "build", "-o", tmp + "/", "./cmd/transfer-agent", "./cmd/router", "./cmd/kv-events"], cwd=REPO, check=True)
    return tmp


class Proc:
    def __init__(self, name: str, args: list[str], log_dir: str, env: dict | None = None):
        self.name = name
        self.log_path = os.path.join(log_dir, name + ".log")
        self._log = open(self.log_path, "wb")
        self.p = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                  start_new_session=True)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def records(self) -> list[dict]:
        """The log's JSON records (the Go programs log JSON lines); other lines skipped."""
        out = []
        for line in self.log().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait_until(self, what: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.p.returncode}) before {what}: {self._failure()}")
            if ready():
                return
            time.sleep(0.2)  # polling a process's readiness, which it does not signal
        failure = self._failure()
        self.stop()
        raise RuntimeError(f"{self.name}: no {what} within {timeout:.0f}s: {failure}")

    def _failure(self) -> str:
        """The process's own error first (a vLLM server's log ends with its API server's
        traceback, which says only that the engine failed), then the log's end."""
        log = self.log()
        why = cause(log)
        if not why:
            return "\n" + log[-4000:]
        # The exception's own lines (a pydantic error says what it is on the next) first.
        raised = next(i for i, line in enumerate(why.splitlines()) if _RAISED.match(line))
        headline = " ".join(line.strip() for line in why.splitlines()[raised:])[:600]
        return f"{headline}\n{why}\n--- the log's end ---\n{log[-4000:]}"

    def stop(self) -> None:
        """Ends the process and every process it started (its session's group: vLLM's
        engine core and workers, which hold the GPU's memory until they exit)."""
        if self.p.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.p.wait()
        self._signal(signal.SIGKILL)  # whatever of the group outlived its leader
        self._log.close()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.p.pid, sig)  # start_new_session: the group is the process's
        except ProcessLookupError:
            pass


_TRACEBACK = "Traceback (most recent call last):"
_PREFIX = re.compile(r"^\([\w.-]+ pid=\d+\) ")  # vLLM's "(EngineCore pid=7) " on a child's lines
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")


def cause(log: str) -> str:
    """The first Python traceback in a log, through the exception it ends with and the
    lines that continue its message: the error of the process that failed first ("" when
    there is none)."""
    lines = [_PREFIX.sub("", line) for line in log.splitlines()]
    start = next((i for i, line in enumerate(lines) if _TRACEBACK in line), None)
    if start is None:
        return ""
    j = next((j for j in range(start + 1, len(lines)) if _RAISED.match(lines[j])), None)
    if j is None:
        return "\n".join(lines[start:][-30:])
    end = j + 1
    while end < len(lines) and end - j <= 8 and lines[end].startswith((" ", "\t")):
        end += 1  # the message's own lines, indented
    return "\n".join(lines[max(start, j - 30):end])


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Agent(Proc):
    def __init__(self, bins: str, name: str, d: str):
        os.makedirs(d, exist_ok=True)
        token = os.path.join(d, "token")
        with open(token, "w") as f:
            f.write(TOKEN)
        self.socket = os.path.join(d, "agent.sock")
        super().__init__(name, [os.path.join(bins, "transfer-agent"), "--provider", "tcp;ofi_rxm", "--socket", self.socket,
                                "--peer-listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--peer-token-file", token], d)
        self.peer = self.http = ""
        self.wait_until("serving", self._serving, 60)

    def _serving(self) -> bool:
        for rec in self.records():
            if rec.get("msg") == "serving":
                self.peer = rec["peers"]
            if rec.get("msg") == "http":
                self.http = rec["addr"]
        return bool(self.peer and self.http)

    def metrics(self) -> dict[str, float]:
        out = {}
        with urllib.request.urlopen(f"http://{self.http}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("kvhandoff_agent_"):
                    k, _, v = line.rpartition(" ")
                    out[k] = float(v)
        return out


def kv_config(mode: str, role: str, engine_id: str, socket_path: str, doorbell: bool = True, same_node: bool = False,
              peer_tp: int = 0) -> str:
    """mode push-layered is push with the prefill engine streaming its layers; doorbell
    false keeps reports and events on gRPC; same_node lets GPU KV move (both engines on
    one node, as the manager renders it for sameNode: Allow); peer_tp is the other side's
    tensor-parallel size where it differs (the manager renders it from the other pool)."""
    extra = {"mode": mode.removesuffix("-layered"), "role": role, "socket": socket_path,
             "kv_lease_duration": 30, "push_registration_timeout": 60, "decoder_kv_blocks_ttl": 60, "doorbell": doorbell,
             "same_node": same_node}
    if peer_tp:
        extra["peer_tp_size"] = peer_tp
    if mode == "push-layered" and role == "prefill":
        extra["layer_streaming"] = True
    return json.dumps({
        "kv_connector": "KVHandoffConnector", "kv_connector_module_path": "kvhandoff_vllm.connector",
        "kv_role": "kv_both", "engine_id": engine_id, "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    })


class GPU:
    """Where a GPU engine runs: GPU 0 of the host, a share of its memory (engines share the
    GPU), KV of kv_bytes, prompts up to max_model_len. served: as vLLM is served (its engine
    core in a process of its own, decode steps replayed as full CUDA graphs, the mode vLLM
    names for P/D decode engines; no torch.compile, which takes minutes per engine); else
    eager with the engine core in the API server's process (the tests: quick to start)."""

    def __init__(self, share: float, kv_bytes: int, max_model_len: int, served: bool = False):
        self.share, self.kv_bytes, self.max_model_len, self.served = share, kv_bytes, max_model_len, served

    def flags(self) -> tuple[list[str], dict]:
        """The engine's arguments and environment on this GPU."""
        # A prompt up to max_model_len is computed in one step: one forward for the whole
        # prompt, whose layers push-layered streams as they are computed.
        args = ["--dtype", "bfloat16", "--max-model-len", str(self.max_model_len), "--max-num-batched-tokens", str(self.max_model_len),
                "--gpu-memory-utilization", str(self.share), "--kv-cache-memory-bytes", str(self.kv_bytes)]
        env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
        if self.served:
            args += ["--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})]
        else:
            args += ["--enforce-eager"]
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return args, env


class Engine(Proc):
    """A vLLM OpenAI server on the CPU backend, pinned to one core (tp > 1: all its ranks,
    which take turns; a waiting rank spins); or, with gpu, on a GPU in bf16 (see GPU.served)."""

    def __init__(self, name: str, model: str, log_dir: str, cpu: int, kv: str | None = None, extra: list[str] | None = None,
                 env: dict | None = None, gpu: GPU | None = None, host: str | None = None, tp: int = 1):
        self.host = host or loopback_host()
        self.addr = f"{self.host}:{ENGINE_PORT}"
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(ENGINE_PORT),
                "--host", self.host, "--served-model-name", "m", "--seed", "0"]
        if gpu is None:
            args += ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"]
            cores = "|".join([str(cpu)] * tp)  # every rank on the engine's core: the other engine keeps its own
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cores, **(env or {})}
            if tp > 1:
                args += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
        else:
            flags, gpu_env = gpu.flags()
            args += flags
            env = {**gpu_env, **(env or {})}
        if kv:
            args += ["--kv-transfer-config", kv]
        args += extra or []
        connector = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [connector, env.get("PYTHONPATH"), os.environ.get("PYTHONPATH")]))
        super().__init__(name, args, log_dir, env)
        self.started = time.monotonic()
        self.tp = tp

    def ready(self, timeout: float = 300) -> float:
        self.wait_until("/health", lambda: http_ok(f"http://{self.addr}/health"), timeout)
        return time.monotonic() - self.started


class NixlEngine(Engine):
    """A stock vLLM engine with vLLM's own NIXL connector (on CPUs kv_buffer_device cpu:
    vLLM's CPU backend allows it; with gpu, its KV in GPU memory), its side channel on its
    host's SIDE_CHANNEL_PORT. keep_affinity puts bench/sitecustomize.py on its path, which
    stops NIXL's worker from moving the engine's compute thread to the NUMA node's last core."""

    def __init__(self, name: str, model: str, log_dir: str, cpu: int, connector: str, keep_affinity: bool = False,
                 gpu: GPU | None = None, ucx_threads: int | None = None):
        host = loopback_host()
        kv = {"kv_connector": connector, "kv_role": "kv_both", "kv_buffer_device": "cuda" if gpu else "cpu",
              "engine_id": name + "-0.default"}
        if ucx_threads is not None:
            kv["kv_connector_extra_config"] = {"num_threads": ucx_threads}
        kv = json.dumps(kv)
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE_CHANNEL_PORT), "VLLM_NIXL_SIDE_CHANNEL_HOST": host}
        if keep_affinity:
            env["KVH_BENCH_KEEP_AFFINITY"] = "1"
            env["PYTHONPATH"] = os.path.join(REPO, "vllm-connector", "bench")
        super().__init__(name, model, log_dir, cpu, kv, env=env, host=host, gpu=gpu)


class Procs:
    """The processes of a stack: stopped in reverse order of start, their logs together."""

    procs: list

    def _add(self, p):
        self.procs.append(p)
        return p

    def stop(self):
        for p in reversed(self.procs):
            p.stop()

    def logs(self) -> str:
        """The tail of every process's log, without the engines' metrics scrapes."""
        def tail(p):
            return "\n".join(line for line in p.log().splitlines() if "GET /metrics" not in line)[-4000:]
        return "\n".join(f"--- {p.name}\n{tail(p)}" for p in self.procs)


class NixlStack(Procs):
    """Two stock NIXL engines (prefill on core 0, decode on core 1; with gpu both on GPU 0)
    behind the router."""

    def __init__(self, bins, model, d, mode: str, keep_affinity: bool = False, gpu: GPU | None = None,
                 ucx_threads: int | None = None):
        connector = "NixlPushConnector" if mode == "push" else "NixlConnector"
        self.procs = []
        try:
            self.p = self._add(NixlEngine("prefill", model, d, 0, connector, keep_affinity, gpu, ucx_threads))
            self.d = self._add(NixlEngine("decode", model, d, 1, connector, keep_affinity, gpu, ucx_threads))
            TIMINGS[f"nixl {mode} prefill+decode start (together)"] = max(self.p.ready(), self.d.ready())
            # NIXL's side channels are the engines' own.
            self.r = self._add(Router(bins, d, mode, endpoint(self.p, "prefill", self.p.host, SIDE_CHANNEL_PORT),
                                      [endpoint(self.d, "decode", self.d.host, SIDE_CHANNEL_PORT)]))
        except BaseException:
            self.stop()
            raise


def endpoint(e: Engine, role: str, host: str = "", side: int = 0, index: int = 0) -> dict:
    """A router endpoint for engine e: its KV side channel (host, side) where the prefill
    side of its pair dials it."""
    ep = {"url": f"http://{e.addr}", "engineID": f"{role}-{index}.default", "tensorParallelSize": e.tp}
    if host:
        ep.update(host=host, sideChannelPort=side)
    return ep


class Router(Proc):
    """kvhandoff's router over a prefill and decode endpoints, with static discovery;
    routing and block_size as a KVTransferPolicy's and a DecodePool's."""

    def __init__(self, bins: str, log_dir: str, mode: str, prefill: dict, decodes: list[dict], routing: dict | None = None, block_size: int = 0):
        host = loopback_host()
        self.addr, admin = f"{host}:{ROUTER_PORT}", f"{host}:{ROUTER_ADMIN_PORT}"
        # Engines with a kv-events sidecar: follow them with the pool's token.
        follow = ["--kv-events-token-file", kv_events_token(log_dir)] if any("kvEventsURL" in e for e in [prefill, *decodes]) else []
        endpoints = os.path.join(log_dir, "endpoints.json")
        with open(endpoints, "w") as f:
            s = {"mode": mode.removesuffix("-layered").capitalize(), "prefill": [prefill], "decode": decodes}
            if routing:
                s.update(routing=routing, blockSize=block_size)
            json.dump(s, f)
        self.metrics_url = f"http://{admin}/metrics"
        super().__init__("router", [os.path.join(bins, "router"), "--listen", self.addr, "--admin-listen", admin,
                                    "--endpoints", endpoints, "--scrape-interval", "0", *follow], log_dir)
        self.wait_until("/readyz", lambda: http_ok(f"http://{self.addr}/readyz"), 30)

    def metric(self, name: str) -> float:
        return metric_at(self.metrics_url, name)


def metric_at(url: str, name: str) -> float:
    """The value of the series name (with its labels, as exposed) at url; 0 when absent."""
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            k, _, v = line.rpartition(" ")
            if k == name:
                return float(v)
    return 0.0


def kv_events_args(host: str) -> list[str]:
    """vLLM's flag that publishes its KV cache events to the kv-events sidecar beside it
    (on its host), as the manager renders it."""
    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": f"tcp://{host}:{KV_EVENTS_ZMQ_PORT}", "topic": "kv"})]


def kv_events_token(d: str) -> str:
    """The pool's kv-events token file (the manager's Secret), shared by sidecars and router."""
    path = os.path.join(d, "kv-events-token")
    with open(path, "w") as f:
        f.write(TOKEN)
    return path


class EventsSidecar(Proc):
    """An engine's kv-events sidecar (the kv-events binary) on the engine's
    host, listening for the publisher that engine's kv_events_args names."""

    def __init__(self, bins: str, e: Engine, log_dir: str):
        addr = f"{e.host}:{KV_EVENTS_PORT}"
        super().__init__(e.name + "-kv-events", [os.path.join(bins, "kv-events"), "--served-model=m",
                                                 f"--kv-events-endpoint=tcp://{e.host}:{KV_EVENTS_ZMQ_PORT}", f"--engine={e.addr}",
                                                 "--listen", addr, "--token-file", kv_events_token(log_dir)], log_dir)
        self.url = f"http://{addr}"
        self.wait_until("/healthz", lambda: http_ok(self.url + "/healthz"), 30)

    def metric(self, name: str) -> float:
        return metric_at(self.url + "/metrics", name)


def complete(addr: str, prompt: str, max_tokens: int = 16, timeout: float = 120, min_tokens: int = 0) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": min_tokens, "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(f"http://{addr}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return list(json.load(r)["choices"][0]["token_ids"])


class Stack(Procs):
    """A prefill and a decode engine behind the router. On CPUs each engine has an agent of
    its own (two "nodes" on loopback); with gpu both engines share GPU 0 and one agent (one
    node), which moves their KV with CUDA copies. agents lists the distinct agents."""

    def __init__(self, bins, model, d, mode, decode_extra=None, doorbell=True, gpu: GPU | None = None, decodes: int = 1,
                 routing: dict | None = None, engine_args: list[str] | None = None, kv_events: bool = False,
                 tp: tuple[int, int] = (1, 1)):
        self.procs = []
        try:
            self.a = self._add(Agent(bins, "agent-prefill-node", os.path.join(d, "a")))
            self.b = self.a if gpu else self._add(Agent(bins, "agent-decode-node", os.path.join(d, "b")))
            self.agents = [self.a] if gpu else [self.a, self.b]
            same = gpu is not None
            # kv_events: each engine publishes its KV cache events to a sidecar on its host.
            hosts = {e: loopback_host() for e in ["prefill", *range(decodes)]}
            events = lambda e: kv_events_args(hosts[e]) if kv_events else []
            # tp: the prefill and decode engines' tensor-parallel sizes.
            peer = lambda own, other: other if own != other else 0
            self.p = self._add(Engine("prefill", model, d, 0, kv_config(mode, "prefill", "prefill-0.default", self.a.socket, doorbell, same,
                                                                        peer(tp[0], tp[1])),
                                      (engine_args or []) + events("prefill"), gpu=gpu, host=hosts["prefill"], tp=tp[0]))
            # More decode engines share the decode node's agent and its core.
            self.ds = [self._add(Engine(f"decode-{i}" if i else "decode", model, d, 1,
                                        kv_config(mode, "decode", f"decode-{i}.default", self.b.socket, doorbell, same, peer(tp[1], tp[0])),
                                        (engine_args or []) + (decode_extra or []) + events(i), gpu=gpu, host=hosts[i], tp=tp[1]))
                       for i in range(decodes)]
            self.d = self.ds[0]
            self.sidecars = {e: self._add(EventsSidecar(bins, self.p if e == "prefill" else self.ds[e], d)) for e in hosts} if kv_events else {}
            TIMINGS[f"{mode} prefill+{decodes} decode start (together)"] = max(e.ready() for e in [self.p, *self.ds])
            # For executor Agent a prefill engine's KV side channel is its agent.
            host, _, port = self.a.peer.rpartition(":")
            p = endpoint(self.p, "prefill", host, int(port))
            ds = [endpoint(e, "decode", index=i) for i, e in enumerate(self.ds)]
            for ep, e in zip([p, *ds], self.sidecars):
                ep["kvEventsURL"] = self.sidecars[e].url
            self.r = self._add(Router(bins, d, mode, p, ds, routing, block_size(self.d) if routing else 0))
        except BaseException:
            self.stop()  # nothing outlives a stack that failed to start
            raise


def prompt_tokens(e: Engine, prompt: str) -> int:
    """How many tokens the engine makes of prompt (its /tokenize)."""
    req = urllib.request.Request(f"http://{e.addr}/tokenize", json.dumps({"model": "m", "prompt": prompt}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["count"]


def kv_moved(agents, mode: str) -> float:
    """KV bytes the agents moved in mode: a push's counted once, by the prefill side that
    writes them; a pull's twice, by the decode side that reads them and the prefill side
    whose blocks were read."""
    key = f'kvhandoff_agent_transferred_bytes_total{{mode="{mode}"}}'
    return sum(a.metrics().get(key, 0) for a in agents)


def block_size(e: Engine) -> int:
    """The engine's KV block size in tokens, from its vllm:cache_config_info series."""
    with urllib.request.urlopen(f"http://{e.addr}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:cache_config_info{"):
                return int(line.split('block_size="')[1].split('"')[0])
    raise LookupError(f"{e.name} exports no vllm:cache_config_info")


def next_event(w, key: str, timeout: float = 20, log=lambda: ""):
    """A worker side's next agent event about key (others are skipped): from its session's
    doorbell ring, drained into the queue the event stream feeds, or from that stream."""
    import queue

    deadline = time.monotonic() + timeout
    while True:
        for ev in w.session.poll_events():
            w.session.events.put(ev)
        try:
            ev = w.session.events.get(timeout=0.01)
        except queue.Empty:
            assert time.monotonic() < deadline, f"no event for {key} within {timeout} s{log()}"
            continue
        assert ev is not None, f"the agent ended the session: {w.session.error}"
        if ev.request_id == key:
            return ev


def engine_metric(e: Engine, name: str, label: str = "") -> float:
    """The sum of a vLLM metric's series (vllm:num_preemptions_total, ...), those with
    label (finished_reason="abort", ...) when one is named."""
    total = 0.0
    with urllib.request.urlopen(f"http://{e.addr}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name) and label in line:
                total += float(line.rpartition(" ")[2])
    return total


def until(what: str, ok, timeout: float = 20) -> None:
    """Polls ok until it holds, failing the test after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.01)


def wait_idle(e: Engine, timeout: float = 60) -> None:
    """Waits until an engine runs no request and holds no KV block: a prefill engine's
    blocks are held until its agent is done with them, so after this every source it
    reported has been delivered, declined or failed, and the agent's counters are final."""
    deadline = time.monotonic() + timeout
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    while any(engine_metric(e, n) for n in names):
        if time.monotonic() > deadline:
            busy = {n: engine_metric(e, n) for n in names}
            log = "\n".join(line for line in e.log().splitlines() if "GET /metrics" not in line)
            raise AssertionError(f"{e.name} still busy after {timeout} s: {busy}\n{log[-8000:]}")
        time.sleep(0.1)  # polling the engine's metrics for its last blocks to come back
