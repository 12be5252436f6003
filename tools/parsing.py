"""Parse model output (OpenAI `tool_calls` or Hermes/Qwen `<tool_call>` text) into validated calls."""

from __future__ import annotations

import ast
import difflib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rollway.tools.base import Tool, ToolCall
from rollway.tools.schema import (
    MAX_ARGUMENT_DEPTH,
    argument_bounds,
    describe_parameters,
    example_value,
    validate,
)

CallFormat = Literal["openai", "hermes"]

# Non-greedy up to the closing tag, or to the end of the text: generation often stops on the
# closing tag's stop token, leaving the last call unclosed.
_TAG_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_XML_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>")
_XML_PARAMETER_RE = re.compile(
    r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL
)
_FENCE_RE = re.compile(r"^```[\w-]*\s*\n?(.*?)\n?\s*```$", re.DOTALL)


@dataclass(frozen=True)
class CallError:
    """A call that cannot run. `message` is the whole observation the model reads."""

    message: str
    call_id: str | None = None
    name: str | None = None
    """The tool name when one could be read."""


@dataclass
class ParsedOutput:
    """Everything found in one model message, in message order."""

    items: list[ToolCall | CallError] = field(default_factory=list)
    format: CallFormat = "hermes"
    """How the calls were written; error messages show the model this same format."""

    @property
    def calls(self) -> list[ToolCall]:
        return [item for item in self.items if isinstance(item, ToolCall)]

    @property
    def errors(self) -> list[CallError]:
        return [item for item in self.items if isinstance(item, CallError)]


def parse_tool_calls(output: Any, tools: Mapping[str, Tool] | None = None) -> ParsedOutput:
    """Parse one model message and, when `tools` is given, check each call against its tool.

    `output` may be the assistant text, an assistant message dict (`tool_calls` wins over
    `content`), a list of OpenAI tool-call dicts, or a list of `ToolCall`. Never raises: every
    problem becomes a `CallError` whose message says what was wrong and how to call correctly;
    hostile text (nesting beyond the recursion limit, numbers of thousands of digits) included.
    """
    try:
        parsed = _parse_raw(output, tools or {})
    except (RecursionError, ValueError, OverflowError, MemoryError) as error:
        # The known paths catch these themselves; this keeps a missed one from failing the episode.
        return ParsedOutput(items=[CallError(f"Your message could not be read as tool calls ({type(error).__name__}). "
                                             f"{_generic_usage('hermes')}")])
    if tools is not None:
        parsed.items = [
            check_call(item, tools, parsed.format) if isinstance(item, ToolCall) else item
            for item in parsed.items
        ]
    return parsed


def _parse_raw(output: Any, tools: Mapping[str, Tool]) -> ParsedOutput:
    if isinstance(output, Mapping):
        if output.get("tool_calls"):
            return _parse_raw(list(output["tool_calls"]), tools)
        return _parse_raw(output.get("content") or "", tools)
    if isinstance(output, str):
        return ParsedOutput(items=_parse_hermes(output, tools), format="hermes")
    if isinstance(output, (list, tuple)):
        items = [
            item if isinstance(item, ToolCall) else _parse_openai(item, i) for i, item in enumerate(output)
        ]
        return ParsedOutput(items=items, format="openai")
    if isinstance(output, ToolCall):
        return ParsedOutput(items=[output], format="openai")
    return ParsedOutput(items=[CallError(f"Cannot read tool calls from a {type(output).__name__}.")])


def _parse_openai(raw: Any, index: int) -> ToolCall | CallError:
    if not isinstance(raw, Mapping):
        return CallError(f"Tool call #{index + 1} is not an object: {str(raw)[:200]}")
    call_id = raw.get("id")
    function = raw.get("function") if isinstance(raw.get("function"), Mapping) else raw
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        return CallError(f"Tool call #{index + 1} has no function name.\n{_generic_usage('openai')}", call_id)
    arguments = _decode_arguments(function.get("arguments", {}))
    if isinstance(arguments, str):
        return CallError(f"Tool call #{index + 1} (`{name}`): {arguments}", call_id, name)
    return ToolCall(name=name.strip(), arguments=arguments, call_id=call_id)


def _parse_hermes(text: str, tools: Mapping[str, Tool]) -> list[ToolCall | CallError]:
    items: list[ToolCall | CallError] = []
    for match in _TAG_RE.finditer(text):
        body = _strip_fences(match.group(1).strip())
        if body.startswith("<function="):
            items.append(_call_from_xml(body, len(items) + 1, tools))
            continue
        decoded = _decode_json_values(body)
        if isinstance(decoded, str):
            number = len(items) + 1
            snippet = body if len(body) <= 300 else body[:300] + "..."
            items.append(
                CallError(
                    f"Tool call #{number} is not valid JSON ({decoded}).\nYou wrote:\n{snippet}\n{_generic_usage('hermes')}"
                )
            )
            continue
        for value in decoded:
            items.append(_call_from_object(value, len(items) + 1))
    return items


def _call_from_xml(body: str, number: int, tools: Mapping[str, Tool]) -> ToolCall | CallError:
    """Qwen3-Coder's XML call: <function=NAME><parameter=KEY>VALUE</parameter>...</function>.
    Values arrive as text; those the tool's schema types otherwise are decoded as JSON."""
    match = _XML_FUNCTION_RE.match(body)
    if match is None:
        return CallError(f"Tool call #{number}: cannot read the function name.\n{_generic_usage('hermes')}")
    name = match.group(1).strip()
    properties = tools[name].parameters.get("properties", {}) if name in tools else {}
    arguments = {}
    for key, raw in _XML_PARAMETER_RE.findall(body):
        value = raw.strip("\n")
        if properties.get(key.strip(), {}).get("type", "string") != "string":
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                pass  # left as text: validation then says which type was expected
        arguments[key.strip()] = value
    return ToolCall(name=name, arguments=arguments)


