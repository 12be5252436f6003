"""A policy that writes hostile tool calls: each becomes an error observation the model reads, the
episode goes on and is graded, and every message it produces can travel through the broker.
Real bubblewrap sandboxes and actors; only the model is faked (the scripted policy)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT, run
from test_actors import play_seen

from rollway.actors.services import Services
from rollway.config.run import load_config
from rollway.schemas import EpisodeKey, Trajectory, encode

SOLUTION = [
    '<tool_call>{"name": "bash", "arguments": {"command": "cat numbers.txt"}}</tool_call>',
    '<tool_call>{"name": "bash", "arguments": {"command": "awk \'{print $1 + $2}\' numbers.txt > answer.txt"}}'
    "</tool_call>",
    '<tool_call>{"name": "finish", "arguments": {}}</tool_call>',
]
HOSTILE = [
    "<tool_call>" + "[" * 1200 + "</tool_call>",  # RecursionError in the JSON parser
    '<tool_call>{"name": "editor", "arguments": {"command": "view", "path": "numbers.txt", '
    f'"view_range": [1, {2**70}]}}}}</tool_call>',  # an integer MessagePack cannot hold
]


async def play(s: Services) -> tuple[Trajectory, list[bytes]]:
    """init -> agent turns -> reward, encoding every output as the runtime does before producing it."""
    traj, seen = await play_seen(s, EpisodeKey(episode_id="h-g0-s0", group_id="h-g0", task_id="toy-001"))
    return traj, [encode(m) for m in [*seen[1:], traj]]


def test_hostile_tool_calls_become_error_observations_and_the_episode_is_graded(tmp_path: Path):
    # The scripted policy plays turn k of the rule that matches: once the first error is in the prompt
    # (from turn 1 on), the first rule's turns 1.. play.
    script = json.dumps([{"when": "not valid JSON", "turns": [HOSTILE[0], HOSTILE[1], *SOLUTION]},
                         {"when": "", "turns": [HOSTILE[0]]}])
    cfg = load_config(ROOT / "examples" / "smoke.yaml",
                      [f"policy.script={script}", "agent.max_turns=8", "agent.max_tokens_per_turn=2048",
                       "agent.max_total_tokens=32768", "tools.enabled=[bash, editor, finish]"])
    traj, produced = run(play(Services(cfg, tmp_path / "run")))
    assert traj.stop_reason == "finish" and traj.reward == 1.0 and traj.num_turns == 5
    nested, huge = (traj.turns[k].observations for k in (0, 1))
    assert len(nested) == 1 and nested[0].is_error and "not valid JSON" in nested[0].content
    assert len(huge) == 1 and huge[0].is_error and "view_range[1]" in huge[0].content
    assert all(len(b) < 1024 * 1024 for b in produced)
