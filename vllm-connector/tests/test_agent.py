"""The connector's registration with the node's agent."""

import grpc
import pytest

from kvhandoff_vllm._api import agent_pb2 as pb
from kvhandoff_vllm.agent import _register


class _Refused(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "agent not ready: no provider yet"


class _StartingAgent:
    """Answers UNAVAILABLE to its first `refuse` registrations, as a restarted agent does
    before its provider and pod cache are up."""

    def __init__(self, refuse, code=grpc.StatusCode.UNAVAILABLE):
        self.refuse, self.code, self.calls = refuse, code, 0

    def RegisterEngine(self, request, timeout, wait_for_ready):
        self.calls += 1
        assert wait_for_ready and timeout > 0
        if self.calls <= self.refuse:
            raise _Refused(self.code)
        return pb.RegisterEngineResponse(session="s")


def test_an_engine_waits_for_an_agent_that_is_not_ready_yet():
    agent = _StartingAgent(refuse=3)
    assert _register(agent, pb.RegisterEngineRequest(engine_id="e"), timeout=10).session == "s"
    assert agent.calls == 4


def test_an_agent_never_ready_is_reported_once_the_timeout_passes():
    agent = _StartingAgent(refuse=1 << 30)
    with pytest.raises(grpc.RpcError) as e:
        _register(agent, pb.RegisterEngineRequest(engine_id="e"), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and agent.calls > 1


def test_a_refusal_for_a_reason_is_not_retried():
    agent = _StartingAgent(refuse=1, code=grpc.StatusCode.PERMISSION_DENIED)
    with pytest.raises(grpc.RpcError):
        _register(agent, pb.RegisterEngineRequest(engine_id="e"), timeout=10)
    assert agent.calls == 1