def _strip_fences(body: str) -> str:
    match = _FENCE_RE.match(body)
    return match.group(1).strip() if match else body


def _decode_json_values(body: str) -> list[Any] | str:
    """The JSON values in `body` (one object, a list of objects, or several objects in a row);
    a string describing the syntax error when it is not JSON."""
    if not body:
        return "the tags are empty"
    try:
        value = json.loads(body)
        return value if isinstance(value, list) else [value]
    except json.JSONDecodeError as error:
        first_error = f"{error.msg} at line {error.lineno} column {error.colno}"
    except RecursionError:
        return f"nested deeper than this parser reads; arguments nest at most {MAX_ARGUMENT_DEPTH} levels"
    except ValueError as error:  # e.g. an integer of more than 4,300 digits
        return str(error)[:200]
    values = _decode_concatenated(body)
    if values:
        return values
    try:
        # Models trained on Python sometimes write dict literals with single quotes.
        value = ast.literal_eval(body)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return first_error
    if not isinstance(value, dict):
        return first_error
    try:
        # A Python literal may hold values JSON has no form for (sets, bytes, complex numbers):
        # those are not valid arguments, and the round trip turns tuples into lists.
        return [json.loads(json.dumps(value))]
    except (TypeError, ValueError):
        return f"{first_error}; as a Python literal it holds values JSON cannot express"


def _decode_concatenated(body: str) -> list[Any]:
    decoder, values, position = json.JSONDecoder(), [], 0
    while position < len(body):
        try:
            value, position = decoder.raw_decode(body, position)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return []
        values.append(value)
        while position < len(body) and body[position] in " \t\r\n,":
            position += 1
    return values


def _call_from_object(value: Any, number: int) -> ToolCall | CallError:
    if not isinstance(value, dict):
        return CallError(
            f"Tool call #{number} must be a JSON object, got: {_shown(value)}\n"
            f"{_generic_usage('hermes')}"
        )
    inner = value.get("function") if isinstance(value.get("function"), dict) else value
    name = inner.get("name")
    if not isinstance(name, str) or not name.strip():
        return CallError(f'Tool call #{number} has no "name".\n{_generic_usage("hermes")}')
    raw_arguments = inner.get("arguments", inner.get("parameters", {}))
    arguments = _decode_arguments(raw_arguments)
    if isinstance(arguments, str):
        return CallError(
            f"Tool call #{number} (`{name}`): {arguments}\n{_generic_usage('hermes')}", name=name
        )
    return ToolCall(name=name.strip(), arguments=arguments, call_id=value.get("id"))


def _decode_arguments(raw: Any) -> dict[str, Any] | str:
    """Arguments as a dict; a string saying what is wrong otherwise. Accepts a JSON string."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        values = _decode_json_values(_strip_fences(raw.strip()))
        if isinstance(values, str):
            return f"arguments are not valid JSON ({values})"
        raw = values[0] if len(values) == 1 else values
    if not isinstance(raw, dict):
        return f"arguments must be a JSON object, got {_shown(raw)}"
    return raw


def _shown(value: Any) -> str:
    """`value` as JSON for an error message, at most 200 characters; never raises."""
    try:
        return json.dumps(value, default=repr)[:200]
    except (ValueError, RecursionError):  # an integer of thousands of digits, deep nesting
        return f"a {type(value).__name__}"


def check_call(call: ToolCall, tools: Mapping[str, Tool], fmt: CallFormat = "hermes") -> ToolCall | CallError:
    """`call` when it names a known tool with valid arguments, else a `CallError` explaining the fix."""
    tool = tools.get(call.name)
    if tool is None:
        close = difflib.get_close_matches(call.name, list(tools), n=1)
        hint = f" Did you mean `{close[0]}`?" if close else ""
        return CallError(
            f"Unknown tool `{call.name}`.{hint} Available tools: {', '.join(tools) or '(none)'}.\n"
            f"{_generic_usage(fmt)}",
            call.call_id,
            call.name,
        )
    # The bounds first: `validate` recurses, and must not meet a value nested a thousand deep.
    problems = argument_bounds(call.arguments) or validate(call.arguments, tool.parameters)
    if not problems:
        return call
    return CallError(
        f"Invalid arguments for `{call.name}`:\n"
        + "\n".join(f"- {p}" for p in problems)
        + "\n"
        + usage(tool, fmt),
        call.call_id,
        call.name,
    )


def usage(tool: Tool, fmt: CallFormat = "hermes") -> str:
    """How to call `tool` correctly, in the model's own call format, with its parameter list."""
    example = {"name": tool.name, "arguments": example_value(tool.parameters)}
    if fmt == "hermes":
        shown = f"<tool_call>\n{json.dumps(example)}\n</tool_call>"
    else:
        shown = f"function `{tool.name}` with arguments {json.dumps(example['arguments'])}"
    return (
        f"Call it like this:\n{shown}\nParameters of `{tool.name}`:\n{describe_parameters(tool.parameters)}"
    )


def _generic_usage(fmt: CallFormat) -> str:
    if fmt == "hermes":
        return (
            "Write each tool call as one JSON object between tags:\n"
            '<tool_call>\n{"name": "<tool name>", "arguments": {"<parameter>": <value>}}\n</tool_call>'
        )
    return 'Each tool call needs a function name and JSON-object arguments, e.g. {"command": "ls"}.'
