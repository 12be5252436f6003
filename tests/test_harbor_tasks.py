"""`tasks.type: harbor`: the five Harbor task folders in examples/harbor built and verified on the real
Docker engine (solutions pass, empty runs do not), FROM mapping, typed verifier outcomes, and a scripted
policy solving one task through `rollway eval`."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from docker_engine import ensure_engine
from jobs import run_with_progress

from rollway.base.config import ConfigError
from rollway.config.run import load_config
from rollway.envs.config import TasksConfig
from rollway.envs.harbor import (
    HarborTaskSet,
    check_task,
    load_tasks,
    map_from_lines,
    workdir_of,
)
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.docker import DockerSandboxProvider

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "examples" / "harbor"


def test_tasks_load_with_their_timeouts():
    tasks = load_tasks(TASKS)
    assert [t.name for t in tasks] == ["file-permissions", "git-feature-branch", "log-top-ips", "process-timeout",
                                       "zipapp-build"]
    assert all(t.timeout("verifier", 0) == 60.0 and t.timeout("agent", 0) == 300.0 and t.has_solution for t in tasks)


def test_harbor_tasks_with_the_local_sandbox_are_refused_when_the_config_loads():
    """A Harbor task's environment is its Dockerfile's image: with the jail, every episode's init failed (as a
    retryable setup error) instead of the run being refused once."""
    with pytest.raises(ConfigError, match=r"tasks\.type=harbor runs in sandbox\.type=docker, not sandbox\.type=local"):
        load_config(None, ["tasks.type=harbor", f"tasks.path={TASKS}", "sandbox.type=local"])
    assert load_config(None, ["tasks.type=harbor", f"tasks.path={TASKS}", "sandbox.type=docker"]).sandbox.type == "docker"


def test_from_lines_naming_missing_images_are_mapped_to_the_base():
    text = ("FROM --platform=linux/amd64 python:3.12-slim AS build\nRUN make\n"
            "FROM build AS test\nFROM local:yes\nWORKDIR /srv/app\n")
    mapped, mapping = map_from_lines(text, lambda image: image == "local:yes", "rollway-sandbox:bookworm")
    assert mapping == {"python:3.12-slim": "rollway-sandbox:bookworm"}
    assert mapped.splitlines()[0] == "FROM rollway-sandbox:bookworm AS build"  # the platform goes with the image
    assert "FROM build AS test" in mapped and "FROM local:yes" in mapped  # a stage and a local image stay
    assert workdir_of(mapped) == "/srv/app" and workdir_of("FROM x\n") == "/app"


def test_verify_runs_every_solution_and_an_empty_run(capsys):
    """`rollway tasks verify` on the five tasks: every solution scores 1, every empty run 0."""
    ensure_engine()
    from rollway.runners.cli import main

    assert main(["tasks", "verify", str(TASKS), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["total"], summary["oracle_passed"], summary["empty_passed"]) == (5, 5, 0), summary
    assert all(r["oracle_reward"] == 1.0 and r["empty_reward"] == 0.0 for r in summary["tasks"]), summary["tasks"]


def test_verify_runs_a_check_whose_engine_lost_its_output_again_in_a_fresh_sandbox(monkeypatch, capsys):
    """The engine's fault is injected (the only fake here): the first verifier command of the empty run
    raises what DockerSandbox raises when the engine drops an exec's output (moby#27289, seen under load in
    a full suite run). The real engine, task and verifier then run the check again in a fresh sandbox; the
    task is not reported as broken."""
    from rollway.envs.harbor_verifier import STARTED
    from rollway.sandboxes.base import OutputLost
    from rollway.sandboxes.docker import USER, DockerSandbox

    ensure_engine()
    real, lost = DockerSandbox._exec, []

    def exec_losing_once(self, command, limits, user=USER):
        if STARTED in command and not lost and re.search(r"-e[0-9a-f]{8}", self.name):
            lost.append(self.name)
            raise OutputLost(f"the Docker engine lost the output of a command in {self.name} (injected)")
        return real(self, command, limits, user)

    monkeypatch.setattr(DockerSandbox, "_exec", exec_losing_once)
    from rollway.runners.cli import main

    # Through the CLI: the warning about the loss goes to stderr, stdout stays the JSON result (seen in a full
    # run: the warning line on stdout broke `--json`).
    assert main(["tasks", "verify", str(TASKS / "file-permissions"), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["tasks"]
    assert lost and (row["oracle_reward"], row["empty_reward"], row["empty_tries"]) == (1.0, 0.0, 2), row


def test_verifier_outcomes(tmp_path):
    """A test script that writes no reward scores 0 (no_reward: no opt-out through env_error); one that
    runs past [verifier].timeout_sec scores 0 as test_timeout; reward.json is read too."""
    ensure_engine()
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))
    cases = {"no-reward": "echo nothing\n", "slow": "sleep 30\n",
             "json-reward": 'echo \'{"reward": 0.5}\' > /logs/verifier/reward.json\n'}
    for name, script in cases.items():
        task = tmp_path / name
        shutil.copytree(TASKS / "file-permissions", task)
        (task / "tests" / "test.sh").write_text("#!/bin/bash\n" + script)
        (task / "task.toml").write_text((task / "task.toml").read_text().replace("timeout_sec = 60.0", "timeout_sec = 3.0"))
    taskset = HarborTaskSet(TasksConfig(type="harbor", path=str(tmp_path)))

    def check(name: str):
        task = taskset.by_name[name]
        return asyncio.run(check_task(task, provider, taskset.spec_for(task), oracle=False))

    silent = check("no-reward")
    assert (silent.reward, silent.details["outcome"]) == (0.0, "no_reward")
    slow = check("slow")
    assert (slow.reward, slow.stop_reason) == (0.0, "test_timeout")
    half = check("json-reward")
    assert (half.reward, half.resolved) == (0.5, False)


def test_eval_with_a_scripted_policy_solves_one_task(broker, tmp_path):
    """Through `rollway eval` with docker sandboxes: the script fixes the permissions task with bash calls
    in the task's working directory (/app is the workspace) and gives up at once on the others."""
    ensure_engine()
    bash = '<tool_call>{{"name": "bash", "arguments": {{"command": "{}"}}}}</tool_call>'
    finish = '<tool_call>{"name": "finish", "arguments": {}}</tool_call>'
    script = [{"when": "fix the file permissions", "turns": [
        bash.format("cd /app && chmod 755 deploy.sh && chmod 600 secret.key"),
        bash.format("chmod 644 public/*"), finish]},
        {"when": "", "turns": [finish]}]
    cfg = {"run": {"name": "harbor-eval", "timeout_s": 900}, "eval": {"attempts": 1},
           "tasks": {"type": "harbor", "path": str(TASKS)}, "scheduler": {"episode_deadline_s": 300},
           "agent": {"max_turns": 5}, "sandbox": {"type": "docker"}, "policy": {"type": "scripted", "script": script}}
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "eval", str(tmp_path / "eval.yaml"), "--run-dir",
                          str(run_dir), "--bootstrap", broker.bootstrap, "runtime.processes=one", f"topics.prefix=hb{uuid.uuid4().hex[:6]}-"],
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((run_dir / "swebench_report.json").read_text())
    assert report["resolved_ids"] == ["file-permissions"] and len(report["unresolved_ids"]) == 4
    atif = [json.loads(p.read_text()) for p in (run_dir / "atif").glob("*.json")]
    solved = next(a for a in atif if a["extra"]["task_id"] == "file-permissions")
    calls = [c["function_name"] for s in solved["steps"] for c in s.get("tool_calls", [])]
    assert calls == ["bash", "bash", "finish"] and solved["extra"]["reward"] == 1.0


