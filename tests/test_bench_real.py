"""The real pipeline benchmark's pieces that need no engine: reading vLLM's /metrics, CPU of process
trees from /proc, the sampler's window figures, and the job config both modes share. The run itself
(vLLM, SWE tasks, sandboxes, grading) is tested in test_vllm_server.py, beside the module's server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from jobs import run_with_progress

from rollway.bench.real import (
    CpuMeter,
    RealBenchConfig,
    Sampler,
    descendants,
    proc_table,
    real_run_config,
)
from rollway.config.run import load_config
from rollway.policies.vllm import parse_metrics

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e+09
"""


def test_parse_metrics_reads_named_series_and_ignores_the_rest():
    got = parse_metrics(METRICS, ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                  "vllm:generation_tokens_total", "vllm:absent"))
    assert got == {"vllm:num_requests_running": 3.0, "vllm:num_requests_waiting": 1.0,
                   "vllm:generation_tokens_total": 1234.0, "vllm:absent": 0.0}


def test_descendants_of_a_process_tree_without_the_excluded_subtree():
    table = {1: (0, 1.0, 0), 10: (1, 2.0, 0), 11: (10, 4.0, 0), 20: (1, 8.0, 0), 21: (20, 16.0, 0), 30: (0, 32.0, 0)}
    assert sorted(descendants(table, 1)) == [1, 10, 11, 20, 21]
    assert sorted(descendants(table, 1, exclude=20)) == [1, 10, 11]
    assert descendants(table, 99) == []


def test_cpu_meter_counts_a_sandboxed_style_child_that_exits():
    """A real child burning 0.6 s of CPU, sampled while it runs, still counts after it exits (and
    its pid's reuse would not merge with it: processes are keyed by pid and start time)."""
    meter = CpuMeter()
    before = meter.sample(proc_table(), os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile time.process_time() < 0.6: pass"])
    try:
        while child.poll() is None:
            meter.sample(proc_table(), os.getpid())
            time.sleep(0.02)
        assert meter.sample(proc_table(), os.getpid()) - before > 0.4
    finally:
        if child.poll() is None:
            child.kill()


def test_sampler_window_figures():
    s = Sampler("http://127.0.0.1:9/metrics", None, 1.0)
    # (time, running, waiting, engine CPU s, rollway CPU s, machine busy CPU s)
    s.samples = [(0.0, 0, 0, 0.0, 0.0, 0.0), (1.0, 2, 0, 1.0, 0.5, 2.0), (2.0, 4, 2, 2.0, 1.0, 4.0),
                 (3.0, 0, 0, 2.0, 1.5, 5.0), (9.0, 9, 9, 9.0, 9.0, 9.0)]
    w = s.window(0.0, 3.0)
    assert w["engine_busy_fraction"] == 0.5 and w["engine_mean_running"] == 1.5 and w["engine_mean_waiting"] == 0.5
    assert w["cores_engine"] == pytest.approx(2 / 3) and w["cores_rollway"] == pytest.approx(0.5)
    assert w["cores_machine"] == pytest.approx(5 / 3) and w["cores_other"] == pytest.approx(5 / 3 - 0.5 - 2 / 3)
    empty = s.window(4.0, 5.0)  # no sample in the window: every figure null, with its reason
    assert empty["samples"] == 0 and empty["engine_mean_running"] is None and empty["cores_rollway"] is None
    assert "no sample in the window" in empty["no_sample"]["engine_busy_fraction"]
    assert w["load_average_mean"] is None and "load_average_mean" in w["no_sample"]  # no load samples
    s.loads = [(0.0, 2.0), (1.5, 4.0), (3.0, 6.0), (9.0, 50.0)]
    assert s.load_window(0.0, 3.0) == {"load_average_mean": 4.0, "load_average_max": 6.0}
    assert s.window(0.0, 3.0)["load_average_max"] == 6.0


def test_both_modes_share_a_valid_job_config_with_the_same_episode_ids(tmp_path):
    rc = RealBenchConfig(num_tasks=2, group_size=3, epochs=2, slots=4, tool_overlap=4)
    assert rc.episodes == 12
    cfgs = []
    for mode in ("baseline", "pipeline"):
        data = real_run_config(rc, tmp_path / "tasks.jsonl", tmp_path / mode, "http://127.0.0.1:1/v1", "tok", mode)
        path = tmp_path / f"{mode}.yaml"
        path.write_text(yaml.safe_dump(data))
        cfgs.append(load_config(path))
    a, b = cfgs
    assert a.run.id == b.run.id, "episode ids, and so sampling seeds, must match between the modes"
    assert a.topics.prefix != b.topics.prefix
    assert a.agent.concurrency == rc.slots and a.scheduler.group_size == 3 and a.scheduler.epochs == 2
    assert a.tasks.type == "swe" and a.sandbox.type == "local" and a.policy.type == "openai"
    assert a.broker.fetch_max_wait_ms == b.broker.fetch_max_wait_ms == rc.fetch_max_wait_ms == 100


def test_the_cli_says_how_to_get_vllm_when_it_is_missing(tmp_path):
    env = {**os.environ, "ROLLWAY_VLLM_PYTHON": str(tmp_path / "no-python")}
    t0 = time.monotonic()
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "bench", "pipeline", "--real", "--out",
                          str(tmp_path / "o")], env=env)
    assert out.returncode == 2 and "setup-vllm.sh" in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - t0 < 120 and not Path(tmp_path / "o").exists()


