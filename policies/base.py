"""The inference interface: token ids in; token ids, logprobs and finish reason out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
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
    """Per-request sampling seed. The agent seeds turn k of an episode with `episode_seed(...) + k`,
    so a re-run of an episode draws the same samples."""
    ignore_eos: bool = False
    """Keep sampling past the model's end-of-sequence token (benchmarks and tests of long turns)."""
    task_id: str | None = None
    """The episode's task (set by the agent actor), for policies that read the task set (`gold`)."""
    turn: int = 0
    """The episode's turn (0-based), set by the agent actor."""


@dataclass(frozen=True)
class Generation:
    """One completion. `logprobs` has the length of `token_ids` (behaviour logprobs)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """`stop` (a stop token was produced) or `length` (max_tokens reached)."""
    policy_version: int


class InferenceClient(ABC):
    """Serves the policy to the agent actor. Built by `build_inference(config)` as
    `Class.from_config(config, chat, taskset)`; the agent actor calls `generate` once per turn and
    `close` at shutdown."""

    @classmethod
    def from_config(cls, cfg: Any, chat: ChatFormat, taskset: Any = None) -> InferenceClient:
        """The client for this policy config. Default `Class(config, chat)` (how plugins are built);
        `taskset` is the run's task set (the gold policy plays its reference solutions)."""
        return cls(cfg, chat)

    @abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample one completion for `prompt_ids`."""

    supports_weight_sync: bool = False
    """True when `load_weights` loads a learner checkpoint into the served policy. The learner refuses
    to train against a client without it (its new weights would never be used)."""

    async def load_weights(self, path: str, version: int) -> int:
        """Load the learner checkpoint at `path` as policy `version`; returns the version served."""
        raise NotImplementedError(f"{type(self).__name__} cannot load new weights (supports_weight_sync is False)")

    async def served_version(self) -> int | None:
        """The policy version the engine serves now, as its responses report it; None when the engine
        cannot say (then agents in other processes cannot know which policy produced a turn)."""
        return None

    async def context_tokens(self) -> int | None:
        """Prompt and output tokens the engine holds per sequence (its `max_model_len`); None when it
        cannot say. The gateway refuses a longer prompt with the error programs compact on, and cuts a
        call's max_tokens to the room left, before the engine sees it."""
        return None

    async def close(self) -> None:
        """Release connections."""


class InferenceRequestError(RuntimeError):
    """The engine refused a request (4xx) for what it holds (a prompt too long, an id outside the
    vocabulary): retrying will not help, and the prompt is the agent's doing (base/blame.py)."""

    def __init__(self, message: str, status: int = 400, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = str(message if reason is None else reason)[:500]
        """The engine's own words, without the engine's address (what a program may be told)."""


class InferenceSettingsRefused(InferenceRequestError):
    """The engine refused who asked or for what model (401, 403, 404, 405: the client's key, route or model
    name, the operator's settings, or an adapter a weight update unloaded): no agent can cause it."""

    infrastructure = True


class EngineAnswerUnreadable(ConnectionError):
    """The engine answered with a success status and a body the client cannot read (not JSON, no choices,
    token ids that are not ids, fewer logprobs than tokens). No program or model shapes that JSON, so it is
    the engine's or its settings' failure (an OSError: infrastructure, base/blame.py), never the agent's; the
    client does not send it again (the engine would answer alike)."""


MAX_TOKEN_ID = 2**31
"""Token ids are below this (vocabularies are far smaller; larger ids are not ids): a prompt a program sends
and an engine's answer are refused past it, and the gateway holds ids as 32-bit C ints."""


def read_answer(what: str, parse: Callable[..., Generation], *args: Any) -> Generation:
    """`parse(*args)`, the engine's answer to `what` read as a Generation, with what it cannot read and a
    Generation that is not one (ids that are not ints in [0, MAX_TOKEN_ID), logprobs of another length)
    raised as EngineAnswerUnreadable."""
    try:
        gen = parse(*args)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise EngineAnswerUnreadable(f"could not read the inference engine's answer to {what}: {err!r}") from None
    ids_ok = all(type(t) is int and 0 <= t < MAX_TOKEN_ID for t in gen.token_ids)
    if not ids_ok or len(gen.logprobs) != len(gen.token_ids) or type(gen.policy_version) is not int:
        raise EngineAnswerUnreadable(f"could not read the inference engine's answer to {what}: "
                                     f"{len(gen.token_ids)} token ids (all ints: {ids_ok}), {len(gen.logprobs)} "
                                     f"logprobs, policy version {gen.policy_version!r}")
    return gen


def inference_refusal(message: str, status: int, reason: str | None = None) -> InferenceRequestError:
    """The error for an engine's 4xx answer of `status`."""
    kind = InferenceSettingsRefused if status in (401, 403, 404, 405) else InferenceRequestError
    return kind(message, status, reason)


class PolicyVersionUnknown(RuntimeError):
    """The engine does not report which policy version produced a response."""


async def check_served_version(client: InferenceClient, version: int) -> None:
    """After a weight update: the engine must report `version`, or turns would be mislabelled."""
    served = await client.served_version()
    if served is None:
        raise PolicyVersionUnknown(
            f"the inference engine ({type(client).__name__}) does not report policy versions, so every turn "
            "would be labelled 0 and, once the learner is max_policy_lag versions ahead, every episode dropped "
            "as stale: train with policy.engine=vllm or the built-in engine (policy.launch=true), or "
            "policy.type=local")
    if served != version:
        raise PolicyVersionUnknown(f"the inference engine serves policy version {served} after loading "
                                   f"version {version}: another process updates it; give each run its own engine")


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

    @property
    def user_header_ids(self) -> tuple[int, ...] | None:
        """Token ids that open a user turn, when the format has them (None: unknown)."""
        return None

    def turns_since_user(self, prompt_ids: list[int]) -> int:
        """Assistant turns in `prompt_ids` after the last user message (worked examples given as
        earlier turns do not count); the generation prompt at the end is not a finished turn."""
        start = 0
        if self.user_header_ids:
            start = last_index_of(prompt_ids, self.user_header_ids) + 1
        return max(0, count_subsequence(prompt_ids[start:], self.assistant_header_ids) - 1)

    def drift(self, history: list[dict[str, Any]], tools: list[dict[str, Any]],
              token_ids: list[int]) -> bool:
        """True when rendering `history` from scratch would not give `token_ids` (the template is
        not append-only). Default: no check."""
        return False


def count_subsequence(haystack: list[int], needle: tuple[int, ...]) -> int:
    """Non-overlapping occurrences of `needle` in `haystack`."""
    n, count, i = len(needle), 0, 0
    while n and i <= len(haystack) - n:
        if tuple(haystack[i:i + n]) == needle:
            count, i = count + 1, i + n
        else:
            i += 1
    return count


def last_index_of(haystack: list[int], needle: tuple[int, ...]) -> int:
    """Start of the last occurrence of `needle`, or -1."""
    n = len(needle)
    for i in range(len(haystack) - n, -1, -1):
        if tuple(haystack[i:i + n]) == needle:
            return i
    return -1


def episode_seed(episode_id: str, attempt: int) -> int:
    """A stable 31-bit seed per episode attempt (independent of Python's hash randomisation)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{episode_id}/{attempt}".encode()).digest()[:4], "big") >> 1