def _task_copy(tmp_path: Path, name: str, test_sh: str, solve_sh: str, toml_edits: dict[str, str] | None = None) -> Path:
    """A copy of the file-permissions task with its own tests/solution scripts and task.toml edits."""
    task = tmp_path / name
    shutil.copytree(TASKS / "file-permissions", task)
    (task / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve_sh)
    text = (task / "task.toml").read_text()
    for old, new in (toml_edits or {}).items():
        assert old in text
        text = text.replace(old, new)
    (task / "task.toml").write_text(text)
    return task


def test_binary_files_in_tests_and_solution_arrive_byte_exact(tmp_path):
    """Binary fixture files (every byte value, invalid UTF-8) in solution/ and tests/ reach the sandbox
    byte for byte, an executable helper keeps its x bit: the solution copies its blob, the tests compare
    it with theirs (oracle 1, empty 0)."""
    ensure_engine()
    blob = bytes(range(256)) * 4 + b"\xff\xfe\x00\x80 not utf-8 \xc3\x28"
    task = _task_copy(tmp_path, "binary", "cd /app\n/tests/same.sh /tests/expected.bin out.bin "
                      "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
                      "cp /solution/blob.bin /app/out.bin\n")
    (task / "solution" / "blob.bin").write_bytes(blob)
    (task / "tests" / "expected.bin").write_bytes(blob)
    (task / "tests" / "same.sh").write_text('#!/bin/bash\ncmp "$1" "$2"\n')
    (task / "tests" / "same.sh").chmod(0o755)
    taskset = HarborTaskSet(TasksConfig(type="harbor", path=str(task)))
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))
    harbor_task = taskset.by_name["binary"]
    oracle = asyncio.run(check_task(harbor_task, provider, taskset.spec_for(harbor_task), oracle=True))
    empty = asyncio.run(check_task(harbor_task, provider, taskset.spec_for(harbor_task), oracle=False))
    assert (oracle.reward, empty.reward) == (1.0, 0.0)


