"""Tool-call parsing, argument validation, the tool registry and observation truncation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rollway.tools.base import Tool, ToolCall, ToolResult
from rollway.tools.config import ToolsConfig
from rollway.tools.parsing import CallError, parse_tool_calls
from rollway.tools.registry import build_tools, run_tool_calls, truncate_observation
from rollway.tools.schema import validate

CFG = ToolsConfig()
TOOLS = build_tools(["bash", "editor", "search", "finish"], CFG)


def hermes(name: str, arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_hermes_several_calls_with_whitespace_fences_and_string_arguments() -> None:
    text = (
        'Let me look.\n<tool_call>  {"name": "bash", "arguments": {"command": "ls"}}  </tool_call>\n'
        '<tool_call>\n```json\n{"name": "editor", "arguments": "{\\"command\\": \\"view\\", '
        '\\"path\\": \\"a.py\\"}"}\n```\n</tool_call>'
    )
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.errors == []
    assert parsed.calls == [
        ToolCall("bash", {"command": "ls"}),
        ToolCall("editor", {"command": "view", "path": "a.py"}),
    ]


def test_hermes_unclosed_last_call_is_parsed() -> None:
    # Generation often stops on the closing tag's stop token.
    parsed = parse_tool_calls('<tool_call>\n{"name": "finish", "arguments": {}}', TOOLS)
    assert parsed.calls == [ToolCall("finish", {})]


def test_text_without_calls_gives_nothing() -> None:
    assert parse_tool_calls("I think the bug is in foo().", TOOLS).items == []


def test_bad_json_becomes_error_showing_the_format() -> None:
    parsed = parse_tool_calls('<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>', TOOLS)
    [error] = parsed.errors
    assert "not valid JSON" in error.message and "line 1 column" in error.message
    assert "<tool_call>" in error.message and '"name": "<tool name>"' in error.message


def test_python_dict_literal_is_tolerated() -> None:
    parsed = parse_tool_calls(
        "<tool_call>{'name': 'bash', 'arguments': {'command': 'pwd'}}</tool_call>", TOOLS
    )
    assert parsed.calls == [ToolCall("bash", {"command": "pwd"})]


@pytest.mark.parametrize(
    "body",
    [
        "{'name': 'bash', 'arguments': {'command': {'ls', 'pwd'}}}",  # a set inside the arguments
        "{'name': 'bash', 'arguments': {1, 2}}",  # the arguments themselves a set
        "{'name': {'bash'}, 'arguments': {}}",
        "{'name': 'bash', 'arguments': {'command': b'ls'}}",
    ],
)
def test_python_literal_with_values_json_cannot_hold_is_an_error_not_a_crash(body: str) -> None:
    # Model output once held a set literal; decoding it raised TypeError and dead-lettered the turn.
    parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>", TOOLS)
    [error] = parsed.errors
    assert parsed.calls == [] and "Tool call #1" in error.message


def test_missing_name_is_an_error() -> None:
    [error] = parse_tool_calls('<tool_call>{"arguments": {"command": "ls"}}</tool_call>', TOOLS).errors
    assert 'has no "name"' in error.message


def test_unknown_tool_lists_available_tools_and_suggests() -> None:
    [error] = parse_tool_calls(hermes("bsh", {"command": "ls"}), TOOLS).errors
    assert "Unknown tool `bsh`" in error.message and "Did you mean `bash`" in error.message
    assert "bash, editor, search, finish" in error.message


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({}, "missing required key 'command'"),
        ({"command": 5}, "arguments.command: expected a string, got integer 5"),
        ({"command": "ls", "cmd": "x"}, "unknown key 'cmd'"),
    ],
)
def test_schema_violations_explain_the_fix(arguments: dict[str, Any], expected: str) -> None:
    [error] = parse_tool_calls(hermes("bash", arguments), TOOLS).errors
    assert expected in error.message
    # The model is shown a well-formed call and the parameter list.
    assert '{"name": "bash", "arguments": {"command": "<string>"}}' in error.message
    assert "- command (string, required)" in error.message


def test_enum_and_array_item_violations() -> None:
    [error] = parse_tool_calls(hermes("editor", {"command": "open", "path": "a.py"}), TOOLS).errors
    assert '"open" is not one of "view", "create"' in error.message
    [error] = parse_tool_calls(
        hermes("editor", {"command": "view", "path": "a", "view_range": [1, "9"]}), TOOLS
    ).errors
    assert "arguments.view_range[1]: expected an integer, got string" in error.message


def test_openai_tool_calls_message_and_list() -> None:
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
            {"id": "c2", "type": "function", "function": {"name": "finish", "arguments": ""}},
            {"id": "c3", "type": "function", "function": {"name": "bash", "arguments": "{not json"}},
        ],
    }
    parsed = parse_tool_calls(message, TOOLS)
    assert parsed.format == "openai"
    assert parsed.calls == [ToolCall("bash", {"command": "ls"}, "c1"), ToolCall("finish", {}, "c2")]
    [error] = parsed.errors
    assert error.call_id == "c3" and "arguments are not valid JSON" in error.message


def test_openai_schema_error_shows_openai_format() -> None:
    calls = [{"id": "x", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]
    [error] = parse_tool_calls(calls, TOOLS).errors
    assert "function `bash` with arguments" in error.message and "<tool_call>" not in error.message


@pytest.mark.parametrize(
    "garbage",
    [
        None,
        42,
        [1, "x"],
        {"tool_calls": [None]},
        "<tool_call></tool_call>",
        '<tool_call>["a", 1]</tool_call>',
        "<tool_call>" * 3,
    ],
)
def test_never_raises(garbage: Any) -> None:
    parsed = parse_tool_calls(garbage, TOOLS)
    assert all(isinstance(item, (ToolCall, CallError)) for item in parsed.items)


def test_validator_types() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "b": {"type": "boolean"}}}
    assert validate({"n": 3.0, "b": False}, schema) == []
    assert validate({"n": True}, schema) == ["arguments.n: expected an integer, got boolean true"]
    assert validate({"b": 1}, schema) == ["arguments.b: expected true or false, got integer 1"]


def test_build_tools_unknown_name_lists_available() -> None:
    # Task sets may register more tools (calculator, python): the built-ins are listed among them.
    with pytest.raises(ValueError, match=r"available tools: (\w+, )*bash, (\w+, )*editor, (\w+, )*finish, "
                                         r"(\w+, )*search"):
        build_tools(["bash", "grep"], CFG)
    assert [spec["function"]["name"] for spec in [t.spec() for t in TOOLS.values()]] == ["bash", "editor", "search", "finish"]


class _BrokenTool(Tool):
    name = "broken"
    description = "Always raises."
    parameters = {"type": "object", "properties": {}}

    async def call(self, arguments: dict[str, Any], sandbox: Any, context: Any) -> ToolResult:
        raise KeyError("bug")


def test_run_tool_calls_survives_tool_bugs_and_stops_after_finish() -> None:
    tools = {"broken": _BrokenTool(), "finish": TOOLS["finish"]}
    text = (
        hermes("broken", {})
        + hermes("nope", {})
        + hermes("finish", {"message": "done"})
        + hermes("broken", {})
    )
    turn = asyncio.run(run_tool_calls(text, tools, None, CFG))  # neither tool touches the sandbox
    first, unknown, finish, skipped = turn.observations
    assert first.is_error and first.internal_error and "failed internally (KeyError" in first.content
    assert unknown.is_error and unknown.tool == "nope"
    assert finish.ends_episode and "Summary: done" in finish.content
    assert "Not run" in skipped.content and not skipped.internal_error
    assert turn.done == "finish" and turn.errors == 2 and turn.internal_errors == 1


def test_message_without_call_gets_format_reminder() -> None:
    turn = asyncio.run(run_tool_calls("Hmm.", TOOLS, None, CFG))
    [observation] = turn.observations
    assert (
        observation.is_error
        and "no tool call" in observation.content
        and "<tool_call>" in observation.content
    )
    quiet = asyncio.run(run_tool_calls("Hmm.", TOOLS, None, ToolsConfig(), require_call=False))
    assert quiet.observations == []


def test_too_many_calls_are_refused() -> None:
    text = hermes("finish", {}) * 3
    turn = asyncio.run(
        run_tool_calls(text, {"broken": _BrokenTool()}, None, ToolsConfig(max_calls_per_turn=1))
    )
    assert len(turn.observations) == 3 and all(o.is_error for o in turn.observations)


def test_truncation_keeps_head_and_tail_with_notice() -> None:
    text = "HEAD" + "x" * 10_000 + "TAIL"
    cut, truncated = truncate_observation(text, 1000)
    assert truncated and len(cut) <= 1000
    assert cut.startswith("HEAD") and cut.endswith("TAIL") and "characters cut" in cut
    assert truncate_observation("short", 1000) == ("short", False)


def test_qwen3_coder_xml_calls_are_typed_by_schema() -> None:
    text = (
        "<tool_call>\n<function=editor>\n<parameter=command>\nview\n</parameter>\n"
        "<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=view_range>\n[3, 9]\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call><function=bash><parameter=command>echo '[1]'</parameter>"
        "</function></tool_call>"
    )
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.errors == []
    assert parsed.calls == [
        ToolCall("editor", {"command": "view", "path": "src/a.py", "view_range": [3, 9]}),
        ToolCall("bash", {"command": "echo '[1]'"}),
    ]


def test_standard_json_schema_keywords_are_checked():
    from rollway.tools.schema import validate

    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "title": "args",
              "properties": {"x": {"type": "number", "exclusiveMinimum": 0},
                             "unit": {"anyOf": [{"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
                                                {"type": "null"}]},
                             "mode": {"const": "fast"}},
              "required": ["x"], "additionalProperties": {"type": "integer"}}
    assert validate({"x": 2.5, "unit": "cm", "mode": "fast", "extra": 3}, schema) == []
    assert validate({"x": 2.5, "unit": None}, schema) == []
    assert validate({"x": 0}, schema) == ["arguments.x: must be > 0, got 0"]
    assert validate({"x": 1, "unit": "CM"}, schema)[0].startswith('arguments.unit: "CM" does not match')
    assert validate({"x": 1, "mode": "slow"}, schema) == ['arguments.mode: must be "fast", got "slow"']
    assert validate({"x": 1, "extra": "a"}, schema) == ['arguments.extra: expected an integer, got string "a"']


# -- hostile model output: never raises, always an observation the model can read ---------------

HOSTILE_TEXTS = {
    "nested-brackets": "<tool_call>" + "[" * 1200 + "</tool_call>",
    "nested-objects": '<tool_call>{"name": "bash", "arguments": ' + '{"a": ' * 1200 + "1" + "}" * 1201 + "</tool_call>",
    "nested-string-arguments": '<tool_call>{"name": "bash", "arguments": "' + "[" * 1200 + '"}</tool_call>',
    "5000-digit-number": '<tool_call>{"name": "editor", "arguments": {"command": "view", "path": "a.py", '
                         '"view_range": [1, ' + "9" * 5000 + "]}}</tool_call>",
    "xml-nested": "<tool_call><function=editor><parameter=command>view</parameter><parameter=path>a.py"
                  "</parameter><parameter=view_range>" + "[" * 1200 + "</parameter></function></tool_call>",
    "xml-5000-digits": "<tool_call><function=editor><parameter=command>view</parameter><parameter=path>a.py"
                       "</parameter><parameter=view_range>[1, " + "9" * 5000 + "]</parameter></function></tool_call>",
}


@pytest.mark.parametrize("text", list(HOSTILE_TEXTS.values()), ids=list(HOSTILE_TEXTS))
def test_hostile_text_becomes_a_call_error_never_an_exception(text: str) -> None:
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == [] and len(parsed.errors) == 1
    assert len(parsed.errors[0].message) < 5000, "the error must not echo the hostile text whole"


def test_huge_view_range_is_refused_by_the_editor_schema() -> None:
    """A valid-looking call whose integer cannot even be encoded (above 2**64) used to pass validation
    and kill the agent's output encoding; the editor's schema states the bounds of a line number."""
    for end, problem in ((2**70, "must be an integer between"), (2**40, "must be <= 2147483647")):
        parsed = parse_tool_calls(hermes("editor", {"command": "view", "path": "a.py", "view_range": [1, end]}), TOOLS)
        assert parsed.calls == []
        assert f"arguments.view_range[1]: {problem}" in parsed.errors[0].message


@pytest.mark.parametrize("arguments, problem", [
    ({"command": "ls", "extra": 2**63}, "arguments.extra: must be an integer between"),
    ({"command": "x" * 1_000_001}, "arguments.command: longer than"),
    ({"command": "ls", "extra": list(range(10_001))}, "arguments.extra: more than"),
    ({"command": "ls", "extra": json.loads("[" * 40 + "]" * 40)}, "nested deeper than"),
], ids=["int64", "string", "array", "depth"])
def test_every_tools_arguments_are_bounded(arguments: dict, problem: str) -> None:
    """Bounds that hold for every tool, even one whose schema states none (plugin tools)."""

    class Open(Tool):
        name = "open"
        description = "takes anything"
        parameters = {"type": "object", "properties": {"command": {"type": "string"}}}

        async def call(self, arguments, sandbox, context):  # pragma: no cover - never reached
            return ToolResult("ran")

    parsed = parse_tool_calls([ToolCall("open", arguments)], {"open": Open()})
    assert parsed.calls == [] and problem in parsed.errors[0].message


def test_lone_surrogate_escapes_are_refused_and_every_observation_encodes() -> None:
    """JSON lets a model write `"\\udc80"`: a string no UTF-8 record can carry. The call is refused with
    a reason (it failed the whole attempt at encoding before), and a surrogate in a tool name still
    gives an observation that encodes."""
    from rollway.schemas.codec import encode
    from rollway.schemas.messages import TurnRecord

    tools = build_tools(["bash", "editor", "finish"], ToolsConfig())
    text = ('<tool_call>{"name": "bash", "arguments": {"command": "echo \\udc80\\ud800"}}</tool_call>'
            '<tool_call>{"name": "ba\\udc80sh", "arguments": {"command": "true"}}</tool_call>')
    turn = asyncio.run(run_tool_calls(text, tools, None, ToolsConfig()))
    assert [o.is_error for o in turn.observations] == [True, True]
    assert "not valid Unicode" in turn.observations[0].content
    record = TurnRecord(turn=0, completion_ids=[], logprobs=[], policy_version=0, finish_reason="stop",
                        assistant_text="", observations=turn.observations)
    assert encode(record)
