"""Harbor tasks against an adversarial policy and adversarial task folders (issue 25), on the real Docker
engine: a verifier the agent cannot reach (forged reward files graded 0, in separate and shared mode), no
env_error opt-out for a test that writes no reward, [verifier] user and env honoured, task folders that stay
data (symlinks out of the folder, names and WORKDIRs that would inject lines refused), image builds without
the host's network, and the example tasks passing `harbor lint`.

The agent's moves are played by the task's solution/solve.sh (run in the agent's sandbox exactly as the
agent's bash tool would run them): that script is the scripted policy; everything else is real."""

from __future__ import annotations

import asyncio
import io
import os
import re
import shutil
import socket
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

import pytest
from docker_engine import ensure_engine

from rollway.envs.config import TasksConfig
from rollway.envs.harbor import HarborTaskError, HarborTaskSet, check_task, load_tasks, run_solution
from rollway.envs.harbor_verifier import VERIFIER_TIMEOUT_S, as_data, verify
from rollway.sandboxes.base import SandboxError
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.docker import DockerSandboxProvider

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "examples" / "harbor"
HARBOR_VENV = Path.home() / ".cache" / "rollway" / "harbor-venv"

FORGE = ("mkdir -p /workspace/.rollway/harbor/logs/verifier && echo 1 > /logs/verifier/reward.txt && echo '{\"reward\": 1}' > "
         "/logs/verifier/reward.json && chmod 444 /logs/verifier/reward.* && chmod 555 /logs/verifier /logs\n")
"""The attack: a reward written before the verifier runs, its folders made unwritable so test.sh cannot
replace it (the task itself, fixing file modes, is left undone)."""


def _task(tmp_path: Path, name: str, solve_sh: str, test_sh: str | None = None, verifier: str = "") -> Path:
    """A copy of the file-permissions task with its own solve.sh (the policy's moves), optionally its own
    test.sh, and extra lines under [verifier]."""
    task = tmp_path / name
    shutil.copytree(TASKS / "file-permissions", task)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve_sh)
    if test_sh is not None:
        (task / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
    _add_toml(task, "verifier", verifier)
    return task


def _add_toml(task: Path, section: str, lines: str) -> None:
    """`lines` added to task.toml's [section] (made when missing)."""
    toml = (task / "task.toml").read_text()
    if "environment_mode" in lines:  # replaces the example's own
        toml = toml.replace('environment_mode = "separate"\n', "")
    head = f"[{section}]\n"
    toml = toml.replace(head, head + lines, 1) if head in toml else head + lines + toml
    (task / "task.toml").write_text(toml)


def _grade(task_dir: Path, oracle: bool = True):
    taskset = HarborTaskSet(TasksConfig(type="harbor", path=str(task_dir)))
    task = next(iter(taskset.by_name.values()))
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))
    return asyncio.run(check_task(task, provider, taskset.spec_for(task), oracle=oracle))


@pytest.mark.parametrize("mode", ["separate", "shared"])
def test_forged_reward_in_a_locked_folder_is_graded_zero(tmp_path, mode):
    """The agent pre-writes reward.txt and reward.json and makes /logs unwritable: test.sh still runs
    (on the untouched task) and the grade is 0, in both verifier modes."""
    ensure_engine()
    grade = _grade(_task(tmp_path, f"forge-{mode}", FORGE, verifier=f'environment_mode = "{mode}"\n'))
    assert (grade.reward, grade.resolved) == (0.0, False), grade.details
    assert grade.details["verifier_mode"] == mode


@pytest.mark.parametrize("mode", ["separate", "shared"])
def test_forged_reward_beside_an_honest_fix_still_needs_the_tests(tmp_path, mode):
    """The same forgery beside a real fix: test.sh runs all the same and its own reward (1) counts; its
    folder held nothing of the agent's (a stray file the agent left there would fail the test)."""
    ensure_engine()
    solve = (TASKS / "file-permissions" / "solution" / "solve.sh").read_text()
    test = (TASKS / "file-permissions" / "tests" / "test.sh").read_text().replace(
        "echo $ok >", "[ -e /logs/verifier/extra.txt ] && ok=0\necho $ok >")
    grade = _grade(_task(tmp_path, f"forge-fix-{mode}", solve + "echo 0.5 > /logs/verifier/extra.txt\n" + FORGE,
                         test, f'environment_mode = "{mode}"\n'))
    assert (grade.reward, grade.resolved) == (1.0, True), grade.details


