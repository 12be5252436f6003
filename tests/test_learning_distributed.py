"""The sharded learner (FSDP2 over gloo, CPU): 2 ranks match 1 rank, a rank killed mid-step fails the
step on rank 0 with a clear error, and the restart (with another rank count) resumes from the sharded
checkpoint without losing or repeating an episode. Ranks are real processes (tests/sharded_job.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import run_with_progress
from safetensors.torch import load_file

from rollway.learning.checkpoint import read_manifests
from rollway.learning.config import LearnerConfig
from rollway.learning.distributed import rank_plans
from rollway.learning.testing import tiny_model_factory
from rollway.learning.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharded_job import trajectories  # noqa: E402

TOL = 1e-5
"""Losses, computed before any optimiser step. Float32 on CPU: sums over other micro-batch groupings and a
gloo reduction differ in rounding only."""
WEIGHT_TOL = 1e-4
"""Weights after AdamW steps at lr 1e-2: AdamW divides by the square root of tiny second moments, so a
rounding difference in a near-zero gradient (another summation order: two ranks, packed rows, another
CPU's kernels) moves a weight by a few 1e-5: 3e-5 after two steps with packed rows; 1.3e-5 in one of 9,600
`lm_head` elements with two ranks on an AVX2 CPU (torch's CPU capability AVX2), under 1e-5 on AVX-512
machines. A rank's rows left out of the step moves weights by the order of the learning rate."""


def _job(tmp_path: Path, name: str, run_dir: Path, cfg: dict, groups: list, **extra) -> dict:
    out = tmp_path / f"{name}.json"
    spec = {"run_dir": str(run_dir), "out": str(out), "cfg": cfg, "groups": groups, **extra}
    proc = run_with_progress([sys.executable, str(ROOT / "tests" / "sharded_job.py"), json.dumps(spec)])
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    return {**json.loads(out.read_text()), "stderr": proc.stderr}


def _single(run_dir: Path, groups: list, **cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    return _single_results(run_dir, groups, **cfg)[0::2]


def _single_results(run_dir: Path, groups: list, segmented: bool = False,
                    **cfg) -> tuple[list[float], list, dict[str, torch.Tensor]]:
    """One process, no sharding: losses, the step results and the final weights (the reference)."""
    cfg = LearnerConfig(**{"type": "grpo", "group_size": 3, "lr": 1e-2, "tensorboard": False, **cfg})
    trainer = Trainer(cfg, run_dir, model_factory=tiny_model_factory())
    results = [r for g, o in groups for t in trajectories(g, o, segmented) for r in trainer.add(t)]
    return [r.metrics["loss"] for r in results], results, \
        {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _weights(checkpoint: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(checkpoint) / "model.safetensors"))


def _assert_same(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert set(weights) == set(reference)
    for k, v in weights.items():
        torch.testing.assert_close(v, reference[k], atol=WEIGHT_TOL, rtol=WEIGHT_TOL,
                                   msg=lambda detail, k=k: f"{k}: {detail}")


def test_rank_plans_split_by_tokens_and_keep_every_sample() -> None:
    from rollway.learning.batching import Sample, plan_micro_batches

    samples = [Sample(f"e{i}", [0] * n, [1] * n, [None] * n, 1.0) for i, n in enumerate([9, 2, 7, 3, 3])]
    plans = rank_plans(samples, 2, lambda n: plan_micro_batches(n, 10))
    assert sorted(i for plan in plans for mb in plan for i in mb) == [0, 1, 2, 3, 4]
    loads = [sum(len(samples[i].token_ids) for mb in plan for i in mb) for plan in plans]
    assert max(loads) - min(loads) <= 3
    assert rank_plans(samples[:1], 3, lambda n: plan_micro_batches(n, 10))[1:] == [[], []]  # ranks without rows idle (zero-weight micro-batch)


def test_two_ranks_train_multi_segment_episodes_like_one_rank(tmp_path: Path) -> None:
    """Harness episodes of several token streams: the sharded learner splits them per segment and
    normalises per episode exactly as one process does (tests/test_learning_segments.py checks that
    one process against plain torch), here over two mini-batches and packed rows."""
    groups = [["g0", 0], ["g1", 1]]
    cfg = {"mini_batches": 2, "loss_agg": "seq-mean-token-mean", "pack_sequences": True, "micro_batch_tokens": 16}
    losses, reference = _single(tmp_path / "single", groups, segmented=True, **cfg)
    job = _job(tmp_path, "two", tmp_path / "two", {"dist": {"ranks": 2}, **cfg}, groups, segmented=True)
    assert job["error"] is None
    assert [r["version"] for r in job["results"]] == [1, 2]
    assert [r["loss"] for r in job["results"]] == pytest.approx(losses, rel=TOL, abs=TOL)
    _assert_same(_weights(job["results"][-1]["checkpoint"]), reference)


def test_rank_killed_mid_step_then_resume_with_one_rank(tmp_path: Path) -> None:
    groups = [["g0", 0], ["g1", 1], ["g2", 2]]
    _, reference = _single(tmp_path / "single", groups)
    run = tmp_path / "run"
    # Rank 1 dies (SIGKILL) when the second update's command arrives: rank 0 is in its collectives.
    # Packed rows and activation checkpointing on both runs: the same numbers as the padded single process.
    tools = {"pack_sequences": True, "gradient_checkpointing": True, "micro_batch_tokens": 16}
    crashed = _job(tmp_path, "crash", run, {"dist": {"ranks": 2, "collective_timeout_s": 300}, **tools}, groups,
                   die_after_commands=4)
    assert [r["version"] for r in crashed["results"]] == [1]
    assert crashed["broken"] and "RankDied" in crashed["error"] and "restart the learner" in crashed["error"]
    assert crashed["seconds"] < 150  # the death was seen, not the 300-s collective limit waited out
    # The restarted learner (one rank now) gets every uncommitted group again: g1 and g2.
    resumed = _job(tmp_path, "resume", run, {"dist": {"ranks": 1, "fsdp": True}, **tools}, groups)
    assert resumed["error"] is None
    assert [r["episodes"] for r in resumed["results"]] == [["g1-a", "g1-b", "g1-c"], ["g2-a", "g2-b", "g2-c"]]
    consumed = [e for entry in read_manifests(run) for e in entry["episode_ids"]]
    assert sorted(consumed) == sorted(f"{g}-{s}" for g, _ in groups for s in "abc")  # none lost, none twice
    # Weights and AdamW state came back from the 2-rank shards: same result as one uninterrupted process.
    _assert_same(_weights(resumed["results"][-1]["checkpoint"]), reference)


LORA = {"enabled": True, "r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def test_two_ranks_train_lora_adapters_like_one_rank(tmp_path: Path) -> None:
    """LoRA on sharded ranks: the frozen base and the adapters are sharded, only the adapters train;
    the checkpoint's adapter folder (written once, by rank 0) equals one process's, and its sharded
    part holds adapters and their optimizer state only. A restart with one rank resumes from it."""
    from torch.distributed.checkpoint import FileSystemReader

    groups = [["g0", 0], ["g1", 1]]
    losses, single, _ = _single_results(tmp_path / "single", groups, lr=5e-2, lora=LORA)
    job = _job(tmp_path, "two", tmp_path / "two", {"dist": {"ranks": 2}, "lr": 5e-2, "lora": LORA}, groups)
    assert job["error"] is None
    assert [r["loss"] for r in job["results"]] == pytest.approx(losses, rel=TOL, abs=TOL)
    ckpt = Path(job["results"][-1]["checkpoint"])
    files = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "dcp"} <= files and "model.safetensors" not in files
    reference = load_file(str(single[-1].checkpoint_path / "adapter_model.safetensors"))
    adapters = load_file(str(ckpt / "adapter_model.safetensors"))
    assert len(reference) == 2 * 3 * 2  # lora_A and lora_B of 3 layers in each of 2 blocks
    assert reference["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].abs().max() > 1e-3  # trained
    _assert_same(adapters, reference)
    sharded = FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in sharded if k.startswith("model.")]
    assert len(model_keys) == len(reference) and all(".lora_" in k for k in model_keys)  # no base weights
    resumed = _job(tmp_path, "resume", tmp_path / "two", {"dist": {"ranks": 1, "fsdp": True}, "lr": 5e-2,
                                                          "lora": LORA}, [["g0", 0], ["g1", 1], ["g2", 2]])
    assert resumed["error"] is None and [r["version"] for r in resumed["results"]] == [3]  # g0, g1 known


def test_two_ranks_with_a_kl_penalty_match_one_rank(tmp_path: Path) -> None:
    """kl_coef > 0 on sharded ranks: each rank holds a shard of the frozen reference model and computes
    its share of the reference logprobs; the KL term and the updated weights equal one process's. (Also the
    plain case, two ranks matching one, with its sharded checkpoint: the same path with the reference model
    added; a test of its own paid for one more two-rank job.)"""
    groups = [["g0", 0], ["g1", 1], ["g2", 2]]
    losses, single, reference = _single_results(tmp_path / "single", groups, kl_coef=0.5)
    kls = [r.metrics["kl_ref_mean"] for r in single]
    assert kls[0] == pytest.approx(0.0, abs=1e-9) and kls[-1] > 1e-4  # the policy left the reference
    # One episode per micro-batch: rank 0 gets one, rank 1 two, so rank 0 idles through one micro-batch of
    # the reference model's forward (it must join that model's all-gathers, not the policy's).
    job = _job(tmp_path, "two", tmp_path / "two", {"dist": {"ranks": 2}, "kl_coef": 0.5, "micro_batch_tokens": 8},
               groups)
    assert job["error"] is None
    assert [r["version"] for r in job["results"]] == [1, 2, 3]
    assert [r["kl_ref"] for r in job["results"]] == pytest.approx(kls, rel=1e-4, abs=TOL)
    assert [r["loss"] for r in job["results"]] == pytest.approx(losses, rel=TOL, abs=TOL)
    _assert_same(_weights(job["results"][-1]["checkpoint"]), reference)
    assert (Path(job["results"][-1]["checkpoint"]) / "dcp" / ".metadata").is_file()  # sharded checkpoint
    without = _single(tmp_path / "no-kl", groups)[1]
    assert max((without[k] - reference[k]).abs().max() for k in reference) > 1e-4  # the penalty changed the update


# ---- the rank channel trusts no peer: no pickle, signed commands, loopback only -----------------------------


class _Planted:
    """Unpickling this creates a file: the proof that a pickle from the network ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _loopback_store(world: int = 2):
    """Rank 0's real rendezvous store (learning/distributed.py) on a free loopback port."""
    import os
    from datetime import timedelta

    from rollway.learning.distributed import free_port, rendezvous_store

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    return rendezvous_store(0, world, timedelta(seconds=10))


def test_a_pickle_in_the_rank_channel_is_refused_unread(tmp_path: Path) -> None:
    """Attack: a process on the host connects to the learner's store and plants the next command as a
    pickle (what the channel used to unpickle). The follower refuses it and no code runs."""
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    from rollway.learning.distributed import CommandChannel, CommandRefused

    store = _loopback_store()
    attacker = dist.TCPStore("127.0.0.1", store.port, 2, False, timedelta(seconds=10))
    marker = tmp_path / "pwned"
    attacker.set("rollway/cmd/1", pickle.dumps(("optimise", _Planted(str(marker)))))
    follower = CommandChannel(store, b"run-token", rank=1)
    with pytest.raises(CommandRefused, match="ROLLWAY_DIST_TOKEN"):
        follower.receive()
    assert not marker.exists()


def test_a_peer_without_the_run_token_is_refused_and_rank_0s_commands_verify() -> None:
    """Attack: a peer that speaks the new encoding but does not know the per-run token (or replays a real
    command under the next key) is refused; rank 0's own commands, samples included, arrive intact."""
    from rollway.learning.batching import Sample
    from rollway.learning.distributed import CommandChannel, CommandRefused, encode_command

    store = _loopback_store()
    leader, follower = CommandChannel(store, b"token-a", 0), CommandChannel(store, b"token-a", 1)
    samples = [Sample("e-1", [1, 2, 3], [0, 1, 1], [None, -0.5, -0.25], 0.5, 0.75)]
    leader.send("optimise", samples)
    assert follower.receive() == ("optimise", samples)
    store.set("rollway/cmd/2", encode_command(b"token-b", "rollway/cmd/2", ["save", "/tmp/elsewhere"]))
    with pytest.raises(CommandRefused):
        follower.receive()
    replayed = CommandChannel(store, b"token-a", 1)  # the first command, copied to key 3
    store.set("rollway/cmd/3", store.get("rollway/cmd/1"))
    replayed._seq = 2
    with pytest.raises(CommandRefused):
        replayed.receive()


def test_rank_0s_store_listens_on_loopback_only() -> None:
    """torch's own TCPStore listens on every interface; rank 0's listens on MASTER_ADDR (127.0.0.1 here)."""
    store = _loopback_store()
    listening = subprocess.run(["ss", "-Hltn", f"sport = :{store.port}"], capture_output=True, text=True,
                               check=True).stdout.split()
    assert f"127.0.0.1:{store.port}" in listening and f"*:{store.port}" not in listening, listening


def test_more_than_one_rank_without_a_token_fails_naming_it(monkeypatch) -> None:
    from rollway.learning.distributed import RankDied, run_token

    monkeypatch.delenv("ROLLWAY_DIST_TOKEN", raising=False)
    with pytest.raises(RankDied, match="ROLLWAY_DIST_TOKEN is not set"):
        run_token(2)
    assert len(run_token(1)) == 32