def test_sampler_thread_samples_this_process_and_stops():
    """Against a port where no engine answers: no gauges (None), the CPU of this process tree is read."""
    s = Sampler("http://127.0.0.1:9/metrics", None, 0.05)
    s.start()
    t0, cpu0 = time.time(), time.process_time()
    while (time.process_time() - cpu0 < 0.3 or len(s.samples) < 2) and time.time() - t0 < 20:
        pass  # burn some CPU of our own, across at least two samples
    s.stop()
    assert not s.is_alive() and len(s.samples) >= 2
    assert s.samples[-1][4] > s.samples[0][4], "this process's CPU grew between the first and last sample"
    assert s.samples[0][1] is None and s.samples[0][3] is None, "no engine: no gauges, no engine CPU"
    w = s.window(s.samples[0][0], s.samples[-1][0])
    assert w["engine_busy_fraction"] is None and w["engine_mean_running"] is None and w["cores_rollway"] > 0
    assert "answered" in w["no_sample"]["engine_mean_running"] and "engine_url" in w["no_sample"]["cores_engine"]


# ------------------------------------------------------------------ the task set: several archives


def make_sdist(cache: Path, name: str, functions: dict[str, tuple[str, str]]) -> str:
    """A real source archive `name-1.0.tar.gz` in `cache/sdists` (where the builder looks before asking the
    package index): one package with `functions` (name -> (body expression, test assertion)), and a test
    module, or none when `functions` is empty of tests."""
    import tarfile

    src = cache / "src" / f"{name}-1.0"
    (src / name).mkdir(parents=True)
    (src / name / "__init__.py").write_text("".join(f"def {f}(x, y):\n    return {body}\n\n\n"
                                                    for f, (body, _) in functions.items()))
    tests = [f"def test_{f}():\n    assert {check}\n\n\n" for f, (_, check) in functions.items() if check]
    if tests:
        (src / "tests").mkdir()
        (src / "tests" / f"test_{name}.py").write_text(f"from {name} import *  # noqa\n\n\n" + "".join(tests))
    (cache / "sdists").mkdir(parents=True, exist_ok=True)
    with tarfile.open(cache / "sdists" / f"{name}-1.0.tar.gz", "w:gz") as tf:
        tf.add(src, arcname=f"{name}-1.0")
    return f"{name}==1.0"


