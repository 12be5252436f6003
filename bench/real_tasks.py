"""The real pipeline benchmark's task set: SWE instances built from one or several source archives
(`rollway tasks build swe`, cached per archive under ~/.cache/rollway/bench), or an instances file.
Tasks are drawn across the archives in turn; an archive that yields fewer than its share leaves the
rest to the others."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REQUIRED_FIELDS = ("instance_id", "snapshot", "mutation", "FAIL_TO_PASS", "PASS_TO_PASS")
"""What an instances file (`rollway tasks build swe --format instances`) holds per instance."""


class TaskSetError(RuntimeError):
    """The bench cannot get its tasks; the message names the archive or file, why, and what to try."""


def shares(num_tasks: int, archives: int) -> list[int]:
    """`num_tasks` split across `archives` as evenly as it goes, the first archives taking one more."""
    return [num_tasks // archives + (i < num_tasks % archives) for i in range(archives)]


def cache_file(folder: Path, sdist: str, num_tasks: int, seed: int) -> Path:
    from rollway.envs.sdist import parse_requirement

    name, version = parse_requirement(sdist)
    return folder / f"{name}-{version}-n{num_tasks}-s{seed}.jsonl"


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cached_rows(folder: Path, sdist: str, num_tasks: int, seed: int) -> tuple[list[dict[str, Any]], Path] | None:
    """An earlier build that answers for `num_tasks` tasks of `sdist`: one of at least as many tasks (its
    first `num_tasks`: the builder keeps tasks in its seeded candidate order, so a larger build begins
    with the smaller one), or a smaller one that came up short (the archive has no more under this seed)."""
    from rollway.envs.sdist import parse_requirement

    name, version = parse_requirement(sdist)
    pattern = re.compile(rf"{re.escape(name)}-{re.escape(version)}-n(\d+)-s{seed}\.jsonl")
    found: list[tuple[int, Path]] = []
    for path in folder.glob(f"{name}-{version}-n*-s{seed}.jsonl") if folder.is_dir() else ():
        match = pattern.fullmatch(path.name)
        if match:
            found.append((int(match[1]), path))
    for built, path in sorted(found):
        rows = read_rows(path)
        if built >= num_tasks or len(rows) < built:
            return rows[:num_tasks], path
    return None


def build_rows(sdist: str, num_tasks: int, seed: int, cache_dir: Path | None,
               say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Up to `num_tasks` instances of `sdist`, from the cache or built (every step of the build is said)."""
    from rollway.envs.sdist import SdistError, cache_root
    from rollway.envs.swe_build import BuildError, BuildOptions, build_instances

    folder = cache_root(cache_dir) / "bench"
    hit = cached_rows(folder, sdist, num_tasks, seed)
    if hit is not None:
        say(f"tasks: {sdist}: {len(hit[0])} task(s) cached in {hit[1]}")
        return hit[0]
    path = cache_file(folder, sdist, num_tasks, seed)
    say(f"tasks: building {num_tasks} task(s) from {sdist} (once; cached at {path}): the clean test suite "
        "twice, then one test run per candidate bug")
    t0 = time.monotonic()
    try:
        rows = build_instances(BuildOptions(sdist=sdist, max_tasks=num_tasks, seed=seed,
                                            cache_dir=str(cache_dir) if cache_dir else None, log=lambda line: say(f"tasks: {sdist}: {line}")))
    except (BuildError, SdistError) as err:
        raise TaskSetError(f"sdist {sdist} yields no tasks: {err}") from err
    except Exception as err:  # an archive that does not unpack or parse: name it, whatever broke
        raise TaskSetError(f"sdist {sdist}: building its tasks failed ({type(err).__name__}: {err}); drop it "
                           "from sdist= or try `rollway tasks build swe --sdist` on it alone") from err
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    say(f"tasks: {sdist}: {len(rows)} of {num_tasks} task(s) built in {time.monotonic() - t0:.0f} s")
    return rows


