"""Engines of different tensor-parallel sizes: each rank exchanges its KV heads with the peer
ranks that hold them, one transfer per rank pair, and vLLM hears of a request once every
pair is over — never while a pair may still write into its blocks."""

import json
import os
import queue

import pytest
import torch

from kvhandoff_vllm import heads
from kvhandoff_vllm._api import agent_pb2 as pb
from kvhandoff_vllm.agent import AgentError
from kvhandoff_vllm.config import Config, ConfigError
from kvhandoff_vllm.memory import is_head_major
from kvhandoff_vllm.metadata import KVHandoffMetadata, Receive, Send
from kvhandoff_vllm.worker import WorkerSide

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "..", "transferagent", "api", "v1", "testdata", "sources.json")


def test_the_connector_pairs_ranks_as_the_agent_does():
    # The Go functions wrote the table (transferagent/api/v1, TestSourcesTable); both sides
    # of a handoff must name the same pairs, or each waits for transfers the other never starts.
    with open(GOLDEN) as f:
        table = json.load(f)
    assert len(table) > 20
    for row in table:
        kv, p, d = row["kvHeads"], row["prefill"], row["decode"]
        assert [heads.sources(kv, p, d, j) for j in range(d)] == row["sources"], row
        assert [heads.destinations(kv, p, d, i) for i in range(p)] == row["destinations"], row


def test_heads_that_neither_split_nor_replicate_are_refused():
    with pytest.raises(heads.ShardError, match="6 KV heads neither split over nor replicate across tensor-parallel size 4"):
        heads.sources(6, 2, 4, 0)


class Agent:
    """A recording session: what the worker asks of the agent; the test plays its events."""

    def __init__(self, refuse: str = ""):
        self.events = queue.Queue()
        self.calls = []
        self.bell = None
        self.ended = False  # the agent never ends it
        self.refuse = refuse
        self.outstanding = set()

    def poll_events(self):
        return []

    def _check(self, key):
        if key == self.refuse:
            raise AgentError(f"RegisterDestination: INVALID_ARGUMENT: {key} refused")
        self.outstanding.add(key)

    def register_destination(self, key, attempt, blocks, source, first=0):
        self.calls.append(("register", key, source.tp_rank, source.tp_size))
        self._check(key)

    def pull(self, key, attempt, source, src, dst):
        self.calls.append(("pull", key, source.tp_rank, source.tp_size))
        self._check(key)

    def source_ready(self, key, blocks):
        self.calls.append(("ready", key))

    def decline(self, key, source):
        self.calls.append(("decline", key, source.tp_rank))

    def cancel(self, key, attempt):
        self.calls.append(("cancel", key))
        return key in self.outstanding

    def heartbeat(self):
        pass


def worker(role: str, tp: int, rank: int, peer: int, kv_heads: int = 8, refuse: str = "") -> WorkerSide:
    cfg = Config.from_fields(f"{role}-0.default", {"mode": "push", "role": role, "peer_tp_size": peer})
    w = WorkerSide(cfg, rank=rank, tp_size=tp, block_size=16, kv_heads=kv_heads, head_dim=4)
    w.session = Agent(refuse)
    return w


def event(w: WorkerSide, key: str, typ):
    w.session.events.put(pb.Event(type=typ, request_id=key, attempt=1))


def receive(key="k", pull=False):
    return Receive(req_id="r", key=key, blocks=[3, 4], source_agent="a:1", source_engine="prefill-0.default",
                   src_blocks=[7, 8] if pull else None)


def test_a_tp2_decode_rank_registers_with_the_one_prefill_rank_holding_its_heads():
    w = worker("decode", tp=2, rank=1, peer=1)
    w.start_load(KVHandoffMetadata(receives=[receive()]))
    assert w.session.calls == [("register", "k#0>1", 0, 1)]
    event(w, "k#0>1", pb.Event.DELIVERED)
    assert w.results(set()) == (set(), {"r"}, set())


def test_a_tp1_decode_rank_is_delivered_once_both_prefill_ranks_have_written():
    for pull in (False, True):
        w = worker("decode", tp=1, rank=0, peer=2)
        w.start_load(KVHandoffMetadata(receives=[receive(pull=pull)]))
        call = "pull" if pull else "register"
        assert w.session.calls == [(call, "k#0>0", 0, 2), (call, "k#1>0", 1, 2)]
        event(w, "k#1>0", pb.Event.DELIVERED)
        assert w.results(set()) == (set(), set(), set()), "half the heads arrived"
        event(w, "k#0>0", pb.Event.DELIVERED)
        assert w.results(set()) == (set(), {"r"}, set())
        assert w.stats["delivered"] == 1


