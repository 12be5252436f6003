"""The grader check's rows of issue 39 (programs a Harbor verifier runs that the agent wrote; in-process
forgery in SWE test runs) flag a deliberately weakened build: with the defences that contain them turned
off in this process, every row is reported as not contained. (The real build containing them is
tests/test_grader_check.py::test_every_grader_contains_every_attack.) Real engine, real toolz
row and Harbor task; the weakening is the only thing changed, by monkeypatching the named defences."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from rollway.audit.grader_attacks import ATTACKS
from rollway.audit.grader_check import Options, run_suite

HARBOR_ROWS = tuple(a.name for a in ATTACKS if a.name.startswith("verifier_program_")
                    and a.name not in ("verifier_program_kills_all", "verifier_program_kills_parent"))
"""The rows the verifier's privilege separation contains; the two kill rows are the failure rule's
(tests/test_grader_check.py weakens that rule for them)."""
SWE_ROWS = ("trylast_hook_from_code", "trylast_hook_from_frames", "trylast_hook_obfuscated", "report_class_patched",
            "report_key_from_closure")


def weaken_harbor(monkeypatch) -> None:
    """The verifier as it was before issue 39: Docker's seccomp allowing ptrace (here: allowing everything),
    rollway's bash readable (so dumpable), reward files left for test.sh to make, no count of processes that
    outlive test.sh, and the status trusted as printed and then ignored."""
    import rollway.envs.harbor_verifier as hv
    import rollway.sandboxes.docker as d

    monkeypatch.setattr(d, "docker_profile", lambda: '{"defaultAction": "SCMP_ACT_ALLOW"}')
    monkeypatch.setattr(d, "_TOOLS", d._TOOLS.replace("chmod 0111", "chmod 0755"))
    monkeypatch.setattr(hv, "_WRITTEN", ("test-stdout.txt",))
    command = hv.test_command
    monkeypatch.setattr(hv, "test_command", lambda s: command(s).replace(f"echo {hv.LEFT}=$n", f"echo {hv.LEFT}=0"))
    monkeypatch.setattr(hv, "ended_as_reported", lambda engine, reported: True)
    graded = hv._graded
    monkeypatch.setattr(hv, "_graded", lambda box, status, written, details: graded(box, 0, written, details))


def test_the_rows_exist():
    assert len(HARBOR_ROWS) >= 5 and set(SWE_ROWS) <= {a.name for a in ATTACKS}


RACING_ROWS = ("verifier_program_rewrites_after",)
"""Rows whose attack races the weakened verifier: the process left behind must rewrite the reward between
test.sh's write and the grader's read, and on a loaded machine a woken process may not run in time (lost
twice in whole-suite runs, 2026-11 and 2026-11-30). Such a row is played again, up to twice more, when
contained: one win shows the verifier is open to it; the real verifier must contain it every time
(tests/test_grader_check.py)."""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_verifier_program_rows_flag_a_weakened_verifier(monkeypatch):
    from docker_engine import count_containers, ensure_engine

    ensure_engine()
    weaken_harbor(monkeypatch)
    prefix = f"gcw-{uuid.uuid4().hex[:6]}-"
    report = asyncio.run(run_suite(Options(sandbox="docker", families=("harbor",), attacks=HARBOR_ROWS,
                                           name_prefix=prefix)))
    assert sorted(r["attack"] for r in report["rows"]) == sorted(HARBOR_ROWS)
    contained = [r for r in report["rows"] if r["contained"]]
    for _ in range(2):
        again = tuple(r["attack"] for r in contained if r["attack"] in RACING_ROWS)
        if not again:
            break
        replay = asyncio.run(run_suite(Options(sandbox="docker", families=("harbor",), attacks=again,
                                               name_prefix=prefix)))
        contained = [r for r in contained if r["attack"] not in again] + [r for r in replay["rows"] if r["contained"]]
    assert contained == []
    assert count_containers(prefix) == 0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_in_process_forgery_rows_flag_a_build_without_the_reach_check(monkeypatch, toolz_swebench_row):
    """Played as the swebench family on the real engine (the row's image has its own pytest)."""
    from docker_engine import ensure_engine

    import rollway.envs.swe_grading as swe_grading

    ensure_engine()
    monkeypatch.setattr(swe_grading, "reaching_lines", lambda patch, limit=20, repo="": [])
    report = asyncio.run(run_suite(Options(sandbox="docker", families=("swebench",), attacks=SWE_ROWS,
                                           cache_dir=toolz_swebench_row.parent, name_prefix=f"gcw-{uuid.uuid4().hex[:6]}-")))
    assert sorted(r["attack"] for r in report["rows"]) == sorted(SWE_ROWS)
    assert [r["attack"] for r in report["rows"] if r["contained"]] == [], report["rows"]
