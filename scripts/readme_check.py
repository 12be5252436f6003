"""CI step: the README's two commands, taken from README.md as written, on a fresh clone.

The test command is CI itself (.ci/run runs it; this check fails if .ci/run stops running it). The main
job's command is run in a fresh `git clone` of this repository, exactly as the README writes it, until the
job's learner has published its first policy update (version 1 in the run folder's learner-status.json),
then stopped as a user would stop it (Ctrl-C: SIGINT to its process group); every process of the job must
be gone within a grace period.

The one thing not done from scratch: the setup that the main command's make target depends on
(`.venv/.ready`: system packages, the Docker engine and sandbox image, the vLLM build, the agent programs)
is the one CI ran a moment ago for the test command on this machine. The clone gets its own small `.venv`
that reuses those installed packages (a .pth file to this checkout's .venv) with the clone's own rollway
installed editable, and a link to `.venv-vllm`, so the clone runs its own code and files while the
minutes of setup are not paid twice. Everything after the setup runs as the README says.

    .venv/bin/python scripts/readme_check.py [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## The two commands"
FIRST_UPDATE_CEILING_S = 3600.0
"""How long the main job may take to publish its first update (about 10 minutes on an idle 2-core machine)."""
STOP_GRACE_S = 180.0
"""How long the job's processes may take to exit after Ctrl-C."""


class CheckFailed(Exception):
    pass


def readme_commands(readme: str) -> list[str]:
    """The commands of the README's first bash block under SECTION, comments removed, in order."""
    if SECTION not in readme:
        raise CheckFailed(f"README.md has no '{SECTION}' section: update scripts/readme_check.py with the README")
    block = re.search(r"```bash\n(.*?)```", readme.split(SECTION, 1)[1], re.S)
    if block is None:
        raise CheckFailed(f"README.md's '{SECTION}' section has no ```bash block")
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [c for c in commands if c]


def split_commands(readme: str, ci_script: str) -> tuple[str, str]:
    """(test command, main job command): the README must give exactly two, and CI must run the test one."""
    commands = readme_commands(readme)
    if len(commands) != 2:
        raise CheckFailed(f"README.md's two commands are now {commands}: update scripts/readme_check.py and .ci/run")
    tests = [c for c in commands if "test" in shlex.split(c)[-1]]
    if len(tests) != 1:
        raise CheckFailed(f"cannot tell the test command among {commands}")
    test, main = tests[0], next(c for c in commands if c != tests[0])
    ci_lines = [line.strip() for line in ci_script.splitlines()]
    if test not in ci_lines:
        raise CheckFailed(f"CI (.ci/run) does not run the README's test command `{test}` as written")
    return test, main


def clone(dest: Path, venv: Path) -> Path:
    """A fresh clone of this repository's current commit, with a light .venv over the packages of `venv`."""
    run(["git", "clone", "--quiet", "--no-local", str(ROOT), str(dest)])
    head = run(["git", "-C", str(ROOT), "rev-parse", "HEAD"]).stdout.strip()
    run(["git", "-C", str(dest), "checkout", "--quiet", head])
    base = run([str(venv / "bin/python"), "-c", "import sys; print(sys.base_prefix)"]).stdout.strip()
    run([f"{base}/bin/python3", "-m", "venv", "--without-pip", str(dest / ".venv")])  # pip, setuptools: ours
    purelib = run([str(dest / ".venv/bin/python"), "-c",
                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    ours = run([str(venv / "bin/python"), "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    # zz_: read after the clone's own editable install, so `rollway` is the clone's code.
    Path(purelib, "zz_setup_venv.pth").write_text(ours + "\n")
    run([str(dest / ".venv/bin/python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "-e", str(dest)])
    (dest / ".venv/.ready").touch()  # newer than the clone's pyproject.toml and setup scripts: make skips setup
    vllm = ROOT / ".venv-vllm"
    if vllm.exists():
        (dest / ".venv-vllm").symlink_to(vllm.resolve())
    where = run([str(dest / ".venv/bin/python"), "-c", "import rollway.runners as r; print(r.__file__)"])
    if not Path(where.stdout.strip()).resolve().is_relative_to(dest.resolve()):
        raise CheckFailed(f"the clone's venv imports rollway from {where.stdout.strip()}, not from the clone {dest}")
    return dest


def first_update(repo: Path) -> Path | None:
    """The run folder under repo/runs whose learner has published policy version 1 or later."""
    for status in sorted(repo.glob("runs/*/learner-status.json")):
        try:
            if json.loads(status.read_text()).get("policy_version", 0) >= 1:
                return status.parent
        except (OSError, json.JSONDecodeError):
            continue  # being replaced
    return None


def run_main_command(repo: Path, command: str, log: Path) -> float:
    """Run `command` in `repo` until its first policy update; Ctrl-C it; seconds to the update."""
    print(f"readme check: `{command}` in {repo}", flush=True)
    t0 = time.monotonic()
    with open(log, "wb") as out:
        job = subprocess.Popen(["bash", "-c", command], cwd=repo, stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        while (run_dir := first_update(repo)) is None:
            if job.poll() is not None:
                raise CheckFailed(f"`{command}` exited with {job.returncode} before its first policy update:\n"
                                  f"{tail(log)}")
            if time.monotonic() - t0 > FIRST_UPDATE_CEILING_S:
                raise CheckFailed(f"`{command}` made no policy update in {FIRST_UPDATE_CEILING_S:.0f} s:\n{tail(log)}")
            time.sleep(2)
        took = time.monotonic() - t0
        print(f"readme check: first policy update after {took:.0f} s ({run_dir})", flush=True)
    finally:
        stop(job, log)
    return took


def stop(job: subprocess.Popen, log: Path) -> None:
    """Ctrl-C to the job's process group; every process in it must exit within STOP_GRACE_S."""
    if job.poll() is not None:
        return
    os.killpg(job.pid, signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and group_alive(job):
        time.sleep(1)
    if group_alive(job):
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        raise CheckFailed(f"the job's processes were still running {STOP_GRACE_S:.0f} s after Ctrl-C:\n{tail(log)}")
    print(f"readme check: stopped by Ctrl-C (make exited {job.returncode})", flush=True)


def group_alive(job: subprocess.Popen) -> bool:
    job.poll()  # reap the leader, so a finished group reads as gone
    try:
        os.killpg(job.pid, 0)
        return True
    except ProcessLookupError:
        return False


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def run(argv: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        raise CheckFailed(f"{' '.join(argv)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv",
                        help="the set-up virtual environment whose packages the clone reuses (default: this checkout's)")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="rollway-readme-"))
    try:
        test, main_command = split_commands((ROOT / "README.md").read_text(), (ROOT / ".ci/run").read_text())
        print(f"readme check: test command `{test}` is run by .ci/run; main job command `{main_command}`", flush=True)
        repo = clone(tmp / "rollway", args.venv)
        run_main_command(repo, main_command, tmp / "main-command.log")
    except CheckFailed as err:
        print(f"readme check: FAILED: {err}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"readme check: clone kept in {tmp}")
        else:
            subprocess.run(["rm", "-rf", str(tmp)])
    print("readme check: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
