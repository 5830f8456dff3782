"""The connector's scheduler side inside vLLM's real Scheduler: which requests wait for
KV, what the workers are told, and when blocks are freed."""

import itertools
import json

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.utils.hashing import sha256

from kvhandoff_vllm.metadata import Handshake

BLOCK = 16
EOS = 2
_INDEXED = "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__
_ids = itertools.count(1)


def scheduler(model: str, mode: str, role: str, num_blocks: int = 100, **extra) -> Scheduler:
    cfg = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVHandoffConnector", kv_connector_module_path="kvhandoff_vllm.connector",
            kv_role="kv_both", engine_id=f"{role}-0.default",
            kv_connector_extra_config={"mode": mode, "role": role, "kv_lease_duration": 30, **extra}),
        device_config=DeviceConfig("cpu"),
    )
    cfg.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    return Scheduler(vllm_config=cfg, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(cfg),
                     block_size=BLOCK, log_stats=False)


def request(tokens: int, params: dict, max_tokens: int = 8, prompt: list[int] | None = None) -> Request:
    init_none_hash(sha256)
    n = next(_ids)
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, EOS)
    r = Request(request_id=f"req-{n}", prompt_token_ids=prompt or [(n * 7 + i) % 900 + 3 for i in range(tokens)],
                sampling_params=sp, pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    r.kv_transfer_params = dict(params)
    return r


def output(reqs, token=5, sending=None, recving=None, failed=None) -> ModelRunnerOutput:
    ids = [r.request_id for r in reqs]
    kv = None
    if sending or recving or failed:
        kv = KVConnectorOutput(finished_sending=sending, finished_recving=recving, failed_recving=failed or set())
    index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if _INDEXED else {}  # vLLM < 0.34 takes it
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[token] for _ in ids], kv_connector_output=kv, **index)


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.free_block_queue.num_free_blocks


PUSH_DECODE = dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id="prefill-0.default",
                   remote_host="198.18.0.7", remote_port=7470, tp_size=1, pp_size=1,
                   remote_request_id="client-1", transfer_id="t-1")


def test_push_decode_waits_for_the_agent_then_computes_only_the_last_token(tiny_model):
    s = scheduler(tiny_model, "push", "decode")
    r = request(40, PUSH_DECODE)
    s.add_request(r)
    out = s.schedule()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (recv,) = out.kv_connector_metadata.receives
    blocks = s.kv_cache_manager.get_block_ids(r.request_id)[0]
    assert (recv.key, recv.source_agent, recv.source_engine, recv.src_blocks) == ("t-1", "198.18.0.7:7470", "prefill-0.default", None)
    assert recv.blocks == blocks and len(blocks) == 3  # 40 tokens in 16-token blocks
    # Nothing runs until the worker reports the KV landed.
    assert not s.schedule().num_scheduled_tokens
    s.update_from_output(s.schedule(), output([], recving={r.request_id}))
    out = s.schedule()
    # 39 tokens came over; the last prompt token is computed here, for its logits.
    assert out.num_scheduled_tokens == {r.request_id: 1}


