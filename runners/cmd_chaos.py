"""`rollway chaos CONFIG`: run a job while killing and restarting processes of every kind; judge the
run from the topics and the learner's step manifests."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rollway.base.redaction import redact_data
from rollway.base.run_dir import RunDir, fresh_run_folder
from rollway.runners.common import add_config_arguments, load_or_exit

NAME = "chaos"
HELP = "Run a job while killing processes of every kind (and optionally the broker); report lost/duplicated."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--run-dir", default=None, help="run folder (default runs/<name>-chaos-<time>)")
    parser.add_argument("--min-gap", type=float, default=1.0, help="least seconds between kills")
    parser.add_argument("--max-gap", type=float, default=3.0, help="most seconds between kills")
    parser.add_argument("--max-kills", type=int, default=50, help="stop killing after this many")
    parser.add_argument("--broker-restarts", type=int, default=0,
                        help="also restart the embedded broker this many times (its in-memory log is lost; "
                             "the scheduler re-issues what it lost after the episode deadline)")
    parser.add_argument("--faults", default=None,
                        help="fault points armed in every stage process (base/faults.py), e.g. "
                             "'checkpoint.write=0.3' (probability per hit) or 'learner.rank_step=once' (the first hit "
                             "of the run); 'none' disarms; default: a mix of every point")
    parser.add_argument("--kinds", default=None,
                        help="comma-separated process kinds to kill (default: every kind present: "
                             "scheduler, init, agent, reward, learner, sink, engine when the job launched one, "
                             "sandbox-engine with --fleet-dir)")
    parser.add_argument("--fleet-dir", default=None,
                        help="the folder of scripts/fleet-up.sh whose engines (fleet-K in sandbox.engines) hold the "
                             "run's sandboxes: adds the kind sandbox-engine (a daemon holding sandboxes of the run is "
                             "SIGKILLed, then started again by fleet-up.sh)")
    parser.add_argument("--fleet-restart-after", type=float, default=5.0,
                        help="seconds before a killed sandbox engine is started again (negative: left down)")
    parser.add_argument("--workers", action="append", default=[], metavar="STAGE=N",
                        help="processes per stage (default: 2 init, 2 agent, 2 reward, 1 learner, 1 sink)")


def run(args: argparse.Namespace) -> int:
    from rollway.actors.scheduler import new_run_id
    from rollway.runners.chaos import (
        FAULT_POINTS,
        ChaosMonkey,
        FleetKiller,
        Ledger,
        engine_kills,
        sandboxes_left,
        sink_check,
    )
    from rollway.runners.cmd_up import prepare_run_dir
    from rollway.runners.up import JobFailed, parse_workers, run_job, write_run_files
    from rollway.runtime.broker import BrokerError, EmbeddedBroker
    from rollway.sandboxes.base import SandboxError

    cfg = load_or_exit(args, "chaos")
    cfg.run.id = cfg.run.id or new_run_id()
    if args.run_dir is None and cfg.run.dir is None:
        args.run_dir = str(fresh_run_folder(f"{cfg.run.name}-chaos-s{args.seed}"))
    run_dir = prepare_run_dir(args, cfg, "chaos")
    workers = parse_workers(["init=2", "agent=2", "reward=2", *args.workers])
    write_run_files(run_dir, cfg)
    try:
        broker = EmbeddedBroker(cfg.broker.port, log_path=RunDir(run_dir).broker_log).start()
    except BrokerError as err:
        print(f"rollway chaos: {err}", file=sys.stderr)
        return 1
    ledger = Ledger(cfg, broker.bootstrap)
    fleet = None
    if args.fleet_dir:
        engines = getattr(cfg.sandbox, "engines", None) or []
        if not any(e.id.startswith("fleet-") for e in engines):
            print("rollway chaos: --fleet-dir needs the fleet's engines in sandbox.engines (fleet-up.sh prints them)",
                  file=sys.stderr)
            broker.stop()
            return 2
        fleet = FleetKiller(Path(args.fleet_dir), engines, cfg.run.id,
                            None if args.fleet_restart_after < 0 else args.fleet_restart_after)
    monkey = ChaosMonkey(args.seed, args.min_gap, args.max_gap, broker, args.broker_restarts, args.max_kills, ledger,
                         kinds=tuple(args.kinds.split(",")) if args.kinds else None,
                         harness=cfg.agent.harness is not None,
                         gateway_root=getattr(cfg.sandbox, "gateway_root", None), fleet=fleet)
    faults = FAULT_POINTS if args.faults is None else ("" if args.faults == "none" else args.faults)
    env = {"ROLLWAY_FAULTS": faults, "ROLLWAY_FAULTS_SEED": str(args.seed),
           "ROLLWAY_FAULTS_STATE": str(RunDir(run_dir).faults_state)}  # `NAME=once` points: one kill per run
    error = None
    try:
        summary = run_job(cfg, args.config, list(args.overrides), broker.bootstrap, run_dir, workers,
                          on_tick=monkey, max_restarts=10_000, env=env)
    except JobFailed as err:
        error, summary = str(err), {}
    finally:
        ledger.poll()
        broker.stop()
        if fleet is not None:
            fleet.wait()  # every killed engine back before the leftovers are counted
    try:
        left = sandboxes_left(cfg)
    except SandboxError as err:  # an engine that does not answer (a killed one not back): not counted
        left, error = None, error or f"the run's sandboxes could not be counted: {err}"[:1000]
    outcome = ledger.judge(run_dir, cfg.learner.trains) | {"sandboxes_left": left}
    if fleet is not None:
        outcome |= engine_kills(monkey, ledger)
    if monkey.harness:
        outcome |= {**ledger.judge_calls(run_dir, cfg.learner.trains), **_harness_kills(monkey)}
    result = {"seed": args.seed, **outcome, **sink_check(run_dir, ledger), "kills": monkey.kills,
              "killed_kinds": sorted({e["kill"].rsplit("-", 1)[0] for e in monkey.events if "kill" in e}),
              "fault_kills": _fault_kills(run_dir), "broker_restarts": sum("restart" in e for e in monkey.events),
              "events": monkey.events, "wall_seconds": summary.get("wall_seconds"), "run_dir": str(run_dir),
              "error": error}
    RunDir(run_dir).chaos_result.write_text(json.dumps(redact_data(result), indent=1))
    if args.json:
        print(json.dumps(result))
    else:
        keys = ["scheduled", "completed", "failed", "lost", "duplicated", "trained", "kills", "broker_restarts",
                "wall_seconds"]
        if monkey.harness:
            keys += ["calls_recorded", "calls_lost", "calls_duplicated", "dead_attempt_calls",
                     "agent_kills_with_programs", "programs_lingering", "sandboxes_left"]
        print(" ".join(f"{k}={result[k]}" for k in keys))
    exact = not cfg.learner.trains or (result["completed_not_trained"] == 0 and result["trained_not_completed"] == 0)
    calls_exact = not monkey.harness or not any(result[k] for k in (
        "calls_lost", "calls_duplicated", "calls_foreign", "calls_out_of_order", "programs_lingering", "sandboxes_left"))
    return 0 if error is None and result["lost"] == 0 and result["duplicated"] == 0 and exact and calls_exact else 1


def _harness_kills(monkey) -> dict[str, int]:
    """Agent workers killed while running agent programs, the programs they ran, and how many of the
    processes below them (docker: of the containers their programs ran in) still ran after the run
    (their programs must die with them, or with their containers). Docker: `orphan_container_s`, the
    seconds each such container ran on after the kill (None: it was still there at the run's end,
    removed by the run's reaper if `programs_lingering` is 0)."""
    agent = [e for e in monkey.events if e.get("kill", "").startswith("agent-")]
    lingering = monkey.lingering()
    return {"agent_kills_with_programs": sum(1 for e in agent if e.get("programs")),
            "programs_killed": sum(e.get("programs", 0) for e in agent), "programs_lingering": lingering,
            "orphan_container_s": {n: monkey.orphan_box_seconds.get(n) for n in monkey.orphan_boxes}}


def _fault_kills(run_dir) -> dict[str, int]:
    """Processes that killed themselves at an armed fault point, by point (from the stage logs)."""
    from collections import Counter

    marker = "rollway fault injection: killed at "
    found: Counter[str] = Counter()
    for path in RunDir(run_dir).logs.glob("*.out"):
        for line in path.read_text(errors="replace").splitlines():
            if marker in line:
                found[line.split(marker, 1)[1].strip()] += 1
    return dict(found)
