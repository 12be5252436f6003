"""Evaluation outputs: `rollway eval`'s pass@k (DIR/eval.json, and to the trackers) and what other tools read:
a `swebench` harness predictions file, a resolved / unresolved / error report, and trajectories in Harbor's
ATIF format (ATIF-v1.4, one JSON file per episode)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from rollway.base.redaction import redact_data
from rollway.base.run_dir import RunDir, read_records

ATIF_VERSION = "ATIF-v1.4"
ERROR_OUTCOMES = ("patch_failed", "test_timeout", "env_error")


def write_eval(run_dir: Path, cfg, task_ids: list[str] | None = None) -> dict:
    """pass@k over every scheduled attempt (`attempts` per task of the task set, as the eval
    overrides schedule them): a failed or unfinished attempt counts as incorrect, and the reasons
    of the failed ones are reported."""
    from collections import Counter

    from rollway.actors.sink import belongs_to_run
    from rollway.learning.passk import evaluate_scheduled

    if task_ids is None:
        from rollway.envs.factory import build_taskset

        task_ids = [t.task_id for t in build_taskset(cfg.tasks).tasks()]
    trajs = {t["episode"]["episode_id"]: t for t in read_records(RunDir(run_dir).trajectories)
             if belongs_to_run(t["episode"]["episode_id"], cfg.run.id)}
    last_failure = {f["episode"]["episode_id"]: f for f in read_records(RunDir(run_dir).failures)
                    if belongs_to_run(f["episode"]["episode_id"], cfg.run.id)}
    reasons = Counter(_reason(f)[:200] for eid, f in last_failure.items() if eid not in trajs)
    ks = sorted({*cfg.eval.ks, cfg.eval.attempts})
    completed = [(t["episode"]["task_id"], bool(t["resolved"])) for t in trajs.values()]
    result = {"temperature": cfg.eval.temperature, "attempts_per_task": cfg.eval.attempts,
              "reward_mean": round(sum(t["reward"] for t in trajs.values()) / len(trajs), 6) if trajs else None,
              **evaluate_scheduled(dict.fromkeys(task_ids, cfg.eval.attempts), completed, ks),
              "failure_reasons": dict(reasons.most_common())}
    if cfg.tasks.type in ("swebench", "harbor"):
        reasons_by_task = {f["episode"]["task_id"]: _reason(f) for eid, f in last_failure.items() if eid not in trajs}
        report = write_predictions(run_dir, cfg, task_ids, list(trajs.values()), reasons_by_task)
        result["swebench"] = {k: report[k] for k in ("resolved_instances", "unresolved_instances", "error_instances")}
        result["atif_files"] = write_atif(run_dir, cfg, list(trajs.values()))
    RunDir(run_dir).eval_result.write_text(json.dumps(redact_data(result), indent=1))
    return result


def track_eval(run_dir: Path, cfg, result: dict) -> None:
    """The evaluation's figures to `tracking.trackers` (the run's tracker run): `eval/pass_at_K` overall and
    `eval/SOURCE/pass_at_K` per task source (learning/passk.py), `eval/reward_mean`."""
    from rollway.config.run import dump_config
    from rollway.learning.tracking import TrackingHub

    hub = TrackingHub.for_run(cfg.tracking, run_dir, cfg.run.name, cfg.run.id, dump_config(cfg))
    if hub is None:
        return
    figures = {"eval/reward_mean": result["reward_mean"]}
    for prefix, row in [("eval", result), *((f"eval/{s}", r) for s, r in result["per_source"].items())]:
        figures.update({f"{prefix}/{k.replace('@', '_at_')}": v for k, v in row.items() if k.startswith("pass@")})
    hub.log(0, figures)
    hub.close()


def _reason(failure: dict) -> str:
    """"stage: reason"; the scheduler's final verdict already names the stage the attempt failed in."""
    from rollway.actors.scheduler import GIVE_UP_STAGE

    return failure["reason"] if failure["stage"] == GIVE_UP_STAGE else f"{failure['stage']}: {failure['reason']}"


def model_name(cfg: Any) -> str:
    policy = cfg.policy
    name = getattr(policy, "model", None) or getattr(policy, "served_model", None)
    return str(name) if name else f"rollway-{policy.type}"


