"""Sleep and weight updates (vLLM >= 0.33 call unregister_kv_caches before they release or
remap the KV memory, and restore_kv_caches after), and the agent's own restart: against the
real agent, a worker's session ends, whatever it had in flight fails where vLLM looks for
it, and the same KV views register again and move KV as before."""

import signal
import threading
import time

import pytest
import torch

from kvhandoff_vllm._api import agent_pb2 as pb
from kvhandoff_vllm.config import Config
from kvhandoff_vllm.metadata import KVHandoffMetadata, Receive
from kvhandoff_vllm.worker import WorkerSide
from stack import Agent, next_event, until

LAYERS, BLOCKS, BLOCK_BYTES = 2, 32, 512


@pytest.fixture
def agent(bins, tmp_path):
    a = Agent(bins, "agent", str(tmp_path))
    yield a
    a.stop()


def worker(agent: Agent, role: str) -> tuple[WorkerSide, dict]:
    cfg = Config.from_fields(f"{role}-0.default", {"mode": "push", "role": role, "socket": agent.socket,
                                                   "kv_lease_duration": 30, "push_registration_timeout": 60,
                                                   "decoder_kv_blocks_ttl": 60})
    w = WorkerSide(cfg, rank=0, tp_size=1, block_size=16, kv_heads=1, head_dim=BLOCK_BYTES // 32)
    with w.mem_pool_context():  # as vLLM's CPU worker allocates its KV: one int8 buffer
        raw = torch.zeros(LAYERS * BLOCKS * BLOCK_BYTES, dtype=torch.int8)
    layers = raw.view(LAYERS, BLOCKS, BLOCK_BYTES)
    w.register_kv_caches({f"model.layers.{i}.self_attn.attn": layers[i] for i in range(LAYERS)})
    return w, layers


def sessions(agent: Agent) -> float:
    return sum(v for k, v in agent.metrics().items() if k.startswith("kvhandoff_agent_engine_sessions"))


def push(p: WorkerSide, d: WorkerSide, key: str, src: list[int], dst: list[int]) -> None:
    d.session.register_destination(key, 1, dst, p.session.ref)
    p.session.source_ready(key, src)
    assert next_event(d, key).type == pb.Event.DELIVERED


def test_a_worker_unregisters_before_sleep_and_moves_kv_again_after_it(agent):
    p, src = worker(agent, "prefill")
    d, dst = worker(agent, "decode")
    try:
        src.copy_(torch.randint(-128, 127, src.shape, dtype=torch.int8))
        push(p, d, "before", [1, 2], [5, 6])
        assert torch.equal(dst[:, [5, 6]], src[:, [1, 2]])
        assert sessions(agent) == 2

        # A receive vLLM is waiting for when the engine is put to sleep: it fails, both
        # as a failed receive (vLLM >= 0.30) and by its blocks (before).
        d.start_load(KVHandoffMetadata(receives=[Receive(req_id="r-1", key="waiting", blocks=[9, 10],
                                                         source_agent=p.session.ref.agent, source_engine=p.cfg.engine_id)]))
        d.unregister()
        d.unregister()  # idempotent, as vLLM asks
        assert d.session is None
        until("the agent ended the decode session", lambda: sessions(agent) == 1)
        sent, recvd, failed = d.results(set())
        assert (recvd, failed) == ({"r-1"}, {"r-1"})
        assert d.load_errors() == {9, 10} and d.load_errors() == set()

        dst.zero_()  # the memory behind the same views may hold anything after a wake-up
        d.restore()
        d.restore()
        until("the decode engine registered again, once", lambda: sessions(agent) == 2)
        push(p, d, "after", [3, 4], [7, 8])
        assert torch.equal(dst[:, [7, 8]], src[:, [3, 4]])
        assert not dst[:, [5, 6]].any(), "a block nobody pushed to since the wake-up was written"
    finally:
        p.close()
        d.close()


def test_a_receive_that_fails_reports_its_blocks_for_vllm_before_get_transfer_results(agent):
    d, _ = worker(agent, "decode")
    try:
        # The prefill engine named in the parameters does not exist: the pull fails.
        d.start_load(KVHandoffMetadata(receives=[Receive(req_id="r-2", key="gone", blocks=[3, 4, 5],
                                                         source_agent=d.session.ref.agent, source_engine="prefill-9.default",
                                                         src_blocks=[1, 2, 3])]))
        deadline = time.monotonic() + 20
        recvd = failed = set()
        while not recvd and time.monotonic() < deadline:
            _, recvd, failed = d.results(set())
            time.sleep(0.01)
        assert (recvd, failed) == ({"r-2"}, {"r-2"})
        assert d.load_errors() == {3, 4, 5}
    finally:
        d.close()


def test_a_worker_whose_agent_restarted_registers_again_and_moves_kv(agent, bins, tmp_path):
    p, src = worker(agent, "prefill")
    d, dst = worker(agent, "decode")
    restarted = None
    try:
        src.copy_(torch.randint(-128, 127, src.shape, dtype=torch.int8))
        push(p, d, "before", [1, 2], [5, 6])
        d.start_load(KVHandoffMetadata(receives=[Receive(req_id="r-1", key="waiting", blocks=[9, 10],
                                                         source_agent=p.session.ref.agent, source_engine=p.cfg.engine_id)]))

        # The agent dies (its pod deleted, OOM-killed): what the decode rank waited for fails.
        agent._signal(signal.SIGKILL)
        agent.p.wait()
        got = set()

        def failed():
            got.update(d.results(set())[2])
            p.results(set())
            return "r-1" in got
        until("the outstanding receive failed", failed)

        # No agent: a receive fails at once, the step is not held up waiting for one.
        t = time.monotonic()
        d.start_load(KVHandoffMetadata(receives=[Receive(req_id="r-2", key="meanwhile", blocks=[11],
                                                         source_agent=p.session.ref.agent, source_engine=p.cfg.engine_id)]))
        assert d.results(set())[2] == {"r-2"}
        assert time.monotonic() - t < 1, "a step waited for the agent"

        # The agent comes back on the same socket: both ranks register again by themselves,
        # idle, with no step (an engine steps only while it has requests, and its first
        # request after the agent's restart may be one its pair's other engine waits on).
        restarted = Agent(bins, "agent-restarted", str(tmp_path))
        until("both idle ranks registered with the restarted agent", lambda: sessions(restarted) == 2, timeout=30)
        # A step takes the new session once its regions are registered too.
        until("both ranks' steps took their new sessions",
              lambda: p.results(set()) == d.results(set()) == (set(), set(), set()) and p.stats["reconnects"] == d.stats["reconnects"] == 1)
        dst.zero_()
        push(p, d, "after", [3, 4], [7, 8])
        assert torch.equal(dst[:, [7, 8]], src[:, [3, 4]])
    finally:
        p.close()
        d.close()
        if restarted is not None:
            restarted.stop()


def registrations(agent: Agent) -> dict[str, int]:
    """How many times the agent registered each engine rank (its log's records)."""
    out: dict[str, int] = {}
    for rec in agent.records():
        if rec.get("msg") == "engine registered":
            out[rec["engine"]] = out.get(rec["engine"], 0) + 1
    return out


def test_ranks_that_rejoined_before_their_next_step_register_once(bins, tmp_path):
    """The agent restarts while the ranks do not step, and their rejoin threads register
    before a step reads the old session's end: the step takes the new session and starts
    no second rejoin. Each registration of a rank ends its previous session at the agent,
    so one too many would end the session just taken, whose end would start another, for
    as long as the engine runs."""
    d_ = str(tmp_path)
    agent = Agent(bins, "agent", d_)
    p, _ = worker(agent, "prefill")
    d, _ = worker(agent, "decode")
    try:
        agent._signal(signal.SIGKILL)
        agent.p.wait()
        agent = Agent(bins, "agent-restarted", d_)
        # Their sessions registered whole, waiting for a step (the race made certain).
        until("both idle ranks' new sessions ready", lambda: p._replacement is not None and d._replacement is not None, timeout=30)
        until("both ranks' steps took their new sessions",
              lambda: p.results(set()) == d.results(set()) == (set(), set(), set()) and p.stats["reconnects"] == d.stats["reconnects"] == 1)
        taken = (p.session.session, d.session.session)
        for _ in range(20):  # steps for a second, with nothing to do
            p.results(set())
            d.results(set())
            time.sleep(0.05)
        assert (p.session.session, d.session.session) == taken
        assert p.stats["reconnects"] == d.stats["reconnects"] == 1
        assert registrations(agent) == {"prefill-0.default/0": 1, "decode-0.default/0": 1}, agent.log()[-3000:]
        # Nor is a rejoin still trying: the agent refuses a rank whose session is live.
        assert not [t.name for t in threading.enumerate() if t.name == "kvhandoff-rejoin"]
    finally:
        p.close()
        d.close()
        agent.stop()
