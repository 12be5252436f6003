"""Tiny random policy models and synthetic trajectories for learner tests (no downloads)."""

from __future__ import annotations

from typing import Any

import torch

from rollway.learning.modeling import ModelFactory
from rollway.schemas.messages import EpisodeKey, Trajectory

TINY_VOCAB = 300


def tiny_model_factory(seed: int = 0) -> ModelFactory:
    """A factory for a 2-layer Llama (hidden 32, vocab 300): random weights seeded by `seed` for
    None, `from_pretrained` for a checkpoint folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def factory(path: str | None) -> tuple[Any, None]:
        if path is not None:
            return LlamaForCausalLM.from_pretrained(path), None
        torch.manual_seed(seed)
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=256)
        return LlamaForCausalLM(cfg), None

    return factory


def make_trajectory(episode_id: str, group_id: str, prompt: list[int], completion: list[int], reward: float,
                    *, observation: list[int] | None = None, second: list[int] | None = None,
                    stop_reason: str = "finish", versions: list[int] | None = None,
                    behaviour_logprob: float = -5.0, sample_index: int = 0) -> Trajectory:
    """A one- or two-turn trajectory: prompt, completion [, observation, second completion]."""
    ids, mask = list(prompt), [0] * len(prompt)
    spans = [(len(ids), len(ids) + len(completion))]
    ids += completion
    mask += [1] * len(completion)
    if second is not None:
        ids += observation or []
        mask += [0] * len(observation or [])
        spans.append((len(ids), len(ids) + len(second)))
        ids += second
        mask += [1] * len(second)
    logprobs = [behaviour_logprob if m else None for m in mask]
    return Trajectory(episode=EpisodeKey(episode_id=episode_id, group_id=group_id, task_id=f"task-{group_id}",
                                         sample_index=sample_index), token_ids=ids, loss_mask=mask, logprobs=logprobs,
                      turn_policy_versions=versions or [0] * len(spans), turn_spans=spans, reward=reward,
                      resolved=reward > 0, stop_reason=stop_reason, num_turns=len(spans),
                      prompt_length=len(prompt))
