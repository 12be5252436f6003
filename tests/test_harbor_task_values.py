"""A hostile task author's task.toml values, generated: an example task's settings replaced by values of other
types, non-finite or absurd numbers, deleted, or whole sections replaced by a value. Loading either refuses the
task with HarborTaskError naming it, or gives limits a run can live with: every timeout finite, positive and at
most `tasks.max_timeout_s` (a verifier's `timeout_sec = inf` held a reward worker forever), every resource a
finite positive number. Only loading runs here (no image is built), so no part is faked."""

from __future__ import annotations

import copy
import json
import math
import random
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest

from rollway.envs.config import HarborTasksConfig
from rollway.envs.harbor import HarborTaskError, HarborTaskSet, load_tasks

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "harbor" / "file-permissions"
VALUES: list[Any] = [math.inf, -math.inf, math.nan, -1, 0, 0.0, 1e-9, 1e12, 2**62, 1, 30.5, True, False, "", "x", "60",
                     "2G", "-2G", "nanG", "infM", "1e999M", [], [1], {}, {"timeout_sec": math.inf}, {"a": []}]
TIMEOUTS = (("agent", "timeout_sec"), ("verifier", "timeout_sec"), ("environment", "build_timeout_sec"))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"


def to_toml(config: dict[str, Any]) -> str:
    """TOML for `config`: plain values first, then one [table] per dict (their dicts inline)."""
    lines = [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for name, table in config.items():
        if isinstance(table, dict):
            lines += [f"[{json.dumps(name)}]", *(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def mutated(config: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    config = copy.deepcopy(config)
    config.setdefault("verifier", {})["environment"] = {"cpus": 1, "memory_mb": 256}  # reached by mutation too
    for _ in range(rng.choice((1, 1, 2, 3))):
        section = rng.choice(["agent", "verifier", "environment", "task"])
        roll = rng.random()
        if roll < 0.1:
            config[section] = copy.deepcopy(rng.choice(VALUES))  # a section that is not a table
            continue
        table = config.setdefault(section, {})
        if not isinstance(table, dict):
            continue
        if section == "verifier" and isinstance(table.get("environment"), dict) and rng.random() < 0.3:
            table = table["environment"]
            key = rng.choice(["cpus", "memory_mb", "memory", "storage_mb", "storage"])
        else:
            key = rng.choice({"agent": ["timeout_sec"], "verifier": ["timeout_sec", "environment"],
                              "environment": ["build_timeout_sec", "cpus", "memory_mb", "memory", "storage_mb",
                                              "storage"],
                              "task": ["name"]}[section])
        if roll < 0.2:
            table.pop(key, None)
        else:
            table[key] = copy.deepcopy(rng.choice(VALUES))
    return config


def _task_copy(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    task = tmp_path / name
    shutil.copytree(EXAMPLE, task)
    (task / "task.toml").write_text(to_toml(config))
    return task


def _check_limits(task_set: HarborTaskSet, ceiling: float) -> None:
    for task in task_set.by_name.values():
        for section, key in TIMEOUTS:
            seconds = task.timeout(section, 600.0, key)
            assert math.isfinite(seconds) and 0 < seconds <= ceiling, (section, key, seconds, task.config)
        for env in (None, task.verifier.resources):
            for name, value in (task.resources() if env is None else env).items():
                assert value is None or (math.isfinite(value) and value > 0), (name, value, task.config)


def test_generated_task_values_are_refused_by_name_or_bounded(tmp_path):
    base = tomllib.loads((EXAMPLE / "task.toml").read_text())
    rng = random.Random(2026)
    loaded = refused = 0
    for n in range(300):
        config = mutated(base, rng)
        task = _task_copy(tmp_path, f"t{n}", config)
        cfg = HarborTasksConfig(path=str(task), max_timeout_s=900)
        try:
            task_set = HarborTaskSet(cfg)
        except HarborTaskError as err:
            refused += 1
            assert str(err).startswith(("task ", str(task))), str(err)  # names the task (or its folder)
            continue
        loaded += 1
        _check_limits(task_set, 900)
    assert loaded >= 50 and refused >= 50, (loaded, refused)  # both outcomes reached


def test_a_task_timeout_past_the_operators_ceiling_is_cut_to_it(tmp_path):
    """A verifier's timeout_sec of a billion seconds (a test.sh that sleeps would hold a reward worker for 31
    years) is cut to tasks.max_timeout_s; within the ceiling the task's own value stands."""
    config = tomllib.loads((EXAMPLE / "task.toml").read_text())
    config["verifier"]["timeout_sec"] = 1e9
    task = _task_copy(tmp_path, "slow-verifier", config)
    cfg = HarborTasksConfig(path=str(task), max_timeout_s=120)
    harbor = HarborTaskSet(cfg).by_name["slow-verifier"]
    assert harbor.timeout("verifier", 600.0) == 120
    assert harbor.timeout("agent", 600.0) == 120  # the example's 300 s, cut too
    assert harbor.timeout("environment", 600.0, "build_timeout_sec") == 120
    default = HarborTaskSet(HarborTasksConfig(path=str(task))).by_name["slow-verifier"]
    assert default.timeout("agent", 600.0) == 300 and default.timeout("verifier", 600.0) == 3600


@pytest.mark.parametrize(("section", "key", "value"), [("verifier", "timeout_sec", math.inf),
                                                       ("agent", "timeout_sec", math.nan),
                                                       ("environment", "build_timeout_sec", -1),
                                                       ("environment", "cpus", math.inf),
                                                       ("environment", "memory_mb", math.inf),
                                                       ("agent", "timeout_sec", "600")])
def test_a_non_finite_or_non_positive_number_is_refused_naming_it(tmp_path, section, key, value):
    config = tomllib.loads((EXAMPLE / "task.toml").read_text())
    config[section][key] = value
    task = _task_copy(tmp_path, "bad-number", config)
    with pytest.raises(HarborTaskError, match=rf"task bad-number: \[{section}\] {key}"):
        load_tasks(task)


@pytest.mark.parametrize("name", ["instruction.md", "task.toml", "environment/Dockerfile"])
def test_a_task_file_that_is_not_utf8_is_refused_naming_it(tmp_path, name):
    """A UnicodeDecodeError named no file; now the task's error names the one that is not text."""
    task = tmp_path / "binary"
    shutil.copytree(EXAMPLE, task)
    (task / name).write_bytes((task / name).read_bytes() + b"\n\xff\xfe\n")
    with pytest.raises(HarborTaskError, match=re.escape(f"{task / name} is not UTF-8 text")):
        load_tasks(task)
