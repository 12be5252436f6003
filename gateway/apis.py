"""The OpenAI Responses API and the Anthropic Messages API on the wire: each request converted to the
gateway's canonical chat request (so it takes the chat completions capture path), and each reply
written back in the API's own body and server-sent event forms (no HTTP here)."""

from __future__ import annotations

import json
import time
from typing import Any

from rollway.gateway.protocol import (
    ChatRequest,
    Reply,
    RequestError,
    _check_fields,
    _expect,
    _sampling,
    _text_part,
    _tool,
    _tool_choice,
)

CHAT_APIS = ("chat", "responses", "messages")
"""APIs whose requests are conversations: one capture path (extensions, retries, segments) for all."""

# -- Responses (POST /v1/responses) ----------------------------------------------------------------

_RESPONSES_FIELDS = {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
                     "stream", "store", "include", "reasoning", "text", "truncation", "prompt_cache_key",
                     "safety_identifier", "max_tool_calls", "background", "previous_response_id", "conversation",
                     "prompt", "top_logprobs", "client_metadata"}
_RESPONSES_NEUTRAL = {"truncation": "disabled", "background": False, "top_logprobs": 0}
_ROLE_OF = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant"}


def parse_responses_request(body: Any) -> ChatRequest:
    """A Responses request as a canonical chat request. Stateless use only: the whole history in
    `input`, nothing stored (`previous_response_id`, `conversation`, `store: true` and prompt templates
    are refused naming the field); non-function tools are dropped from what the model sees."""
    body = _check_fields(body, _RESPONSES_FIELDS)
    for name in ("previous_response_id", "conversation", "prompt"):
        if name in body:
            raise RequestError(f"{name} is not supported: this gateway keeps no responses or conversations; send "
                               "store: false and the whole history in input each call", name,
                               code="unsupported_option")
    if body.get("store") is True:
        raise RequestError("store: true is not supported: this gateway keeps no responses; send store: false and "
                           "the whole history in input each call", "store", code="unsupported_option")
    for name, neutral in _RESPONSES_NEUTRAL.items():
        if name in body and body[name] != neutral:
            raise RequestError(f"unsupported option {name}={json.dumps(body[name])[:80]}: leave it out or send "
                               f"{json.dumps(neutral)}", name, code="unsupported_option")
    text = _expect(body.get("text", {}), dict, "text", "an object")
    text_format = _expect(text.get("format") or {}, dict, "text.format", "an object").get("type", "text")
    if text_format != "text":
        raise RequestError(f"text.format type {json.dumps(text_format)[:60]} is not supported (no constrained "
                           "decoding): leave text.format out", "text.format", code="unsupported_option")
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _expect(body["instructions"], str, "instructions", "a string")})
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError("input must be a non-empty string or list of items", "input")
    for i, item in enumerate(raw):
        _responses_item(item, f"input[{i}]", messages)
    if not messages or messages[-1]["role"] == "assistant":
        raise RequestError("input ends with the assistant's own output: the gateway samples a new assistant turn, so "
                           "end with a user message or a function_call_output", "input")
    tools = [_tool(_function_tool(t), f"tools[{i}]")
             for i, t in enumerate(_expect(body.get("tools", []), list, "tools", "a list"))
             if isinstance(t, dict) and t.get("type") == "function"]
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif isinstance(choice, dict):
        choice = "auto"  # a hosted tool type: dropped with the tool, like the tool
    return ChatRequest(messages, tools, _tool_choice(choice, tools), _sampling(_sampling_fields(body),
                                                                            "max_output_tokens"))


def _sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in ("max_output_tokens", "temperature", "top_p", "stream") if k in body}


def _function_tool(raw: dict[str, Any]) -> dict[str, Any]:
    spec = {k: raw[k] for k in ("name", "description", "parameters") if raw.get(k) is not None}
    return {"type": "function", "function": spec}


