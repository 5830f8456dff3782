"""Writes the KV event batches the Go tests decode, with vLLM's own classes and encoder
(vllm.distributed.kv_events, msgspec), as vLLM's publisher sends them. Run with the
test venv's python: python gen.py."""

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

enc = msgspec.msgpack.Encoder()
ids = list(range(100, 164))  # two blocks of 32
batch = EventBatch(ts=1.5, events=[
    BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=ids, block_size=32, lora_id=None, medium="GPU",
                lora_name=None, extra_keys=[("s1",), None], group_idx=0, kv_cache_spec_kind="full_attention"),
    BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=list(range(200, 232)), block_size=32, lora_id=None,
                medium="GPU", lora_name=None),
    BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=ids[:32], block_size=32, lora_id=1,
                medium="GPU", lora_name="adapter", extra_keys=[("adapter",)]),
    BlockRemoved(block_hashes=[13], medium="GPU"),
    AllBlocksCleared(),
], data_parallel_rank=0)
open("batch-array.msgpack", "wb").write(enc.encode(batch))
# Releases after 0.34 encode the batch as a map.
as_map = {"ts": 1.5, "events": batch.events, "data_parallel_rank": 0}
open("batch-map.msgpack", "wb").write(enc.encode(as_map))
