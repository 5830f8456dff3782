"""Loaded by Python at start-up when make bench-vllm puts this folder on PYTHONPATH with
KVH_BENCH_KEEP_AFFINITY=1 (the "placement undone" NIXL configuration): vLLM's NIXL worker on
the CPU backend moves the engine's compute thread to the last core of its NUMA node
(base_worker.py, "reserve different cores for start_load_kv()"), so on a small machine the
prefill and decode engines end up sharing one core. Here that call keeps the thread where
the engine was placed."""

import os

if os.environ.get("KVH_BENCH_KEEP_AFFINITY") == "1":
    _set = os.sched_setaffinity

    def _keep(pid, cpus):
        if pid == 0:
            return None  # the calling thread stays on the core it was given
        return _set(pid, cpus)

    os.sched_setaffinity = _keep