def test_the_timeline_marks_a_decode_request_from_arrival_to_its_second_step(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("KVHANDOFF_TIMELINE", str(tmp_path))
    s = scheduler(tiny_model, "push", "decode")
    r = request(40, PUSH_DECODE)
    s.add_request(r)
    s.schedule()
    s.schedule()  # still waiting: asked again, marked once
    s.update_from_output(s.schedule(), output([], recving={r.request_id}))
    for _ in range(3):  # its first step, the step after, and one more that marks nothing
        out = s.schedule()
        assert out.num_scheduled_tokens.get(r.request_id)
        s.update_from_output(out, output([r]))
    (f,) = tmp_path.glob("*.jsonl")
    marks = [json.loads(line) for line in f.read_text().splitlines()]
    assert [m["ev"] for m in marks] == ["arrived", "allocated", "resumed", "scheduled", "stepped"]
    assert {m["key"] for m in marks} == {"t-1"}
    assert [m["t"] for m in marks] == sorted(m["t"] for m in marks)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_prompt_whose_prefix_is_cached_here_brings_only_the_tail(tiny_model, mode):
    s = scheduler(tiny_model, mode, "decode")
    seen = request(40, {}, max_tokens=1)
    s.add_request(seen)
    out = s.schedule()
    cached = s.kv_cache_manager.get_block_ids(seen.request_id)[0][:2]
    s.update_from_output(out, output([seen]))  # its prompt's two full blocks are cached now
    params = PUSH_DECODE if mode == "push" else dict(PUSH_DECODE, transfer_id=None, remote_block_ids=[11, 12, 13])
    r = request(40, params, prompt=list(seen.prompt_token_ids))
    s.add_request(r)
    out = s.schedule()
    # The cached 32 tokens are this engine's own blocks; only the third block (positions
    # 32..39) waits for KV: registered (push) or read from the prefill's third (pull).
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = out.kv_connector_metadata
    assert not meta.declines
    (recv,) = meta.receives
    blocks = s.kv_cache_manager.get_block_ids(r.request_id)[0]
    assert blocks[:2] == cached and recv.blocks == blocks[2:] and recv.first == 2
    assert recv.src_blocks == (None if mode == "push" else [13])
    s.update_from_output(s.schedule(), output([], recving={r.request_id}))
    assert s.schedule().num_scheduled_tokens == {r.request_id: 1}


def test_pull_decode_reads_the_prefill_blocks_named_in_the_parameters(tiny_model):
    s = scheduler(tiny_model, "pull", "decode")
    r = request(33, dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id="prefill-0.default",
                         remote_host="198.18.0.7", remote_port=7470, remote_block_ids=[11, 12, 13],
                         remote_request_id="p-req-9", tp_size=1))
    s.add_request(r)
    (recv,) = s.schedule().kv_connector_metadata.receives
    assert (recv.key, recv.src_blocks) == ("p-req-9", [11, 12, 13])
    assert recv.blocks == s.kv_cache_manager.get_block_ids(r.request_id)[0]


def test_bad_parameters_fail_the_receive_naming_the_field(tiny_model):
    s = scheduler(tiny_model, "pull", "decode")
    r = request(20, dict(do_remote_prefill=True, remote_engine_id="p", remote_port=1, remote_block_ids=[1, 2], remote_request_id="x"))
    s.add_request(r)
    (recv,) = s.schedule().kv_connector_metadata.receives
    assert "remote_host" in recv.error


def test_an_abort_while_kv_is_on_its_way_cancels_and_frees_only_after_the_agent_answers(tiny_model):
    s = scheduler(tiny_model, "push", "decode")
    before = free_blocks(s)
    r = request(40, PUSH_DECODE)
    s.add_request(r)
    s.update_from_output(s.schedule(), output([]))
    held = free_blocks(s)
    assert held == before - 3
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert out.kv_connector_metadata.cancels == [(r.request_id, "t-1")]
    assert free_blocks(s) == held  # the agent has not acknowledged: writes may still land
    s.update_from_output(out, output([], recving={r.request_id}, failed={r.request_id}))
    assert free_blocks(s) == before and not s.requests


def prefill_to_end(s: Scheduler, r: Request):
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {r.request_id: r.num_prompt_tokens}
    return s.update_from_output(out, output([r]))


def test_push_prefill_holds_its_blocks_until_the_agent_is_done_with_them(tiny_model, tmp_path, monkeypatch):
    held = tmp_path / "held"
    monkeypatch.setenv("KVHANDOFF_HELD_FILE", str(held))
    s = scheduler(tiny_model, "push", "prefill")
    assert held.read_text() == "0\n"
    before = free_blocks(s)
    r = request(40, dict(do_remote_decode=True, do_remote_prefill=False, transfer_id="t-7"), max_tokens=1)
    prefill_to_end(s, r)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # The drain hook of a terminating engine waits while this says a request holds blocks.
    assert held.read_text() == "1\n"
    out = s.schedule()
    (send,) = out.kv_connector_metadata.sends
    assert (send.req_id, send.key, len(send.blocks)) == (r.request_id, "t-7", 3)
    assert free_blocks(s) == before - 3
    s.update_from_output(out, output([], sending={r.request_id}))
    assert free_blocks(s) == before and not s.requests
    assert held.read_text() == "0\n"


