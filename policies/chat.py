"""ChatML over UTF-8 bytes: a model-free chat format for the scripted policy and tests."""

from __future__ import annotations

import json
from typing import Any

from rollway.policies.base import ChatFormat

IM_START = 256
IM_END = 257
VOCAB_SIZE = 258


class BytesChatML(ChatFormat):
    """Token id = byte value; 256 and 257 are <|im_start|> and <|im_end|>. Append-only by design."""

    def _block(self, role: str, content: str) -> list[int]:
        return [IM_START, *f"{role}\n{content}".encode(), IM_END, *b"\n"]

    def _system_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict]:
        if not tools:
            return messages
        listing = "\n".join(json.dumps(t["function"], sort_keys=True) for t in tools)
        note = ("\n\n# Tools\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."
                f"\n<tools>\n{listing}\n</tools>")
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + note}, *messages[1:]]
        return [{"role": "system", "content": note.strip()}, *messages]

    def initial(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        ids: list[int] = []
        for m in self._system_text(messages, tools):
            ids += self._block(m["role"], m["content"])
        return ids + [IM_START, *b"assistant\n"]

    def continuation(self, history: list[dict[str, Any]], new: list[dict[str, Any]],
                     tools: list[dict[str, Any]]) -> list[int]:
        ids: list[int] = [*b"\n"]  # the model's completion ends with IM_END; ChatML puts a newline after it
        for m in new:
            ids += self._block(m["role"], m["content"])
        return ids + [IM_START, *b"assistant\n"]

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    @property
    def assistant_header_ids(self) -> tuple[int, ...]:
        return (IM_START, *b"assistant\n")

    @property
    def user_header_ids(self) -> tuple[int, ...]:
        return (IM_START, *b"user\n")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (IM_END,)