def test_separate_verifier_gets_the_workspace_and_nothing_else(tmp_path):
    """Separate mode: the agent's files in its working directory reach the verifier (modes kept, a link
    kept as a link), its /tmp and its links planted in place of /logs do not."""
    ensure_engine()
    solve = ("echo made > /app/made.txt && chmod 640 /app/made.txt && ln -s made.txt /app/link && "
             "echo planted > /tmp/planted && rm -rf /workspace/.rollway/harbor && "
             "ln -s /tmp /workspace/.rollway/harbor\n")
    test = ('cd /app; ok=1; [ "$(cat made.txt)" = made ] && [ "$(stat -c %a made.txt)" = 640 ] || ok=0\n'
            '[ -L link ] && [ "$(readlink link)" = made.txt ] || ok=0; [ -e /tmp/planted ] && ok=0\n'
            'echo $ok > /logs/verifier/reward.txt\n')
    grade = _grade(_task(tmp_path, "carried", solve, test))
    assert grade.reward == 1.0, grade.details


def test_a_workspace_bigger_than_its_volume_is_not_carried(tmp_path):
    """The copy out of the agent's container is bounded: a sparse 200 MB file in a 32 MB workspace (it
    takes no room there, but 200 MB in an archive) stops the copy at the bound and is graded 0."""
    ensure_engine()
    task = _task(tmp_path, "sparse", "truncate -s 200M /app/sparse\n", "echo 1 > /logs/verifier/reward.txt\n")
    _add_toml(task, "environment", "")
    (task / "task.toml").write_text((task / "task.toml").read_text().replace("storage_mb = 1024", "storage_mb = 32"))
    grade = _grade(task)
    assert (grade.reward, grade.details["outcome"], grade.details["limit_mb"]) == (0.0, "workspace_too_large", 32)


def test_build_network_opt_in_is_logged(tmp_path):
    """Image builds get no network by default; tasks.build_network=host opts in, with a warning."""
    import structlog

    task = _task(tmp_path, "netted", "true\n")
    assert HarborTaskSet(TasksConfig(type="harbor", path=str(task))).images.network == "none"
    with structlog.testing.capture_logs() as logs:
        taskset = HarborTaskSet(TasksConfig(type="harbor", path=str(task), build_network="host"))
    assert taskset.images.network == "host"
    assert [(e["log_level"], e["network"]) for e in logs] == [("warning", "host")]


def _example(tmp_path: Path, name: str, solve_sh: str) -> Path:
    """A copy of example task `name` whose solution (the policy's moves) is `solve_sh`."""
    task = tmp_path / name
    shutil.copytree(TASKS / name, task)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve_sh)
    return task


def test_a_git_hook_in_the_agents_repository_does_not_run_in_the_verifier(tmp_path):
    """git-feature-branch, left undone; the agent sets core.fsmonitor in /app/repo/.git/config to a script
    that starts a process turning every 0 in reward.txt into 1. git run in that repository by test.sh would
    run it with the verifier's rights; the example reads the repository through a fresh bare clone instead."""
    ensure_engine()
    flip = ("cd /app/repo && printf '#!/bin/bash\\n( while :; do read -r v < /logs/verifier/reward.txt; "
            "[ \"$v\" = 0 ] && echo 1 > /logs/verifier/reward.txt; done ) >/dev/null 2>&1 &\\nexit 1\\n' "
            "> .git/flip.sh && chmod +x .git/flip.sh && git config core.fsmonitor \"$PWD/.git/flip.sh\"\n")
    grade = _grade(_example(tmp_path, "git-feature-branch", flip))
    assert (grade.reward, grade.details["outcome"]) == (0.0, "unresolved"), grade.details


