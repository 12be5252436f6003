"""`tasks.type: swebench`: SWE-bench-family rows (four formats, JSONL and Parquet), log parsers, rows
built from three libraries' source archives over a real git mirror, graded in per-instance images on the
real Docker engine, typed outcomes, and `rollway eval` with a scripted policy through the pipeline."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from conftest import built_once
from docker_engine import ensure_engine
from jobs import run_with_progress
from test_envs_swe import editor_fix_calls

from rollway.envs.base import Episode
from rollway.envs.config import TasksConfig
from rollway.envs.swe_export import as_variant
from rollway.envs.swe_grading import (
    GradeSettings,
    GradingEnvError,
    grade_instance,
    parse_pytest_log,
    parse_test_log,
    parse_unittest_log,
)
from rollway.envs.swe_rows import detect_format, load_swe_instances, normalise_row, reverse_patch
from rollway.envs.swebench import SWEBenchTaskSet
from rollway.reports.eval_outputs import to_atif, write_predictions
from rollway.runners import cmd_tasks
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.docker import DockerSandboxProvider

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ["toolz==1.2.0", "inflection==0.5.1", "six==1.16.0"]


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- parsers and rows (no engine)


def test_pytest_parser_reads_summary_and_verbose_lines():
    log = ("tests/test_a.py::test_v PASSED                                   [ 50%]\n"
           "tests/test_a.py::test_w FAILED                                   [100%]\n"
           "=========================== short test summary info ============================\n"
           "PASSED tests/test_a.py::test_ok\n"
           "FAILED tests/test_a.py::test_bad[1 - 2] - AssertionError: assert 1 == 2\n"
           "XFAIL tests/test_a.py::test_known - reason\n"
           "XPASS tests/test_a.py::test_lucky\n"
           "PASSED tests/test_a.py::test_td\n"
           "ERROR tests/test_a.py::test_td - teardown failed\n")
    assert parse_pytest_log(log) == {
        "tests/test_a.py::test_v": "PASSED", "tests/test_a.py::test_w": "FAILED", "tests/test_a.py::test_ok": "PASSED",
        "tests/test_a.py::test_bad[1 - 2]": "FAILED", "tests/test_a.py::test_known": "PASSED",
        "tests/test_a.py::test_lucky": "FAILED", "tests/test_a.py::test_td": "ERROR"}


def test_unittest_parser_reads_django_style_lines():
    log = ("test_add (utils_tests.test_math.MathTests) ... ok\n"
           "test_div (utils_tests.test_math.MathTests)\nDivide. ... FAIL\n"
           "test_sub (utils_tests.test_math.MathTests) ... ERROR\n"
           "test_gpu (utils_tests.test_math.MathTests) ... skipped 'no gpu'\n"
           "test_doc (utils_tests.test_math.MathTests) Check the doc ... ok\n")
    assert parse_unittest_log(log) == {
        "test_add (utils_tests.test_math.MathTests)": "PASSED", "test_sub (utils_tests.test_math.MathTests)": "ERROR",
        "test_gpu (utils_tests.test_math.MathTests)": "SKIPPED", "test_doc (utils_tests.test_math.MathTests)": "PASSED"}
    # A docstring line between name and verdict hides the verdict from a line parser, as in SWE-bench:
    # such a test is missing from the log, which grades as not passed.
    assert "test_div (utils_tests.test_math.MathTests)" not in parse_test_log(log)


SWEBENCH_ROW = {
    "instance_id": "acme__widgets-42", "repo": "acme/widgets", "base_commit": "a" * 40,
    "problem_statement": "Widgets break.", "hints_text": "look at spin()", "patch": "diff --git a/w.py b/w.py\n",
    "test_patch": "diff --git a/tests/test_w.py b/tests/test_w.py\n", "version": "1.0",
    "environment_setup_commit": "b" * 40, "created_at": "2024-01-01",
    "FAIL_TO_PASS": '["tests/test_w.py::test_spin"]', "PASS_TO_PASS": '["tests/test_w.py::test_ok"]',
}


def test_rows_of_each_format_normalise_to_one_shape(tmp_path):
    base = normalise_row(SWEBENCH_ROW)
    assert (base.source_format, base.fail_to_pass, base.pass_to_pass) == (
        "swebench", ["tests/test_w.py::test_spin"], ["tests/test_w.py::test_ok"])
    gym = {k: v for k, v in SWEBENCH_ROW.items() if k != "environment_setup_commit"}
    gym["FAIL_TO_PASS"], gym["PASS_TO_PASS"] = ["t::a"], []  # SWE-Gym keeps lists
    assert detect_format(gym) == "swe-gym" and normalise_row(gym).fail_to_pass == ["t::a"]
    bug = "diff --git a/w.py b/w.py\n--- a/w.py\n+++ b/w.py\n@@ -1,2 +1,2 @@\n x = 1\n-y = 2\n+y = 3\n"
    smith = {"instance_id": "acme__widgets.1234abcd.func_pm__x", "repo": "swesmith/acme__widgets.1234abcd",
             "patch": bug, "FAIL_TO_PASS": ["t::a"], "PASS_TO_PASS": ["t::b"], "image_name": "swesmith.x86_64.acme",
             "problem_statement": "y is wrong"}
    inst = normalise_row(smith)
    assert (inst.source_format, inst.repo, inst.base_commit, inst.pre_patch) == ("swe-smith", "acme__widgets",
                                                                                 "1234abcd", bug)
    assert inst.patch == reverse_patch(bug) and "-y = 3\n+y = 2\n" in inst.patch
    r2e = {"repo_name": "widgets", "docker_image": "namanjain12/widgets_final:c0ffee", "commit_hash": "c" * 40,
           "problem_statement": "p", "parsed_commit_content": json.dumps(
               {"old_commit_hash": "d" * 40, "new_commit_hash": "c" * 40, "file_diffs": [{"patch": bug}]}),
           "expected_output_json": json.dumps({"t::a": "PASSED", "t::b": "FAILED"}), "execution_result_content": ""}
    inst = normalise_row(r2e)
    assert (inst.source_format, inst.instance_id, inst.base_commit, inst.fail_to_pass, inst.image_name) == (
        "r2e-gym", f"widgets__{'c' * 40}", "d" * 40, ["t::a"], "namanjain12/widgets_final:c0ffee")
    # Parquet and JSONL give the same instances.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([SWEBENCH_ROW]), tmp_path / "rows.parquet")
    (tmp_path / "rows.jsonl").write_text(json.dumps(SWEBENCH_ROW) + "\n")
    assert load_swe_instances(tmp_path / "rows.parquet") == load_swe_instances(tmp_path / "rows.jsonl") == [base]


R2E_COMMIT = {  # one commit in R2E-Gym's published ParsedCommit layout (parsed_commit_content), trimmed
    "old_commit_hash": "d" * 40, "new_commit_hash": "c" * 40, "commit_message": "fix y", "commit_date":
    "2024-01-02T03:04:05", "metadata": {}, "file_diffs": [
        {"header": {"file": {"path": "pkg/w.py"}, "misc_line": None},
         "index_line": {"old_commit_hash": "1111111", "new_commit_hash": "2222222", "mode": "100644"},
         "is_binary_file": False, "binary_line": None, "minus_file": {"path": "a/pkg/w.py"},
         "plus_file": {"path": "b/pkg/w.py"}, "old_file_content": "x = 1\ny = 2\n", "new_file_content": "x = 1\ny = 3",
         "hunks": [{"descriptor": {"old_range": {"start": 1, "length": 2}, "new_range": {"start": 1, "length": 2},
                                   "section": ""},
                    "line_group": {"all_lines": [
                        {"content": "x = 1", "type": "context"}, {"content": "y = 2", "type": "deleted"},
                        {"content": "y = 3", "type": "added"},
                        {"content": "No newline at end of file", "type": "note"}]}}]},
        {"header": {"file": {"path": "tests/test_w.py"}, "misc_line": "new file mode 100644"},
         "index_line": {"old_commit_hash": "0000000", "new_commit_hash": "3333333", "mode": ""},
         "is_binary_file": False, "binary_line": None, "minus_file": {"path": "/dev/null"},
         "plus_file": {"path": "b/tests/test_w.py"}, "old_file_content": "", "new_file_content": "...",
         "hunks": [{"descriptor": {"old_range": {"start": 0, "length": 0}, "new_range": {"start": 1, "length": 2},
                                   "section": ""},
                    "line_group": {"all_lines": [{"content": "from pkg.w import y", "type": "added"},
                                                 {"content": "def test_y(): assert y == 3", "type": "added"}]}}]}]}


def test_r2e_gym_gold_patch_is_derived_from_structured_file_diffs(tmp_path):
    """An R2E-Gym row without a `patch` column: the gold patch is rendered from the structured
    `file_diffs` (test files apart, as the test patch) and both apply with git to the base tree."""
    row = {"repo_name": "widgets", "docker_image": "namanjain12/widgets_final:c0ffee", "commit_hash": "c" * 40,
           "problem_statement": "[ISSUE]y is wrong[/ISSUE]", "parsed_commit_content": json.dumps(R2E_COMMIT),
           "expected_output_json": json.dumps({"test_w.py::test_y": "PASSED"}), "execution_result_content": ""}
    inst = normalise_row(row)
    assert inst.patch.startswith("diff --git a/pkg/w.py b/pkg/w.py\nindex 1111111..2222222 100644\n--- a/pkg/w.py\n")
    assert "-y = 2\n+y = 3\n\\ No newline at end of file\n" in inst.patch and "tests/" not in inst.patch
    assert inst.test_patch.startswith("diff --git a/tests/test_w.py b/tests/test_w.py\nnew file mode 100644\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "w.py").write_text("x = 1\ny = 2\n")  # the fix drops the last newline (the note)
    for patch in (inst.patch, inst.test_patch):
        done = subprocess.run(["git", "apply", "-"], cwd=tmp_path, input=patch, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "pkg" / "w.py").read_text() == "x = 1\ny = 3"
    assert (tmp_path / "tests" / "test_w.py").read_text().startswith("from pkg.w import y\n")
    # A `patch` column still wins; the writer of R2E-shaped fixtures round-trips through the same layout.
    assert normalise_row({**row, "patch": "P"}).patch == "P"
    from rollway.envs.r2e_diffs import file_diffs_from_patch, patch_from_file_diffs

    assert patch_from_file_diffs(file_diffs_from_patch(inst.patch + inst.test_patch)) == (inst.patch, inst.test_patch)


def test_reverse_patch_undoes_a_patch(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\nb = 2\nc = 3\n")
    bug = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1,3 +1,4 @@\n a = 1\n-b = 2\n+b = 20\n+d = 4\n c = 3\n"
    for patch in (bug, reverse_patch(bug)):
        done = subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=tmp_path, capture_output=True)
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "m.py").read_text() == "a = 1\nb = 2\nc = 3\n"


def test_predictions_report_and_atif_from_trajectories(tmp_path):
    trajs = [
        {"episode": {"episode_id": "e1", "group_id": "e1", "task_id": "a", "sample_index": 0}, "reward": 1.0, "resolved": True, "stop_reason": "finish",
         "prompt_length": 10, "grade": {"outcome": "resolved", "model_patch": "diff --git a/x b/x\n"},
         "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix it"}],
         "turns": [{"turn": 0, "assistant_text": "<tool_call>..</tool_call>", "completion_ids": [1, 2],
                    "logprobs": [-0.1, -0.2], "policy_version": 0, "finish_reason": "stop",
                    "observations": [{"tool": "bash", "arguments": {"command": "ls"}, "content": "x\n"}]}]},
        {"episode": {"episode_id": "e2", "group_id": "e2", "task_id": "b", "sample_index": 0}, "reward": 0.0, "resolved": False,
         "grade": {"outcome": "patch_failed", "model_patch": "junk"}},
        {"episode": {"episode_id": "e3", "group_id": "e3", "task_id": "c", "sample_index": 0}, "reward": 0.0, "resolved": False,
         "grade": {"outcome": "unresolved", "model_patch": ""}},
    ]
    cfg = argparse.Namespace(policy=argparse.Namespace(type="scripted"))
    report = write_predictions(tmp_path, cfg, ["a", "b", "c", "d"], trajs, {"d": "reward: GradingEnvError: env_error: x"})
    preds = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [p["instance_id"] for p in preds] == ["a", "b", "c"]
    assert set(preds[0]) == {"instance_id", "model_name_or_path", "model_patch"}
    assert (report["resolved_ids"], report["unresolved_ids"], report["error_ids"]) == (["a"], ["c"], ["b", "d"])
    atif = to_atif(trajs[0], "m")
    assert atif["schema_version"] == "ATIF-v1.4" and [s["source"] for s in atif["steps"]] == ["system", "user", "agent"]
    call = atif["steps"][2]["tool_calls"][0]
    assert atif["steps"][2]["observation"]["results"][0]["source_call_id"] == call["tool_call_id"]
    assert atif["steps"][2]["metrics"]["completion_token_ids"] == [1, 2]


# ---------------------------------------------------------------- built rows in real images


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rollway tasks")
    cmd_tasks.add_arguments(parser)
    return cmd_tasks.run(parser.parse_args(argv))


@pytest.fixture(scope="module")
def built(tmp_path_factory, toolz_swebench_row):
    """One instance from each of three libraries' source archives, as SWE-bench rows over a git mirror
    (built once per test run, `built_once`; sdists cached under ~/.cache/rollway, images cached on the
    engine). inflection and six are built here with the gold patch checked in their images (`--sandbox
    docker`); the toolz row is the session's (`toolz_swebench_row`, the same command's local check), its
    repository copied into this mirror."""
    import shutil

    ensure_engine()

    def build(folder: Path) -> None:
        mirror = folder / "mirror"
        # The two builds run side by side (each its own process; they share only the mirror folder, one
        # repository each).
        pool = ThreadPoolExecutor(len(LIBRARIES) - 1)
        jobs = [(out, pool.submit(run_with_progress, [sys.executable, "-m", "rollway.runners", "tasks", "build", "swe",
                                                      "--sdist", sdist, "--max-tasks", "1", "--sandbox", "docker",
                                                      "--mirror", str(mirror), "--out", str(out)], cwd=ROOT))
                for sdist in LIBRARIES[1:] for out in [folder / f"{sdist.split('==')[0]}.jsonl"]]
        rows = [json.loads(line) for line in (toolz_swebench_row / "rows.jsonl").read_text().splitlines()]
        mirror.mkdir(parents=True, exist_ok=True)
        shutil.copytree(toolz_swebench_row / "mirror" / "pypi__toolz.git", mirror / "pypi__toolz.git")
        with pool:
            for out, job in jobs:
                done = job.result()
                assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
                rows += [json.loads(line) for line in out.read_text().splitlines()]
        (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    return built_once(tmp_path_factory, "swebench-rows", build)


def test_built_rows_are_swebench_rows_over_real_commits(built):
    rows = [json.loads(line) for line in (built / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and {r["repo"] for r in rows} == {"pypi/toolz", "pypi/inflection", "pypi/six"}
    for row in rows:
        assert isinstance(row["FAIL_TO_PASS"], str) and json.loads(row["FAIL_TO_PASS"])  # JSON strings, as SWE-bench
        git = ["git", "-C", str(built / "mirror" / f"{row['repo'].replace('/', '__')}.git")]
        parent = subprocess.run([*git, "rev-parse", f"{row['base_commit']}^"], capture_output=True, text=True)
        assert parent.stdout.strip() == row["environment_setup_commit"]  # the bug is one commit on the clean sdist
        diff = subprocess.run([*git, "diff", row["base_commit"], row["environment_setup_commit"]], capture_output=True,
                              text=True).stdout
        assert diff.strip() and diff.splitlines()[-1] in row["patch"]  # gold patch = the bug commit reverted


def test_verify_gold_resolves_and_empty_does_not_in_images(built, capsys):
    # Generous time limits: on a loaded machine a test run in a 1-CPU container can take minutes.
    assert cli(["verify", str(built / "rows.jsonl"), "--mirror", str(built / "mirror"), "--json", "--timeout", "600",
                "--sandbox", "docker"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["total"], summary["gold_resolved"], summary["empty_resolved"]) == (3, 3, 0)


def test_each_format_variant_grades_like_the_swebench_row(built, tmp_path):
    """The toolz row rewritten as a row of each dataset: the same loader and grader, gold 1, empty 0.
    (SWE-smith starts from the clean commit plus its bug patch: a second image is built for it.)"""
    row = json.loads((built / "rows.jsonl").read_text().splitlines()[0])
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))
    for fmt in ("swe-gym", "swe-smith", "r2e-gym"):
        path = tmp_path / f"{fmt}.jsonl"
        path.write_text(json.dumps(as_variant(row, fmt)) + "\n")
        taskset = SWEBenchTaskSet(TasksConfig(type="swebench", path=str(path), mirror=str(built / "mirror"), test_timeout_s=600))
        taskset.sandbox_config = SandboxConfig(type="docker")  # workspaces from images
        inst = next(iter(taskset.instances.values()))
        assert inst.source_format == fmt
        spec = taskset.spec_for(inst)
        # One after the other: graded side by side on a loaded 2-core machine, tests can reach their timeout.
        gold = run(grade_instance(inst, inst.patch, provider, spec, taskset.settings))
        empty = run(grade_instance(inst, "", provider, spec, taskset.settings))
        assert (gold.resolved, gold.reward, empty.resolved, empty.reward) == (True, 1.0, False, 0.0), (fmt, gold)


def test_missing_image_builds_once_in_a_thread_while_other_episodes_start(built, tmp_path):
    """Two episodes of an instance whose image is missing (a fresh install command: a new build key) build it
    once, in a thread: meanwhile, on the same event loop, another instance's sandbox is created and ready
    long before that build ends."""
    import time

    rows = [json.loads(line) for line in (built / "rows.jsonl").read_text().splitlines()]
    slow = {**rows[0], "install": f"sleep 8  # {uuid.uuid4().hex}"}
    (tmp_path / "rows.jsonl").write_text(json.dumps(slow) + "\n" + json.dumps(rows[1]) + "\n")
    taskset = SWEBenchTaskSet(TasksConfig(type="swebench", path=str(tmp_path / "rows.jsonl"),
                                          mirror=str(built / "mirror")))
    taskset.sandbox_config = SandboxConfig(type="docker")  # workspaces from images
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))
    task_a, task_b = taskset.get(slow["instance_id"]), taskset.get(rows[1]["instance_id"])
    run(taskset.prepare(task_b))  # B's image ready first (found, or built by this call)
    before = list(taskset.images.built)

    async def episodes() -> tuple[float, float]:
        t0 = time.monotonic()
        builds = [asyncio.create_task(taskset.prepare(task_a)) for _ in range(2)]
        await asyncio.sleep(0.5)
        box = await provider.create(taskset.sandbox_spec(task_b), f"other-{uuid.uuid4().hex[:6]}")
        other_ready = time.monotonic() - t0
        await box.destroy()
        await asyncio.gather(*builds)
        return other_ready, time.monotonic() - t0

    other_ready, built_at = run(episodes())
    new = taskset.images.built[len(before):]
    try:
        assert len(new) == 1 and new[0].startswith("rollway-swe/") and built_at >= 8.0, (new, built_at)
        assert other_ready < built_at - 3.0, (other_ready, built_at)
        assert taskset.sandbox_spec(task_a).image == new[0]  # found without a second build
    finally:
        for tag in new:  # unique to this run (a fresh install command): leave none behind
            taskset.images.client.images.remove(tag, force=True)


def test_typed_outcomes(built):
    rows = [json.loads(line) for line in (built / "rows.jsonl").read_text().splitlines()]
    taskset = SWEBenchTaskSet(TasksConfig(type="swebench", path=str(built / "rows.jsonl"), mirror=str(built / "mirror"),
                                          test_timeout_s=600))
    taskset.sandbox_config = SandboxConfig(type="docker")  # workspaces from images
    inst = taskset.instances[rows[0]["instance_id"]]
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))
    spec = taskset.spec_for(inst)
    junk = "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n"
    failed = run(grade_instance(inst, junk, provider, spec, taskset.settings))
    assert (failed.reward, failed.stop_reason, failed.details["outcome"]) == (0.0, "patch_failed", "patch_failed")
    with pytest.raises(ValueError, match="env_error"):  # the agent's outcomes cannot be made retried failures
        TasksConfig(type="swebench", path=str(built / "rows.jsonl"), failure_outcomes=["env_error", "patch_failed"])
    slow = inst.__class__(**{**inst.__dict__, "test_command": "sleep 30"})
    timed = run(grade_instance(slow, "", provider, spec, GradeSettings(timeout_s=2)))
    assert (timed.reward, timed.stop_reason) == (0.0, "test_timeout")
    broken = inst.__class__(**{**inst.__dict__, "test_patch": junk})
    with pytest.raises(GradingEnvError, match="env_error: test_patch"):
        run(grade_instance(broken, inst.patch, provider, spec, taskset.settings))
    missing = inst.__class__(**{**inst.__dict__, "test_command": "no-such-runner -q"})
    with pytest.raises(GradingEnvError, match="could not start"):
        run(grade_instance(missing, inst.patch, provider, spec, taskset.settings))


def test_grading_in_images_resists_tampering(built):
    """The agent is an adversary (real image, real Docker engine, the bug left unfixed): a conftest.py that
    turns failures into passes is not graded; code that exits 127 when the tests import it is a graded 0
    (the runner was checked on the unpatched tree), never an env_error to retry; a 3 MB diff leaves a
    grade that still fits a broker message."""
    from test_grading_tamper import FORGE_PLUGIN

    rows = [json.loads(line) for line in (built / "rows.jsonl").read_text().splitlines()]
    taskset = SWEBenchTaskSet(TasksConfig(type="swebench", path=str(built / "rows.jsonl"), mirror=str(built / "mirror"),
                                          test_timeout_s=600))
    taskset.sandbox_config = SandboxConfig(type="docker")  # workspaces from images
    task = taskset.get(rows[0]["instance_id"])
    buggy_module = taskset.instances[task.task_id].patch.split(" b/", 1)[1].split("\n", 1)[0]
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))

    async def episode(edit):
        sandbox = await provider.create(taskset.sandbox_spec(task), f"tamper-{uuid.uuid4().hex[:8]}")
        try:
            await edit(sandbox)
            return await taskset.grade(task, sandbox, provider, Episode.outside_run(task))
        finally:
            await sandbox.destroy()

    async def conftest(sandbox):
        await sandbox.write_file("conftest.py", FORGE_PLUGIN)

    async def exit_127(sandbox):
        await sandbox.write_file(buggy_module, await sandbox.read_file(buggy_module) + "\nimport os\nos._exit(127)\n")

    async def huge(sandbox):
        await sandbox.write_file("notes.py", "x = 1  # padding\n" * 180_000)

    forged = run(episode(conftest))
    assert forged.reward == 0.0 and forged.details["dropped_runner_files"] == ["conftest.py"], forged.details
    opted_out = run(episode(exit_127))
    assert (opted_out.reward, opted_out.details["outcome"]) == (0.0, "no_report"), opted_out.details
    big = run(episode(huge))
    assert big.details["model_patch_truncated"] and big.details["model_patch_chars"] > 3_000_000
    assert len(json.dumps(big.details)) < 300_000


def test_images_are_found_by_template_and_cached(built):
    from rollway.envs.swe_images import InstanceImages

    rows = load_swe_instances(built / "rows.jsonl")
    first = InstanceImages(str(built / "mirror"), "sweb.eval.x86_64.{id_docker}:latest", "rollway-sandbox:bookworm")
    tag = first.image_for(rows[0])
    client = ensure_engine()
    labels = client.images.get(tag).labels
    assert labels["rollway.swe.instance"] == rows[0].instance_id
    # A fresh process finds the built image by its key instead of building (no mirror needed any more).
    assert InstanceImages(None, "x-{id_docker}", "rollway-sandbox:bookworm").image_for(rows[0]) == tag
    # A repository missing from the mirror is cloned from tasks.git_url (here a file:// URL).
    src = built / "upstream" / "pypi"
    src.mkdir(parents=True, exist_ok=True)
    if not (src / "toolz.git").exists():
        (src / "toolz.git").symlink_to(built / "mirror" / "pypi__toolz.git")
    cloned = InstanceImages(str(built / "fresh-mirror"), "x", "rollway-sandbox:bookworm",
                            git_url=f"file://{built / 'upstream'}/{{repo}}.git")
    from rollway.envs.swe_images import find_repo

    repo = find_repo(cloned.mirror, "pypi/toolz", cloned.git_url)
    assert repo == built / "fresh-mirror" / "pypi__toolz.git" and (repo / "HEAD").is_file()
    # An image named by the template is found, not built: its tree as it is, without its repository's history
    # (an image rollway did not build may hold the commits around base_commit in repo_dir/.git).
    named = f"rollway-test-template/{uuid.uuid4().hex[:8]}:latest"
    client.images.get(tag).tag(named)
    found = InstanceImages(None, named.replace(":latest", "") + ":latest", "x")
    try:
        derived = found.image_for(rows[0])
        assert derived.startswith("rollway-nohistory/") and client.images.get(derived)
    finally:
        client.images.remove(named)


def test_eval_with_a_scripted_policy_reproduces_its_resolved_ids(built, broker, tmp_path):
    """Through `rollway eval` with docker sandboxes: the script applies the gold patch (editor calls) on
    the toolz instance only and gives up at once on the others; the report lists exactly that one as
    resolved, and the predictions file and ATIF trajectories come out."""
    rows = [json.loads(line) for line in (built / "rows.jsonl").read_text().splitlines()]
    target = rows[0]
    # A fourth instance whose test_patch does not apply: env_error, retried, then reported as an error.
    broken = {**target, "instance_id": "broken__env-1", "test_patch": "diff --git a/no.py b/no.py\n--- a/no.py\n"
              "+++ b/no.py\n@@ -1 +1 @@\n-a\n+b\n"}
    (tmp_path / "rows.jsonl").write_text((built / "rows.jsonl").read_text() + json.dumps(broken) + "\n")
    finish = '<tool_call>{"name": "finish", "arguments": {}}</tool_call>'
    script = [{"when": f"Repository: {target['repo']} ", "turns": [*editor_fix_calls(target["patch"]), finish]},
              {"when": "", "turns": [finish]}]
    cfg = {"run": {"name": "swebench-eval", "timeout_s": 1200}, "eval": {"attempts": 1},
           "tasks": {"type": "swebench", "path": str(tmp_path / "rows.jsonl"), "mirror": str(built / "mirror"),
                     "test_timeout_s": 600},
           "scheduler": {"episode_deadline_s": 900, "max_attempts": 2},
           "agent": {"max_turns": 6, "max_tokens_per_turn": 4096, "max_total_tokens": 100000},
           "sandbox": {"type": "docker"}, "policy": {"type": "scripted", "script": script}}
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "eval", str(tmp_path / "eval.yaml"), "--run-dir",
                          str(run_dir), "--bootstrap", broker.bootstrap, "runtime.processes=one", f"topics.prefix=sb{uuid.uuid4().hex[:6]}-"],
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((run_dir / "swebench_report.json").read_text())
    assert report["resolved_ids"] == [target["instance_id"]]
    assert sorted(report["unresolved_ids"]) == sorted(r["instance_id"] for r in rows[1:])
    assert report["error_ids"] == ["broken__env-1"] and "env_error: test_patch" in report["errors"]["broken__env-1"]
    preds = {p["instance_id"]: p for p in map(json.loads, (run_dir / "predictions.jsonl").read_text().splitlines())}
    assert set(preds) == {r["instance_id"] for r in rows}  # no trajectory, no prediction for the errored one
    assert preds[target["instance_id"]]["model_patch"].startswith("diff --git a/")
    assert len(list((run_dir / "atif").glob("*.json"))) == 3
    failures = [json.loads(line) for line in (run_dir / "failures.jsonl").read_text().splitlines()]
    assert sum(f["episode"]["task_id"] == "broken__env-1" and f["stage"] == "reward" for f in failures) == 2  # retried once