def tasks_from_sdists(sdists: list[str], num_tasks: int, seed: int, say: Callable[[str], None],
                      cache_dir: Path | None = None) -> list[dict[str, Any]]:
    """`num_tasks` instances drawn across `sdists` in turn (archives, snapshots and builds under `cache_dir`,
    default ~/.cache/rollway). An archive yielding fewer than its share (its
    mutations run out under `seed`) passes the rest to the others; none at all is an error naming it."""
    want = dict(zip(sdists, shares(num_tasks, len(sdists)), strict=True))
    got: dict[str, list[dict[str, Any]]] = {}
    exhausted: set[str] = set()
    while True:
        for sdist, n in want.items():
            if sdist not in got or (len(got[sdist]) < n and sdist not in exhausted):
                got[sdist] = build_rows(sdist, n, seed, cache_dir, say)
                if len(got[sdist]) < n:
                    exhausted.add(sdist)
        missing = sum(want[s] - len(got[s]) for s in want)
        if not missing:
            break
        short = "; ".join(f"{s} yields {len(got[s])} of {want[s]}" for s in sorted(exhausted))
        others = [s for s in want if s not in exhausted]
        if not others:
            raise TaskSetError(f"{short} task(s) under task_seed={seed}: {sum(map(len, got.values()))} of "
                               f"num_tasks={num_tasks}; lower num_tasks, add an archive to sdist= or try another "
                               "task_seed")
        say(f"tasks: {short}; {missing} more from {', '.join(others)}")
        for s in exhausted:
            want[s] = len(got[s])
        for i in range(missing):
            want[others[i % len(others)]] += 1
    rows = [got[s][i] for i in range(max(want.values())) for s in sdists if i < len(got[s])]
    return rows


def per_archive(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Instances per source repository ("?" for a row that names none), in first-seen order."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.get("repo", "?")] = counts.get(row.get("repo", "?"), 0) + 1
    return counts


def check_instances(path: Path, num_tasks: int) -> list[dict[str, Any]]:
    """The rows of an instances file, checked: the `swe` task set's fields, at least `num_tasks` rows."""
    if not path.is_file():
        raise TaskSetError(f"tasks_path {path} does not exist; write one with `rollway tasks build swe --sdist "
                           "NAME==VERSION --out FILE`, or name archives with sdist= instead")
    try:
        rows = read_rows(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TaskSetError(f"tasks_path {path} is not JSON lines ({err}); give the file `rollway tasks build "
                           "swe` wrote") from err
    if len(rows) < num_tasks:
        raise TaskSetError(f"tasks_path {path} holds {len(rows)} instance(s), num_tasks={num_tasks}: lower "
                           "num_tasks or build more tasks (`rollway tasks build swe --max-tasks N`)")
    for row in rows:
        lacking = [f for f in REQUIRED_FIELDS if not isinstance(row, dict) or f not in row]
        if lacking:
            rid = row.get("instance_id", "?") if isinstance(row, dict) else "?"
            raise TaskSetError(f"tasks_path {path}: instance {rid} lacks {', '.join(lacking)}; the real bench runs "
                               "`tasks.type: swe` in local sandboxes and needs the rows `rollway tasks build swe` "
                               "writes with --format instances (converted to SWE-bench rows over git on load)")
    return rows


def ensure_tasks(sdists: list[str], tasks_path: str | None, num_tasks: int, seed: int, out: Path,
                 say: Callable[[str], None] = print, cache_dir: Path | None = None) -> Path:
    """The instances file both modes run: `tasks_path` (checked), or `num_tasks` tasks built from `sdists`
    (each archive's build cached under ~/.cache/rollway/bench) written to `out/tasks.jsonl`."""
    if tasks_path:
        path = Path(tasks_path).expanduser()
        check_instances(path, num_tasks)
        return path
    rows = tasks_from_sdists(sdists, num_tasks, seed, say, cache_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    say(f"tasks: {len(rows)} in {path} ({', '.join(f'{k}: {v}' for k, v in per_archive(rows).items())})")
    return path
