"""What vLLM 0.34 decides from the connector's hooks, in vLLM 0.34's own config code (run in
its venv by `make test-vllm`; test_releases.py checks the hooks of every other release):
GPU KV is created exportable as POSIX fds, the agent's way in, and host KV stays the
connector's own memfd."""

from vllm.config.kv_transfer import KVCacheAccess
from vllm.platforms import current_platform
from vllm.utils.vmm_driver import MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
from vllm.v1.worker.extensible_kv_cache import kv_cache_export_handle_types

from kvhandoff_vllm.connector import KVHandoffConnector
from test_scheduler import scheduler


def test_on_gpus_vllm_creates_the_kv_cache_exportable_as_fds(tiny_model, monkeypatch):
    cfg = scheduler(tiny_model, "push", "decode").vllm_config
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True)
    assert KVHandoffConnector.kv_cache_access(cfg.kv_transfer_config) == KVCacheAccess.EXPORTS_FD
    assert kv_cache_export_handle_types(cfg) & MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def test_on_the_cpu_backend_the_connector_allocates_host_kv_itself(tiny_model):
    cfg = scheduler(tiny_model, "push", "decode").vllm_config
    assert KVHandoffConnector.kv_cache_access(cfg.kv_transfer_config) == KVCacheAccess.IN_PROCESS
    # No extensible KV cache, so the worker enters the connector's memory pool context.
    assert cfg.cache_config.enable_extensible_kv_cache is False
    assert kv_cache_export_handle_types(cfg) == 0

