"""The test stacks' process handling, which the GPU benchmark relies on: a stopped process
takes every process it started with it (vLLM's engine core and workers hold the GPU's memory
until they exit), a process that fails to start is reported by its own error, and the
benchmark waits for the GPU's memory to come back before the next configuration."""

import json
import os
import stat
import sys

import pytest

from stack import GPU, Engine, Proc, cause, until

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import bench_vllm  # noqa: E402

def test_the_first_traceback_is_the_cause():
    log = """\
(APIServer pid=10) INFO starting
(EngineCore pid=11) Traceback (most recent call last):
(EngineCore pid=11)   File "gpu_worker.py", line 3, in determine_available_memory
(EngineCore pid=11)     raise ValueError("No available memory for the cache blocks.")
(EngineCore pid=11) ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`.
(APIServer pid=10) Traceback (most recent call last):
(APIServer pid=10)   File "api_server.py", line 1, in <module>
(APIServer pid=10) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
    got = cause(log)
    assert got.splitlines()[-1] == "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`."
    assert "Engine core initialization failed" not in got
    assert cause("INFO all good\n") == ""


def test_stopping_a_process_ends_every_process_it_started(tmp_path):
    pid_file = tmp_path / "child"
    p = Proc("parent", ["sh", "-c", f"sleep 600 & echo $! > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; wait"], str(tmp_path))
    p.wait_until("its child", pid_file.exists, 10)
    child = int(pid_file.read_text())
    p.stop()

    def gone() -> bool:
        try:
            os.kill(child, 0)  # still there (or a zombie init has yet to reap)
        except ProcessLookupError:
            return True
        return False
    until("the stopped process's child ended", gone, 10)


def test_an_engine_that_fails_to_start_is_reported_by_its_own_error(tiny_model, tmp_path):
    e = Engine("bad", tiny_model, str(tmp_path), 0, extra=["--max-model-len", "1000000"])
    try:
        with pytest.raises(RuntimeError) as err:
            e.ready(120)
    finally:
        e.stop()
    # vLLM's refusal is the first line, not the end of the log (the API server's teardown).
    first = str(err.value).splitlines()[0]
    assert first.startswith("bad exited (1) before /health: pydantic_core._pydantic_core.ValidationError"), first
    assert "User-specified max_model_len (1000000) is greater than the derived max_model_len" in first, first


def fake_nvidia_smi(tmp_path, start_mib: int, step_mib: int) -> str:
    """An nvidia-smi that answers memory.used from a file, lower by step_mib each call (an
    engine's processes exiting): the CLI the benchmark reads, for a machine without a GPU."""
    state = tmp_path / "used"
    state.write_text(str(start_mib))
    calls = tmp_path / "calls"
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nv=$(cat {state}); echo $v; echo $((v - {step_mib})) > {state}; echo x >> {calls}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path)


def test_the_bench_waits_for_the_gpus_memory_to_come_back(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, 40000, 13000) + os.pathsep + os.environ["PATH"])
    bench_vllm.wait_gpu_freed(baseline_mib=1000, timeout=30)
    # 40000, 27000 and 14000 MiB are still in use; 1000 is the baseline's.
    assert len((tmp_path / "calls").read_text().splitlines()) == 4
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, 40000, 0) + os.pathsep + os.environ["PATH"])
    with pytest.raises(RuntimeError, match="GPU memory still 40000 MiB in use 1 s after the configuration stopped"):
        bench_vllm.wait_gpu_freed(baseline_mib=1000, timeout=1)


def test_nixl_configurations_name_their_ucx_threads():
    assert bench_vllm.ucx_threads("nixl pull") is None
    assert bench_vllm.ucx_threads("nixl pull (0 UCX threads)") == 0
    assert bench_vllm.ucx_threads("nixl push (1 UCX thread)") == 1
    assert bench_vllm.ucx_threads("nixl pull (placement undone)") is None


def test_engine_stages_are_the_means_between_two_scrapes():
    def scrape(ttft_sum, ttft_n, queue_sum, queue_n):
        return (f'vllm:time_to_first_token_seconds_sum{{model_name="m"}} {ttft_sum}\n'
                f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {ttft_n}\n'
                f'vllm:time_to_first_token_seconds_bucket{{le="0.1",model_name="m"}} 99\n'
                f'vllm:request_queue_time_seconds_sum{{model_name="m"}} {queue_sum}\n'
                f'vllm:request_queue_time_seconds_count{{model_name="m"}} {queue_n}\n')
    got = bench_vllm.engine_stages({"decode": scrape(1.0, 2, 0.5, 2)}, {"decode": scrape(1.3, 5, 0.5, 2), "prefill": scrape(0.2, 1, 0.1, 1)})
    # Only what happened between the scrapes counts; a stage with no new requests is left out.
    assert got == {"decode": {"API server: arrival → first token": 100.0},
                   "prefill": {"API server: arrival → first token": 200.0, "engine core: queued → scheduled": 100.0}}


