"""Per-request timestamps of the handoff as the engine sees it, for finding where P/D time
goes (make bench-vllm reads them beside the router's log and the agents' stage metrics).

Off unless $KVHANDOFF_TIMELINE names a folder; then each process of the engine (the
scheduler and every worker) appends one JSON line per point to a file of its own there:
{"t": wall-clock seconds, "ev": the point, "key": the request's transfer key}. The wall
clock is the one clock every process of a machine shares. The points, in handoff order:

prefill  finished (scheduler: vLLM finished the request and holds its blocks),
         ready_call / ready_done (worker: around the SourceReady call),
         event_source_done (worker: the agent's SOURCE_DONE arrived on the events stream)
decode   arrived (scheduler: first asked about the request, after vLLM's API server),
         declined (scheduler, push: the prompt is cached here; computed here instead),
         allocated (scheduler: blocks allocated for the remote KV),
         load_call / load_done (worker: around the RegisterDestination or Pull call),
         event_delivered (worker: DELIVERED arrived on the events stream),
         drained (worker: the step that reports it to vLLM took it),
         resumed (scheduler: vLLM was told the request's KV is in),
         scheduled (scheduler: the first step that computes it, which samples its first
         token), stepped (scheduler: the step after it)
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV = "KVHANDOFF_TIMELINE"


class Timeline:
    def __init__(self, who: str):
        self._f = None
        d = os.environ.get(ENV)
        if d:
            os.makedirs(d, exist_ok=True)
            self._f = open(os.path.join(d, f"{who}-{os.getpid()}.jsonl"), "a", buffering=1)
            self._lock = threading.Lock()  # the events thread and the engine's both write

    @property
    def on(self) -> bool:
        return self._f is not None

    def mark(self, ev: str, key: str) -> None:
        if self._f is None:
            return
        line = json.dumps({"t": time.time(), "ev": ev, "key": key}) + "\n"
        with self._lock:
            self._f.write(line)