def test_default_write_bytes_goes_through_exec(tmp_path):
    """The base class's write_bytes (for sandboxes that do not write files directly), run in a real
    local jail: base64 chunks through exec, more than one chunk, bytes kept."""
    from rollway.sandboxes.base import Sandbox, SandboxSpec
    from rollway.sandboxes.local import LocalSandboxProvider

    provider = LocalSandboxProvider(SandboxConfig(root=str(tmp_path / "boxes")))
    data = bytes(range(256)) * 300  # 76 800 bytes: two base64 chunks

    async def go() -> bytes:
        box = await provider.create(SandboxSpec(), "wb-default")
        try:
            await Sandbox.write_bytes(box, "d/blob.bin", data, executable=True)
            listed = await box.exec("test -x d/blob.bin && echo exec")
            assert "exec" in listed.output
            return (Path(box.workspace_path) / "d" / "blob.bin").read_bytes()
        finally:
            await box.destroy()

    assert asyncio.run(go()) == data


def test_task_memory_and_cpu_limits_apply_to_its_container(tmp_path):
    """[environment] memory_mb/cpus/storage_mb replace sandbox.* for the task's container: a solution that
    allocates 200 MB passes under memory_mb = 512 and fails under memory_mb = 64 (killed or MemoryError)."""
    client = ensure_engine()
    solve = ("python3 -c 'b = bytearray(200 << 20); b[::4096] = b\"x\" * len(b[::4096])' && echo done > /app/out.txt\n")
    test = "[ -f /app/out.txt ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
    _task_copy(tmp_path, "roomy", test, solve, {"cpus = 1": "cpus = 0.5"})
    _task_copy(tmp_path, "tight", test, solve, {"memory_mb = 512": "memory_mb = 64", "storage_mb = 1024": "storage = \"32M\""})
    taskset = HarborTaskSet(TasksConfig(type="harbor", path=str(tmp_path)))
    provider = DockerSandboxProvider(SandboxConfig(type="docker", memory_mb=1024, cpus=1.0))
    roomy, tight = taskset.by_name["roomy"], taskset.by_name["tight"]
    assert taskset.spec_for(tight).memory_mb == 64 and taskset.spec_for(tight).workspace_mb == 32
    # The container's own settings, read back from the engine.
    box = asyncio.run(provider.create(taskset.spec_for(roomy), f"limits-{uuid.uuid4().hex[:6]}"))
    try:
        host = client.api.inspect_container(box.container_id)["HostConfig"]
        assert (host["Memory"], host["NanoCpus"]) == (512 * 2**20, 500_000_000)
        assert "size=1024m" in client.volumes.get(f"rollway-{box.name}").attrs["Options"]["o"]
    finally:
        asyncio.run(box.destroy())
    assert asyncio.run(check_task(roomy, provider, taskset.spec_for(roomy), oracle=True)).reward == 1.0
    assert asyncio.run(check_task(tight, provider, taskset.spec_for(tight), oracle=True)).reward == 0.0


def test_spec_memory_limit_applies_in_the_local_jail(tmp_path):
    """The same per-sandbox limit in a bubblewrap jail: 300 MB fit under the configured 1024 MB and not
    under the spec's 128 MB (the memory cgroup kills the process as root; without a cgroup the
    per-process address space, then also the spec's, refuses it: MemoryError)."""
    from rollway.sandboxes import cgroups
    from rollway.sandboxes.base import SandboxSpec
    from rollway.sandboxes.local import LocalSandboxProvider

    provider = LocalSandboxProvider(SandboxConfig(root=str(tmp_path / "boxes"), memory_mb=1024))
    alloc = "python3 -c 'b = bytearray(300 << 20); b[::4096] = b\"x\" * len(b[::4096]); print(\"fits\")'"

    async def go(memory_mb: int | None) -> tuple[str, str | None]:
        box = await provider.create(SandboxSpec(memory_mb=memory_mb, cpus=0.5), f"jail-mem-{memory_mb}")
        try:
            result = await box.exec(alloc)
            out = f"{result.output}exit {result.exit_code}"
            group = provider.cgroup(box.box_dir.name, create=False)
            limit = Path(group.dirs[0], "memory.limit_in_bytes" if group.kind == "v1" else "memory.max")
            return out, limit.read_text().strip() if group is not None else None
        finally:
            await box.destroy()

    roomy_out, roomy_limit = asyncio.run(go(None))
    tight_out, tight_limit = asyncio.run(go(128))
    assert "fits" in roomy_out and "fits" not in tight_out, tight_out
    if cgroups.mechanism() is not None:  # root here: the whole-sandbox cgroup carries the spec's limit
        assert (roomy_limit, tight_limit) == (str(1024 * 2**20), str(128 * 2**20))
        assert tight_out.endswith("exit 137"), tight_out  # killed by the cgroup (SIGKILL)
    else:
        assert "MemoryError" in tight_out


