"""`rollway bench search-seeds DIR...`: the search bench's paired figures over several seeds at once.

One `rollway bench search` run answers the issue's two questions on one seed and one held-out split; runs
on several disagree (the bash arm learns more where its base policy finds training reward, only the search
arm learns where it does not). This reads each run's `search-bench.json` and pools each figure over the
runs: the fixed-effect mean (weights 1 / SE^2), the random-effects mean (DerSimonian-Laird: the spread
between runs beyond their own noise, tau^2, added to each run's variance), Cochran's Q and I^2 (how much of
that spread is more than noise), and how many runs are beyond z 3 either way. A figure with SE 0 (an arm
that ran no update: its gain is 0 by construction, not measured) is left out of that figure's pool and
counted as such."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from rollway.base.figures import dumps

FIGURES = {
    "search_gain": ("gain", "search"),
    "bash_gain": ("gain", "bash"),
    "after_search_minus_bash": ("after_search_minus_bash", "pass@1"),
    "gain_search_minus_bash": ("gain_search_minus_bash",),
}
"""Each pooled figure: its path in search-bench.json (a {diff, se, z} object; pass@1, paired per task)."""

Z = 3.0
"""The issue's bar for 'beyond noise'."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="a `rollway bench search` run folder (or its search-bench.json), one per seed")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def read_run(path: Path) -> dict[str, Any]:
    file = path / "search-bench.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: no search-bench.json (a `rollway bench search` run that finished writes one)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not JSON ({err})") from None
    if not isinstance(data, dict) or "before" not in data:
        raise ValueError(f"{file}: not a search bench result (no 'before')")
    return data


def figure(result: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    node: Any = result
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node if isinstance(node, dict) and isinstance(node.get("diff"), (int, float)) else None


def pool(rows: list[tuple[float, float]]) -> dict[str, Any]:
    """rows: (diff, se) per run, se > 0. Fixed-effect and random-effects means with SE and z; Q, I^2, tau^2."""
    k = len(rows)
    if k == 0:
        return {"runs": 0}
    w = [1 / se ** 2 for _, se in rows]
    fixed = sum(wi * d for wi, (d, _) in zip(w, rows, strict=True)) / sum(w)
    fixed_se = math.sqrt(1 / sum(w))
    q = sum(wi * (d - fixed) ** 2 for wi, (d, _) in zip(w, rows, strict=True))
    denom = sum(w) - sum(wi ** 2 for wi in w) / sum(w)
    tau2 = max(0.0, (q - (k - 1)) / denom) if k > 1 and denom > 0 else 0.0
    w_re = [1 / (se ** 2 + tau2) for _, se in rows]
    rand = sum(wi * d for wi, (d, _) in zip(w_re, rows, strict=True)) / sum(w_re)
    rand_se = math.sqrt(1 / sum(w_re))
    return {"runs": k,
            "fixed": {"diff": round(fixed, 4), "se": round(fixed_se, 4), "z": round(fixed / fixed_se, 2)},
            "random": {"diff": round(rand, 4), "se": round(rand_se, 4), "z": round(rand / rand_se, 2)},
            "q": round(q, 2), "i2": round(max(0.0, (q - (k - 1)) / q), 3) if q > 0 else 0.0,
            "tau": round(math.sqrt(tau2), 4),
            "above_z3": sum(round(d / se, 2) >= Z for d, se in rows),
            "below_minus_z3": sum(round(d / se, 2) <= -Z for d, se in rows)}


def combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    per_run = []
    for r in results:
        row: dict[str, Any] = {"seed": r.get("seed"), "run_dir": r.get("run_dir"), "heldout": r.get("heldout")}
        for name, path in FIGURES.items():
            row[name] = figure(r, path)
        per_run.append(row)
    pooled = {}
    for name in FIGURES:
        measured = [(f["diff"], f["se"]) for row in per_run if (f := row[name]) and f.get("se")]
        pooled[name] = {**pool(measured), "not_measured": len(per_run) - len(measured)}
    return {"per_run": per_run, "pooled": pooled}


def format_text(out: dict[str, Any]) -> str:
    def cell(f: dict[str, Any] | None) -> str:
        if not f:
            return "-"
        return f"{f['diff']:+.3f} (z {f['z']})" if f.get("se") else f"{f['diff']:+.3f} (exact)"

    lines = ["held-out pass@1, paired per task; pooled over runs (random effects, DerSimonian-Laird)",
             f"{'seed':>6}  {'held-out':<34}" + "".join(f"{n:>26}" for n in FIGURES)]
    for row in out["per_run"]:
        held = ",".join(lib.split("==")[0] for lib in row["heldout"] or []) or "?"  # versions: --json
        lines.append(f"{row['seed']!s:>6}  {held[:34]:<34}" + "".join(f"{cell(row[n]):>26}" for n in FIGURES))
    for effect in ("fixed", "random"):
        lines.append(f"{effect:>6}  {'':<34}" + "".join(
            f"{cell(out['pooled'][n].get(effect)):>26}" for n in FIGURES))
    lines.append(f"{'':>6}  {'I^2 (share of spread beyond noise)':<34}" + "".join(
        f"{out['pooled'][n].get('i2', '-')!s:>26}" for n in FIGURES))
    lines.append(f"{'':>6}  {'runs beyond z 3 / beyond z -3':<34}" + "".join(
        f"{str(out['pooled'][n].get('above_z3', 0)) + ' / ' + str(out['pooled'][n].get('below_minus_z3', 0)):>26}"
        for n in FIGURES))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        results = [read_run(Path(p)) for p in args.runs]
    except ValueError as err:
        print(f"rollway bench search-seeds: {err}", file=sys.stderr)
        return 2
    out = combine(results)
    print(dumps(out, indent=1) if args.json else format_text(out))
    return 0
