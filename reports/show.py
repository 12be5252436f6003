"""Render recorded episodes turn by turn with rich: model output, tool calls, observations, hints,
reward, and the seconds each stage spent on it (from the run folder's telemetry). A harness episode
(an external agent program) shows call by call, with the segment each call belongs to and, where the
program rewrote its history, the call that opened a segment, why, and the messages it sent. The same renderables
print to a terminal or export as HTML."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def _clip(text: str, max_chars: int) -> str:
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    return text[: max_chars // 2] + f"\n[... {len(text) - max_chars} characters not shown (--max-chars) ...]\n" \
        + text[-max_chars // 2:]


def _ms(seconds: float) -> str:
    if seconds < 0.01:
        return f"{seconds * 1000:.1f} ms"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def episode_list(trajs: list[dict[str, Any]]) -> Table:
    table = Table(title=f"{len(trajs)} episodes", title_justify="left")
    for col in ("episode", "task", "reward", "turns", "stop reason"):
        table.add_column(col)
    for t in trajs:
        segments = len(t.get("segment_starts") or [])
        turns = str(t["num_turns"]) + (f" ({segments + 1} segments)" if segments else "")
        table.add_row(t["episode"]["episode_id"], t["episode"]["task_id"], f"{t['reward']:g}", turns, t["stop_reason"])
    return table


def episode_header(t: dict[str, Any], stage_seconds: dict[str, float] | None = None) -> Table:
    """`stage_seconds`: handling and queue seconds per stage (runtime/telemetry.py); None: not known
    (an episode read from the topic)."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan")
    grid.add_column()
    rows = [("episode", t["episode"]["episode_id"]), ("task", t["episode"]["task_id"]), ("group", f"{t['episode']['group_id']} (sample "
            f"{t['episode'].get('sample_index', 0)}, attempt {t['episode'].get('attempt', 0)})"),
            ("reward", f"{t['reward']:g} ({'resolved' if t['resolved'] else 'not resolved'})"),
            ("stop reason", t["stop_reason"]), ("turns", str(t["num_turns"])),
            ("tokens", f"{len(t.get('token_ids', []))} ({t.get('prompt_length', 0)} prompt, "
             f"{sum(t.get('loss_mask', []))} model)"),
            ("grade", json.dumps(t.get("grade", {})))]
    if is_harness(t):
        rows.append(("program calls", f"{len(t['turns'])} kept (calls {', '.join(str(x['call_index']) for x in t['turns'])})"))
        rows.append(("segments", segments_line(t)))
        if t.get("side_calls"):
            rows.append(("side calls", "; ".join(f"call {c['call_index']}: {c['name']} ({c['output_tokens']} tokens, "
                                                 "not trained)" for c in t["side_calls"])))
    if stage_seconds is not None:
        rows.append(("stages", ", ".join(f"{k} {_ms(v)}" for k, v in stage_seconds.items()) or "(no telemetry)"))
    for key, value in rows:
        grid.add_row(key, Text(value))
    return grid


SEGMENT_REASONS = {
    "start": "the program's first call",
    "history_rewritten": "the program rewrote its history (compaction, truncation or an edit)",
    "system_changed": "the program changed its system prompt",
    "tools_changed": "the program changed the tools it offers",
    "prompt_changed": "the program sent a prompt that does not extend the previous one",
}
"""What each `segment_reason` (gateway/capture.py) means, for readers."""


def is_harness(t: dict[str, Any]) -> bool:
    """An episode played by an external agent program through the gateway (its turns are calls)."""
    return any(turn.get("call_index") is not None for turn in t.get("turns", []))


def turn_segments(t: dict[str, Any]) -> list[int]:
    """The 0-based segment (token stream) of each turn: a turn with a `segment_reason` opens the next."""
    out, seg = [], 0
    for turn in t.get("turns", []):
        seg += turn.get("segment_reason") is not None
        out.append(seg)
    return out


def segments_line(t: dict[str, Any]) -> str:
    opened = [f"segment {k + 1} at call {turn.get('call_index')}: {turn['segment_reason']}"
              for k, turn in enumerate(x for x in t.get("turns", []) if x.get("segment_reason") is not None)]
    return f"{len(opened) + 1} (" + "; ".join(["segment 0 at the first call", *opened]) + ")" + \
        (", each trained as its own sequence" if opened else "")


def _messages(messages: list[dict[str, Any]], max_chars: int) -> list[RenderableType]:
    parts: list[RenderableType] = []
    for m in messages:
        text = str(m.get("content") or "")
        for call in m.get("tool_calls") or []:
            text += f"\n[tool call {call.get('name')} {json.dumps(call.get('arguments'), ensure_ascii=False)}]"
        parts += [Text(m.get("role", "?"), style="bold blue"), Text(_clip(text, max_chars))]
    return parts