def test_an_edited_log_does_not_change_the_answer(tmp_path):
    """log-top-ips: the agent rewrites /app/access.log to three lines and answers for those; the test makes
    the log again from its own copy of the generator, so the answer is wrong (0)."""
    ensure_engine()
    forge = ("cd /app && printf '10.9.9.9 - - [x] \"GET / HTTP/1.1\" 404 1\\n' > access.log && "
             "echo '1 10.9.9.9' > top404.txt\n")
    grade = _grade(_example(tmp_path, "log-top-ips", forge))
    assert grade.reward == 0.0, grade.details
    same = {(TASKS / "log-top-ips" / rel).read_bytes() for rel in ("environment/make_log.py", "tests/make_log.py")}
    assert len(same) == 1, "tests/make_log.py must stay a copy of environment/make_log.py"


def test_a_test_that_writes_no_reward_or_fails_is_graded_zero(tmp_path):
    """No opt-out: test.sh writing no reward is a graded 0 (outcome no_reward, not env_error); test.sh that
    writes 1 but exits non-zero is a graded 0 (test_failed) with its exit status in the details."""
    ensure_engine()
    silent = _grade(_task(tmp_path, "silent", "true\n", "echo nothing to say\n"))
    assert (silent.reward, silent.details["outcome"]) == (0.0, "no_reward"), silent.details
    assert "nothing to say" in silent.details["test_output"]
    failing = _grade(_task(tmp_path, "failing", "true\n", "echo 1 > /logs/verifier/reward.txt\nexit 3\n"))
    assert (failing.reward, failing.details["outcome"], failing.details["exit_code"]) == (0.0, "test_failed", 3)


def test_verifier_user_and_env_are_honoured(tmp_path):
    """[verifier] user = "daemon" and env = {GREETING = "hi there"}: test.sh sees both (uid 1 in the
    Debian base image) and only then writes 1."""
    ensure_engine()
    test = ('[ "$(id -u)" = 1 ] && [ "$GREETING" = "hi there" ] && echo 1 > /logs/verifier/reward.txt '
            '|| { id; env; echo 0 > /logs/verifier/reward.txt; }\n')
    grade = _grade(_task(tmp_path, "user-env", "true\n", test, 'user = "daemon"\nenv = { GREETING = "hi there" }\n'))
    assert grade.reward == 1.0, grade.details


def test_no_process_of_the_verifier_user_outlives_its_test(tmp_path):
    """A test.sh run as [verifier] user daemon (shared mode, so the container is still there to look at)
    leaves a busy loop behind, as a hostile program it ran could: no process of daemon is left when the
    reward files are listed and read."""
    ensure_engine()
    test = "( while :; do :; done ) >/dev/null 2>&1 &\necho 0 > /logs/verifier/reward.txt\n"
    task_dir = _task(tmp_path, "leftover", "true\n", test, 'environment_mode = "shared"\nuser = "daemon"\n')
    taskset = HarborTaskSet(TasksConfig(type="harbor", path=str(task_dir)))
    task = taskset.by_name["leftover"]
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))

    async def go() -> tuple[float, str]:
        spec = taskset.spec_for(task)
        box = await provider.create(spec, f"leftover-{uuid.uuid4().hex[:6]}")
        try:
            grade = await verify(task, box, provider, spec, task.files("tests"))
            return grade.reward, (await box.exec("ps -o pid=,args= -u daemon; true")).output
        finally:
            await box.destroy()

    reward, left = asyncio.run(go())
    assert (reward, left.strip()) == (0.0, "")