def test_one_pair_failing_cancels_the_other_and_the_blocks_wait_for_it():
    w = worker("decode", tp=1, rank=0, peer=2)
    w.start_load(KVHandoffMetadata(receives=[receive()]))
    event(w, "k#0>0", pb.Event.FAILED)
    assert w.results(set()) == (set(), set(), set()), "the other pair may still be writing into the blocks"
    assert ("cancel", "k#1>0") in w.session.calls
    event(w, "k#1>0", pb.Event.CANCEL_ACKED)
    assert w.results(set()) == (set(), {"r"}, {"r"})
    assert w.stats["failed"] == 1 and w.stats["delivered"] == 0


def test_a_refused_registration_ends_the_request_without_waiting_for_pairs_never_made():
    w = worker("decode", tp=1, rank=0, peer=4, refuse="k#1>0")
    w.start_load(KVHandoffMetadata(receives=[receive()]))
    # The first pair was registered and is cancelled; the others were never made.
    assert [c[:2] for c in w.session.calls] == [("register", "k#0>0"), ("register", "k#1>0"), ("cancel", "k#0>0"),
                                                ("cancel", "k#2>0"), ("cancel", "k#3>0")]
    assert w.results(set()) == (set(), set(), set())
    event(w, "k#0>0", pb.Event.CANCEL_ACKED)
    assert w.results(set()) == (set(), {"r"}, {"r"})


def test_cancels_and_declines_reach_every_pair():
    w = worker("decode", tp=1, rank=0, peer=2)
    w.start_load(KVHandoffMetadata(receives=[receive()]))
    w.session.calls.clear()
    w.start_load(KVHandoffMetadata(cancels=[("r", "k")]))
    assert w.session.calls == [("cancel", "k#0>0"), ("cancel", "k#1>0")]
    from kvhandoff_vllm.metadata import Decline
    w.session.calls.clear()
    w.start_load(KVHandoffMetadata(declines=[Decline(key="d", source_agent="a:1", source_engine="prefill-0.default")]))
    assert w.session.calls == [("decline", "d#0>0", 0), ("decline", "d#1>0", 1)]


def test_a_prefill_rank_reports_to_every_decode_rank_it_feeds_and_is_sent_once_all_took_it():
    w = worker("prefill", tp=1, rank=0, peer=2)
    w.start_load(KVHandoffMetadata(sends=[Send(req_id="r", key="k", blocks=[1, 2])]))
    assert w.session.calls == [("ready", "k#0>0"), ("ready", "k#0>1")]
    event(w, "k#0>1", pb.Event.SOURCE_DONE)
    assert w.results({"r"})[0] == set()
    event(w, "k#0>0", pb.Event.SOURCE_DONE)
    assert w.results(set())[0] == {"r"}

    w = worker("prefill", tp=4, rank=3, peer=2)
    w.start_load(KVHandoffMetadata(sends=[Send(req_id="r", key="k", blocks=[1, 2])]))
    assert w.session.calls == [("ready", "k#3>1")]


def test_equal_sizes_keep_the_request_key():
    w = worker("decode", tp=2, rank=1, peer=0)
    w.start_load(KVHandoffMetadata(receives=[receive()]))
    assert w.session.calls == [("register", "k", 1, 0)]


def test_an_engine_whose_heads_cannot_pair_with_its_peers_stops_at_start():
    with pytest.raises(RuntimeError, match=r"tensor-parallel size is 2 and its peers' \(peer_tp_size\) 4, and 6 KV heads neither split"):
        worker("decode", tp=2, rank=0, peer=4, kv_heads=6)
    worker("decode", tp=2, rank=0, peer=4, kv_heads=1)  # one head, replicated on every rank


def test_peer_tp_size_is_checked():
    for bad in (-1, "2", True, 2000):
        with pytest.raises(ConfigError, match="kv_connector_extra_config.peer_tp_size"):
            Config.from_fields("e", {"mode": "pull", "role": "decode", "peer_tp_size": bad})


def test_head_major_blocks_are_told_from_their_strides():
    blocks, hds, bs, hd = 5, 4, 16, 8
    cpu = torch.zeros(blocks, hds, bs, 2 * hd)  # vLLM's CPU backend: a block is its heads in turn
    assert is_head_major(cpu, hds)
    nhd = torch.zeros(2, blocks, bs, hds, hd)[0]  # FlashAttention's default: tokens, then heads
    assert not is_head_major(nhd, hds)
    hnd = torch.zeros(2, blocks, hds, bs, hd).permute(0, 1, 3, 2, 4)[0]  # VLLM_KV_CACHE_LAYOUT=HND
    assert is_head_major(hnd, hds)
    assert is_head_major(nhd, 1), "one head a rank is its whole block"
    square = torch.zeros(blocks, hds, hds, hd)  # block size equal to the heads: the outer one is the heads
    assert is_head_major(square, hds)
