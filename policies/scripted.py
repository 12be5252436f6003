"""A deterministic scripted policy behind the real inference interface (tests, smoke job, demos)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from rollway.policies.base import (
    ChatFormat,
    Generation,
    InferenceClient,
    InferenceRequestError,
    SamplingParams,
)
from rollway.policies.config import ScriptRule

SCRIPTED_LOGPROB = -0.01
"""Behaviour logprob reported for every scripted token (a near-certain choice)."""


class ScriptedPolicy(InferenceClient):
    """Plays `turns[k]` of the first rule matching the prompt, where k is the episode's turn (the
    agent's `SamplingParams.turn`, so a simulated user's message does not restart the script; for a
    program's calls through the gateway, which carry no turn, the assistant turns since the last user
    message). Same prompt and turn, same output: episodes are reproducible."""

    @classmethod
    def from_config(cls, cfg: Any, chat: ChatFormat, taskset: Any = None) -> ScriptedPolicy:
        return cls(cfg.script, chat, max_model_len=cfg.max_model_len)

    def __init__(self, rules: list[ScriptRule], chat: ChatFormat, policy_version: int = 0,
                 max_model_len: int | None = None):
        if not rules:
            raise ValueError("policy.script is empty: give at least one rule with `turns` for the scripted policy")
        self.rules = [(re.compile(r.when), [r.turns, *r.alternatives], r.seconds) for r in rules]
        self.chat = chat
        self.policy_version = policy_version
        self.max_model_len = max_model_len

    async def context_tokens(self) -> int | None:
        return self.max_model_len

    def _scripts_for(self, prompt_text: str) -> tuple[list[list[str]], float]:
        for pattern, scripts, seconds in self.rules:
            if pattern.search(prompt_text):
                return scripts, seconds
        raise LookupError("no policy.script rule matches this prompt; add a rule with when: ''")

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            raise InferenceRequestError(f"the prompt ({len(prompt_ids)} tokens) does not fit the context of "
                                        f"{self.max_model_len} tokens")
        scripts, seconds = self._scripts_for(self.chat.decode(prompt_ids))
        if seconds:
            await asyncio.sleep(seconds)
        k = params.turn or self.chat.turns_since_user(prompt_ids)
        turns = scripts[0]
        if len(scripts) > 1 and params.temperature > 0 and params.seed is not None:
            turns = scripts[(params.seed - k) % len(scripts)]  # the episode's seed, same on every turn
        ids = self.chat.encode(turns[min(k, len(turns) - 1)]) + list(self.chat.stop_token_ids[:1])
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        return Generation(ids, [SCRIPTED_LOGPROB] * len(ids), finish, self.policy_version)