def chosen_attempts(trajs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One trajectory per task: the lowest sample index that completed (one prediction per instance,
    as the harness takes)."""
    chosen: dict[str, dict[str, Any]] = {}
    for t in sorted(trajs, key=lambda t: (t["episode"]["task_id"], t["episode"].get("sample_index", 0))):
        chosen.setdefault(t["episode"]["task_id"], t)
    return chosen


def outcome_of(traj: dict[str, Any]) -> str:
    grade = traj.get("grade") or {}
    if grade.get("outcome"):
        return str(grade["outcome"])
    return "resolved" if traj.get("resolved") else "unresolved"


def write_predictions(run_dir: Path, cfg: Any, task_ids: list[str], trajs: list[dict[str, Any]],
                      failures: dict[str, str]) -> dict[str, Any]:
    """`predictions.jsonl` (instance_id, model_name_or_path, model_patch) and `swebench_report.json`:
    resolved, unresolved and error ids (errors: patch_failed, test_timeout, and attempts that failed in
    the pipeline with `failures[task_id]` as the reason). Returns the report."""
    chosen = chosen_attempts(trajs)
    name = model_name(cfg)
    with RunDir(run_dir).predictions.open("w") as out:
        for task_id in task_ids:
            if task_id in chosen:
                patch = (chosen[task_id].get("grade") or {}).get("model_patch", "")
                out.write(json.dumps({"instance_id": task_id, "model_name_or_path": name, "model_patch": patch}) + "\n")
    outcomes = {tid: outcome_of(t) for tid, t in chosen.items()}
    errors = {tid: o for tid, o in outcomes.items() if o in ERROR_OUTCOMES}
    errors.update({tid: failures[tid] for tid in task_ids if tid not in chosen and tid in failures})
    report = {
        "model_name_or_path": name, "total_instances": len(task_ids), "submitted_instances": len(chosen),
        "resolved_instances": sum(o == "resolved" for o in outcomes.values()),
        "unresolved_instances": sum(o == "unresolved" for o in outcomes.values()),
        "error_instances": len(errors),
        "resolved_ids": sorted(t for t, o in outcomes.items() if o == "resolved"),
        "unresolved_ids": sorted(t for t, o in outcomes.items() if o == "unresolved"),
        "error_ids": sorted(errors), "errors": dict(sorted(errors.items())),
        "empty_patch_ids": sorted(t for t, tr in chosen.items() if not (tr.get("grade") or {}).get("model_patch")),
        "incomplete_ids": sorted(t for t in task_ids if t not in chosen and t not in failures),
    }
    RunDir(run_dir).swebench_report.write_text(json.dumps(report, indent=1))
    return report


def to_atif(traj: dict[str, Any], model: str) -> dict[str, Any]:
    """One trajectory as an ATIF document: the initial messages, then one agent step per turn with its
    tool calls, their observations and the turn's token ids and logprobs. A harness episode's steps are
    its program's kept calls; each says in `extra` its call index and segment, and a call that opened a
    segment why and the messages it sent; the document's `extra.segments` counts them."""
    steps: list[dict[str, Any]] = []
    for msg in traj.get("messages") or []:
        source = {"system": "system", "user": "user"}.get(msg.get("role"), "user")
        steps.append({"step_id": len(steps) + 1, "source": source, "message": _text(msg.get("content"))})
    completion_tokens, segment = 0, 0
    for turn in traj.get("turns") or []:
        calls, results = [], []
        segment += turn.get("segment_reason") is not None
        for i, obs in enumerate(turn.get("observations") or []):
            # a harness call's results answer the gateway's tool-call ids (unique per episode)
            harness_id = obs.get("call_id") if turn.get("call_index") is not None else None
            call_id = harness_id or f"call_{turn['turn']}_{i}"
            calls.append({"tool_call_id": call_id, "function_name": obs["tool"], "arguments": obs.get("arguments") or {}})
            results.append({"source_call_id": call_id, "content": obs.get("content", "")})
        completion_tokens += len(turn.get("completion_ids") or [])
        step: dict[str, Any] = {
            "step_id": len(steps) + 1, "source": "agent", "model_name": model, "message": turn.get("assistant_text", ""),
            "metrics": {"completion_tokens": len(turn.get("completion_ids") or []),
                        "completion_token_ids": list(turn.get("completion_ids") or []),
                        "logprobs": list(turn.get("logprobs") or []),
                        "extra": {"policy_version": turn.get("policy_version"),
                                  "finish_reason": turn.get("finish_reason")}},
        }
        if calls:
            step["tool_calls"], step["observation"] = calls, {"results": results}
        if turn.get("call_index") is not None:  # a harness episode: one step per kept program call
            step["extra"] = _call_extra(turn, segment)
        steps.append(step)
    return {
        "schema_version": ATIF_VERSION, "session_id": traj["episode"]["episode_id"],
        "agent": {"name": "rollway", "version": _version(), "model_name": model},
        "steps": steps,
        "final_metrics": {"total_prompt_tokens": traj.get("prompt_length", 0),
                          "total_completion_tokens": completion_tokens, "total_steps": len(steps)},
        "extra": {"task_id": traj["episode"]["task_id"], "reward": traj.get("reward"), "resolved": traj.get("resolved"),
                  "stop_reason": traj.get("stop_reason"), "outcome": outcome_of(traj),
                  "segments": len(traj.get("segment_starts") or []) + 1},
    }


def _call_extra(turn: dict[str, Any], segment: int) -> dict[str, Any]:
    """A program call's place: its gateway call index, its segment (token stream) and, on a call that
    opened a segment, why and the rewritten history the program sent (the step's prompt)."""
    extra: dict[str, Any] = {"call_index": turn["call_index"], "segment": segment}
    if turn.get("segment_reason") is not None:
        extra["segment_reason"] = turn["segment_reason"]
        extra["segment_messages"] = list(turn.get("segment_messages") or [])
    if turn.get("user_message") is not None:  # a user message the program sent after this call's reply
        extra["user_message"] = turn["user_message"]
    return extra


def write_atif(run_dir: Path, cfg: Any, trajs: list[dict[str, Any]]) -> int:
    folder = RunDir(run_dir).atif
    folder.mkdir(exist_ok=True)
    model = model_name(cfg)
    for traj in trajs:
        (folder / f"{traj['episode']['episode_id']}.json").write_text(json.dumps(to_atif(traj, model), indent=1))
    return len(trajs)


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _version() -> str:
    try:
        return metadata.version("rollway")
    except metadata.PackageNotFoundError:
        return "0"
