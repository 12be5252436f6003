"""The CI check of the README's two commands (scripts/readme_check.py) reads them from README.md: it finds
exactly the two the README shows, knows which one CI runs, and refuses a README or a CI script that has
moved on without it. (The check itself, a fresh clone running the main command to its first policy update,
is a step of .ci/run, not a test: it takes minutes.)"""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
from conftest import ROOT

spec = importlib.util.spec_from_file_location("readme_check", ROOT / "scripts" / "readme_check.py")
readme_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_check)

README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def test_the_check_reads_the_two_commands_the_readme_shows():
    test, main = readme_check.split_commands(README, CI)
    assert (test, main) == ("make test", "make run")
    # The README says what `make run` is; make's dry run of the target agrees.
    dry = subprocess.run(["make", "-n", "-o", ".venv/.ready", "run"], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0 and "rollway up examples/learn.yaml scheduler.num_tasks=4" in dry.stdout
    assert "`make run` is `rollway up examples/learn.yaml scheduler.num_tasks=4`" in README
    assert ".venv/bin/python scripts/readme_check.py" in [line.strip() for line in CI.splitlines()]


def test_the_check_refuses_a_readme_or_ci_that_moved_on():
    third = README.replace("make test    #", "make lint\nmake test    #", 1)
    with pytest.raises(readme_check.CheckFailed, match="update scripts/readme_check.py"):
        readme_check.split_commands(third, CI)
    with pytest.raises(readme_check.CheckFailed, match="does not run the README's test command"):
        readme_check.split_commands(README, CI.replace("make test", "make test TEST_WORKERS=2"))
    with pytest.raises(readme_check.CheckFailed, match="no '## The two commands' section"):
        readme_check.split_commands(README.replace("## The two commands", "## Commands"), CI)