def _responses_text(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    parts = _expect(content, list, param, "a string or a list of content parts")
    return "".join(_text_part(part, f"{param}[{i}]", kinds) for i, part in enumerate(parts))


def _responses_item(item: Any, param: str, messages: list[dict[str, Any]]) -> None:
    """Append `item` to `messages` in canonical form: a function_call joins the assistant turn it follows
    (an assistant's text and calls come back as separate items), its output becomes a tool message."""
    if not isinstance(item, dict):
        raise RequestError(f"{param} must be an object", param)
    kind = item.get("type", "message")
    if kind == "message":
        role = _ROLE_OF.get(item["role"]) if isinstance(item.get("role"), str) else None
        if role is None:
            raise RequestError(f"{param}.role must be user, assistant, system or developer", f"{param}.role")
        kinds = ("output_text", "refusal") if role == "assistant" else ("input_text", "output_text")
        text = _responses_text(item.get("content"), f"{param}.content", kinds)
        messages.append({"role": role, "content": text, "tool_calls": []} if role == "assistant"
                        else {"role": role, "content": text})
    elif kind == "function_call":
        name, call_id = item.get("name"), item.get("call_id")
        if not (isinstance(name, str) and isinstance(call_id, str)):
            raise RequestError(f"{param}: a function_call needs string name and call_id", param)
        arguments = _expect(item.get("arguments", "{}"), str, f"{param}.arguments", "a JSON string")
        try:
            parsed = json.loads(arguments or "{}")
        except (ValueError, RecursionError):
            raise RequestError(f"{param}.arguments is not JSON (or nests deeper than the parser reads)",
                               f"{param}.arguments") from None
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": "", "tool_calls": []})
        messages[-1]["tool_calls"].append({"id": call_id, "name": name, "arguments": parsed})
    elif kind == "function_call_output":
        call_id = _expect(item.get("call_id"), str, f"{param}.call_id", "a string")
        output = item.get("output", "")
        text = output if isinstance(output, str) else _responses_text(output, f"{param}.output",
                                                                      ("input_text", "output_text"))
        messages.append({"role": "tool", "content": text, "tool_call_id": call_id})
    elif kind == "reasoning":
        return  # the gateway emits none; another model's reasoning is not rendered
    else:
        raise RequestError(f"{param}: input item type {json.dumps(kind)[:40]} is not supported; this gateway reads "
                           "message, function_call and function_call_output items", f"{param}.type",
                           code="unsupported_option")


def _responses_usage(usage: dict[str, int]) -> dict[str, Any]:
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _output_items(call_id: str, reply: Reply) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reply.content or not reply.tool_calls:
        items.append({"type": "message", "id": f"msg_{call_id}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": reply.content, "annotations": []}]})
    for i, c in enumerate(reply.tool_calls):
        items.append({"type": "function_call", "id": f"fc_{call_id}_{i}", "call_id": c["id"], "name": c["name"],
                      "arguments": json.dumps(c["arguments"]), "status": "completed"})
    return items


