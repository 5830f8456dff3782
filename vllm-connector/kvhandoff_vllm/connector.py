"""KVHandoffConnector: vLLM's KV handoff through the node's kvhandoff transfer agent.

Load it with --kv-transfer-config '{"kv_connector": "KVHandoffConnector",
"kv_connector_module_path": "kvhandoff_vllm.connector", ...}' (config.py lists the
settings). The scheduler half is scheduler.py, the worker half worker.py.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from .config import Config
from .scheduler import SchedulerSide
from .worker import WorkerSide

try:  # vLLM >= 0.32 reports failed receives beside finished ones.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None


class KVHandoffConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = Config.from_vllm(vllm_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        self._s: SchedulerSide | None = None
        self._w: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._s = SchedulerSide(cfg, tp, vllm_config.cache_config.block_size)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            model = vllm_config.model_config
            self._w = WorkerSide(cfg, get_tensor_model_parallel_rank(), tp, vllm_config.cache_config.block_size,
                                 model.get_total_num_kv_heads(), model.get_head_size())

    # Worker side.

    def get_mem_pool_context(self):
        return self._w.mem_pool_context()

    def register_kv_caches(self, kv_caches):
        self._w.register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self._w.handshake() if self._w else None

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._w.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._w.save_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self):
        self._w.save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids):
        sent, recvd, _ = self._w.results(finished_req_ids)
        return sent or None, recvd or None

    def get_transfer_results(self, finished_req_ids):
        sent, recvd, failed = self._w.results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recvd, failed_recving=failed)

    def shutdown(self):
        if self._w:
            self._w.close()

    # Scheduler side.

    def set_xfer_handshake_metadata(self, metadata) -> None:
        self._s.set_handshake(metadata)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._s.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._s.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._s.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self._s.request_finished(request, block_ids)

    def update_connector_output(self, connector_output):
        self._s.update_connector_output(connector_output)
