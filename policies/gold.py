"""`policy.type: gold`: plays the task set's reference solution, turn by turn (`rollway tasks verify`)."""

from __future__ import annotations

from typing import Any

from rollway.policies.base import ChatFormat, Generation, InferenceClient, SamplingParams

GOLD_LOGPROB = 0.0
"""Behaviour logprob reported for every gold token (episodes of this policy are for checking task sets,
not for training)."""


class GoldPolicy(InferenceClient):
    """Turn k of an episode plays `taskset.reference_solution(task)[k]` (the last entry repeats), or
    what the task set's reference agent answers to the conversation so far.
    A task set without a reference solution makes this policy fail naming the task."""

    @classmethod
    def from_config(cls, cfg: Any, chat: ChatFormat, taskset: Any = None) -> GoldPolicy:
        if taskset is None:
            raise ValueError("policy.type=gold plays the task set's reference solutions: build it with the task set")
        return cls(taskset, chat)

    def __init__(self, taskset: Any, chat: ChatFormat) -> None:
        self.taskset = taskset
        self.chat = chat

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if params.task_id is None:
            raise ValueError("policy.type=gold needs the episode's task id in SamplingParams (set by the agent actor)")
        task = self.taskset.get(params.task_id)
        turns = self.taskset.reference_solution(task)
        if not turns:
            raise ValueError(f"{type(self.taskset).__name__} has no reference solution for task {task.task_id!r}: "
                             "implement TaskSet.reference_solution to use policy.type=gold")
        if callable(turns):  # a reference agent: it reads the conversation so far
            text = turns(self.chat.decode(prompt_ids), params.turn)
        else:
            text = turns[min(params.turn, len(turns) - 1)]
        ids = self.chat.encode(text) + list(self.chat.stop_token_ids[:1])
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        return Generation(ids, [GOLD_LOGPROB] * len(ids), finish, 0)
