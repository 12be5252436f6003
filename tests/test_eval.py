"""`rollway eval` end to end: k attempts per task without training, pass@k in eval.json."""

from __future__ import annotations

import json
import sys
from math import comb

import yaml
from conftest import ROOT
from jobs import run_with_progress

RIGHT = '<tool_call>{"name": "answer", "arguments": {"value": "158"}}</tool_call>'
CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "83 + 75"}}</tool_call>'
OTHER_CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>'
WRONG = '<tool_call>{"name": "answer", "arguments": {"value": "7"}}</tool_call>'


def test_eval_reports_pass_at_k_over_every_scheduled_attempt(tmp_path, broker):
    """Each sample of the easy task plays one of three scripts (chosen by its seed): right, wrong, or
    one that crashes the agent on its second turn (no script matches a prompt that contains BOOM): after
    the agent's first turn ran its tools, that failure is graded 0 (base/blame.py), so it counts as an
    incorrect sample; every sample of the hard task is wrong. pass@k is over every scheduled attempt."""
    cfg = {"run": {"name": "evaltest", "id": "ev1"}, "tasks": {"type": "calc", "count": 2},  # id: seeds are fixed
           "scheduler": {"episode_deadline_s": 60, "max_attempts": 1}, "agent": {"max_turns": 3},
           "eval": {"attempts": 6, "ks": [1, 2], "temperature": 1.0}, "tracking": {"trackers": ["tensorboard"]},
           "policy": {"type": "scripted", "script": [
               {"when": "83 \\+ 75(?![\\s\\S]*BOOM)", "turns": [CALC, RIGHT],
                "alternatives": [[CALC, WRONG], ["BOOM"]]},
               {"when": "^(?![\\s\\S]*BOOM)", "turns": [OTHER_CALC, WRONG]}]}}
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "eval", str(config), "--run-dir", str(run_dir),
                          "--bootstrap", broker.bootstrap, "runtime.processes=one", f"topics.prefix=ev{tmp_path.name[-6:]}-"],
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((run_dir / "eval.json").read_text())
    assert result["tasks"] == 2 and result["attempts"] == 12
    easy, hard = result["per_task"]["calc-0000"], result["per_task"]["calc-0001"]
    assert hard["n"] == 6 and hard["correct"] == 0 and hard["failed"] == 0 and hard["pass@6"] == 0.0
    # Seeded: some samples right, some wrong, some crashed (graded 0); all six count.
    assert easy["n"] == 6 and 0 < easy["correct"] < 6 and easy["failed"] == 0
    assert result["failed"] == 0 and result["completed"] == 12
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 12
    crashed = [t for t in trajs if t["stop_reason"] == "agent_failure"]
    assert crashed and all(t["reward"] == 0 and "LookupError" in t["grade"]["failure_kind"] for t in crashed)
    c = easy["correct"]
    assert abs(result["pass@1"] - (c / 6 + 0) / 2) < 1e-5  # c of 6 scheduled, not c of the completed
    # The unbiased estimator, per task 1 - C(n - c, k) / C(n, k), averaged over tasks (hard: 0).
    assert abs(result["pass@2"] - (1 - comb(6 - c, 2) / comb(6, 2)) / 2) < 1e-5
    assert result["pass@1"] < result["pass@2"] <= result["pass@6"] == 0.5
    # Both tasks are of one source (`calc`): its pass@k is the overall one, in eval.json and in the tracker.
    assert result["per_source"] == {"calc": {"tasks": 2, **{f"pass@{k}": result[f"pass@{k}"] for k in (1, 2, 6)}}}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb" / "tracking"))
    acc.Reload()
    for k in (1, 2, 6):
        for tag in (f"train/eval/pass_at_{k}", f"train/eval/calc/pass_at_{k}"):
            assert [(e.step, round(e.value, 5)) for e in acc.Scalars(tag)] == [(0, round(result[f"pass@{k}"], 5))], tag
