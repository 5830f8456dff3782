"""KVHandoffConnector: vLLM's KV handoff through the node's kvhandoff transfer agent.

Load it with --kv-transfer-config '{"kv_connector": "KVHandoffConnector",
"kv_connector_module_path": "kvhandoff_vllm.connector", ...}' (config.py lists the
settings). The scheduler half is scheduler.py, the worker half worker.py.

Supported: vLLM 0.26 through 0.34. The connector keys on the hooks a release has, not on
its version number: each hook below that not every release has says which ones call it.
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

try:  # vLLM >= 0.30 reports failed receives beside finished ones.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM 0.26-0.29: failed receives are reported by their blocks
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
            # vLLM 0.34's extensible KV cache allocates the KV itself (exportable: see
            # kv_cache_access) and refuses a connector's memory pool.
            own_pool = not getattr(vllm_config.cache_config, "enable_extensible_kv_cache", False)
            self._w = WorkerSide(cfg, get_tensor_model_parallel_rank(), tp, vllm_config.cache_config.block_size,
                                 model.get_total_num_kv_heads(), model.get_head_size(), own_pool=own_pool)

    # How vLLM may allocate and remap the KV cache.

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        """vLLM >= 0.34: the agent, another process, maps GPU KV through POSIX fds, so the
        extensible KV cache must be created exportable. Host KV reaches it as a memfd
        the connector allocates (the CPU backend has no extensible KV cache)."""
        from vllm.config.kv_transfer import KVCacheAccess
        from vllm.platforms import current_platform

        return KVCacheAccess.EXPORTS_FD if current_platform.is_cuda() else KVCacheAccess.IN_PROCESS

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """vLLM >= 0.33: sleep and wake call unregister_kv_caches and restore_kv_caches."""
        return True

    # Worker side.

    def get_mem_pool_context(self):
        """vLLM >= 0.31 enters it around the KV allocation (unless its KV cache is
        extensible); before, GPU KV comes from cudaMalloc and is named by IPC handles."""
        return self._w.mem_pool_context()

    def register_kv_caches(self, kv_caches):
        self._w.register_kv_caches(kv_caches)

    def unregister_kv_caches(self):
        """vLLM >= 0.33, before sleep or a weight update that borrows the KV memory."""
        self._w.unregister()

    def restore_kv_caches(self):
        """vLLM >= 0.33, after wake-up or that weight update."""
        self._w.restore()

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
        """vLLM >= 0.30; before, get_finished and get_block_ids_with_load_errors."""
        sent, recvd, failed = self._w.results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recvd, failed_recving=failed)

    def get_block_ids_with_load_errors(self):
        # vLLM < 0.30 learns of a failed receive only from its blocks, in the step that
        # reports it finished; later releases read failed_recving, and the blocks must
        # not be reported twice. Every release calls this each step: it drains them.
        if self._w is None:
            return set()
        blocks = self._w.load_errors()
        return blocks if KVConnectorTransferResults is None else set()

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

    def get_loaded_kv_cache_group_ids(self, request):
        """vLLM >= 0.32: a receive fills every group the request's KV moves in, not only the
        prefix-cacheable ones (vLLM must not zero them)."""
        return self._kv_cache_config.transfer_group_ids

    def update_connector_output(self, connector_output):
        self._s.update_connector_output(connector_output)
