"""`rollway eval` end to end: k attempts per task without training, pass@k in eval.json."""

from __future__ import annotations

import json
import subprocess
import sys
from math import comb

import yaml
from conftest import ROOT

RIGHT = '<tool_call>{"name": "answer", "arguments": {"value": "158"}}</tool_call>'
CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "83 + 75"}}</tool_call>'
WRONG = '<tool_call>{"name": "answer", "arguments": {"value": "7"}}</tool_call>'


def test_eval_reports_pass_at_k_from_sampled_attempts(tmp_path, broker):
    cfg = {"run": {"name": "evaltest", "id": "ev1"}, "tasks": {"type": "calc", "count": 2},  # id: seeds are fixed
           "scheduler": {"episode_deadline_s": 60}, "agent": {"max_turns": 3},
           "eval": {"attempts": 6, "ks": [1, 2], "temperature": 1.0},
           "policy": {"type": "scripted", "script": [
               {"when": "83 \\+ 75", "turns": [CALC, RIGHT], "alternatives": [[CALC, WRONG]]},
               {"when": "", "turns": [CALC, WRONG]}]}}
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rollway.runners", "eval", str(config), "--run-dir", str(run_dir),
                          "--bootstrap", broker.bootstrap, f"topics.prefix=ev{tmp_path.name[-6:]}-"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((run_dir / "eval.json").read_text())
    assert result["tasks"] == 2 and result["attempts"] == 12
    easy, hard = result["per_task"]["calc-0000"], result["per_task"]["calc-0001"]
    assert hard["correct"] == 0 and hard["pass@6"] == 0.0
    assert 0 < easy["correct"] < 6 and easy["pass@6"] == 1.0  # seeded: some samples right, some wrong
    assert abs(result["pass@1"] - (easy["correct"] / 6 + 0) / 2) < 1e-5
    # The unbiased estimator, per task 1 - C(n - c, k) / C(n, k), averaged over tasks (hard: 0).
    c = easy["correct"]
    assert abs(result["pass@2"] - (1 - comb(6 - c, 2) / comb(6, 2)) / 2) < 1e-5
    assert result["pass@1"] < result["pass@2"] <= result["pass@6"] == 0.5
