"""`rollway bench`: benchmarks. `pipeline` (pipelined vs batched rollout), `training` (sync vs async RL
training), `ceiling` (one agent worker against a zero-latency engine), `serve`, `learner`, `learn`,
`weight-sync` (learner-to-replicas weight broadcast), `gateway` (the time the OpenAI-compatible gateway adds
to a model call), `up` (what `rollway up` adds to a job's own work, one process against one per stage)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from rollway.base.figures import dumps
from rollway.base.run_dir import fresh_run_folder
from rollway.bench.bench_dir import BenchDir

NAME = "bench"
HELP = ("Benchmarks: pipeline (pipelined vs bounded-batch rollout), serve (inference engine), learner "
        "(training tokens/s), learn (held-out pass rate before and after a training run), search (bug localisation "
        "with and without the AST search tool, before and after training), search-seeds (search's figures pooled "
        "over seeds), up (what rollway up adds to a job's own work).")

DELEGATES = {"serve": "rollway.policies.bench_serve", "learner": "rollway.learning.bench",
             "learn": "rollway.bench.learn", "weight-sync": "rollway.bench.weight_sync",
             "gateway": "rollway.bench.gateway", "search": "rollway.bench.search",
             "search-seeds": "rollway.bench.search_seeds", "up": "rollway.bench.up_cost"}
"""Subcommands owned by other packages: each module has add_arguments(parser) and run(args)."""


def _add_run_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """--json, --seed and --out, shared by the benchmarks this module runs."""
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--seed", type=int, default=None, help="workload seed (same as seed=S)")
    parser.add_argument("--out", default=None, help=f"output folder (default runs/bench-{name}-<time>)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = sub.add_parser("pipeline", help="pipelined vs bounded async batching on one seeded simulated workload",
                       description="Runs the bounded-batch baseline and the Kafka pipeline (rollway up) on the "
                                   "same seeded workload against one simulated inference server; prints makespans, "
                                   "ratio, ideal makespan, efficiency, utilisation, broker overhead, sandboxes.")
    _add_run_arguments(p, "pipeline")
    p.add_argument("--no-baseline", action="store_true",
                   help="run the pipeline only (efficiency and broker overhead at scale; no ratio)")
    p.add_argument("--real", action="store_true",
                   help="real parts instead of simulated ones: the vLLM CPU engine, SWE tasks built from a source "
                        "archive, bubblewrap sandboxes, grading by the tasks' tests (rollway.bench.real; "
                        "key=value sets RealBenchConfig fields, e.g. sdist=six==1.17.0 epochs=1)")
    p.add_argument("--scaling", default="1,2,4",
                   help="agent worker counts to run the pipeline with (comma list; the first is the headline)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="workload settings, e.g. episodes=32 init_s_median=4 (see rollway.bench.workload)")
    p.set_defaults(_bench=run_pipeline_bench)
    t = sub.add_parser("training", help="synchronous vs asynchronous RL training (max policy lag 1, 2, 4) on the "
                                        "seeded simulated workload with a simulated learner",
                       description="Runs the benchmark workload's rollouts (real actors in-process, simulated engine "
                                   "and sandboxes) under a simulated learner whose step time grows with the tokens it "
                                   "trains on, synchronously and with each maximum policy lag; prints trained "
                                   "episodes/s, ratio to sync, engine and learner busy fractions, staleness histograms.")
    _add_run_arguments(t, "training")
    t.add_argument("overrides", nargs="*", metavar="key=value",
                   help="workload settings (rollway.bench.workload) or training settings (batch_episodes, steps, "
                        "lags=[0,2], learner_fixed_s, learner_s_per_ktoken, weight_sync_s, out_of_order, "
                        "stragglers=drop|wait)")
    t.set_defaults(_bench=run_training_bench)
    c = sub.add_parser("ceiling", help="turns/s of one agent worker against a zero-latency engine, per-turn "
                                       "overhead broken down",
                       description="Runs one real agent stage worker on the embedded broker against a simulated "
                                   "engine that answers at once, with zero-time tools: turns/s, CPU ms per turn, and "
                                   "ms per turn in decode, tokenisation, inference round trip, tool dispatch, produce, "
                                   "commit; one turn at a time and slots + tool_overlap at once.")
    _add_run_arguments(c, "ceiling")
    c.add_argument("--profile", action="store_true", help="run the concurrent case again under cProfile: CPU per turn by category")
    c.add_argument("overrides", nargs="*", metavar="key=value",
                   help="workload settings, e.g. episodes=512 slots=64 tool_overlap=64")
    c.set_defaults(_bench=run_ceiling_bench)
    for name, module in DELEGATES.items():
        d = sub.add_parser(name, help=f"see {module}")
        _delegate_arguments(d, module)
        d.set_defaults(_bench=lambda args, module=module: importlib.import_module(module).run(args))


def _delegate_arguments(parser: argparse.ArgumentParser, module: str) -> None:
    """The delegate's own arguments when its module is importable; otherwise run() says what is missing."""
    try:
        importlib.import_module(module).add_arguments(parser)
    except ImportError:
        parser.set_defaults(_missing=module)


def run(args: argparse.Namespace) -> int:
    missing = getattr(args, "_missing", None)
    if missing:
        print(f"rollway bench {args.bench}: {missing} is not available in this install", file=sys.stderr)
        return 2
    return int(args._bench(args) or 0)