def test_short_agent_timeout_ends_the_episode_with_its_reason(broker, tmp_path):
    """Through `rollway eval`: a task with [agent] timeout_sec = 4 whose agent runs `sleep 60`: the command
    is killed at the task's limit, the episode ends with stop reason agent_timeout and is graded (reward 0,
    not a failure)."""
    ensure_engine()
    tasks = tmp_path / "tasks"
    _task_copy(tasks, "slow-agent", "echo 0 > /logs/verifier/reward.txt\n", "true\n",
               {"[agent]\ntimeout_sec = 300.0": "[agent]\ntimeout_sec = 4.0"})
    bash = '<tool_call>{"name": "bash", "arguments": {"command": "sleep 60"}}</tool_call>'
    script = [{"when": "", "turns": [bash, bash, bash]}]
    cfg = {"run": {"name": "harbor-timeout", "timeout_s": 600}, "eval": {"attempts": 1},
           "tasks": {"type": "harbor", "path": str(tasks)}, "scheduler": {"episode_deadline_s": 300},
           "agent": {"max_turns": 5}, "tools": {"bash_timeout_s": 120},
           "sandbox": {"type": "docker", "exec_timeout_s": 120}, "policy": {"type": "scripted", "script": script}}
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "eval", str(tmp_path / "eval.yaml"), "--run-dir",
                          str(run_dir), "--bootstrap", broker.bootstrap, "runtime.processes=one", f"topics.prefix=hbt{uuid.uuid4().hex[:6]}-"],
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 1 and trajs[0]["stop_reason"] == "agent_timeout" and trajs[0]["reward"] == 0.0
    assert trajs[0]["num_turns"] == 1  # the first `sleep 60` was cut at the limit; no second model call
    assert "task images ready" in out.stderr + out.stdout  # built before the stages started (prebuild_images)


def test_build_images_command_builds_each_task_image_once(tmp_path, capsys):
    """`rollway tasks build-images CONFIG`: a task whose image is not on the engine is built (and listed as
    built); a second run finds it and builds nothing."""
    client = ensure_engine()
    from rollway.runners.cli import main

    task = _task_copy(tmp_path / "tasks", "fresh-image", "echo 1 > /logs/verifier/reward.txt\n", "true\n")
    dockerfile = task / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + f"RUN echo {uuid.uuid4().hex} > /etc/rollway-marker\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"tasks": {"type": "harbor", "path": str(tmp_path / "tasks")},
                                   "sandbox": {"type": "docker"}}))
    assert main(["tasks", "build-images", str(cfg), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert list(first["images"]) == ["fresh-image"] and first["built"] == [first["images"]["fresh-image"]]
    try:
        assert main(["tasks", "build-images", str(cfg), "--json"]) == 0
        second = json.loads(capsys.readouterr().out)
        assert second["images"] == first["images"] and second["built"] == [] and not second["failed"]
    finally:
        client.images.remove(first["images"]["fresh-image"], force=True)  # unique to this run: leave none behind


def test_two_verifications_of_one_task_at_once_do_not_share_a_container():
    """Two `tasks verify` (or two tests) checking one task at the same moment: each must get its own
    container. With a name fixed per task, the second create met the first's container and removed it
    mid-run ("removal already in progress", an env_error; seen in a CI run of the suite)."""
    ensure_engine()
    taskset = HarborTaskSet(TasksConfig(type="harbor", path=str(TASKS / "file-permissions")))
    task = next(iter(taskset.by_name.values()))
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))
    spec = taskset.spec_for(task)

    async def both():
        return await asyncio.gather(check_task(task, provider, spec, oracle=True),
                                    check_task(task, provider, spec, oracle=True))

    grades = asyncio.run(both())
    assert [g.reward for g in grades] == [1.0, 1.0], [g.outcome for g in grades]
