"""Build tools by name and run one model message's tool calls into observations."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from pydantic import ValidationError

from rollway.base.plugins import is_plugin, load_plugin
from rollway.base.registry import Registry
from rollway.base.threads import BlockingTimeout
from rollway.sandboxes.base import Sandbox
from rollway.schemas.messages import Observation
from rollway.tools.base import Tool, ToolCall, ToolContext, check_tool, outside_episode
from rollway.tools.bash import BashTool
from rollway.tools.config import ToolsConfig
from rollway.tools.editor import EditorTool
from rollway.tools.finish import FinishTool
from rollway.tools.parsing import CallError, parse_tool_calls
from rollway.tools.schema import example_value
from rollway.tools.search import SearchTool

log = structlog.get_logger()

TOOLS = Registry("tool", "tools.enabled", "rollway.tools.base:Tool")
"""Tools by the name a task set or `tools.enabled` lists (the same Registry as every other component
kind); `register_tool` adds more. A task set may also give Tool instances directly (`TaskSet.environment`)."""
TOOLS.add("bash", BashTool)
TOOLS.add("editor", EditorTool)
TOOLS.add("search", SearchTool)
TOOLS.add("finish", FinishTool)


def register_tool(name: str, factory: Callable[[ToolsConfig], Tool]) -> None:
    """Make a tool available to `build_tools` by `name` (call at import time of the module defining
    it). Names are global: registering a different tool under a taken name is an error."""
    old = TOOLS.registered(name)
    if old is not None and _qualified(old) != _qualified(factory):
        raise ValueError(f"tool name {name!r} is taken by {_qualified(old)}; register {_qualified(factory)} under "
                         "another name (e.g. prefixed with your task family: 'myfamily.lookup')")
    TOOLS.add(name, factory)


def _text(value: str) -> str:
    """`value` with anything UTF-8 cannot carry (lone surrogates) replaced, so the record encodes."""
    return value.encode("utf-8", "replace").decode("utf-8")


def _qualified(factory: Any) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', repr(factory))}"


def tool_factory(ref: str) -> Callable[..., Tool]:
    """The factory `ref` names: a registered tool name or `python:MODULE:CLASS` (a Tool subclass)."""
    if is_plugin(ref):
        return load_plugin(ref, Tool)
    try:
        return TOOLS.load(ref)
    except ValueError:
        raise ValueError(
            f"unknown tool {ref!r}; available tools: {', '.join(TOOLS.names())}, or your own Tool subclass "
            "as python:MODULE:CLASS. Fix tools.enabled or the task set's tools (default_tools / environment); a tool "
            "registered with register_tool must be registered by a module the task set imports") from None


def build_tool(ref: str, cfg: ToolsConfig) -> Tool:
    """One tool; a tool with its own `config_class` also gets its validated `tools.settings` entry."""
    factory = tool_factory(ref)
    config_class = getattr(factory, "config_class", None)
    if config_class is None:
        return factory(cfg)
    name = getattr(factory, "name", ref)
    return factory(cfg, validate_options(config_class, cfg.settings.get(name, {}), f"tools.settings.{name}"))


def validate_options(config_class: type, options: Any, where: str) -> Any:
    """A tool's options validated by its config class, unknown keys refused whatever the class's own
    `extra` setting (a plain pydantic model would drop a misspelt key silently)."""
    if isinstance(options, dict):
        known = {k for name, f in config_class.model_fields.items() for k in (name, f.alias) if k}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: Extra inputs are not permitted (the options of this tool are: "
                             f"{', '.join(sorted(config_class.model_fields)) or 'none'})")
    try:
        return config_class.model_validate(options)
    except ValidationError as err:
        raise ValueError("; ".join(f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                   for e in err.errors())) from None


def check_tool_settings(cfg: ToolsConfig) -> None:
    """Every `tools.settings` entry belongs to a tool with a config class and passes it (config load)."""
    by_name = {getattr(f, "name", n): f for n in TOOLS.names() for f in [TOOLS.load(n)]}
    by_name |= {getattr(f, "name", r): f for r in cfg.enabled or () if is_plugin(r) for f in [tool_factory(r)]}
    for name, options in cfg.settings.items():
        config_class = getattr(by_name.get(name), "config_class", None)
        if config_class is None:
            raise ValueError(f"tools.settings.{name}: no tool {name!r} with its own config class is known here "
                             "(name it in tools.enabled as python:MODULE:CLASS, or register it before the config loads)")
        validate_options(config_class, options, f"tools.settings.{name}")


def build_tools(names: Sequence[str | Tool], cfg: ToolsConfig) -> dict[str, Tool]:
    """The named tools (registered names, `python:MODULE:CLASS`, or Tool instances a task set made from
    its data, which need no registration), in the given order, keyed by the name the model calls. Two
    tools under one name are an error, never a silent overwrite; so is a tool whose `call` is not
    `call(arguments, sandbox, context)` (HookSignatureError)."""
    tools: dict[str, Tool] = {}
    for ref in names:
        if isinstance(ref, Tool):
            tool, key = ref, ref.name
        else:
            tool = build_tool(ref, cfg)
            key = ref if not is_plugin(ref) else tool.name
        check_tool(tool)  # `call` with another signature fails here, named, not at the model's first call
        if key in tools:
            raise ValueError(f"two tools are named {key!r} ({type(tools[key]).__name__} and {type(tool).__name__}); "
                             "tool names must be unique within an episode")
        tools[key] = tool
    return tools


class Toolbox:
    """A worker's tools and the run's tool settings: each list built once (`tools.enabled` replaces every list)."""

    def __init__(self, cfg: ToolsConfig) -> None:
        self.cfg, self._built = cfg, {}

    def build(self, refs: Sequence[str | Tool]) -> dict[str, Tool]:
        """The tools `refs` names (see `build_tools`), by the name the model calls."""
        key = tuple(self.cfg.enabled or refs)
        if key not in self._built:
            self._built[key] = build_tools(key, self.cfg)
        return self._built[key]


@dataclass
class Step:
    """What comes back after a model output: its tool calls' outcome and (`Environment.step`) the rest."""

    calls: list[ToolCall]
    """Valid calls found in the message, in order (the ones that ran and any skipped)."""
    observations: list[Observation]
    """One per call or parse error, in message order."""
    done: str | None = None
    """Why the episode ends after this turn (`finish`, `user_done`: the simulated user ended it); None: it goes on."""
    user_message: str | None = None
    """A simulated user's next message; None adds none."""
    hints: list[str] = field(default_factory=list)
    """The task's hints for the next turn (the episode adds its own); dropped, like the user message, at the end."""

    @property
    def errors(self) -> int:
        return sum(observation.is_error for observation in self.observations)

    @property
    def internal_errors(self) -> int:
        return sum(observation.internal_error for observation in self.observations)


