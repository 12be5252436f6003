"""Experiment trackers (learning/tracking.py): chosen by config, checked at start-up, never in the learner's way;
W&B in offline mode (its files read back) and MLflow against a real tracking server started here."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, wait_until

from rollway.base.config import ConfigError
from rollway.config.run import load_config
from rollway.learning.tracking import TRACKERS, Tracker, TrackerRun, TrackingConfig, TrackingHub


class NeedsAbsentPackage(Tracker):
    """A tracker whose package is not installed anywhere."""

    requires = "rollway-no-such-package"

    def start(self, run: TrackerRun) -> None: ...

    def log(self, step, metrics) -> None: ...


HANG = threading.Event()


class HangingTracker(Tracker):
    """A tracker whose server never answers (its calls block until the test lets them go)."""

    def start(self, run: TrackerRun) -> None:
        HANG.wait()

    def log(self, step, metrics) -> None:
        HANG.wait()


class FailingTracker(Tracker):
    """A tracker whose every call fails (a full disk)."""

    calls = 0

    def start(self, run: TrackerRun) -> None:
        FailingTracker.calls += 1
        raise OSError(28, "No space left on device")

    def log(self, step, metrics) -> None:
        raise OSError(28, "No space left on device")


def plugin(name: str) -> str:
    return f"python:{__name__}:{name}"  # this module itself (pytest imported it), so the test sees its classes


def hub(tmp_path: Path, *trackers: str, **cfg) -> TrackingHub:
    return TrackingHub.for_run(TrackingConfig(trackers=list(trackers), **cfg), tmp_path, "test", "run-abc",
                               {"policy": {"api_key": "**********", "model": "m"}, "learner": {"lr": 1e-6}})


def test_a_tracker_without_its_package_is_refused_at_start_up_naming_it():
    with pytest.raises(ConfigError, match="needs the `rollway-no-such-package` package, which is not installed"):
        load_config(None, [f"tracking.trackers=[{plugin('NeedsAbsentPackage')}]"])
    with pytest.raises(ConfigError, match="unknown tracker 'neptune'"):
        load_config(None, ["tracking.trackers=[neptune]"])
    # Each built-in names the package it imports.
    assert {n: c.requires for n, c in TRACKERS.items()} == {"console": None, "tensorboard": "tensorboard",
                                                            "wandb": "wandb", "mlflow": "mlflow"}


def test_mlflow_without_a_server_needs_the_full_package_and_says_so(monkeypatch):
    """`rollway[mlflow]` installs MLflow's client only (the full package brings scikit-learn and scipy into every
    model process); its local store needs SQLAlchemy. This environment has the client only (setup puts the
    server in .venv-mlflow): mlflow without a URI is refused at start-up with what to do; with a URI it loads."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert importlib.util.find_spec("mlflow"), "MLflow's client is not installed: pip install -e '.[mlflow]'"
    if importlib.util.find_spec("sqlalchemy") is None:
        with pytest.raises(ConfigError, match=r"local store .*pip install mlflow.*tracking.mlflow_uri"):
            load_config(None, ["tracking.trackers=[mlflow]"])
    assert load_config(None, ["tracking.trackers=[mlflow]", "tracking.mlflow_uri=http://127.0.0.1:5000"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert load_config(None, ["tracking.trackers=[mlflow]"])


def test_failing_or_hanging_trackers_never_hold_the_learner(tmp_path):
    """A tracker that hangs and one that fails: the learner's `log` calls return at once; the failing one is
    retried with back-off, and at the end what it never took is in the run folder."""
    HANG.clear()
    h = hub(tmp_path, plugin("HangingTracker"), plugin("FailingTracker"), "console", queue_size=50)
    t0 = time.perf_counter()
    for step in range(1, 201):  # more than the queue holds: the overflow goes to the unsent files, not a wait
        h.log(step, {"loss": 0.5, "reward_mean": step / 200, "note": "text is left out"})
    h.table(200, "samples", [{"task_id": "calc-0001", "reward": 1.0}])
    assert time.perf_counter() - t0 < 1.0
    wait_until(lambda: FailingTracker.calls >= 1, timeout_s=60, what="the failing tracker to be tried (not held up "
               "by the hanging one)")
    HANG.set()
    h.close(timeout_s=60)
    assert FailingTracker.calls < 10  # backed off, not retried for each of its 200 records
    unsent = [json.loads(x) for x in (tmp_path / "tracking-unsent" / "FailingTracker.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in unsent if "table" not in r) == list(range(1, 201)) and "note" not in unsent[0]
    assert [r for r in unsent if "table" in r] == [{"step": 200, "table": "samples",
                                                     "rows": [{"task_id": "calc-0001", "reward": 1.0}]}]


def test_wandb_offline_run_files(tmp_path):
    pytest.importorskip("wandb", reason="pip install 'rollway[wandb]'")
    h = hub(tmp_path, "wandb")
    for step in (1, 2, 3):
        h.log(step, {"reward_mean": step / 10, "loss": 1.0 / step, "policy_version": step})
    h.close(timeout_s=120)
    run_file = wandb_run_file(tmp_path)
    # W&B's service process may still be writing the file when `finish()` returns.
    wait_until(lambda: len(read_wandb_offline(run_file)[0]) >= 3, timeout_s=120, what="W&B's file to hold 3 updates")
    history, config = read_wandb_offline(run_file)
    assert [(r["_step"], r["reward_mean"], r["policy_version"]) for r in history] == [(1, 0.1, 1), (2, 0.2, 2), (3, 0.3, 3)]
    assert config["policy"]["api_key"] == "**********" and config["learner"]["lr"] == 1e-6
    # A resumed run (same run folder) continues the same W&B run.
    h = hub(tmp_path, "wandb")
    h.log(4, {"reward_mean": 0.4})
    h.close(timeout_s=120)
    assert {p.name for p in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")} == {run_file.name}


def wandb_run_file(run_dir: Path) -> Path:
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


def read_wandb_offline(path: Path) -> tuple[list[dict], dict]:
    """The history rows and the config an offline W&B run file holds. The file is W&B's LevelDB-style log
    (a 7-byte `:W&B` header, then 32 KiB blocks of records: crc32 (4), length (2), type (1: full, 2: first,
    3: middle, 4: last), data), each record a `wandb_internal_pb2.Record` (W&B's own protobuf classes)."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    block, pos, chunks, records = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # no room for a record header: the rest of the block is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(raw[pos + 4:pos + 6], "little"), raw[pos + 6]
        if (length == 0 and kind == 0) or pos + 7 + length > len(raw):
            break  # the end, or a record still being written
        chunks += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(chunks)
            chunks = b""
    history, config = [], {}
    for data in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind in ("config", "run"):
            items = record.config.update if kind == "config" else record.run.config.update
            config.update({i.key: json.loads(i.value_json) for i in items})
    return history, {k: v for k, v in config.items() if not k.startswith("_")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlflow_server_down_at_first_then_up_gets_every_update(tmp_path):
    """A real MLflow tracking server (local SQLite store) that is not yet running when the learner logs its
    first updates: the calls return at once, the records are kept, and once the server answers every update
    arrives, with the config (secrets masked) as parameters."""
    pytest.importorskip("mlflow", reason="pip install 'rollway[mlflow]'")
    from mlflow.tracking import MlflowClient

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    h = hub(tmp_path, "mlflow", mlflow_uri=uri, project="rollway-test")
    t0 = time.perf_counter()
    h.log(1, {"reward_mean": 0.1, "loss": 2.0})
    h.log(2, {"reward_mean": 0.2, "loss": 1.0})
    assert time.perf_counter() - t0 < 0.1
    server_exe = ROOT / ".venv-mlflow" / "bin" / "mlflow"
    assert server_exe.exists(), "MLflow's server is not installed: run `make setup` (scripts/setup.sh puts it in .venv-mlflow)"
    # No job runner: its seven worker processes (MLflow's GenAI jobs, unused here) cost 29 core-seconds of imports.
    env = {**os.environ, "MLFLOW_LOGGING_LEVEL": "WARNING", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(
        [str(server_exe), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--default-artifact-root", str(tmp_path / "art")],
        stdout=(tmp_path / "mlflow.log").open("wb"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_until(lambda: _answers(f"{uri}/health"), timeout_s=180, interval_s=0.5,
                   what=f"the MLflow server (log: {tmp_path / 'mlflow.log'})")
        h.log(3, {"reward_mean": 0.3, "loss": 0.5})
        client = MlflowClient(tracking_uri=uri)

        def rewards() -> list[tuple[int, float]]:
            exp = client.get_experiment_by_name("rollway-test")
            runs = client.search_runs([exp.experiment_id]) if exp else []
            return sorted((m.step, m.value) for r in runs for m in client.get_metric_history(r.info.run_id, "reward_mean"))

        wait_until(lambda: len(rewards()) == 3, timeout_s=180, interval_s=0.5, what="every update at the server")
        assert rewards() == [(1, 0.1), (2, 0.2), (3, 0.3)]
        h.close(timeout_s=60)
        (run,) = client.search_runs([client.get_experiment_by_name("rollway-test").experiment_id])
        assert run.data.params["policy.api_key"] == "**********" and run.data.params["learner.lr"] == "1e-06"
        assert run.info.status == "FINISHED" and run.info.run_name == "test-run-abc"
        # Another run: an update with an episode's figures and the table of sample trajectories.
        h = hub(tmp_path / "second", "mlflow", mlflow_uri=uri, project="rollway-samples", samples_every=1)
        h.episode(sample_trajectory(0, "calc-0001", 1.0, {}, "g"))
        h.update(1, {"reward_mean": 1.0})
        h.close(timeout_s=60)
        (second,) = client.search_runs([client.get_experiment_by_name("rollway-samples").experiment_id])
        assert [(m.step, m.value) for m in client.get_metric_history(second.info.run_id, "pass_rate/calc")] == [(1, 1.0)]
        table = json.loads(Path(client.download_artifacts(second.info.run_id, "samples/step-000001.json",
                                                          str(tmp_path / "second"))).read_text())
        assert table == {"columns": ["task_id", "prompt", "actions", "reward"],
                         "data": [["calc-0001", "Solve calc-0001.", "answer 0 | done", 1.0]]}
        assert not (tmp_path / "tracking-unsent").exists()
        # The run as a user sees it: MLflow's own UI drawn by headless Chromium (docs/observability.md shows it).
        shot = tmp_path / "mlflow-run.png"
        screenshot(f"{uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/model-metrics", shot, tmp_path)
        if os.environ.get("ROLLWAY_DOCS_SCREENSHOTS"):
            shutil.copy(shot, ROOT / "docs" / "img" / "mlflow-run.png")
    finally:
        server.terminate()
        server.wait(30)


def screenshot(url: str, out: Path, tmp_path: Path) -> None:
    """Chromium's drawing of MLflow's metric charts at `url`, taken again until the chart lines are drawn
    (their blue, #2172b4, in the chart area: a page still loading shows spinners)."""
    import numpy as np
    from PIL import Image

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is not installed: run `make setup` (scripts/setup.sh installs it with apt)"

    def drawn() -> bool:
        proc = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                               "--force-device-scale-factor=1", f"--user-data-dir={tmp_path / 'chromium-profile'}",
                               "--virtual-time-budget=20000", f"--screenshot={out}", "--window-size=1400,900", url],
                              capture_output=True, text=True, timeout=300)
        assert out.exists(), f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}"
        charts = np.asarray(Image.open(out).convert("RGB"))[240:600, 200:750].astype(int)
        line = (abs(charts - (33, 114, 180)) <= 2).all(axis=2)
        return int(line.sum()) > 200

    wait_until(drawn, timeout_s=600, interval_s=1, what="MLflow's UI to draw the run's metric charts")


def _answers(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=5).status == 200
    except OSError:
        return False


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the train extra")
def test_tensorboard_and_console_trackers(tmp_path):
    h = hub(tmp_path, "tensorboard", "console")
    h.log(1, {"reward_mean": 0.5})
    h.close(timeout_s=60)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "tracking"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(1, 0.5)]


RECORDED: list = []


class RecordingTracker(Tracker):
    """Keeps what it is given (the learner test reads it back)."""

    def start(self, run: TrackerRun) -> None:
        RECORDED.append(("start", run))

    def log(self, step, metrics) -> None:
        RECORDED.append((step, dict(metrics)))


def test_the_learner_logs_each_update_and_the_masked_config(tmp_path):
    """A real (tiny) torch learner: one policy update reaches the tracker with its figures, the policy version
    and the episodes trained; the config it records has its secrets masked."""
    pytest.importorskip("torch")
    from test_learner_actor import learner_services, traj

    from rollway.actors.learner import LearnerActor
    from rollway.learning.testing import tiny_model_factory
    from rollway.runtime.actor import MessageMeta

    RECORDED.clear()
    s = learner_services(tmp_path, f"tracking.trackers=[{plugin('RecordingTracker')}]", "broker.sasl_password=sk-secret-1")

    async def scenario():
        actor = LearnerActor(s, trainer_factory=tiny_model_factory())
        await actor.setup()
        await actor.handle(traj(0, 1.0), MessageMeta("trajectories", 0, 5))
        await actor.handle(traj(1, 0.0), MessageMeta("trajectories", 1, 9))
        await actor.close()

    asyncio.run(scenario())
    (start, run), (step, figures) = RECORDED
    assert start == "start" and run.config["broker"]["sasl_password"] == "**********" and "sk-secret-1" not in json.dumps(run.config)
    assert step == 1 and figures["policy_version"] == 1 and figures["episodes_trained"] == 2
    assert figures["reward_mean"] == pytest.approx(0.5) and figures["pass_rate"] == pytest.approx(0.5)
    assert {"loss", "grad_norm", "tokens_per_second", "train_seconds"} <= set(figures), sorted(figures)


def sample_trajectory(i: int, task_id: str, reward: float, grade: dict, group: str):
    """A one-turn trajectory of task `task_id` whose prompt and action are readable text."""
    import msgspec

    from rollway.learning.testing import make_trajectory
    from rollway.schemas.messages import TurnRecord

    t = make_trajectory(f"{group}-s{i}", group, prompt=[1, 2, 3], completion=[10 + i, 11, 12], reward=reward,
                        sample_index=i)
    turn = TurnRecord(turn=0, completion_ids=[10 + i, 11, 12], logprobs=[-5.0] * 3, policy_version=0,
                      finish_reason="stop", assistant_text=f"answer {i} | done")
    return msgspec.structs.replace(t, episode=msgspec.structs.replace(t.episode, task_id=task_id), grade=grade,
                                   turns=[turn], messages=[{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": f"Solve {task_id}."}])


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None or importlib.util.find_spec("wandb") is None,
                    reason="needs the train extra and rollway[wandb]")
def test_the_learner_logs_pass_rate_per_source_failures_hacks_and_sample_tables(tmp_path):
    """A real (tiny) torch learner, two updates of one group each (two task sources), logged to TensorBoard
    and W&B (offline), read back from their files: pass rate per task source over each update's episodes,
    graded failures by kind and suspected reward hacks counted since the start, and the table of sample
    trajectories (prompt, actions, reward) at every update (`tracking.samples_every=1`)."""
    pytest.importorskip("torch")
    from test_learner_actor import learner_services

    from rollway.actors.learner import LearnerActor
    from rollway.base.blame import AGENT_FAILURE
    from rollway.envs.reach_check import SUSPECTED_HACK
    from rollway.learning.testing import tiny_model_factory
    from rollway.runtime.actor import MessageMeta

    hack = {"outcome": SUSPECTED_HACK, SUSPECTED_HACK: [{"path": "tests/conftest.py"}]}
    crash = {"outcome": AGENT_FAILURE, "failure_kind": "HarnessCrashed", "failure_stage": "agent", "failure": "x"}
    episodes = [sample_trajectory(0, "calc-0001", 1.0, {}, "rL-g0"), sample_trajectory(1, "calc-0001", 0.0, hack, "rL-g0"),
                sample_trajectory(2, "toy-007", 0.0, crash, "rL-g1"), sample_trajectory(3, "toy-007", 1.0, {}, "rL-g1")]
    s = learner_services(tmp_path, "tracking.trackers=[tensorboard, wandb]", "tracking.samples_every=1",
                         "tracking.samples=2")

    async def scenario():
        actor = LearnerActor(s, trainer_factory=tiny_model_factory())
        await actor.setup()
        for offset, t in enumerate(episodes):
            await actor.handle(t, MessageMeta("trajectories", 0, offset))
        await actor.close()

    # A reward worker's status file as runtime/worker.py writes it (by hand here: no stage worker runs in
    # this test): the run's dead letters so far are in every update's figures.
    from rollway.base.run_dir import RunDir

    status = RunDir(tmp_path / "run").worker_status_path("reward", "host.4242")
    status.parent.mkdir(parents=True, exist_ok=True)
    status.write_text(json.dumps({"stage": "reward", "pid": 4242, "handled": 9, "dead_lettered": 2}))
    asyncio.run(scenario())
    run_dir = tmp_path / "run"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb" / "tracking"), size_guidance={"tensors": 0})
    acc.Reload()

    def scalars(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in acc.Scalars(f"train/{tag}")]

    assert scalars("pass_rate/calc") == [(1, 0.5)] and scalars("pass_rate/toy") == [(2, 0.5)]
    assert scalars("suspected_reward_hacks") == [(1, 1.0), (2, 1.0)]  # since the start
    assert scalars("failures/agent/HarnessCrashed") == [(2, 1.0)]
    assert scalars("dead_letters") == [(1, 2.0), (2, 2.0)]
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/text_summary")}
    assert sorted(texts) == [1, 2]
    assert "| task_id | prompt | actions | reward |" in texts[2]
    assert "| toy-007 | Solve toy-007. | answer 2 \\| done | 0.0 |" in texts[2]
    assert "| toy-007 | Solve toy-007. | answer 3 \\| done | 1.0 |" in texts[2]
    # W&B's offline files: the same figures, and the table as W&B stores it (a table file per step).
    run_file = wandb_run_file(run_dir)
    wait_until(lambda: len(read_wandb_offline(run_file)[0]) >= 2, timeout_s=120, what="W&B's file to hold 2 updates")
    history = {r["_step"]: r for r in read_wandb_offline(run_file)[0]}
    assert history[1]["pass_rate/calc"] == 0.5 and "pass_rate/toy" not in history[1]
    assert history[2]["pass_rate/toy"] == 0.5 and history[2]["failures/agent/HarnessCrashed"] == 1
    assert history[1]["suspected_reward_hacks"] == history[2]["suspected_reward_hacks"] == 1
    assert history[1]["samples/_type"] == "table-file" and history[1]["samples/nrows"] == 2
    table = json.loads((run_file.parent / "files" / history[2]["samples/path"]).read_text())
    assert table["columns"] == ["task_id", "prompt", "actions", "reward"]
    assert table["data"] == [["toy-007", "Solve toy-007.", "answer 2 | done", 0.0],
                             ["toy-007", "Solve toy-007.", "answer 3 | done", 1.0]]
