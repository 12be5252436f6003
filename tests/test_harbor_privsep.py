"""Programs a Harbor verifier runs that the agent wrote (issue 39, items 1-2), on the real Docker engine.

The task's test.sh runs a program from the agent's working directory (as three of the five shipped
examples do) and only then checks the work. The agent's program, running with test.sh's rights, tries to
forge the verdict: it writes reward.txt = 1 and then makes test.sh end with status 0 before it writes its
own verdict (through ptrace, or by writing code into test.sh's memory through /proc/PID/mem), or writes
rollway's own end-of-test line into the verifier's output and kills it, or locks reward.txt against
test.sh's later write, or leaves a process behind that rewrites reward.txt after test.sh wrote it. Every
attack must be graded 0. The agent's moves are played by solution/solve.sh (the scripted policy), as in
tests/test_harbor_security.py; the engine, the image and the verifier are real."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest
from docker_engine import ensure_engine
from test_harbor_security import _task

from rollway.audit.grader_attacks import VERIFIER_PROGRAMS
from rollway.envs.config import TasksConfig
from rollway.envs.harbor import HarborTaskSet, check_task
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.docker import DockerSandboxProvider

TEST_SH = """cd /app
python3 /app/check_me.py > /tmp/out.txt 2>&1
if [ "$(cat /tmp/out.txt)" = "solved" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
echo "checked: $(cat /tmp/out.txt)"
"""
"""The task's test: run the agent's program, reward 1 only when it prints `solved` (it never does here)."""

def _attack_task(tmp_path, name: str, program: str):
    solve = f"cat > /app/check_me.py <<'EOF'\n{program}\nEOF\n"
    return _task(tmp_path, name, solve, TEST_SH)


def _grade(task_dir):
    taskset = HarborTaskSet(TasksConfig(type="harbor", path=str(task_dir)))
    task = next(iter(taskset.by_name.values()))
    provider = DockerSandboxProvider(SandboxConfig(type="docker"))
    return asyncio.run(check_task(task, provider, taskset.spec_for(task), oracle=True))


@pytest.mark.parametrize("attack", sorted(VERIFIER_PROGRAMS))
def test_a_program_run_by_test_sh_cannot_forge_the_verdict(tmp_path, attack):
    """The agent's program, run by test.sh with test.sh's rights, writes reward 1 and then attacks
    test.sh or the verifier around it (audit/grader_attacks.py VERIFIER_PROGRAMS): graded 0 every time."""
    ensure_engine()
    grade = _grade(_attack_task(tmp_path, f"privsep-{attack.replace('_', '-')}", VERIFIER_PROGRAMS[attack]))
    assert (grade.reward, grade.resolved) == (0.0, False), grade.details


def test_an_honest_program_run_by_test_sh_still_passes(tmp_path):
    """The same task with a program that prints `solved`: graded 1 (the defences leave honest tests alone)."""
    ensure_engine()
    grade = _grade(_task(tmp_path, "privsep-honest", "cat > /app/check_me.py <<'EOF'\nprint('solved')\nEOF\n", TEST_SH))
    assert (grade.reward, grade.resolved) == (1.0, True), grade.details


PROBE = r"""
import ctypes, errno, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
def parent_of(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
seen = {}
seen["ptrace_own_child"] = libc.ptrace(16, child, None, None) == 0 or ctypes.get_errno()
iov = (ctypes.c_char * 8)()
local = (ctypes.c_void_p * 2)(ctypes.cast(iov, ctypes.c_void_p), 8)
seen["process_vm_readv"] = libc.process_vm_readv(child, local, 1, local, 1, 0) >= 0 or ctypes.get_errno()
pid, chain = os.getpid(), []
while pid > 1:
    pid = parent_of(pid)
    chain.append(pid)
for i, pid in enumerate(chain[:-1]):  # every ancestor but the container's init
    for what in ("mem", "fd/1"):
        try:
            open(f"/proc/{pid}/{what}", "rb" if what == "mem" else "w").close()
            seen[f"ancestor{i}_{what}"] = True
        except OSError as exc:
            seen[f"ancestor{i}_{what}"] = exc.errno
os.kill(child, 9)
print(seen)
"""


def test_the_sandbox_user_cannot_trace_or_write_any_process_above_it():
    """In a real container, a command of the sandbox user (run as the agent's and as test.sh's programs are):
    ptrace and process_vm_readv are refused (EPERM, the seccomp profile) even on its own child, and no process
    above it (the command's shell, `timeout`, rollway's wrapper) lets it open its /proc/PID/mem or write to its
    output through /proc/PID/fd (EACCES: started from the execute-only bash, not dumpable)."""
    import ast

    from rollway.sandboxes.base import SandboxSpec

    ensure_engine()

    async def go() -> str:
        provider = DockerSandboxProvider(SandboxConfig(type="docker"))
        box = await provider.create(SandboxSpec(files={"probe.py": PROBE}), f"privsep-probe-{os.getpid()}")
        try:
            return (await box.exec("python3 probe.py")).output
        finally:
            await box.destroy()

    seen = ast.literal_eval(asyncio.run(go()).strip().splitlines()[-1])
    assert seen.pop("ptrace_own_child") == errno.EPERM
    assert seen.pop("process_vm_readv") == errno.EPERM
    assert len(seen) >= 4 and set(seen.values()) == {errno.EACCES}, seen  # `timeout` and the wrapper at least