def test_tasks_are_drawn_across_archives_and_a_short_archive_leaves_the_rest_to_the_others(tmp_path):
    """Two real archives built by the real task builder (its pytest runs included): `one` has a single
    function, so one task (one bug per function), `two` has three. num_tasks=3 asks 2 + 1; `one` yields 1,
    so `two` gives 2. Progress is said while building; a second call builds nothing (the cache answers)."""
    from rollway.bench.real_tasks import ensure_tasks, tasks_from_sdists
    from rollway.envs.swe import load_instances

    one = make_sdist(tmp_path, "rwone", {"add": ("x + y", "add(2, 3) == 5")})
    two = make_sdist(tmp_path, "rwtwo", {"mul": ("x * y", "mul(2, 3) == 6"), "big": ("x > y", "big(3, 2) and not big(2, 3)"),
                                         "sub": ("x - y", "sub(5, 3) == 2")})
    said: list[str] = []
    path = ensure_tasks([one, two], None, 3, 0, tmp_path / "out", said.append, cache_dir=tmp_path)
    rows = load_instances(path, tmp_path)  # snapshots are read only from the cache they were built in
    assert sorted(r["repo"] for r in rows) == [one, two, two] and len({r["instance_id"] for r in rows}) == 3
    assert all(r["FAIL_TO_PASS"] and r["patch"] for r in rows)
    assert any("rwone==1.0: [1/" in line for line in said) and any("rwtwo==1.0: [1/" in line for line in said)
    assert any("rwone==1.0 yields 1 of 2" in line for line in said), said
    again: list[str] = []
    assert tasks_from_sdists([one, two], 3, 0, again.append, cache_dir=tmp_path) == [rows[0], rows[1], rows[2]]
    assert not any("building" in line for line in again) and any("cached" in line for line in again), again
    fewer = tasks_from_sdists([two], 1, 0, again.append, cache_dir=tmp_path)  # the first of the larger build
    assert fewer == [r for r in rows if r["repo"] == two][:1]


def test_an_archive_without_tasks_is_named_with_the_reason(tmp_path):
    from rollway.bench.real_tasks import TaskSetError, tasks_from_sdists

    good = make_sdist(tmp_path, "rwgood", {"add": ("x + y", "add(2, 3) == 5")})
    bare = make_sdist(tmp_path, "rwbare", {"add": ("x + y", "")})  # ships no tests
    with pytest.raises(TaskSetError, match=r"sdist rwbare==1\.0 yields no tasks: no test files"):
        tasks_from_sdists([good, bare], 2, 0, lambda line: None, cache_dir=tmp_path)
    with pytest.raises(TaskSetError, match=r"rwgood==1\.0 yields 1 of 2 task\(s\) under task_seed=0"):
        tasks_from_sdists([good], 2, 0, lambda line: None, cache_dir=tmp_path)


def test_an_instances_file_is_checked_before_the_engine_starts(tmp_path):
    from rollway.bench.real_tasks import TaskSetError, check_instances

    with pytest.raises(TaskSetError, match="does not exist"):
        check_instances(tmp_path / "none.jsonl", 1)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"instance_id": "x", "repo": "a/b", "base_commit": "c", "FAIL_TO_PASS": [], "PASS_TO_PASS": []}\n')
    with pytest.raises(TaskSetError, match="instance x lacks snapshot, mutation"):
        check_instances(rows, 1)
    with pytest.raises(TaskSetError, match="holds 1 instance"):
        check_instances(rows, 2)


def test_the_config_takes_several_archives():
    assert RealBenchConfig.model_validate({"sdist": "toolz==1.2.0, six==1.16.0"}).sdist == ["toolz==1.2.0",
                                                                                           "six==1.16.0"]
    for bad, said in (({"sdist": "toolz"}, "pins no version"), ({"sdist": "a==1,b==2", "num_tasks": 1}, "fewer than"),
                      ({"sdist": "a==1,a==1"}, "twice")):
        with pytest.raises(ValueError, match=said):
            RealBenchConfig.model_validate(bad)


def test_the_cli_names_the_archive_that_yields_no_tasks(tmp_path):
    """Through `rollway bench pipeline --real` with an engine URL nobody serves: the task set fails first,
    exit code 2, the archive and the reason named, no traceback. HOME points at a folder whose cache holds
    an archive that ships no tests (so no package index is asked)."""
    bare = make_sdist(tmp_path / "home" / ".cache" / "rollway", "rwbare", {"add": ("x + y", "")})
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "bench", "pipeline", "--real", "--out",
                          str(tmp_path / "o"), "engine_url=http://127.0.0.1:9/v1", f"sdist={bare}"],
                         env={**os.environ, "HOME": str(tmp_path / "home")})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "sdist rwbare==1.0 yields no tasks: no test files" in out.stderr and "Traceback" not in out.stderr