def run_pipeline_bench(args: argparse.Namespace) -> int:
    if args.real:
        return run_real_pipeline_bench(args)
    from pydantic import ValidationError

    from rollway.base.logging import configure_logging
    from rollway.bench.report import format_text
    from rollway.bench.run import run_bench
    from rollway.bench.workload import WorkloadConfig
    from rollway.config.run import ConfigError

    try:
        data = _settings(args)
        wl = WorkloadConfig.model_validate(data)
        scaling = [int(w) for w in args.scaling.split(",") if w.strip()] or [1]
        if any(w < 1 or wl.slots % w for w in scaling):
            raise ValueError(f"--scaling {args.scaling}: each agent worker count must divide slots={wl.slots}, "
                             "so every run has the same total agent concurrency")
    except (ConfigError, ValidationError, ValueError) as err:
        print(f"rollway bench pipeline: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or fresh_run_folder("bench-pipeline"))
    configure_logging("bench", level="WARNING")  # the in-process baseline would log every episode
    result = run_bench(wl, out, scaling, say=lambda m: print(m, file=sys.stderr, flush=True),
                       with_baseline=not args.no_baseline)
    return _emit(result, out, args.json, format_text)


def run_real_pipeline_bench(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from rollway.base.logging import configure_logging
    from rollway.bench.real import RealBenchConfig, format_real_text, run_real_bench
    from rollway.bench.real_tasks import TaskSetError
    from rollway.config.run import ConfigError
    from rollway.policies.vllm import INSTALL_HINT, vllm_python

    try:
        data = _settings(args)
        rc = RealBenchConfig.model_validate(data)
        if args.no_baseline:
            rc = rc.model_copy(update={"modes": ["pipeline"]})
    except (ConfigError, ValidationError) as err:
        print(f"rollway bench pipeline --real: {err}", file=sys.stderr)
        return 2
    if rc.engine_url is None and vllm_python() is None:
        print(f"rollway bench pipeline --real: {INSTALL_HINT}", file=sys.stderr)
        return 2
    out = Path(args.out or fresh_run_folder("bench-real"))
    configure_logging("bench", level="WARNING")
    try:
        result = run_real_bench(rc, out, say=lambda m: print(m, file=sys.stderr, flush=True))
    except TaskSetError as err:  # an archive that yields no tasks, an instances file the bench cannot run
        print(f"rollway bench pipeline --real: {err}", file=sys.stderr)
        return 2
    return _emit(result, out, args.json, format_real_text)


def run_training_bench(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from rollway.base.logging import configure_logging
    from rollway.bench.training import TrainingConfig, format_training_text, run_training_bench
    from rollway.bench.workload import WorkloadConfig
    from rollway.config.run import ConfigError, apply_override

    workload: dict = {}
    training: dict = {}
    try:
        for override in args.overrides:
            key = override.split("=", 1)[0]
            if key == "episodes":
                raise ValueError("episodes is set by the training loop ((steps + max lag) x batch_episodes)")
            apply_override(training if key in TrainingConfig.model_fields else workload, override)
        if args.seed is not None:
            workload["seed"] = args.seed
        wl, tc = WorkloadConfig.model_validate(workload), TrainingConfig.model_validate(training)
        if any(lag < 0 for lag in tc.lags) or not tc.lags:
            raise ValueError(f"lags={tc.lags}: give one or more lags >= 0 (0 = synchronous)")
    except (ConfigError, ValidationError, ValueError) as err:
        print(f"rollway bench training: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or fresh_run_folder("bench-training"))
    configure_logging("bench", level="WARNING")
    result = run_training_bench(wl, tc, out, say=lambda m: print(m, file=sys.stderr, flush=True))
    return _emit(result, out, args.json, format_training_text)


def run_ceiling_bench(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from rollway.base.logging import configure_logging
    from rollway.bench.ceiling import format_ceiling_text, run_ceiling_bench
    from rollway.bench.workload import WorkloadConfig
    from rollway.config.run import ConfigError

    try:
        data = _settings(args, {"episodes": 256})
        wl = WorkloadConfig.model_validate(data)
    except (ConfigError, ValidationError) as err:
        print(f"rollway bench ceiling: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or fresh_run_folder("bench-ceiling"))
    configure_logging("bench", level="WARNING")
    result = run_ceiling_bench(wl, out, profile=args.profile, say=lambda m: print(m, file=sys.stderr, flush=True))
    return _emit(result, out, args.json, format_ceiling_text)


def _emit(result: dict, out: Path, as_json: bool, format_text) -> int:
    """Write result.json to the run folder and print the result (JSON without the time series, or text)."""
    BenchDir(out).result.write_text(dumps(result, indent=1))
    if as_json:
        print(dumps({k: v for k, v in result.items() if k != "utilisation_series"}))
    else:
        print(format_text(result))
    return 0


def _settings(args: argparse.Namespace, defaults: dict | None = None) -> dict:
    """The benchmark's settings from `defaults`, the dotted overrides and `--seed` (ConfigError on a bad
    override)."""
    from rollway.config.run import apply_override

    data = dict(defaults or {})
    for override in args.overrides:
        apply_override(data, override)
    if args.seed is not None:
        data["seed"] = args.seed
    return data
