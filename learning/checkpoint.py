"""Checkpoint folders: HF weights the inference engine loads, plus the trainer's resume state and the
manifest of the optimiser steps whose effect the folder holds (the chaos ledger reads it)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollway.base.faults import fault_point
from rollway.base.files import write_json_atomic
from rollway.base.run_dir import RunDir

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
OPTIMIZER_FILE = "optimizer.pt"
PREFIX = "step_"
MANIFESTS_DIR = "manifests"
"""`checkpoints/manifests/`: manifests of pruned checkpoint folders, kept for the ledger."""
_NAME = re.compile(rf"^{PREFIX}(\d+)$")


class RecentIds:
    """A bounded, insertion-ordered set of episode ids: the learner's dedup window. Holds the newest
    `capacity` ids; a duplicate arriving after `capacity` newer episodes is not recognised."""

    def __init__(self, capacity: int, ids: list[str] | None = None) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()
        for e in ids or []:
            self.add(e)

    def __contains__(self, episode_id: str) -> bool:
        return episode_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, episode_id: str) -> None:
        self._ids[episode_id] = None
        self._ids.move_to_end(episode_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def to_list(self) -> list[str]:
        return list(self._ids)


@dataclass
class TrainerState:
    """What a restart needs besides the weights, persisted in every checkpoint folder so that what
    counts as consumed always matches the weights it sits next to. Bounded: no list of every episode."""

    version: int = 0
    """Policy version of the weights (0 = the initial model); bumped by every update."""
    step: int = 0
    """Updates done (equal to `version`; kept separately for PolicyVersion.step)."""
    optimizer_steps: int = 0
    episodes_trained: int = 0
    """Distinct episodes consumed by updates (trained, masked, dropped or without signal)."""
    recent_episode_ids: list[str] = field(default_factory=list)
    """The dedup window (newest last), at most `learner.dedup_window` ids."""
    recent_group_ids: list[str] = field(default_factory=list)
    """Groups updates took (newest last, the same bound): a member arriving after is late, not trained."""
    watermarks: dict[str, int] = field(default_factory=dict)
    """"topic:partition" -> every offset below it has its effect in this checkpoint (the learner's
    committed position when the checkpoint was written)."""
    manifest: list[dict[str, Any]] = field(default_factory=list)
    """The consumptions this folder adds over the previous checkpoint, in order: one entry per
    update `{"step", "version", "episode_ids", "updated"}` (`updated` False: the groups had no signal
    and the weights did not change), and one per late member of a group already taken (`"late": True`,
    not updated)."""

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        data = json.loads(text)
        legacy = data.pop("trained_episode_ids", None)  # checkpoints written before the dedup window
        if legacy is not None:
            data.setdefault("recent_episode_ids", sorted(legacy))
        return cls(**data)


def checkpoints_dir(run_dir: Path) -> Path:
    return RunDir(run_dir).checkpoints


def _complete(root: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first. A crash between the two renames of a re-save leaves
    `step_N.old` without `step_N`: it is the valid copy and is renamed back."""
    for old in root.glob(f"{PREFIX}*.old"):
        live = old.with_suffix("")
        if live.is_dir() and (live / STATE_FILE).is_file():
            shutil.rmtree(old, ignore_errors=True)
        else:
            shutil.rmtree(live, ignore_errors=True)
            old.rename(live)
    done = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(done, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """Newest complete checkpoint folder (one with a state file); unfinished `.tmp` folders from a
    crash mid-save are ignored."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return None
    done = _complete(root)
    return done[-1] if done else None


def load_state(folder: Path) -> TrainerState:
    return TrainerState.from_json((folder / STATE_FILE).read_text())


def save_checkpoint(run_dir: Path, state: TrainerState, model: Any, tokenizer: Any | None,
                    optimizer: torch.optim.Optimizer | None, keep: int | None,
                    write_weights: Callable[[Path], None] | None = None) -> Path:
    """Write `checkpoints/step_<version>/` atomically (a `.tmp` folder renamed when complete), so
    neither a reader nor a resume ever sees half a checkpoint; then prune old folders. Re-saving a
    version (consumption without a weight change) keeps the folder's earlier manifest entries and
    swaps the folders through `.old`, so a crash leaves one complete copy."""
    final = checkpoints_dir(run_dir) / f"{PREFIX}{state.version:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if write_weights is not None:  # a sharded learner: every rank writes its part (learning/distributed.py)
        write_weights(tmp)
    else:
        model.save_pretrained(tmp)  # model.safetensors + config.json (+ generation_config.json)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    earlier = load_state(final).manifest if (final / STATE_FILE).is_file() else []
    saved = TrainerState(**{**state.__dict__, "manifest": earlier + state.manifest})
    fault_point("checkpoint.write")
    (tmp / STATE_FILE).write_text(saved.to_json())
    fsync_tree(tmp)  # the bytes are on disk before the name says the checkpoint is complete
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        fault_point("checkpoint.rename")
        tmp.rename(final)
        fsync_path(final.parent)  # the renames themselves, before the old copy goes
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_path(final.parent)  # a checkpoint counts (its offsets are committed) only once its name is durable
    _prune(run_dir, keep)
    return final


def fsync_path(path: Path) -> None:
    """fsync one file or folder (a folder's fsync makes the names in it, renames included, durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file below `folder`, then every folder, deepest first (a crashed machine must not
    come back with a complete-looking checkpoint holding empty or short files)."""
    folders = [folder]
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            continue
        if path.is_dir():
            folders.append(path)
        else:
            fsync_path(path)
    for path in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        fsync_path(path)


def _prune(run_dir: Path, keep: int | None) -> None:
    """Delete all but the `keep` newest folders; their manifests move to `manifests/` first."""
    if keep is None:
        return
    root = checkpoints_dir(run_dir)
    (root / MANIFESTS_DIR).mkdir(exist_ok=True)
    for old in _complete(root)[:-keep]:
        kept = root / MANIFESTS_DIR / f"{old.name}.json"
        write_json_atomic(kept, load_state(old).manifest)
        fsync_path(kept)
        fsync_path(kept.parent)  # the manifest is durable before the folder that held it goes
        shutil.rmtree(old, ignore_errors=True)


def read_manifests(run_dir: Path) -> list[dict[str, Any]]:
    """Every durable manifest entry of a run (complete checkpoint folders and pruned ones' manifests),
    one per checkpointed consumption, ordered by step. Half-written folders do not count: what they
    held will be consumed again after a restart."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    by_name: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((root / MANIFESTS_DIR).glob(f"{PREFIX}*.json")):
        by_name[path.stem] = json.loads(path.read_text())
    for folder in _complete(root):
        by_name[folder.name] = load_state(folder).manifest  # the live copy wins over a stale pruned one
    entries = [e for name in sorted(by_name) for e in by_name[name]]
    return sorted(entries, key=lambda e: (e["version"], e["step"]))
