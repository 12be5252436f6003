"""Checkpoint folders: HF weights the inference engine loads, plus the trainer's resume state."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
PREFIX = "step_"


@dataclass
class TrainerState:
    """What a restart needs besides the weights. Persisted in every checkpoint folder, so the set
    of trained episodes always matches the weights it sits next to."""

    version: int = 0
    """Policy version of the weights (0 = the initial model); bumped by every update."""
    step: int = 0
    """Updates done (equal to `version`; kept separately for PolicyVersion.step)."""
    optimizer_steps: int = 0
    episodes_trained: int = 0
    trained_episode_ids: set[str] = field(default_factory=set)

    def to_json(self) -> str:
        data = asdict(self)
        data["trained_episode_ids"] = sorted(self.trained_episode_ids)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        data = json.loads(text)
        data["trained_episode_ids"] = set(data.get("trained_episode_ids", []))
        return cls(**data)


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """Newest complete checkpoint folder (one with a state file); unfinished `.tmp` folders from a
    crash mid-save are ignored."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return None
    done = [p for p in root.glob(f"{PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp")
            and (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(p.name[len(PREFIX):]), default=None)


def load_state(folder: Path) -> TrainerState:
    return TrainerState.from_json((folder / STATE_FILE).read_text())


def save_checkpoint(run_dir: Path, state: TrainerState, model: Any, tokenizer: Any | None,
                    optimizer: torch.optim.Optimizer | None, keep: int | None) -> Path:
    """Write `checkpoints/step_<version>/` atomically (a `.tmp` folder renamed when complete), so
    neither a reader nor a resume ever sees half a checkpoint; then prune old folders."""
    final = checkpoints_dir(run_dir) / f"{PREFIX}{state.version:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)  # model.safetensors + config.json (+ generation_config.json)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    (tmp / STATE_FILE).write_text(state.to_json())
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _prune(run_dir, keep)
    return final


def _prune(run_dir: Path, keep: int | None) -> None:
    if keep is None:
        return
    done = sorted((p for p in checkpoints_dir(run_dir).glob(f"{PREFIX}*") if not p.name.endswith(".tmp")),
                  key=lambda p: int(p.name[len(PREFIX):]))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
