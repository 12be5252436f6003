"""The OpenAI wire format: validated requests in, completion and chunk bodies out (no HTTP here)."""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from rollway.policies.base import MAX_TOKEN_ID
from rollway.tools.parsing import parse_tool_calls


class RequestError(ValueError):
    """A request the gateway refuses; `status` is the HTTP status, `param` the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status == 400 else self.code
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


ROLES = ("system", "developer", "user", "assistant", "tool")
_IGNORED_MESSAGE_KEYS = {"refusal", "annotations", "audio", "reasoning_content", "reasoning"}
"""Keys clients echo back from our own responses (null or informational); they do not reach the model."""
_IGNORED_FIELDS = {"model", "user", "metadata", "store", "parallel_tool_calls", "service_tier", "stream_options"}
_SUPPORTED_CHAT = {"messages", "tools", "tool_choice", "stop", "max_tokens", "max_completion_tokens",
                   "temperature", "top_p", "n", "stream", "seed"}
_SUPPORTED_COMPLETION = {"prompt", "stop", "max_tokens", "temperature", "top_p", "n", "stream", "seed"}
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "echo": False, "best_of": 1,
            "logit_bias": {}, "top_logprobs": 0}
"""Options the gateway does not implement, accepted only at the value that means 'off'."""


@dataclass(frozen=True)
class Sampling:
    """The sampling options common to both endpoints."""

    max_tokens: int | None
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    """Canonical messages: role, content (str), tool_calls (list of {id, name, arguments: dict}),
    tool_call_id, name; the forms the capture compares and renders."""
    tools: list[dict[str, Any]]
    tool_choice: str
    sampling: Sampling


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    sampling: Sampling


def _expect(value: Any, kind: type | tuple[type, ...], param: str, what: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise RequestError(f"{param} must be {what}, got {json.dumps(value)[:100]}", param)
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _check_fields(body: Any, supported: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    body = {k: v for k, v in body.items() if v is not None}  # clients send null for 'not given'
    for key, value in body.items():
        if key in supported or key in _IGNORED_FIELDS:
            continue
        if key in _NEUTRAL:
            if value != _NEUTRAL[key]:
                raise RequestError(f"unsupported option {key}={json.dumps(value)[:80]}: the gateway serves "
                                   f"the policy as sampled; leave {key} out", key, code="unsupported_option")
            continue
        raise RequestError(f"unsupported field {key!r}; this gateway reads {', '.join(sorted(supported))}",
                           key, code="unsupported_option")
    return body


def _sampling(body: dict[str, Any], max_field: str | None = None) -> Sampling:
    if _expect(body.get("n", 1), int, "n", "an integer") != 1:
        raise RequestError("only n=1 is supported: send one request per sample", "n", code="unsupported_option")
    limit = None
    for name in ("max_tokens", max_field):
        if name and name in body:
            limit = _expect(body[name], int, name, "a positive integer")
            if limit < 1:
                raise RequestError(f"{name} must be at least 1, got {limit}", name)
    temperature = float(_expect(body.get("temperature", 1.0), (int, float), "temperature", "a number"))
    if not 0 <= temperature <= 2:
        raise RequestError(f"temperature must be between 0 and 2, got {temperature}", "temperature")
    top_p = float(_expect(body.get("top_p", 1.0), (int, float), "top_p", "a number"))
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else _expect(stop, list, "stop", "a string or a list of strings")
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be up to 4 non-empty strings", "stop")
    seed = body.get("seed")
    if seed is not None and not 0 <= _expect(seed, int, "seed", "an integer") < 2**63:
        raise RequestError(f"seed must be in [0, 2**63), got {seed}", "seed")
    options = body.get("stream_options") or {}
    _expect(options, dict, "stream_options", "an object")
    return Sampling(limit, temperature, top_p, tuple(stop), seed,
                    bool(_expect(body.get("stream", False), bool, "stream", "true or false")),
                    bool(options.get("include_usage", False)))


def parse_chat_request(body: Any) -> ChatRequest:
    """A validated chat request; RequestError naming the field otherwise."""
    body = _check_fields(body, _SUPPORTED_CHAT)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list of message objects", "messages")
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]
    if messages[-1]["role"] == "assistant":
        raise RequestError(f"messages[{len(raw) - 1}].role is assistant: the gateway samples a new assistant "
                           "turn, so end with a user or tool message", f"messages[{len(raw) - 1}].role")
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(_expect(body.get("tools", []), list, "tools", "a list"))]
    return ChatRequest(messages, tools, _tool_choice(body.get("tool_choice", "auto"), tools),
                       _sampling(body, "max_completion_tokens"))


def parse_completion_request(body: Any) -> CompletionRequest:
    body = _check_fields(body, _SUPPORTED_COMPLETION)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return CompletionRequest(prompt, _sampling(body))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and
                                                   0 <= t < MAX_TOKEN_ID for t in prompt):
        return CompletionRequest(prompt, _sampling(body))
    raise RequestError(f"prompt must be a non-empty string or a non-empty list of token ids (0 <= id < "
                       f"{MAX_TOKEN_ID}; one prompt per request: batches of several are not supported)", "prompt")


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_part(part, f"{param}[{i}]", ("text",)) for i, part in enumerate(content))
    raise RequestError(f"{param} must be a string or a list of text parts", param)


def _text_part(part: Any, param: str, kinds: tuple[str, ...], what: str = "content part") -> str:
    """The text of one content part of a type in `kinds`. A part of another type is unsupported (named by its
    type); a malformed one (not an object, or its text not a string) is a bad request naming the field."""
    if not isinstance(part, dict):
        raise RequestError(f"{param} must be an object, got {json.dumps(part)[:60]}", param)
    if part.get("type") not in kinds:
        raise RequestError(f"{param}: {what} type {json.dumps(part.get('type'))[:40]} is not supported here; this "
                           f"gateway reads {', '.join(kinds)}", param, code="unsupported_option")
    return _expect(part.get("text"), str, f"{param}.text", "a string")


def _message(raw: Any, param: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise RequestError(f"{param} must be a message object", param)
    role = raw.get("role")
    if role not in ROLES:
        raise RequestError(f"{param}.role must be one of {', '.join(ROLES)}, got {json.dumps(role)[:60]}",
                           f"{param}.role")
    unknown = set(raw) - {"role", "content", "name", "tool_calls", "tool_call_id"} - _IGNORED_MESSAGE_KEYS
    if raw.get("function_call") is not None:
        raise RequestError(f"{param}.function_call (the legacy form) is not supported: use tool_calls",
                           f"{param}.function_call", code="unsupported_option")
    unknown.discard("function_call")
    if unknown:
        raise RequestError(f"{param} has unsupported keys: {', '.join(sorted(unknown))}", f"{param}.{min(unknown)}")
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = raw.get("content")
    if role == "assistant":
        msg["content"] = "" if content is None else _text(content, f"{param}.content")
        msg["tool_calls"] = [_echoed_call(c, f"{param}.tool_calls[{i}]")
                             for i, c in enumerate(_expect(raw.get("tool_calls") or [], list,
                                                           f"{param}.tool_calls", "a list"))]
    else:
        if content is None:
            raise RequestError(f"{param}.content is missing", f"{param}.content")
        msg["content"] = _text(content, f"{param}.content")
    if role == "tool" and raw.get("tool_call_id") is not None:
        msg["tool_call_id"] = _expect(raw["tool_call_id"], str, f"{param}.tool_call_id", "a string")
    if raw.get("name") is not None:
        msg["name"] = _expect(raw["name"], str, f"{param}.name", "a string")
    return msg


def _echoed_call(raw: Any, param: str) -> dict[str, Any]:
    """A tool call the program sends back: {id, name, arguments} with arguments decoded to an object
    when they are JSON (kept as the string otherwise: it then matches no sampled call)."""
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{param} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                           param)
    arguments: Any = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except (ValueError, RecursionError):
            pass  # not JSON (or nested past the parser): kept as text
    return {"id": raw.get("id"), "name": fn["name"], "arguments": arguments}


def _tool(raw: Any, param: str) -> dict[str, Any]:
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(f"{param} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                           param)
    if not isinstance(fn.get("parameters", {}), dict):
        raise RequestError(f"{param}.function.parameters must be a JSON-schema object", f"{param}.function.parameters")
    return {"type": "function", "function": fn}


def _tool_choice(raw: Any, tools: list[dict[str, Any]]) -> str:
    """'auto', 'none', 'required' or a tool name. Only 'none' changes what the model sees (no tools
    offered); the others cannot be enforced without constrained decoding and are taken as 'auto'."""
    if raw in ("auto", "none", "required"):
        return raw
    name = raw.get("function", {}).get("name") if isinstance(raw, dict) else None
    if not isinstance(name, str):
        raise RequestError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': "
                           "{'name': ...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise RequestError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return name


# -- replies ------------------------------------------------------------------------------------------


@dataclass
class Reply:
    """What the program receives for one call: text and tool calls decoded from the sampled ids."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """[{id, name, arguments: dict}]."""
    finish_reason: str = "stop"
    raw_text: str = ""
    """The decoded sampled text, tool-call tags included (how the model wrote it)."""
    stop_string: str | None = None
    """The stop string that ended the text (it is cut off), None when none did."""


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str | None:
    """`text` up to the first stop string, or None when none occurs."""
    cuts = [text.index(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else None


_CALL_BLOCK_RE = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)", re.DOTALL)


def make_reply(text: str, finish_reason: str, parse_tools: bool) -> Reply:
    """The assistant message for sampled `text`: tool calls parsed with rollway's parser and taken out
    of the content when every block parsed; the text kept whole otherwise (the program sees it all)."""
    if parse_tools:
        parsed = parse_tool_calls(text)
        if parsed.calls and not parsed.errors:
            calls = [{"id": f"call_{secrets.token_hex(12)}", "name": c.name, "arguments": c.arguments}
                     for c in parsed.calls]
            return Reply(_CALL_BLOCK_RE.sub("", text).strip(), calls, "tool_calls", text)
    return Reply(text, [], finish_reason, text)


def wire_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls]


def chat_completion(call_id: str, model: str, reply: Reply, usage: dict[str, int]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.tool_calls:
        message["tool_calls"] = wire_tool_calls(reply.tool_calls)
    elif message["content"] is None:
        message["content"] = ""
    return {"id": call_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
            "usage": usage}


def text_completion(call_id: str, model: str, text: str, finish_reason: str, usage: dict[str, int]) -> dict:
    return {"id": call_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage}


def _pieces(text: str, size: int = 8) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def chat_chunks(call_id: str, model: str, reply: Reply, usage: dict[str, int] | None) -> list[dict[str, Any]]:
    """The streamed form of `reply`: a role chunk, content pieces, one chunk per tool call, the finish
    chunk, and a usage chunk when asked for (`stream_options.include_usage`)."""
    base = {"id": call_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": piece}) for piece in _pieces(reply.content)]
    for i, call in enumerate(wire_tool_calls(reply.tool_calls)):
        out.append(chunk({"tool_calls": [{"index": i, **call}]}))
    out.append(chunk({}, reply.finish_reason))
    if usage is not None:
        out.append({**base, "choices": [], "usage": usage})
    return out


def completion_chunks(call_id: str, model: str, text: str, finish_reason: str,
                      usage: dict[str, int] | None) -> list[dict[str, Any]]:
    base = {"id": call_id, "object": "text_completion", "created": int(time.time()), "model": model}
    out = [{**base, "choices": [{"index": 0, "text": piece, "finish_reason": None, "logprobs": None}]}
           for piece in _pieces(text)]
    out.append({**base, "choices": [{"index": 0, "text": "", "finish_reason": finish_reason, "logprobs": None}]})
    if usage is not None:
        out.append({**base, "choices": [], "usage": usage})
    return out
