"""Policy versions through a whole `rollway up` on a real vLLM server: two agent worker processes,
a training learner, updates pushed into the server while episodes run.

The model is a tiny Llama initialised at random (2 layers, SmolLM2's tokenizer) so that an update
takes seconds on this CPU; vLLM, the broker, the sandboxes, the learner and its checkpoints are the
real ones. Faked part: the task set's grader (tests/plugins/coin_tasks.py) derives the reward from
the episode's sandbox, because a random model solves nothing and the learner needs reward variance
to update at all.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from jobs import run_with_progress

from rollway.learning.checkpoint import read_manifests
from rollway.policies.vllm import INSTALL_HINT, vllm_python

pytestmark = pytest.mark.e2e
GROUPS, GROUP_SIZE = 4, 4  # the last task's group is flat (no signal): 3 updates


def tiny_llama(folder: Path) -> Path:
    """A randomly initialised 2-layer Llama in a Hugging Face folder, with SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollway.policies.model_loading import resolve_model_folder

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    smollm2 = resolve_model_folder("smollm2")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2 / name, folder / name)
    return folder


def test_two_agent_processes_record_the_version_vllm_served_each_turn(tmp_path):
    if vllm_python() is None:
        pytest.fail(INSTALL_HINT)
    model = str(tiny_llama(tmp_path / "model"))
    config = {
        "run": {"name": "versions", "timeout_s": 900},
        "tasks": {"type": "python:tests/plugins/coin_tasks.py:CoinTaskSet", "count": GROUPS},
        "scheduler": {"group_size": GROUP_SIZE, "num_tasks": GROUPS, "max_inflight_episodes": 8,
                      "max_policy_lag": 1, "episode_deadline_s": 300},
        "agent": {"concurrency": 8, "max_turns": 2, "max_tokens_per_turn": 16, "max_total_tokens": 512},
        "policy": {"type": "openai", "launch": True, "engine": "vllm", "chat_format": "hf", "model": model,
                   "max_model_len": 1024},
        # stale_policy=drop with a lag bound of 1: were turns labelled 0 whatever the server served, every
        # episode from the third update on would be dropped.
        "learner": {"type": "ppo", "model_path": model, "dtype": "float32", "groups_per_step": 1,
                    "max_policy_lag": 1, "stale_policy": "drop", "checkpoint_every": 1, "keep_checkpoints": 2},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "up", "--no-report", str(tmp_path / "run.yaml"),
                          "--run-dir", str(run_dir), "--workers", "agent=2"],
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]

    episodes = GROUPS * GROUP_SIZE
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes_completed"] == episodes and summary["episodes_failed"] == 0
    trajectories = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len({t["episode"]["episode_id"] for t in trajectories}) == episodes
    versions = [v for t in trajectories for v in t["turn_policy_versions"]]
    # Group k is issued once k-1 updates are trained (lag bound 1): the last group runs on version >= GROUPS - 3.
    assert set(range(GROUPS - 2)) <= set(versions) <= set(range(GROUPS)), sorted(set(versions))
    for t in trajectories:
        assert t["turn_policy_versions"] == sorted(t["turn_policy_versions"])

    # Both agent processes served turns (the versions came from the engine, not from a shared object).
    handled = [json.loads(line)["handled"] for line in (run_dir / "logs" / "agent.jsonl").read_text().splitlines()
               if json.loads(line).get("event") == "stage worker stopped"]
    assert len(handled) == 2 and min(handled) > 0, handled

    # Judged from the learner's checkpoints: every episode trained exactly once, none dropped as stale;
    # the flat group consumed without an update.
    flat = {t["episode"]["episode_id"] for t in trajectories if t["episode"]["task_id"] == f"coin-{GROUPS - 1:03d}"}
    manifests = read_manifests(run_dir)
    trained = [e for m in manifests if m["updated"] for e in m["episode_ids"]]
    assert sorted(trained) == sorted(t["episode"]["episode_id"] for t in trajectories if t["episode"]["episode_id"] not in flat)
    assert {e for m in manifests if not m["updated"] for e in m["episode_ids"]} == flat and len(flat) == GROUP_SIZE
    assert [m["version"] for m in manifests if m["updated"]] == list(range(1, GROUPS))
    # Each new version reached the engine once: the checkpoint that made the flat group durable held
    # unchanged weights and paused no replica.
    loaded = [json.loads(line)["version"] for line in (run_dir / "logs" / "learner.jsonl").read_text().splitlines()
              if json.loads(line).get("event") == "inference engine loaded policy"]
    assert loaded == list(range(1, GROUPS)), loaded