def responses_body(call_id: str, model: str, request: ChatRequest, reply: Reply, usage: dict[str, int] | None,
                   output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The `response` object; `usage` None and `output` [] for the in-progress form a stream opens with."""
    cut = reply.finish_reason == "length"
    status = "in_progress" if usage is None else "incomplete" if cut else "completed"
    return {"id": f"resp_{call_id}", "object": "response", "created_at": int(time.time()), "status": status,
            "model": model, "output": _output_items(call_id, reply) if output is None else output,
            "usage": None if usage is None else _responses_usage(usage),
            "incomplete_details": {"reason": "max_output_tokens"} if cut and usage is not None else None,
            "error": None, "instructions": None, "metadata": {}, "parallel_tool_calls": True,
            "temperature": request.sampling.temperature, "top_p": request.sampling.top_p,
            "tool_choice": "auto", "tools": [], "store": False, "previous_response_id": None,
            "max_output_tokens": request.sampling.max_tokens, "truncation": "disabled", "text": {"format": {"type": "text"}}}


def responses_events(call_id: str, model: str, request: ChatRequest, reply: Reply,
                     usage: dict[str, int]) -> list[tuple[str, dict[str, Any]]]:
    """The stream of a Responses call: created, in_progress, per output item its added/delta/done
    events, then completed (incomplete when cut at the token limit) with usage."""
    events: list[tuple[str, dict[str, Any]]] = []

    def emit(kind: str, **data: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **data}))

    emit("response.created", response=responses_body(call_id, model, request, reply, None, []))
    emit("response.in_progress", response=responses_body(call_id, model, request, reply, None, []))
    for index, item in enumerate(_output_items(call_id, reply)):
        if item["type"] == "message":
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
            part = {"type": "output_text", "text": "", "annotations": []}
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            emit("response.content_part.added", **where, part=part)
            for piece in _pieces(reply.content):
                emit("response.output_text.delta", **where, delta=piece, logprobs=[])
            emit("response.output_text.done", **where, text=reply.content, logprobs=[])
            emit("response.content_part.done", **where, part={**part, "text": reply.content})
        else:
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                 delta=item["arguments"])
            emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                 name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    final = responses_body(call_id, model, request, reply, usage)
    emit("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
    return events


# -- Anthropic Messages (POST /v1/messages) ---------------------------------------------------------

_MESSAGES_FIELDS = {"messages", "system", "max_tokens", "tools", "tool_choice", "stop_sequences", "temperature",
                    "top_p", "stream", "thinking", "top_k", "container", "mcp_servers", "context_management",
                    "service_tier"}


def parse_messages_request(body: Any) -> ChatRequest:
    """An Anthropic Messages request as a canonical chat request: `system` first, tool_result blocks
    as tool messages, tool_use blocks as the assistant's tool calls; server tools (a `type` other than
    `custom`) are dropped from what the model sees; extended thinking and `top_k` are refused."""
    body = _check_fields(body, _MESSAGES_FIELDS)
    for name in ("top_k", "container", "mcp_servers", "context_management"):
        if name in body:
            raise RequestError(f"{name} is not supported by this gateway: leave it out", name,
                               code="unsupported_option")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise RequestError("extended thinking is not supported: leave thinking out or send {\"type\": "
                           "\"disabled\"}", "thinking", code="unsupported_option")
    if "max_tokens" not in body:
        raise RequestError("max_tokens is required", "max_tokens")
    messages: list[dict[str, Any]] = []
    if "system" in body:
        system = _anthropic_text(body["system"], "system")
        if system:
            messages.append({"role": "system", "content": system})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list of message objects", "messages")
    for i, message in enumerate(raw):
        _anthropic_message(message, f"messages[{i}]", messages)
    if messages[-1]["role"] == "assistant":
        raise RequestError("the last message is the assistant's (a prefill): the gateway samples a new assistant "
                           "turn, so end with a user message", f"messages[{len(raw) - 1}].role",
                           code="unsupported_option")
    tools = [_tool({"type": "function", "function": {k: v for k, v in (("name", t.get("name")),
                                                                       ("description", t.get("description")),
                                                                       ("parameters", t.get("input_schema")))
                                                     if v is not None}}, f"tools[{i}]")
             for i, t in enumerate(_expect(body.get("tools", []), list, "tools", "a list"))
             if isinstance(t, dict) and t.get("type", "custom") == "custom"]
    choice = body.get("tool_choice") or {"type": "auto"}
    _expect(choice, dict, "tool_choice", "an object")
    kind = choice.get("type")
    chat_choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if choice.get("type") == "tool":
        chat_choice = {"type": "function", "function": {"name": choice.get("name")}}
    if chat_choice is None:
        raise RequestError("tool_choice.type must be auto, any, tool or none", "tool_choice")
    fields = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "stream") if k in body}
    if "stop_sequences" in body:
        fields["stop"] = body["stop_sequences"]
    temperature = fields.get("temperature", 0)
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 1:
        raise RequestError(f"temperature must be between 0 and 1, got {fields['temperature']}", "temperature")
    return ChatRequest(messages, tools, _tool_choice(chat_choice, tools), _sampling(fields))


def _anthropic_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    blocks = _expect(content, list, param, "a string or a list of text blocks")
    return "".join(_text_part(block, f"{param}[{i}]", ("text",), "content block") for i, block in enumerate(blocks))


def _anthropic_message(raw: Any, param: str, messages: list[dict[str, Any]]) -> None:
    if not isinstance(raw, dict) or raw.get("role") not in ("user", "assistant"):
        raise RequestError(f"{param} must be a message with role user or assistant", f"{param}.role")
    content = raw.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else \
        _expect(content, list, f"{param}.content", "a string or a list of content blocks")
    text, calls = [], []
    for i, block in enumerate(blocks):
        where = f"{param}.content[{i}]"
        kind = _expect(block, dict, where, "a content block object").get("type")
        if kind == "text":
            text.append(_expect(block.get("text"), str, f"{where}.text", "a string"))
        elif kind == "tool_use" and raw["role"] == "assistant":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)):
                raise RequestError(f"{where}: a tool_use block needs string id and name", where)
            calls.append({"id": block["id"], "name": block["name"],
                          "arguments": _expect(block.get("input", {}), dict, f"{where}.input", "an object")})
        elif kind == "tool_result" and raw["role"] == "user":
            result = block.get("content", "")
            messages.append({"role": "tool", "tool_call_id": _expect(block.get("tool_use_id"), str,
                                                                     f"{where}.tool_use_id", "a string"),
                             "content": _anthropic_text(result, f"{where}.content")})
        elif kind in ("thinking", "redacted_thinking") and raw["role"] == "assistant":
            continue  # the gateway emits none; another model's thinking is not rendered
        else:
            raise RequestError(f"{where}: content block type {json.dumps(kind)[:40]} is not supported in a "
                               f"{raw['role']} message; this gateway reads text, tool_use (assistant) and "
                               "tool_result (user) blocks", where, code="unsupported_option")
    if raw["role"] == "assistant":
        messages.append({"role": "assistant", "content": "".join(text), "tool_calls": calls})
    elif text or not blocks:
        messages.append({"role": "user", "content": "".join(text)})


def _stop_reason(reply: Reply) -> str:
    if reply.tool_calls:
        return "tool_use"
    if reply.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if reply.finish_reason == "length" else "end_turn"


def _content_blocks(call_id: str, reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": reply.content}] if reply.content else []
    blocks += [{"type": "tool_use", "id": _tool_use_id(c["id"]), "name": c["name"], "input": c["arguments"]}
               for c in reply.tool_calls]
    return blocks


def _tool_use_id(call_id: str) -> str:
    return call_id if call_id.startswith("toolu_") else f"toolu_{call_id.removeprefix('call_')}"


def messages_body(call_id: str, model: str, reply: Reply, usage: dict[str, int]) -> dict[str, Any]:
    return {"id": f"msg_{call_id}", "type": "message", "role": "assistant", "model": model,
            "content": _content_blocks(call_id, reply), "stop_reason": _stop_reason(reply),
            "stop_sequence": reply.stop_string,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


def messages_events(call_id: str, model: str, reply: Reply, usage: dict[str, int]) -> list[tuple[str, dict[str, Any]]]:
    """message_start, per content block its start/delta/stop, message_delta (stop reason, usage),
    message_stop."""
    start = {**messages_body(call_id, model, reply, usage), "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": 0}}
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(_content_blocks(call_id, reply)):
        if block["type"] == "text":
            opened, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": p}
                                                            for p in _pieces(block["text"])]
        else:
            opened = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
        events.append(("content_block_start", {"type": "content_block_start", "index": index, "content_block": opened}))
        events += [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}) for d in deltas]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    events.append(("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": _stop_reason(reply), "stop_sequence": reply.stop_string},
                                     "usage": {"output_tokens": usage["completion_tokens"]}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def anthropic_error(err: RequestError) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "request_too_large"}.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(err)}}


def _pieces(text: str, size: int = 8) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]
