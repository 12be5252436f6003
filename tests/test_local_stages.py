"""One-process jobs (runtime.processes, runners/local_stages.py): every stage a task of the supervising
process, each the sole owner of its partitions. Real broker, real sandboxes, the scripted policy."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT

from rollway.config.run import faust_installed


def _smoke(overrides: list[str] = ()):
    from rollway.actors.scheduler import new_run_id
    from rollway.config.run import load_config

    cfg = load_config(ROOT / "examples" / "smoke.yaml", list(overrides))
    cfg.run.id = new_run_id()
    return cfg


def test_a_stage_that_crashes_is_restarted_in_place_and_loses_nothing(tmp_path):
    """The sink cannot write its first trajectory (the file's name is taken by a folder): its task fails
    (FatalActorError), the job restarts it in place, and once the folder is gone the restarted sink
    writes every episode exactly once from the committed offsets."""
    from rollway.runners.up import run_job, write_run_files
    from rollway.runtime.broker import EmbeddedBroker

    cfg, run_dir = _smoke(), tmp_path / "run"
    write_run_files(run_dir, cfg)
    blocker = run_dir / "trajectories.jsonl"
    blocker.mkdir()
    seen: dict = {}

    def fix_the_disk_after_the_first_crash(job) -> None:
        (sink,) = [p for p in job.procs if p.stage == "sink"]
        if sink.restarts and blocker.is_dir():
            seen["pids"] = {p.proc.pid for p in job.procs}
            blocker.rmdir()

    with EmbeddedBroker() as broker:
        summary = run_job(cfg, "examples/smoke.yaml", [], broker.bootstrap, run_dir, {}, quiet=True,
                          on_tick=fix_the_disk_after_the_first_crash, max_restarts=5, own_broker=True)
    assert seen, "the sink never crashed"
    assert len(seen["pids"]) == 1, "a one-process job ran stage processes"
    assert summary["worker_restarts"].get("sink-0", 0) >= 1 and summary["episodes_completed"] == 8
    trajs = [json.loads(x) for x in blocker.read_text().splitlines()]
    assert sorted(t["episode"]["episode_id"] for t in trajs) == sorted({t["episode"]["episode_id"] for t in trajs})
    assert len(trajs) == 8
    sink_log = [json.loads(x) for x in (run_dir / "logs" / "sink.jsonl").read_text().splitlines()]
    assert any(x["event"].startswith("stage failed") for x in sink_log), sink_log[-5:]


@pytest.mark.parametrize("case", ["workers", pytest.param("faust", marks=pytest.mark.skipif(
    not faust_installed(), reason="the faust engine is an optional extra"))])
def test_one_process_refuses_what_it_cannot_run(tmp_path, case):
    from rollway.runners.up import JobFailed, one_process

    if case == "faust":
        from rollway.base.config import ConfigError

        with pytest.raises(ConfigError, match="runtime.processes=per-stage"):
            _smoke(["runtime.processes=one", "runtime.engines.sink=faust"])
        return
    cfg = _smoke(["runtime.processes=one"])
    with pytest.raises(JobFailed, match="agent"):
        one_process(cfg, {"agent": 2}, None, own_broker=True)


def test_auto_picks_one_process_only_where_nothing_else_can_join(monkeypatch):
    """`auto`: one process on the command's own broker with one worker per stage; a process per worker on a
    shared broker, with more workers, with a Faust stage or with fault points armed."""
    from rollway.runners.up import one_process

    cfg = _smoke()
    assert one_process(cfg, {"agent": 1}, None, own_broker=True)
    assert not one_process(cfg, {"agent": 1}, None, own_broker=False)
    assert not one_process(cfg, {"agent": 2}, None, own_broker=True)
    assert not one_process(cfg, {}, {"ROLLWAY_FAULTS": "agent.after_tools=0.1"}, own_broker=True)
    assert not one_process(_smoke(["runtime.engines.sink=faust"]), {}, None, own_broker=True)
    monkeypatch.setenv("ROLLWAY_FAULTS", "agent.after_tools=0.1")
    assert not one_process(cfg, {}, None, own_broker=True)


def test_the_faust_engine_without_its_extra_is_refused_at_start_up(monkeypatch):
    """Faust is an optional extra: a config choosing it where faust-streaming is not installed fails
    validation naming the extra. (faust is installed in the test environment: its absence is simulated
    by hiding its distribution from `importlib.metadata.version`, which is all the check reads.)"""
    import importlib.metadata

    from rollway.base.config import ConfigError

    real = importlib.metadata.version

    def version(name):
        if name == "faust-streaming":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(ConfigError, match=r"rollway\[faust\]"):
        _smoke(["runtime.engines.sink=faust"])
