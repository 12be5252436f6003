"""`rollway tasks build buglocal`: the bug-localisation family from several libraries, split by library
(training libraries and held-out ones), each library's mutation instances built by the SWE builder
(rollway format) and cached per library so an interrupted build resumes where it stopped."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollway.envs.buglocal import named_in_tests
from rollway.envs.sdist import SdistError, parse_requirement
from rollway.envs.swe import load_instances
from rollway.envs.swe_build import BuildError, BuildOptions, build_instances

SPLITS = ("train", "heldout")
"""Files the build writes in its folder: `train.jsonl`, `heldout.jsonl` (instances, rollway format)."""


@dataclass
class FamilyOptions:
    out: Path
    train: list[str]
    heldout: list[str]
    per_library: int = 30
    seed: int = 0
    max_failing: int = 50
    max_candidates: int = 1500
    max_per_function: int = 2
    cache_dir: str | None = None
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))


def pin(library: str) -> str:
    """`toolz==1.2.0` as given; a bare `toolz` becomes its newest version on the package index (pip)."""
    if "==" in library:
        parse_requirement(library)
        return library
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", library, "--disable-pip-version-check"],
                          capture_output=True, text=True)
    first = (done.stdout.strip().splitlines() or [""])[0]  # "toolz (1.2.0)"
    if done.returncode != 0 or "(" not in first:
        raise SdistError(f"cannot find {library!r} on the package index ({done.stderr.strip()[-200:]}); "
                         "pin a version: NAME==VERSION")
    return f"{library}=={first.split('(')[1].split(')')[0].strip()}"


class LibraryCache:
    """One library's instances so far (`libs/NAME-VERSION-sSEED.jsonl`, appended as each is kept) and how
    many candidates were tried (`.progress.json`): what a resumed build starts from."""

    def __init__(self, out: Path, sdist: str, seed: int) -> None:
        name, version = parse_requirement(sdist)
        stem = f"{name.lower()}-{version}-s{seed}"  # a version's dots are no suffix: no with_suffix here
        self.rows_file = out / "libs" / f"{stem}.jsonl"
        self.progress_file = out / "libs" / f"{stem}.progress.json"
        self.rows_file.parent.mkdir(parents=True, exist_ok=True)

    def rows(self) -> list[dict[str, Any]]:
        return load_instances(self.rows_file) if self.rows_file.is_file() and self.rows_file.stat().st_size else []

    def progress(self) -> dict[str, Any]:
        return json.loads(self.progress_file.read_text()) if self.progress_file.is_file() else {"tried": 0}

    def record(self, tried: int, instance: dict[str, Any] | None, done: bool = False) -> None:
        if instance is not None:
            with self.rows_file.open("a") as f:
                f.write(json.dumps(instance) + "\n")
        state = {**self.progress(), "tried": tried, **({"done": True} if done else {})}
        self.progress_file.write_text(json.dumps(state))


def build_library(opts: FamilyOptions, sdist: str) -> list[dict[str, Any]]:
    """Up to `per_library` instances of one library, resuming from its cache."""
    cache = LibraryCache(opts.out, sdist, opts.seed)
    rows, progress = cache.rows(), cache.progress()
    if len(rows) >= opts.per_library or progress.get("done"):
        opts.log(f"{sdist}: {len(rows)} instances cached ({cache.rows_file})")
        return rows[: opts.per_library]
    opts.log(f"{sdist}: building ({len(rows)} cached, {progress['tried']} candidates tried before)")
    build = BuildOptions(sdist=sdist, max_tasks=opts.per_library, seed=opts.seed, max_failing=opts.max_failing,
                         max_candidates=opts.max_candidates, max_per_function=opts.max_per_function,
                         cache_dir=opts.cache_dir, log=opts.log, resume=rows, skip_candidates=progress["tried"],
                         on_tried=cache.record)
    try:
        rows = build_instances(build)
    except BuildError as exc:
        if cache.rows():
            raise
        opts.log(f"{sdist}: no instance ({exc}); left out")
        cache.record(progress["tried"], None, done=True)
        return []
    if len(rows) < opts.per_library:  # candidates ran out: a larger --per-library finds no more
        cache.record(cache.progress()["tried"], None, done=True)
    return rows[: opts.per_library]


def interleave(groups: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row of each library in turn: a prefix of the file (`tasks.limit`, `--eval-tasks`, the first
    `scheduler.num_tasks`) then spans the libraries instead of holding the first one only."""
    return [row for turn in itertools.zip_longest(*groups) for row in turn if row is not None]


def build_family(opts: FamilyOptions) -> dict[str, Any]:
    """Build every library, write `train.jsonl` and `heldout.jsonl` and `manifest.json`; the summary."""
    started = time.monotonic()
    train, heldout = [pin(x) for x in opts.train], [pin(x) for x in opts.heldout]
    overlap = {parse_requirement(x)[0].lower() for x in train} & {parse_requirement(x)[0].lower() for x in heldout}
    if overlap:
        raise BuildError(f"libraries in both --train and --heldout: {sorted(overlap)}; held-out libraries must "
                         "never appear in training")
    opts.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"seed": opts.seed, "per_library": opts.per_library, "libraries": {}, "left_out": {}}
    # Held-out first: the before-training measurement needs only these.
    for split, libraries in (("heldout", heldout), ("train", train)):
        by_library: list[list[dict[str, Any]]] = []
        named_in_split = 0
        for i, sdist in enumerate(libraries, start=1):
            t0 = time.monotonic()
            # Not fetched (SdistError is no BuildError, so build_library recorded nothing and the next build
            # tries again): one library the index cannot serve must not lose the others' build.
            try:
                got = build_library(opts, sdist)
            except SdistError as exc:
                summary["left_out"][sdist] = str(exc)
                opts.log(f"[{split} {i}/{len(libraries)}] {sdist}: left out, not fetched ({exc}); the next "
                         "build tries it again")
                continue
            by_library.append(got)
            named = sum(named_in_tests(r) for r in got)
            named_in_split += named
            summary["libraries"][sdist] = {"split": split, "instances": len(got), "named": named,
                                           "seconds": round(time.monotonic() - t0, 1)}
            opts.log(f"[{split} {i}/{len(libraries)}] {sdist}: {len(got)} instances, {named} named "
                     f"({time.monotonic() - t0:.0f}s; {time.monotonic() - started:.0f}s in all)")
            if got and not named:
                opts.log(f"{sdist}: no bug of it is in a function a failing test is named after, so a config with "
                         "tasks.difficulty=named (examples/buglocal.yaml) plays none of its tasks")
        rows = interleave(by_library)
        (opts.out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary[split] = len(rows)
        summary[f"{split}_named"] = named_in_split
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    (opts.out / "manifest.json").write_text(json.dumps(summary, indent=1))
    return summary
