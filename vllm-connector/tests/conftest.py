import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def bins(tmp_path_factory):
    from stack import go_binaries

    return go_binaries(str(tmp_path_factory.mktemp("bin")))


@pytest.fixture(scope="session")
def alone(tiny_model, tmp_path_factory):
    """One engine alone, shared by every test that needs one for the session: the reference
    each P/D answer is held to. Its KV blocks are the CPU backend's 128 tokens; engines of
    other block sizes (the prefix tests' 32) generate the same ids (measured: every prompt,
    cached and not)."""
    from stack import TIMINGS, Engine

    e = Engine("alone", tiny_model, str(tmp_path_factory.mktemp("alone")), cpu=0)
    try:
        TIMINGS["engine start (alone)"] = e.ready()
        yield e
    finally:
        e.stop()


@pytest.fixture(scope="session")
def reference(alone):
    """Each prompt's greedy token ids from the engine alone, one request at a time."""
    from stack import MAX_TOKENS, PROMPTS, complete

    return {p: complete(alone.addr, p, MAX_TOKENS) for p in PROMPTS}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    import tinymodel

    return tinymodel.make(str(tmp_path_factory.mktemp("model")))


def pytest_sessionfinish(session, exitstatus):
    import json
    import time

    from stack import TIMINGS

    path = os.environ.get("KVHANDOFF_VLLM_REPORT")
    if path and TIMINGS:
        with open(path, "w") as f:
            json.dump({"recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "exit_status": int(exitstatus),
                       "timings_s": {k: round(v, 1) for k, v in TIMINGS.items()}}, f, indent=1)
