"""The suite's progress-based limit on subprocess jobs (tests/jobs.py): a job that advances slowly is waited
for however long it takes; one that stops advancing is killed after the stall window with a message that
names the hang; one that spins forever is stopped at the ceiling. Real processes, real clocks."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from jobs import JobHung, run_with_progress, wait_with_progress


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_job_that_keeps_printing_outlives_the_stall_window_and_returns_everything():
    t0 = time.monotonic()
    out = run_with_progress(_py("import sys, time\nfor i in range(8):\n    print(i, flush=True); print('e', i, file=sys.stderr, flush=True); time.sleep(0.7)\nsys.exit(3)"),
                  stall_s=3)
    assert time.monotonic() - t0 > 5, "it ran longer than the stall window"
    assert out.returncode == 3 and out.stdout.split() == [str(i) for i in range(8)] and out.stderr.count("e ") == 8


def test_a_quiet_job_that_computes_or_writes_its_folder_is_not_killed(tmp_path):
    # cpu_s 0.1: on two cores shared by a dozen jobs the burner gets a fraction of a core in each 3 s window
    burn = run_with_progress(_py("import time\nt = time.process_time()\nwhile time.process_time() - t < 3: pass\nprint('done')"),
                             stall_s=3, cpu_s=0.1)
    assert burn.stdout.strip() == "done"
    folder = tmp_path / "run"
    writes = run_with_progress(_py("import pathlib, sys, time\nf = pathlib.Path(sys.argv[2])\nf.mkdir()\n"
                         "for i in range(4):\n    (f / f'{i}.txt').write_text('x'); time.sleep(3)\nprint('ok')")
                     + ["--run-dir", str(folder)], stall_s=12)
    assert writes.returncode == 0 and writes.stdout.strip() == "ok" and len(list(folder.iterdir())) == 4


def test_a_hung_job_is_killed_after_the_stall_window_with_its_last_output_and_processes():
    t0 = time.monotonic()
    with pytest.raises(JobHung) as hung:
        run_with_progress(_py("import sys, time\nprint('loading the model', file=sys.stderr, flush=True)\n"
                    "print('step 1 done', flush=True)\ntime.sleep(3600)"), stall_s=3, name="stuck learner")
    took = time.monotonic() - t0
    assert 3 <= took < 60, took
    message = str(hung.value)
    assert "stuck learner" in message and "no progress for" in message
    assert "loading the model" in message and "step 1 done" in message and "time.sleep(3600)" in message


def test_a_job_that_spins_forever_is_stopped_at_the_ceiling():
    with pytest.raises(JobHung, match="ceiling of 4 s"):
        run_with_progress(_py("import time\nwhile True:\n    print('still here', flush=True); time.sleep(0.2)"),
                stall_s=60, ceiling_s=4)


def test_the_job_gets_its_input_and_environment(tmp_path):
    out = run_with_progress(_py("import os, sys\nprint(sys.stdin.read().upper(), os.environ['X_TEST'], os.getcwd())"),
                  input="hello", env={"X_TEST": "42", "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert out.stdout.split() == ["HELLO", "42", str(tmp_path)]


def test_a_job_the_test_started_itself_is_waited_for_while_its_log_grows_and_not_once_it_hangs(tmp_path):
    log = tmp_path / "job.out"
    with open(log, "wb") as out:
        slow = subprocess.Popen(_py("import time\nfor i in range(6):\n    print('turn', i, flush=True); time.sleep(1)\n"
                                    "raise SystemExit(4)"), stdout=out, stderr=subprocess.STDOUT)
    assert wait_with_progress(slow, watch=[log], stall_s=3) == 4  # 6 s, longer than the stall window
    with open(log, "wb") as out:
        stuck = subprocess.Popen(_py("print('waiting for the broker', flush=True)\nimport time\ntime.sleep(3600)"),
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    with pytest.raises(JobHung, match="(?s)no progress.*waiting for the broker"):
        wait_with_progress(stuck, watch=[log], stall_s=3)
    assert stuck.poll() is not None, "the hung job was killed"
