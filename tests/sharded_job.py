"""A sharded learner job for tests, run as `python tests/sharded_job.py SPEC_JSON`: rank 0 builds the
learner's trainer (which starts the other ranks as copies of this command), feeds it synthetic groups
and writes what happened to SPEC["out"]; ranks > 0 follow rank 0.

SPEC: {"run_dir", "out", "cfg": LearnerConfig overrides, "groups": [[group_id, start], ...] (two
episodes each), "segmented": true (harness-style trajectories of several token streams),
"die_after_commands": N (rank 1 SIGKILLs itself when its Nth command arrives)}."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from segmented import make_segmented_trajectory

from rollway.learning.config import LearnerConfig
from rollway.learning.distributed import RankDied, ShardedTrainer, build_trainer, world_from_env
from rollway.learning.testing import make_trajectory, tiny_model_factory


def trajectories(group: str, start: int, segmented: bool = False) -> list:
    prompt = [1 + start % 7, 2, 3, 4]
    if segmented:  # harness episodes whose program rewrote its history: 2, 1 and 3 token streams
        return [make_segmented_trajectory(f"{group}-a", group, [[prompt, [10 + start % 50, 11, 12], [5], [13]],
                                                                [[1, 9, 8], [14, 15]]], 1.0, sample_index=0),
                make_segmented_trajectory(f"{group}-b", group, [[prompt, [20, 21 + start % 30]]], 0.0, sample_index=1),
                make_segmented_trajectory(f"{group}-c", group, [[prompt, [30]], [[2, 6], [31, 32]], [[3, 7, 7], [33]]],
                                          0.5, sample_index=2)]
    return [make_trajectory(f"{group}-a", group, prompt, [10 + start % 50, 11, 12, 13, 14], 1.0, sample_index=0),
            make_trajectory(f"{group}-b", group, prompt, [20, 21 + start % 30], 0.0, sample_index=1),
            make_trajectory(f"{group}-c", group, prompt, [30, 31, 32], 0.5, sample_index=2)]


def main() -> int:
    spec = json.loads(sys.argv[1])
    cfg = LearnerConfig(**{"type": "grpo", "group_size": 3, "lr": 1e-2, "tensorboard": False, **spec["cfg"]})
    rank, _ = world_from_env()
    if rank > 0:
        trainer = ShardedTrainer(cfg, Path(spec["run_dir"]), model_factory=tiny_model_factory())
        die = spec.get("die_after_commands")
        if die:
            receive = trainer.group.receive
            count = [0]

            def receive_then_die():
                msg = receive()
                count[0] += 1
                if count[0] >= die and msg[0] == "optimise":
                    os.kill(os.getpid(), signal.SIGKILL)
                return msg
            trainer.group.receive = receive_then_die
        try:
            trainer.follow()
        except RankDied as err:
            print(f"rank {rank}: {err}", file=sys.stderr)
            return 1
        return 0
    trainer = build_trainer(cfg, Path(spec["run_dir"]), model_factory=tiny_model_factory())
    out = {"results": [], "error": None}
    start = time.monotonic()
    try:
        for group, offset in spec["groups"]:
            for traj in trajectories(group, offset, spec.get("segmented", False)):
                for r in trainer.add(traj):
                    out["results"].append({"version": r.version, "episodes": r.episode_ids,
                                           "checkpoint": str(r.checkpoint_path), "loss": r.metrics["loss"],
                                           "grad_norm": r.metrics["grad_norm"],
                                           "train_tokens": r.metrics["train_tokens"],
                                           "kl_ref": r.metrics.get("kl_ref_mean")})
    except Exception as err:  # the test reads the error the learner actor would turn into FatalActorError
        out["error"] = f"{type(err).__name__}: {err}"
        out["broken"] = trainer.broken is not None
    out["seconds"] = time.monotonic() - start
    Path(spec["out"]).write_text(json.dumps(out))
    trainer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
