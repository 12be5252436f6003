"""Episode re-run: play a recorded episode again as a run plays it (its model outputs as the policy) in a
fresh sandbox of the same task; report every turn whose observations differ, and the reward."""

from __future__ import annotations

import difflib
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollway.config.run import RunConfig
from rollway.policies.base import Generation, InferenceClient, SamplingParams

VOLATILE_PATTERNS = (
    (r"\b[A-Z][a-z]{2} +\d{1,2} +(\d\d:\d\d|\d{4})\b", "<date>"),  # `ls -l` modification times
    (r"\b\d{4}-\d\d-\d\d[T ]\d\d:\d\d(:\d\d(\.\d+)?)?(Z|[+-]\d\d:?\d\d)?\b", "<timestamp>"),
    (r"\b\d+\.\d+ ?s(econds)?\b", "<seconds>"),  # test runners' durations ("in 0.53s")
)
"""Parts of an observation that change from run to run without anything being different (a fresh
sandbox has new file times); blanked before comparing unless --exact."""


@dataclass
class TurnDifference:
    turn: int
    index: int
    """Position of the observation inside the turn."""
    tool: str
    arguments: dict[str, Any]
    recorded: str
    replayed: str
    diff: str


@dataclass
class RerunResult:
    episode_id: str
    task_id: str
    turns: int
    differences: list[TurnDifference] = field(default_factory=list)
    recorded_reward: float | None = None
    replayed_reward: float | None = None

    @property
    def differing_turns(self) -> list[int]:
        return sorted({d.turn for d in self.differences})

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "identical": not self.differences, "differing_turns": self.differing_turns}


def normalizer(exact: bool, extra: list[str]) -> Any:
    """A function blanking the volatile parts of an observation (and any --ignore patterns)."""
    pats = [] if exact else [(re.compile(p), r) for p, r in VOLATILE_PATTERNS]
    pats += [(re.compile(p), "<ignored>") for p in extra]

    def normalize(text: str) -> str:
        for pat, repl in pats:
            text = pat.sub(repl, text)
        return text

    return normalize


def short_diff(recorded: str, replayed: str, max_lines: int = 20) -> str:
    lines = list(difflib.unified_diff(recorded.splitlines(), replayed.splitlines(), "recorded", "replayed",
                                      lineterm="", n=1))
    if len(lines) > max_lines:
        lines = [*lines[:max_lines], f"... {len(lines) - max_lines} more diff lines"]
    return "\n".join(lines)


def compare_turn(turn: dict[str, Any], replayed: list[Any], normalize: Any) -> list[TurnDifference]:
    recorded = turn.get("observations", [])
    out = []
    for i in range(max(len(recorded), len(replayed))):
        rec = recorded[i]["content"] if i < len(recorded) else "<no observation>"
        new = replayed[i].content if i < len(replayed) else "<no observation>"
        if normalize(rec) != normalize(new):
            src = recorded[i] if i < len(recorded) else {"tool": replayed[i].tool, "arguments": replayed[i].arguments}
            out.append(TurnDifference(turn["turn"], i, src.get("tool") or "", src.get("arguments") or {}, rec, new,
                                      short_diff(rec, new)))
    return out


class NotRerunnable(ValueError):
    """An episode whose tool calls did not run through rollway's tools (an agent program ran them)."""


def check_rerunnable(traj: dict[str, Any]) -> None:
    """Refuse a harness episode: its program ran its own tools inside the sandbox, so replaying the
    model's outputs through rollway's tools would compare against something that never ran."""
    from rollway.reports.show import is_harness

    if is_harness(traj):
        eid = traj["episode"]["episode_id"]
        raise NotRerunnable(
            f"episode {eid} was played by an agent program through the gateway: its tool calls ran inside "
            f"the program, not through rollway's tools, so --rerun cannot replay them. See it call by call, "
            f"with its segments: `rollway show RUN_DIR --episode {eid}`, or its recorded calls: "
            f"`rollway replay gateway-calls --bootstrap HOST:PORT --topic-prefix PREFIX --episode {eid}`")


class RecordedOutputs(InferenceClient):
    """The policy of a re-run: each turn's recorded completion, token for token (past them, an empty one)."""

    def __init__(self, turns: list[dict[str, Any]]) -> None:
        self.turns = turns

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        turn = self.turns[params.turn] if params.turn < len(self.turns) else {}
        return Generation(list(turn.get("completion_ids", [])), list(turn.get("logprobs", [])),
                          turn.get("finish_reason", "stop"), turn.get("policy_version", 0))


async def rerun_episode(traj: dict[str, Any], cfg: RunConfig, normalize: Any) -> RerunResult:
    """Play the episode again the way a run plays one (`play_episode`: the init, agent and reward actors,
    so the task's own tools, the episode's state store, its simulated user and its grade), in a fresh
    sandbox, with the recorded model outputs as the policy; compare each turn's observations with the
    recorded ones. The caller refuses a harness episode first (`check_rerunnable`)."""
    from rollway.actors.services import Services
    from rollway.audit.verify import play_episode

    recorded = traj.get("turns", [])
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": None})})  # the replay is no run's
    with tempfile.TemporaryDirectory(prefix="rollway-rerun-") as run_dir:
        s = Services(cfg, Path(run_dir))
        s.inference = RecordedOutputs(recorded)
        replayed = await play_episode(cfg, s.run_dir, traj["episode"]["task_id"], s, prefix="rerun")
    result = RerunResult(traj["episode"]["episode_id"], traj["episode"]["task_id"], len(replayed.turns),
                         recorded_reward=traj.get("reward"), replayed_reward=replayed.reward)
    for i in range(max(len(recorded), len(replayed.turns))):
        new = replayed.turns[i].observations if i < len(replayed.turns) else []
        result.differences += compare_turn(recorded[i] if i < len(recorded) else {"turn": i}, new, normalize)
    return result


def format_result(r: RerunResult) -> str:
    lines = [f"episode {r.episode_id} (task {r.task_id}): re-ran {r.turns} turns in a fresh sandbox; "
             + (f"{len(r.differing_turns)} turn(s) differ: {', '.join(map(str, r.differing_turns))}"
                if r.differences else "every observation matches")]
    if r.replayed_reward is not None:
        lines.append(f"reward: recorded {r.recorded_reward:g}, replayed {r.replayed_reward:g}")
    for d in r.differences:
        lines.append(f"\nturn {d.turn}, observation {d.index}: {d.tool} {d.arguments}")
        lines += [f"  {x}" for x in d.diff.splitlines()]
    return "\n".join(lines)