def test_a_workspace_too_slow_to_carry_is_graded_zero_within_the_carrys_limit(tmp_path):
    """The agent fills its workspace with 200,000 empty files (a few seconds' work), so that carrying it into
    the verifier (the engine's archive of it, rewritten as data, unpacked) takes far longer than the grading's
    limits leave for it: its grading then outlasted the scheduler's wait, was re-issued, and the agent's 0
    never counted. The carry has a limit of its own (here 2 s; this flood takes tens of seconds on the CPU
    machine), which the task set counts in its grading time: past it the grade is 0, outcome
    workspace_carry_timeout, the agent's doing."""
    ensure_engine()
    flood = ("python3 -c \"import os\nos.makedirs('flood', exist_ok=True)\n"
             "for i in range(200000): open(f'flood/{i}', 'w').close()\"\n")
    task_dir = _task(tmp_path, "carry-flood", f"cd /app\n{flood}")
    taskset = HarborTaskSet(TasksConfig(type="harbor", path=str(task_dir)))
    task = taskset.by_name["carry-flood"]
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))

    async def go():
        spec = taskset.spec_for(task)
        box = await provider.create(spec, f"carry-{uuid.uuid4().hex[:6]}")
        try:
            await run_solution(task, box)
            return await verify(task, box, provider, spec, task.files("tests"), carry_timeout_s=2.0)
        finally:
            await box.destroy()

    grade = asyncio.run(go())
    assert (grade.reward, grade.details.get("outcome")) == (0.0, "workspace_carry_timeout"), grade.details
    taskset.sandbox_config = SandboxConfig(type="docker", exec_timeout_s=10)
    # test.sh's 60 s and the carry's limit, the keeper's (4 x exec_timeout_s)
    assert taskset.grading_time_limit_s(taskset.get("carry-flood")) == task.timeout("verifier", VERIFIER_TIMEOUT_S) + 40 == 100


def test_the_rewrite_of_a_carried_workspace_stops_at_its_deadline_and_shared_mode_carries_nothing(tmp_path):
    """The carry's second step, the engine's archive rewritten as data, gives up at the carry's deadline
    (the e2e above may end in either step, by the machine's speed); a shared-mode task has no carry, so its
    grading time is test.sh's limit alone."""
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for i in range(3):
            tar.addfile(tarfile.TarInfo(f"workspace/f{i}"), io.BytesIO())
    assert as_data(io.BytesIO(archive.getvalue()), time.monotonic() - 1) is None
    assert len(tarfile.open(fileobj=io.BytesIO(as_data(io.BytesIO(archive.getvalue())))).getnames()) == 3
    taskset = HarborTaskSet(TasksConfig(type="harbor", path=str(_task(tmp_path, "shared-carry", "true\n",
                                                                        verifier='environment_mode = "shared"\n'))))
    assert taskset.grading_time_limit_s(taskset.get("shared-carry")) == 60


def test_a_symlink_to_a_host_file_is_refused(tmp_path):
    """A task folder whose tests/ (or build context) holds a link to a host file is refused at load, naming
    the task and the file; a link that stays inside the task folder is fine."""
    for sub in ("tests", "environment"):
        task = _task(tmp_path / sub, "leaky", "true\n")
        os.symlink("/etc/hostname", task / sub / "hostname")
        with pytest.raises(HarborTaskError, match=f"task leaky: {sub}/hostname is a symlink to /etc/hostname"):
            load_tasks(task)
    inside = _task(tmp_path / "inside", "inside", "true\n")
    os.symlink("../instruction.md", inside / "tests" / "instruction.md")
    assert load_tasks(inside)[0].name == "inside"


@pytest.mark.parametrize(("section", "lines", "field"), [
    ("task", 'name = "evil\\nRUN id"\n', "[task] name"),
    ("Dockerfile", "FROM rollway-sandbox:bookworm\nWORKDIR /app;touch$IFS/tmp/x\n", "WORKDIR"),
    ("verifier", 'user = "root\\nx"\n', "[verifier] user"),
    ("verifier", 'env = { "A B" = "1" }\n', "[verifier] env"),
    ("verifier", 'environment_mode = "elsewhere"\n', "[verifier] environment_mode"),
    ("environment", 'workdir = "../../etc"\n', "[environment] workdir"),
])
def test_task_data_that_would_inject_is_refused(tmp_path, section, lines, field):
    """Names used in image tags and Dockerfile lines, and task.toml paths and settings, are checked at load;
    the error names the task and the field."""
    task = _task(tmp_path, "inject", "true\n")
    if section == "Dockerfile":
        (task / "environment" / "Dockerfile").write_text(lines)
    else:
        _add_toml(task, section, lines)
    name = "inject" if section != "task" else r"evil\\nRUN id"
    with pytest.raises(HarborTaskError, match=re.escape(f"task {name}: {field}") if section != "task" else
                       re.escape(f"{task}: {field}")):
        load_tasks(task)


