"""Sampling carried to the learner, with the real model: the built-in engine (SmolLM2 on CPU) behind
the gateway, a program that sends its own temperature, and the learner's logprob function on the
captured tokens. Nothing is faked."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest
from conftest import run

from rollway.actors.learner import sampling_mismatch
from rollway.episode.calls import outcome_of
from rollway.gateway import Gateway, MemoryRecorder, rebuild_segments
from rollway.schemas.messages import EpisodeKey

CONFIGURED = 0.7
"""agent.temperature = learner.temperature, as in examples/learn.yaml."""
PROGRAM_SENDS = 1.0
"""What opencode and Codex sample at (they send no temperature)."""


@pytest.fixture(scope="module")
def engine_and_chat():
    from rollway.policies.config import LocalPolicyConfig
    from rollway.policies.hf_chat import HFChatFormat
    from rollway.policies.local import LocalEngineClient
    from rollway.policies.model_loading import load_tokenizer

    client = LocalEngineClient.from_config(LocalPolicyConfig(max_batch=1))
    yield client, HFChatFormat(load_tokenizer())
    client.engine.stop()


def sample_episode(engine, chat, enforce: tuple[float, float] | None):
    """One call of a program that sends temperature=1.0; the captured calls."""
    async def scenario():
        gateway = Gateway(engine, chat, MemoryRecorder(), enforce_sampling=enforce)
        await gateway.start()
        handle = gateway.open_episode(EpisodeKey(episode_id="e", group_id="g", task_id="t"))
        client = openai.AsyncOpenAI(base_url=handle.base_url, api_key="x", max_retries=0)
        try:
            await client.chat.completions.create(
                model="m", temperature=PROGRAM_SENDS, max_tokens=48, seed=7,
                messages=[{"role": "user", "content": "Write four lines about the sea."}])
        finally:
            await gateway.stop()
        return gateway.recorder.calls

    return run(scenario())


def learner_gap(engine, calls) -> float:
    """Mean |learner logprob - behaviour logprob| over the sampled tokens, the learner's logprobs
    computed as its trainer does (`token_logprobs` at learner.temperature) on the captured stream."""
    import torch

    from rollway.learning.losses import token_logprobs

    [segment] = rebuild_segments(calls)
    ids = torch.tensor([segment.token_ids])
    mask = torch.tensor([segment.loss_mask], dtype=torch.bool)
    with torch.no_grad():
        logits = engine.engine.model(input_ids=ids).logits
    learner = token_logprobs(logits, ids, CONFIGURED, mask)[0]
    gaps = [abs(float(learner[i]) - lp) for i, lp in enumerate(segment.logprobs) if lp is not None]
    assert len(gaps) >= 8
    return sum(gaps) / len(gaps)


def test_enforced_sampling_makes_behaviour_and_learner_logprobs_agree(engine_and_chat):
    engine, chat = engine_and_chat
    # Before the fix (and with sampling: record): the engine samples at the program's 1.0 and the
    # learner computes at 0.7, so its logprobs are of another distribution.
    recorded = sample_episode(engine, chat, None)
    assert (recorded[0].temperature, recorded[0].top_p, recorded[0].sampling_overridden) == (PROGRAM_SENDS, 1.0, False)
    assert learner_gap(engine, recorded) > 0.25
    # ... which the learner no longer trains silently: the episode is refused, naming the mismatch.
    turns = outcome_of(recorded, "harness_exit", []).turns
    assert turns[0].temperature == PROGRAM_SENDS
    assert "temperature 1.0" in sampling_mismatch(SimpleNamespace(turns=turns), CONFIGURED)
    # sampling: enforce (the default): the gateway samples at the configured temperature whatever the
    # program sends, says so in the record, and the learner's logprobs agree within engine noise.
    enforced = sample_episode(engine, chat, (CONFIGURED, 1.0))
    assert (enforced[0].temperature, enforced[0].sampling_overridden) == (CONFIGURED, True)
    assert learner_gap(engine, enforced) < 0.1
    assert sampling_mismatch(SimpleNamespace(turns=outcome_of(enforced, "harness_exit", []).turns), CONFIGURED) is None
