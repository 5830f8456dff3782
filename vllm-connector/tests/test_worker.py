"""The worker side's bookkeeping of layer-streamed sends, against a recording session:
vLLM must hear a send finished exactly when it holds the request's blocks — never for a
request it already forgot (its scheduler asserts the request exists, and the engine dies)."""

import queue

from kvhandoff_vllm._api import agent_pb2 as pb
from kvhandoff_vllm.agent import AgentError
from kvhandoff_vllm.config import Config
from kvhandoff_vllm.metadata import KVHandoffMetadata, Send, Stream
from kvhandoff_vllm.worker import WorkerSide


class RecordingSession:
    """What the worker calls on the agent, recorded; the test plays the agent's events."""

    def __init__(self):
        self.events = queue.Queue()
        self.calls = []
        self.bell = None  # gRPC's path: reports go through the sender thread
        self.ended = False  # the agent never ends it

    def poll_events(self):
        return []

    def source_regions_ready(self, key, blocks, first, count, final):
        self.calls.append(("layer", key, first, final))

    def source_ready(self, key, blocks):
        self.calls.append(("ready", key))
        if key.startswith("refused"):
            raise AgentError("SourceReady: INVALID_ARGUMENT: block_ids: refused")

    def cancel(self, key, attempt):
        self.calls.append(("cancel", key))
        return True

    def heartbeat(self):
        pass


def worker(layer_streaming: bool = True) -> WorkerSide:
    cfg = Config.from_fields("prefill-0.default", {"mode": "push", "role": "prefill", "layer_streaming": layer_streaming})
    w = WorkerSide(cfg, rank=0, tp_size=1, block_size=16, kv_heads=1, head_dim=1)
    w.session = RecordingSession()
    w._region_of, w._regions = {"layer.0": [0], "layer.1": [1]}, 2
    return w


def step(w: WorkerSide, meta: KVHandoffMetadata, finished=()):
    w.start_load(meta)
    for name in ("layer.0", "layer.1"):
        w.save_layer(meta, name)
    w.save(meta)
    return w.results(set(finished))


def done(w: WorkerSide, key: str, typ=pb.Event.SOURCE_DONE):
    w.session.events.put(pb.Event(type=typ, request_id=key, attempt=1))


def flush(w: WorkerSide):
    w._outbox.put(None)
    w._sender.join(timeout=10)


def test_a_streamed_request_vllm_holds_is_reported_once_it_finished():
    w = worker()
    s = Stream(req_id="r1", key="t-1", blocks=[4, 5])
    step(w, KVHandoffMetadata(streams=[s]))
    flush(w)
    assert w.session.calls == [("layer", "t-1", 0, False), ("layer", "t-1", 1, True)]
    done(w, "t-1")  # the agent is done before the scheduler finished the request
    assert step(w, KVHandoffMetadata())[0] == set()
    sent, _, _ = step(w, KVHandoffMetadata(sends=[Send(req_id="r1", key="t-1", blocks=[4, 5], streamed=True)]), finished={"r1"})
    assert sent == {"r1"} and ("ready", "t-1") not in w.session.calls


def test_an_aborted_streamed_request_is_never_reported_to_vllm():
    for event_first in (True, False):
        w = worker()
        step(w, KVHandoffMetadata(streams=[Stream(req_id="r2", key="t-2", blocks=[4])]))
        if event_first:
            done(w, "t-2", pb.Event.FAILED)
            step(w, KVHandoffMetadata())
        # vLLM aborted it before it finished: it freed the blocks and forgot the request.
        sent, _, _ = step(w, KVHandoffMetadata(cancels=[("r2", "t-2")]), finished={"r2"})
        if not event_first:
            done(w, "t-2", pb.Event.FAILED)
        for _ in range(2):
            sent |= step(w, KVHandoffMetadata(), finished={"r2"})[0]
        assert sent == set(), f"event first {event_first}: vLLM told a forgotten request finished sending"
        assert ("cancel", "t-2") in w.session.calls and not w._sent and not w._streaming and not w._keys


def test_without_layer_streaming_a_prompt_is_reported_whole_in_the_step_that_computed_it():
    w = worker(layer_streaming=False)
    step(w, KVHandoffMetadata(streams=[Stream(req_id="r1", key="t-1", blocks=[4, 5])]))
    flush(w)
    assert w.session.calls == [("ready", "t-1")]  # once, whole, before vLLM finished it
    done(w, "t-1")
    sent, _, _ = step(w, KVHandoffMetadata(sends=[Send(req_id="r1", key="t-1", blocks=[4, 5], streamed=True)]), finished={"r1"})
    assert sent == {"r1"} and w.session.calls == [("ready", "t-1")]


def test_a_refused_report_frees_the_blocks_once_vllm_holds_them():
    w = worker(layer_streaming=False)
    step(w, KVHandoffMetadata(streams=[Stream(req_id="r3", key="refused-3", blocks=[4])]))
    flush(w)
    # The agent kept nothing of it and will never answer: the send is over, reported to
    # vLLM only once it finished the request.
    assert step(w, KVHandoffMetadata())[0] == set()
    sent, _, _ = step(w, KVHandoffMetadata(sends=[Send(req_id="r3", key="refused-3", blocks=[4], streamed=True)]), finished={"r3"})
    assert sent == {"r3"} and not w._keys and not w._streaming