def test_a_build_step_cannot_reach_the_host_loopback(tmp_path):
    """A Dockerfile RUN step connects to a listener on the host's 127.0.0.1 (where the embedded broker and
    vLLM listen): the build fails (connection refused at once, no network) and the listener saw nobody."""
    ensure_engine()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        task = _task(tmp_path, "phone-home", "true\n")
        (task / "environment" / "Dockerfile").write_text(
            "FROM rollway-sandbox:bookworm\nWORKDIR /app\n"
            f"RUN python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)\"\n")
        taskset = HarborTaskSet(TasksConfig(type="harbor", path=str(task)))
        with pytest.raises(SandboxError, match="building the image of Harbor task phone-home failed"):
            taskset.images.image_for(taskset.by_name["phone-home"])
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected


def test_example_tasks_pass_harbor_lint():
    """`harbor lint` (PyPI harbor 0.26.0, Python 3.12, offline) finds nothing in the five example tasks. Its
    virtual environment is cached under ~/.cache/rollway; skipped only when it cannot be installed."""
    harbor = HARBOR_VENV / "bin" / "harbor"
    if not harbor.exists():
        python = _python_312()
        if python is None:
            pytest.skip("no Python 3.12 to install harbor into (harbor needs >= 3.12)")
        made = subprocess.run([python, "-m", "venv", str(HARBOR_VENV)], capture_output=True, text=True)
        pip = subprocess.run([str(HARBOR_VENV / "bin" / "pip"), "install", "-q", "harbor==0.26.0"],
                             capture_output=True, text=True) if made.returncode == 0 else made
        if pip.returncode != 0:
            shutil.rmtree(HARBOR_VENV, ignore_errors=True)
            pytest.skip(f"harbor could not be installed (no package index?): {pip.stderr[-300:]}")
    for task in sorted(TASKS.iterdir()):
        out = subprocess.run([str(harbor), "lint", str(task)], capture_output=True, text=True)
        assert out.returncode == 0 and "[" not in out.stdout, f"{task.name}: {out.stdout}{out.stderr}"


def _python_312() -> str | None:
    """A Python 3.12 that runs: pyenv's own build first (its `python3.12` shim on PATH fails unless 3.12 is
    a selected version, and a shim that fails made the lint test skip where 3.12 was installed)."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"  # pyenv's own rule
    found = [str(p) for p in sorted(root.glob("3.12*/bin/python3.12"), reverse=True)] if root.is_dir() else []
    for python in [*found, shutil.which("python3.12")]:
        if python and subprocess.run([python, "--version"], capture_output=True).returncode == 0:
            return python
    return None


def test_a_reward_that_is_not_a_finite_number_is_a_zero(tmp_path):
    """test.sh (whose score can come from the agent's code) writes nan to reward.txt, or Infinity in
    reward.json (Python's JSON reads both): float() took them, and a nan reward reaches every advantage of
    its group. Each is graded 0 with outcome bad_reward, naming what was written."""
    ensure_engine()
    for name, test_sh in (("nan-txt", "echo nan > /logs/verifier/reward.txt\n"),
                          ("inf-json", "echo '{\"reward\": Infinity}' > /logs/verifier/reward.json\n")):
        grade = _grade(_task(tmp_path, name, "true\n", test_sh))
        assert (grade.reward, grade.resolved, grade.details["outcome"]) == (0.0, False, "bad_reward"), grade.details
        assert "not a finite number" in grade.details["error"]
