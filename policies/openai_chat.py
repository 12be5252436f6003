"""`policy.api: chat`: an OpenAI-compatible `/chat/completions` endpoint that takes no token ids.

The agent works in token ids; this client turns the prompt back into messages (ChatML prompts:
`<|im_start|>role\\ncontent<|im_end|>`), sends them, and encodes the reply with the chat format.
The server's own tokenization is unknown, so the logprobs are zeros and the policy version is
`NOT_TRAINABLE_VERSION` (-1): these trajectories serve evaluation, never training (a learner that
loads weights into this client fails at once, see `check_served_version`)."""

from __future__ import annotations

import re
from typing import Any

from rollway.policies.base import ChatFormat, Generation, SamplingParams, read_answer
from rollway.policies.openai_client import OpenAICompletionsClient

NOT_TRAINABLE_VERSION = -1
"""Policy version recorded for turns from an endpoint that returns text only."""
_BLOCK = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.S)


def chatml_messages(text: str) -> list[dict[str, str]]:
    """Messages of a ChatML prompt; the trailing empty assistant header (generation prompt) is dropped."""
    messages = [{"role": role, "content": content.rstrip("\n")} for role, content in _BLOCK.findall(text)]
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    if not messages:
        raise ValueError("policy.api=chat needs a ChatML chat format (<|im_start|>role ... <|im_end|>)")
    return messages


class OpenAIChatClient(OpenAICompletionsClient):
    """Calls `{base_url}/chat/completions` once per turn with the prompt as messages."""

    def __init__(self, base_url: str, chat: ChatFormat, model: str | None = None, timeout: float = 300.0,
                 max_retries: int = 5, api_key: str | None = None):
        super().__init__(base_url, model, timeout, max_retries, api_key=api_key)
        self.chat = chat

    def _prompt_text(self, prompt_ids: list[int]) -> str:
        tokenizer = getattr(self.chat, "tokenizer", None)
        if tokenizer is not None:
            return tokenizer.decode(prompt_ids, skip_special_tokens=False)
        # BytesChatML: bytes, with 256/257 for <|im_start|>/<|im_end|>.
        marks = {256: b"<|im_start|>", 257: b"<|im_end|>"}
        return b"".join(marks.get(t, bytes([t]) if t < 256 else b"") for t in prompt_ids).decode("utf-8", "replace")

    def payload(self, model: str, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": chatml_messages(self._prompt_text(prompt_ids)),
                                "max_tokens": params.max_tokens, "temperature": params.temperature,
                                "top_p": params.top_p}
        if params.seed is not None:
            body["seed"] = params.seed
        if params.ignore_eos:  # never dropped: an endpoint that does not know the field says so
            body["ignore_eos"] = True
        return body

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        url = f"{self.base_url}/chat/completions"
        body, _ = await self._request("POST", url, self.payload(await self.model_name(), prompt_ids, params),
                                      alive_url=self._models_url())
        return read_answer(f"POST {url}", self._generation, body)

    def _generation(self, body: Any) -> Generation:
        choice = body["choices"][0]
        text = (choice.get("message") or {}).get("content") or ""
        if not isinstance(text, str):
            raise TypeError(f"message.content is {type(text).__name__}, not text")
        finish = "stop" if choice.get("finish_reason") == "stop" else "length"
        ids = self.chat.encode(text) + (list(self.chat.stop_token_ids[:1]) if finish == "stop" else [])
        return Generation(ids, [0.0] * len(ids), finish, NOT_TRAINABLE_VERSION)

    async def load_weights(self, path: str, version: int) -> int:
        raise RuntimeError("policy.api=chat serves evaluation only (no token ids or logprobs): train with "
                           "policy.api=completions against an engine that returns token ids")

    async def served_version(self) -> int | None:
        return None
