"""The connector's doorbell against the real agent: reports written into the shared ring
reach it, in order and across the ring's end, and its answers come back through the
events ring."""

import signal
import time

import pytest

from kvhandoff_vllm import doorbell
from kvhandoff_vllm._api import agent_pb2 as pb
from kvhandoff_vllm.agent import AgentError, Session
from stack import Agent


@pytest.fixture
def agent(bins, tmp_path):
    a = Agent(bins, "agent", str(tmp_path))
    yield a
    a.stop()


def session(agent: Agent, role=pb.ROLE_PREFILL, **kw) -> Session:
    return Session(agent.socket, pb.RegisterEngineRequest(
        engine_id="engine-0.default", role=role, mode=pb.MODE_PULL, tp_rank=0, tp_size=1,
        layout=pb.KVLayout(layers=1, block_size=16, kv_heads=1, head_dim=1, dtype_bytes=2)), **kw)


def collect(s: Session, n: int, timeout: float = 30) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += s.poll_events()
        time.sleep(0.001)  # polling the ring, as the engine does at each step
    return got


def test_reports_cross_the_ring_and_the_agents_answers_come_back_through_it(agent):
    s = session(agent, doorbell=True)
    try:
        assert s.bell is not None, "the agent took no doorbell"
        # No region is registered, so the agent refuses every report, each with a FAILED
        # event naming it: 60 reports of 12k blocks (about 36 KB each) wrap the 1 MiB ring.
        keys = [f"big-{i}" for i in range(60)]
        for k in keys:
            s.source_ready(k, list(range(100000, 112000)))
        got = collect(s, len(keys))
        assert [e.request_id for e in got] == keys
        assert all(e.type == pb.Event.FAILED for e in got), got[0]
        assert s.events.empty(), "an event came by the stream while the doorbell was attached"
        assert agent.metrics()['kvhandoff_agent_refused_total{call="doorbell",code="FailedPrecondition"}'] == len(keys)
    finally:
        s.close()


def test_a_pull_crosses_the_ring_and_its_refusal_comes_back_for_its_attempt(agent):
    s = session(agent, role=pb.ROLE_DECODE, doorbell=True)
    try:
        assert s.bell is not None
        src = pb.EngineRef(agent="127.0.0.1:1", engine_id="prefill-0.default", tp_rank=0)
        s.pull("p-1", 7, src, [1, 2], [3])  # one destination block for two sources
        (ev,) = collect(s, 1)
        assert (ev.type, ev.request_id, ev.attempt) == (pb.Event.FAILED, "p-1", 7)
        assert "destination_block_ids" in ev.reason, ev.reason
    finally:
        s.close()


def test_without_the_doorbell_reports_go_by_rpc(agent):
    s = session(agent, doorbell=False)
    try:
        assert s.bell is None
        with pytest.raises(Exception, match="SourceReady"):
            s.source_ready("k", [100000])
    finally:
        s.close()


def test_a_record_too_large_for_the_ring_goes_by_rpc(agent):
    s = session(agent, doorbell=True)
    try:
        blocks = list(range(2**21, 2**21 + doorbell.MAX_RECORD // 2))  # 4-byte varints: twice MAX_RECORD
        with pytest.raises(Exception, match="SourceReady"):
            s.source_ready("huge", blocks)
    finally:
        s.close()


def test_a_report_after_the_agent_is_gone_is_refused_not_raised_as_a_broken_pipe(agent):
    # Found with real vLLM engines as pods: their agent pod deleted, the next report's ring
    # of the bell raised BrokenPipeError out of the model runner, and vLLM's engine core died.
    s = session(agent, doorbell=True)
    try:
        assert s.bell is not None
        agent._signal(signal.SIGKILL)
        agent.p.wait()
        with pytest.raises(AgentError, match="the agent is gone"):
            s.source_ready("after", [1])
    finally:
        s.close()