def turn_panel(turn: dict[str, Any], max_chars: int, segment: int | None = None) -> Panel:
    """One turn; for a harness episode one program call (`segment`: its token stream), headed by the
    messages that opened its segment when it opened one."""
    parts: list[RenderableType] = []
    if turn.get("segment_reason") is not None:
        reason = turn["segment_reason"]
        parts += [Text(f"new segment {segment if segment is not None else ''}: {SEGMENT_REASONS.get(reason, reason)} "
                       f"({reason}); its prompt is the messages below, trained without the earlier segments",
                       style="bold yellow"),
                  *_messages(turn.get("segment_messages") or [], max_chars), Text("")]
    parts += [Text("model output", style="bold magenta"), Text(_clip(turn["assistant_text"], max_chars))]
    for obs in turn.get("observations", []):
        label = f"tool call: {obs['tool']}" if obs.get("tool") else "no valid tool call"
        head = Text(label, style="bold red" if obs.get("is_error") else "bold green")
        if obs.get("arguments"):
            head.append(" " + json.dumps(obs["arguments"], ensure_ascii=False), style="green")
        parts += [Text(""), head, Text("observation" + (" (error)" if obs.get("is_error") else ""), style="bold"),
                  Text(_clip(obs["content"], max_chars), style="dim")]
    for hint in turn.get("hints", []):
        parts += [Text(""), Text(f"hint: {hint}", style="yellow")]
    if turn.get("user_message") is not None:  # the environment's simulated user (Environment.step)
        parts += [Text(""), Text("user", style="bold blue"), Text(_clip(turn["user_message"], max_chars))]
    if turn.get("call_index") is not None:
        title = (f"call {turn['call_index']} · segment {segment if segment is not None else '?'} · turn {turn['turn']} · "
                 f"policy v{turn['policy_version']} · finish {turn['finish_reason']} · "
                 f"{len(turn.get('completion_ids', []))} tokens")
        return Panel(Group(*parts), title=title, title_align="left")
    title = (f"turn {turn['turn']} · policy v{turn['policy_version']} · finish {turn['finish_reason']} · "
             f"gen {_ms(turn.get('gen_seconds', 0.0))} · tools {_ms(turn.get('tool_seconds', 0.0))}"
             f" · {len(turn.get('completion_ids', []))} tokens")
    return Panel(Group(*parts), title=title, title_align="left")


def prompt_panel(t: dict[str, Any], max_chars: int) -> Panel:
    parts = []
    for m in t.get("messages", []):
        parts += [Text(m["role"], style="bold blue"), Text(_clip(str(m["content"]), max_chars))]
    title = "prompt (segment 0: the program's first call)" if is_harness(t) else "prompt"
    return Panel(Group(*parts), title=title, title_align="left")


def episode_view(t: dict[str, Any], max_chars: int = 2000, stage_seconds: dict[str, float] | None = None) -> Group:
    segments = turn_segments(t) if is_harness(t) else [None] * len(t.get("turns", []))
    return Group(episode_header(t, stage_seconds), prompt_panel(t, max_chars),
                 *(turn_panel(turn, max_chars, seg) for turn, seg in zip(t.get("turns", []), segments, strict=True)),
                 Text(f"end: {t['stop_reason']}, reward {t['reward']:g}", style="bold"))


_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(value: Any) -> Any:
    """`value` (recorded data, any depth) with every control character but newline and tab written as
    \\xNN. What the model, its tools and the task wrote is shown to a terminal, which would act on an
    escape sequence (clear the screen, rewrite a line, set the title or the clipboard)."""
    if isinstance(value, str):
        return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", value)
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}  # keys too: argument names are the model's
    if isinstance(value, list):
        return [printable(v) for v in value]
    return value


def render(trajs: list[dict[str, Any]], episode: dict[str, Any], listing: bool, max_chars: int,
           console: Console, stage_seconds: dict[str, float] | None = None) -> None:
    trajs, episode = printable(trajs), printable(episode)
    if listing:
        console.print(episode_list(trajs))
        console.print()
    console.print(episode_view(episode, max_chars, stage_seconds))


def render_html(trajs: list[dict[str, Any]], episode: dict[str, Any], listing: bool, max_chars: int,
                stage_seconds: dict[str, float] | None = None) -> str:
    """Self-contained HTML (inline styles) of the same view."""
    import io

    console = Console(record=True, width=130, file=io.StringIO(), force_terminal=True)
    render(trajs, episode, listing, max_chars, console, stage_seconds)
    return console.export_html(inline_styles=True, theme=None)


def episode_stage_seconds(run_dir: Path, traj: dict) -> dict[str, float]:
    """Seconds per stage the run folder's telemetry recorded for the attempt that made `traj`."""
    from rollway.runtime.telemetry import attempt_records, read_telemetry, stage_seconds

    key = traj["episode"]
    return stage_seconds(attempt_records(read_telemetry(run_dir), key["episode_id"], key.get("attempt", 0)))