async def run_tool_calls(
    output: Any, tools: Mapping[str, Tool], sandbox: Sandbox, cfg: ToolsConfig, context: ToolContext | None = None,
    require_call: bool = True,
) -> Step:
    """Parse `output` (assistant text, message dict or tool-call list), run each valid call in
    order, and return one observation per call. Never raises for anything the model or a tool does;
    calls after `finish` or past `cfg.max_calls_per_turn` are not run. `require_call`: the task set's
    `require_tool_call`."""
    parsed = parse_tool_calls(output, tools)
    if not parsed.items:
        return Step([], [_no_call_observation(tools)] if require_call else [])
    turn = Step(calls=parsed.calls, observations=[])
    for index, item in enumerate(parsed.items):
        observation = await _run_item(item, index, turn, tools, sandbox, cfg, context)
        observation.content, observation.truncated = truncate_observation(
            observation.content, cfg.max_observation_chars
        )
        turn.done = turn.done or ("finish" if observation.ends_episode else None)
        turn.observations.append(observation)
    return turn


async def _run_item(
    item: ToolCall | CallError,
    index: int,
    turn: Step,
    tools: Mapping[str, Tool],
    sandbox: Sandbox,
    cfg: ToolsConfig,
    context: ToolContext | None = None,
) -> Observation:
    if isinstance(item, CallError):
        # A tool name or id parsed from the model's JSON may hold lone surrogates: kept as valid text.
        return Observation(content=_text(item.message), tool=_text(item.name or ""),
                           call_id=_text(item.call_id) if item.call_id else None, is_error=True)
    if turn.done:
        return Observation(content="Not run: `finish` was called earlier in this message.", tool=item.name,
                           call_id=item.call_id, arguments=item.arguments)
    if index >= cfg.max_calls_per_turn:
        return Observation(content=f"Not run: at most {cfg.max_calls_per_turn} tool calls run per message. "
                           "Make fewer calls and wait for their results.",
                           tool=item.name, call_id=item.call_id, arguments=item.arguments, is_error=True)
    return await run_call(item, tools[item.name], sandbox, context, cfg.call_timeout_s)


