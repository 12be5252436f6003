"""A harness-style trajectory of several token streams for learner tests (kept out of the product: it
builds its arrays with the episode package's TokenStream, which the learning package may not import)."""

from __future__ import annotations

from rollway.episode.stream import TokenStream
from rollway.schemas.messages import EpisodeKey, Trajectory, TurnRecord


def make_segmented_trajectory(episode_id: str, group_id: str, segments: list[list[list[int]]], reward: float, *,
                              behaviour_logprob: float = -5.0, sample_index: int = 0) -> Trajectory:
    """A harness-style trajectory of several token streams, built the way the reward stage builds one
    (`rollway.episode.stream.TokenStream` over turn records). Each segment is `[prompt, completion, observation,
    completion, ...]`: its prompt (loss mask 0), then its turns' completions (mask 1) and the tokens
    between them (mask 0). Every segment after the first opens with a turn whose `segment_prompt_ids`
    is its prompt, as a gateway call after a history rewrite does."""
    turns: list[TurnRecord] = []
    for s, (prompt, *parts) in enumerate(segments):
        completions, observations = parts[0::2], parts[1::2] + [[]]
        for k, (completion, observation) in enumerate(zip(completions, observations, strict=False)):
            opens = s > 0 and k == 0
            turns.append(TurnRecord(turn=len(turns), completion_ids=list(completion),
                                    logprobs=[behaviour_logprob] * len(completion), policy_version=0,
                                    finish_reason="stop", assistant_text="", observation_ids=list(observation),
                                    segment_prompt_ids=list(prompt) if opens else None,
                                    segment_reason="history_rewritten" if opens else None))
    stream = TokenStream.of(segments[0][0], turns, episode_id)
    return Trajectory(episode=EpisodeKey(episode_id=episode_id, group_id=group_id, task_id=f"task-{group_id}",
                                         sample_index=sample_index), token_ids=stream.token_ids,
                      loss_mask=stream.loss_mask, logprobs=stream.logprobs, turn_policy_versions=[0] * len(turns),
                      turn_spans=stream.turn_spans, reward=reward, resolved=reward > 0, stop_reason="harness_exit",
                      num_turns=len(turns), prompt_length=len(segments[0][0]), turns=turns,
                      segment_starts=stream.segment_starts)