def test_a_served_gpu_engine_replays_decode_steps_as_full_cuda_graphs_in_its_own_engine_process():
    from vllm.config import CompilationConfig, CUDAGraphMode

    served, env = GPU(0.45, 1 << 30, 2048, served=True).flags()
    assert "--enforce-eager" not in served and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    # vLLM takes the configuration as written: no compilation, full graphs for decode only.
    cc = CompilationConfig(**json.loads(served[served.index("--compilation-config") + 1]))
    assert (cc.mode, cc.cudagraph_mode) == (0, CUDAGraphMode.FULL_DECODE_ONLY)
    eager, env = GPU(0.45, 1 << 30, 2048).flags()
    assert "--enforce-eager" in eager and "--compilation-config" not in eager and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_gpu_names_for_result_files():
    assert bench_vllm.gpu_name("NVIDIA H100 80GB HBM3") == "h100"
    assert bench_vllm.gpu_name("NVIDIA H200") == "h200"
    assert bench_vllm.gpu_name("Some Card") == "gpu"


def test_the_sweep_plot_draws_each_configuration_at_each_of_its_rates():
    sweep = {
        "kvhandoff push": {2.0: {"ttft_ms": {"p50": 500, "p90": 900}}, 4.0: {"ttft_ms": {"p50": 700, "p90": 1500}},
                           8.0: {"ttft_ms": {"p50": 2000, "p90": 4000}}},
        # A configuration that did not run at every rate is drawn where it ran.
        "nixl push": {2.0: {"ttft_ms": {"p50": 800, "p90": 1200}}, 8.0: {"ttft_ms": {"p50": 3000, "p90": 5000}}},
    }
    svg = bench_vllm.sweep_svg(sweep, "TTFT against QPS")
    lines = [ln for ln in svg.splitlines() if ln.startswith("<polyline")]
    # p50 solid and p90 dashed for each configuration, one point per rate it ran at.
    points = [ln.split('points="')[1].split('"')[0].split() for ln in lines]
    assert [len(p) for p in points] == [3, 3, 2, 2]
    assert sum('stroke-dasharray="5,4"' in ln for ln in lines) == 2
    # The rates along the x axis in order, the highest p90 within the y axis.
    ticks = [ln for ln in svg.splitlines() if 'text-anchor="middle">' in ln and ln.endswith("</text>") and "QPS" not in ln and "TTFT" not in ln]
    assert [t.rsplit(">", 2)[1].split("<")[0] for t in ticks] == ["2", "4", "8"]
    ys = [float(xy.split(",")[1]) for p in points for xy in p]
    assert min(ys) >= 40  # the plot's top margin: 5000 ms is below the axis's top
    assert "kvhandoff push" in svg and "nixl push" in svg and svg.rstrip().endswith("</svg>")


def test_the_timeline_splits_pulls_wait_at_the_router(tmp_path):
    # One pull request: prefill finished at 10.0 s; the router had the response 30 ms later
    # (its prefill leg, sent as the client's request came in at 9.5 s, took 530 ms); the
    # decode engine's scheduler had the decode leg 20 ms after that.
    (tmp_path / "tl").mkdir()
    (tmp_path / "tl" / "prefill-0.default-scheduler-1.jsonl").write_text(json.dumps({"t": 10.0, "ev": "finished", "key": "k"}) + "\n")
    (tmp_path / "tl" / "decode-0.default-scheduler-2.jsonl").write_text(json.dumps({"t": 10.05, "ev": "arrived", "key": "k"}) + "\n")
    (tmp_path / "router.log").write_text("not JSON\n" + json.dumps({"msg": "request", "request_id": "r", "transfer_id": "k", "prefill_ms": 530.0}) + "\n")
    cfg = bench_vllm.Config("kvhandoff pull", [], "", router_log=str(tmp_path / "router.log"), timeline=str(tmp_path / "tl"))
    got = bench_vllm.timeline(cfg, [{"error": None, "ttft": 0.6, "id": "r", "sent": 9.5}], [{"ttft": 0.5}])
    ms = {k: round(v["p50"]) for k, v in got.items()}
    assert ms["pull: prefill finished → decode at the scheduler"] == 50
    assert ms["pull: prefill finished → the router has its response"] == 30
    assert ms["pull: the router has the response → decode at the scheduler"] == 20
    assert ms["TTFT − the engine alone's, same request"] == 100