async def run_call(call: ToolCall, tool: Tool, sandbox: Sandbox, context: ToolContext | None = None,
                   timeout_s: float | None = None) -> Observation:
    """Run one validated call within `timeout_s` (tools.call_timeout_s); an exception from the tool
    becomes an error observation so a tool bug or a failing sandbox cannot crash the agent worker, and
    a call past its time limit becomes one too, so no tool holds the episode's worker past it."""
    limit = asyncio.timeout(timeout_s)
    try:
        async with limit:
            result = await tool.call(call.arguments, sandbox, context or outside_episode())  # outside an episode: no task
    except Exception as error:  # noqa: BLE001 - deliberate: the worker must survive tool bugs
        if limit.expired() or isinstance(error, BlockingTimeout):
            log.warning("tool call timed out", tool=call.name, timeout_s=timeout_s, error=str(error))
            return Observation(content=f"The tool `{call.name}` did not finish within its time limit and was "
                               "stopped. Make a smaller call (a narrower path, a shorter command).",
                               tool=call.name, call_id=call.call_id, arguments=call.arguments, is_error=True)
        log.exception("tool failed", tool=call.name, arguments=repr(call.arguments)[:500])
        return Observation(content=f"The tool `{call.name}` failed internally ({type(error).__name__}: {error}). "
                           "This is not a problem with your call's format; try again or use another tool.",
                           tool=call.name, call_id=call.call_id, arguments=call.arguments, is_error=True,
                           internal_error=True)
    return Observation(content=result.content, tool=call.name, call_id=call.call_id, arguments=call.arguments,
                       is_error=result.is_error, ends_episode=result.ends_episode)


def truncate_observation(text: str, max_chars: int) -> tuple[str, bool]:
    """`text` cut to at most `max_chars` (head and tail kept, a notice in between), and whether it
    was cut. The tail matters: errors and test summaries come last."""
    if len(text) <= max_chars:
        return text, False
    notice = (
        "\n\n[... {cut} characters cut: the output was longer than {limit} characters. "
        "Narrow it (grep, head, tail, a view_range) to see the middle. ...]\n\n"
    )
    room = max(0, max_chars - len(notice.format(cut=len(text), limit=max_chars)))
    head, tail = text[: room * 2 // 3], text[len(text) - room // 3 :] if room // 3 else ""
    return head + notice.format(cut=len(text) - len(head) - len(tail), limit=max_chars) + tail, True


def _no_call_observation(tools: Mapping[str, Tool]) -> Observation:
    text = "Your message contained no tool call, so nothing happened."
    if tools:
        first = next(iter(tools.values()))
        example = json.dumps({"name": first.name, "arguments": example_value(first.parameters)})
        text += (
            f" To act, call one of the tools ({', '.join(tools)}) like this:\n"
            f"<tool_call>\n{example}\n</tool_call>"
        )
    if "finish" in tools:
        text += "\nWhen you are done, call `finish`."
    return Observation(content=text, is_error=True)
