"""The inference interface: token ids in; token ids, logprobs and finish reason out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after producing one of these (the stop token is part of the output)."""
    seed: int | None = None


@dataclass(frozen=True)
class Generation:
    """One completion. `logprobs` has the length of `token_ids` (behaviour logprobs)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """`stop` (a stop token was produced) or `length` (max_tokens reached)."""
    policy_version: int


class InferenceClient(ABC):
    """Serves the policy to the agent actor. Built by `build_inference(config)`; the agent actor
    calls `generate` once per turn and `close` at shutdown."""

    @abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample one completion for `prompt_ids`."""

    async def close(self) -> None:
        """Release connections."""


class ChatFormat(ABC):
    """Turns chat messages into token ids, append-only across turns (token-in, token-out).

    Messages are OpenAI-style dicts: {"role": "system"|"user"|"assistant"|"tool", "content": str}.
    """

    @abstractmethod
    def initial(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """Token ids of the first prompt, ending with the assistant generation prompt."""

    @abstractmethod
    def continuation(self, history: list[dict[str, Any]], new: list[dict[str, Any]],
                     tools: list[dict[str, Any]]) -> list[int]:
        """Token ids to append after the model's last completion (which ends `history`) for the
        `new` tool/user messages, ending with the next assistant generation prompt."""

    @abstractmethod
    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids (special tokens dropped)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""

    @property
    @abstractmethod
    def assistant_header_ids(self) -> tuple[int, ...]:
        """Token ids that open an assistant turn (the generation prompt)."""

    @property
    @abstractmethod
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn."""

    def drift(self, history: list[dict[str, Any]], tools: list[dict[str, Any]],
              token_ids: list[int]) -> bool:
        """True when rendering `history` from scratch would not give `token_ids` (the template is
        not append-only). Default: no check."""
        return False