def test_pull_prefill_returns_its_blocks_and_agent_to_the_router(tiny_model):
    s = scheduler(tiny_model, "pull", "prefill")
    s.connector.set_xfer_handshake_metadata({0: Handshake(agent="198.18.2.3:7470", engine_id="prefill-0.default")})
    r = request(20, dict(do_remote_decode=True, do_remote_prefill=False), max_tokens=1)
    outputs = prefill_to_end(s, r)
    (eo,) = [o for client in outputs.values() for o in client.outputs]
    blocks = s.schedule().kv_connector_metadata.sends[0].blocks
    want = dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id="prefill-0.default",
                remote_host="198.18.2.3", remote_port=7470, remote_block_ids=blocks, remote_request_id=r.request_id, tp_size=1)
    # vLLM adds fields of its own (remote_prefill_cached_tokens); ours must all be there.
    assert {k: eo.kv_transfer_params.get(k) for k in want} == want


def test_an_aborted_push_prefill_cancels_at_the_agent_and_frees_at_once(tiny_model):
    s = scheduler(tiny_model, "push", "prefill")
    before = free_blocks(s)
    r = request(40, dict(do_remote_decode=True, do_remote_prefill=False, transfer_id="t-8"), max_tokens=1)
    s.add_request(r)
    computing = s.schedule()
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    meta = s.schedule().kv_connector_metadata
    assert meta.cancels == [(r.request_id, "t-8")] and not meta.sends
    # vLLM >= 0.34 takes the blocks back once the step computing into them is over; the
    # connector holds none of them.
    s.update_from_output(computing, output([]))
    assert free_blocks(s) == before


@pytest.mark.parametrize("extra,field", [
    ({"mode": "both", "role": "decode"}, "mode"),
    ({"mode": "push", "role": "router"}, "role"),
    ({"mode": "push", "role": "decode", "kv_lease_duration": -1}, "kv_lease_duration"),
    ({"mode": "pull", "role": "prefill", "layer_streaming": True}, "layer_streaming"),
    ({"mode": "push", "role": "prefill", "layer_streaming": "yes"}, "layer_streaming"),
    ({"mode": "push", "role": "prefill", "same_node": 1}, "same_node"),
])
def test_invalid_settings_are_refused_naming_the_field(extra, field):
    from kvhandoff_vllm.config import Config, ConfigError

    with pytest.raises(ConfigError, match=field):
        Config.from_fields("e", extra)


@pytest.mark.parametrize("layer_streaming", [True, False])
def test_push_prefill_hands_a_whole_prompt_to_the_workers_in_its_step(tiny_model, layer_streaming):
    s = scheduler(tiny_model, "push", "prefill", layer_streaming=layer_streaming)
    r = request(40, dict(do_remote_decode=True, do_remote_prefill=False, transfer_id="t-9"), max_tokens=1)
    s.add_request(r)
    out = s.schedule()
    # In the step that computes the prompt: each layer can go as it is computed, or the
    # whole prompt once the forward is over.
    (stream,) = out.kv_connector_metadata.streams
    assert (stream.key, stream.blocks) == ("t-9", s.kv_cache_manager.get_block_ids(r.request_id)[0][:3])
    s.update_from_output(out, output([r]))
    (send,) = s.schedule().kv_connector_metadata.sends
    assert send.streamed and send.key == "t-9"  # the worker reported it already


def test_a_prompt_computed_in_chunks_is_reported_whole_when_it_finishes(tiny_model):
    s = scheduler(tiny_model, "push", "prefill", layer_streaming=True)
    r = request(300, dict(do_remote_decode=True, do_remote_prefill=False, transfer_id="t-10"), max_tokens=1)
    s.add_request(r)
    out = s.schedule()  # 256 of 300 tokens: max_num_batched_tokens
    assert out.num_scheduled_tokens == {r.request_id: 256} and not out.kv_connector_metadata.streams
    partial = output([r])
    partial.sampled_token_ids = [[]]  # a partial prefill samples nothing
    s.update_from_output(out, partial)
    out = s.schedule()
    assert out.num_scheduled_tokens == {r.request_id: 44}
    assert not out.kv_connector_metadata.streams
    s.update_from_output(out, output([r]))
    (send,) = s.schedule().kv_connector_metadata.sends
    assert not send.streamed and len(send.blocks) == 19
