"""The task-set interface: where tasks come from, how their sandbox is built, how they are graded."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rollway.base.hooks import check_hook
from rollway.sandboxes.base import Sandbox, SandboxProvider, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.schemas.messages import TurnRecord
from rollway.tools.base import Tool, ToolContext
from rollway.tools.config import ToolsConfig
from rollway.tools.registry import Step, Toolbox, run_tool_calls


@dataclass
class Task:
    """One task. `prompt` is what the model reads first; `metadata` is the task set's own."""

    task_id: str
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Grade:
    """The result of grading one episode."""

    reward: float
    resolved: bool
    stop_reason: str | None = None
    """Set when grading itself ended abnormally (`patch_failed`, `test_timeout`); overrides the
    agent's stop reason in the trajectory."""
    details: dict[str, Any] = field(default_factory=dict)
    """Partial counts and test names, e.g. {"fail_to_pass": {"passed": 1, "total": 2}}."""


@dataclass
class Episode:
    """One episode as its environment (`Environment.step`) and `TaskSet.grade` see it."""

    episode_id: str
    attempt: int
    task: Task
    messages: list[dict[str, Any]]
    """The transcript so far: the initial messages, then per turn the assistant message and what
    followed it (tool results, hints, injected user messages), as chat messages."""
    turns: list[TurnRecord] = field(default_factory=list)
    """Per-turn records: token ids, logprobs, tool calls and observations."""
    state: dict[str, Any] = field(default_factory=dict)
    """The episode's state store (what tools and hooks kept there, see ToolContext.state)."""
    stop_reason: str | None = None
    """Why the agent stopped (in `grade`); in `step`, the limit that ends it after this turn whatever the step says."""

    @classmethod
    def outside_run(cls, task: Task, episode_id: str = "") -> Episode:
        """An episode with no transcript, for grading a sandbox outside a run (tests, `tasks verify`)."""
        return cls(episode_id=episode_id, attempt=0, task=task, messages=[])


@dataclass
class UserTurn:
    """What the deprecated `next_user_message` may return besides a string (ends_episode: stop reason `user_done`)."""

    content: str | None = None
    ends_episode: bool = False


ReferenceAgent = Callable[[str, int], str]
"""(conversation so far as text, turn) -> that turn's assistant output (a reference solution that reacts
to observations)."""


class TaskSet(ABC):
    """A family of tasks. Built once per worker by `build_taskset(config)`."""

    system_prompt: str = "You are a helpful agent. Use the tools to solve the task, then call finish."
    default_tools: tuple[str, ...] = ("bash", "finish")
    require_tool_call: bool = True
    """A model message without a tool call gets an observation explaining the call format. False where
    talking is a turn (a simulated user answers it): such a turn has no observations."""
    describe_tools: bool = True
    """Render the tools' JSON specs into the prompt. Small models may do better with worked
    examples in the environment's first observation (`Environment.start`) instead."""
    environment_class: ClassVar[type[Environment]]
    """The class of this task set's environments (`environment`). Default: `Environment` (tool calls only)."""
    sandbox_config: SandboxConfig | None = None
    """The run's sandbox settings (type, image, HOME, workdir, env), set by the framework right after
    construction, so hooks can depend on them instead of repeating them in the task set's own section.
    None when the task set was built without a run config."""
    config_class: ClassVar[type | None] = None
    """Your own config class (a `rollway.envs.config.TasksConfig` subclass with your fields): the
    `tasks` section is validated against it (unknown keys fail) and passed to the constructor."""

    def environment(self, task: Task, sandbox: Sandbox | None, toolbox: Toolbox) -> Environment:
        """The episode's environment from its task, tools and sandbox (init calls it to start, the agent every
        turn). Default: `environment_class` with `default_tools`; per-task tools are built here with
        `toolbox.build([...])` (names, `python:MODULE:CLASS`, or Tool instances made from the task's data)."""
        if legacy := [h for h in LEGACY_HOOKS if hasattr(self, h)]:
            warnings.warn(f"{type(self).__name__} defines {', '.join(legacy)}: these TaskSet hooks are deprecated and "
                          "go in the next release; give the task set an `environment_class` (an Environment with "
                          "`start` and `step`) instead (docs/extending.md)", DeprecationWarning, stacklevel=2)
            tools = toolbox.build(self.tools_for(task) if hasattr(self, "tools_for") else self.default_tools)
            return HookedEnvironment(self, task, tools, sandbox, toolbox.cfg)
        return self.environment_class(self, task, toolbox.build(self.default_tools), sandbox, toolbox.cfg)

    def reference_solution(self, task: Task) -> list[str] | ReferenceAgent | None:
        """A known-good agent for this task: the assistant outputs (tool calls in the chat format's
        syntax) of each turn, or a small agent that reads what earlier calls printed: a callable given
        the conversation so far (as the model would read it, decoded) and the turn number, returning
        that turn's output. The `gold` policy plays it; `rollway tasks verify CONFIG` checks that it
        resolves every task and that doing nothing resolves none. None: unknown."""
        return None

    @abstractmethod
    def tasks(self) -> list[Task]:
        """All tasks of the configured split, in a stable order."""

    def get(self, task_id: str) -> Task:
        """The task with this id; KeyError naming the id when absent. Indexed on first use (every
        init and reward message looks its task up)."""
        index = self.__dict__.get("_task_index")
        if index is None:
            index = self.__dict__["_task_index"] = {t.task_id: t for t in self.tasks()}
        try:
            return index[task_id]
        except KeyError:
            raise KeyError(f"task {task_id!r} is not in this {type(self).__name__} ({len(index)} tasks); "
                           "check tasks.* in the config (count, split, limit, path)") from None

    async def prepare(self, task: Task) -> None:
        """Called by the init actor before `sandbox_spec`: make what the task's sandbox needs and may take
        long (an image to build), without blocking the event loop (run blocking work in a thread), so
        that `sandbox_spec` is quick. Default: nothing."""

    @abstractmethod
    def sandbox_spec(self, task: Task) -> SandboxSpec:
        """How the init actor builds this task's sandbox."""

    def grading_time_limit_s(self, task: Task) -> float:
        """The longest `grade` may run what the agent made for `task`: the sum of the time limits of its
        grading steps (each command it runs under a timeout), not counting a grading sandbox's start. Once
        an attempt reaches the reward stage the scheduler waits this long plus `scheduler.grading_reserve_s`
        for its grade (instead of the episode's deadline): an agent can make a grading as slow as these
        limits, and a grading cut by a deadline would be re-issued and its 0 never counted. Default: one
        command's limit (`sandbox.exec_timeout_s`); override it where grading runs longer."""
        return self.sandbox_config.exec_timeout_s if self.sandbox_config is not None else 0.0

    @abstractmethod
    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        """Called by the reward actor once per episode, before the sandbox is destroyed. `episode`: the
        transcript, the episode id and its state store (`Episode.outside_run(task)` when grading outside a
        run). Every task set's `grade` takes these four arguments."""


class Environment:
    """One episode's world (`TaskSet.environment`): `start` gives the first observation, `step` answers each
    model output. It is built again every turn (an episode may change worker): keep what must outlast a turn
    in `episode.state` (it travels with the turn records) or in the sandbox."""

    def __init__(self, taskset: TaskSet, task: Task, tools: Mapping[str, Tool], sandbox: Sandbox | None,
                 tool_settings: ToolsConfig) -> None:
        self.taskset, self.task, self.tools, self.sandbox, self.tool_settings = taskset, task, tools, sandbox, tool_settings

    async def start(self, system_prompt: str | None = None) -> list[dict[str, Any]]:
        """The chat the model reads first (`system_prompt`: agent.system_prompt, when set)."""
        return [{"role": "system", "content": system_prompt or self.taskset.system_prompt},
                {"role": "user", "content": self.task.prompt}]

    async def step(self, output: str, episode: Episode) -> Step:
        """Run the tool calls of turn `len(episode.turns)`'s output and say what comes back; `episode.state` (the
        tools' `context.state`) may change. Default: the tool calls only."""
        return await self.run_tools(output, episode)

    async def run_tools(self, output: str, episode: Episode) -> Step:
        """Run `output`'s tool calls in the sandbox within `tools.*`'s limits; never raises for the model or a tool."""
        context = ToolContext(task=self.task, episode_id=episode.episode_id, attempt=episode.attempt,
                              turn=len(episode.turns), state=episode.state)
        return await run_tool_calls(output, self.tools, self.sandbox, self.tool_settings, context,
                                    self.taskset.require_tool_call)


TaskSet.environment_class = Environment

LEGACY_HOOKS = ("tools_for", "next_user_message", "observation_hints", "initial_messages")
"""The TaskSet hooks an `Environment` replaced: still served, with a DeprecationWarning, for one release."""


class HookedEnvironment(Environment):
    """A task set written against the hooks before `Environment` (LEGACY_HOOKS), served as one."""

    async def start(self, system_prompt: str | None = None) -> list[dict[str, Any]]:
        hook = getattr(self.taskset, "initial_messages", None)
        return hook(self.task, system_prompt) if hook else await super().start(system_prompt)

    async def step(self, output: str, episode: Episode) -> Step:
        step = await self.run_tools(output, episode)
        if step.done or episode.stop_reason:
            return step
        if hasattr(self.taskset, "next_user_message"):  # it sees the episode with this turn in it
            record = TurnRecord(turn=len(episode.turns), completion_ids=[], logprobs=[], policy_version=0,
                                finish_reason="", assistant_text=output, observations=step.observations)
            said = [{"role": "assistant", "content": output}, *({"role": "tool" if o.tool else "user",
                                                                 "content": o.content} for o in step.observations)]
            reply = await self.taskset.next_user_message(self.task, Episode(
                episode.episode_id, episode.attempt, self.task, episode.messages + said, [*episode.turns, record],
                episode.state))
            step.user_message, ends = (reply.content, reply.ends_episode) if isinstance(reply, UserTurn) else (reply, False)
            step.done = "user_done" if ends else None
        hints = getattr(self.taskset, "observation_hints", lambda task, observations: [])
        step.hints = list(hints(self.task, step.observations))
        return step


GRADE_SIGNATURE = "async def grade(self, task, sandbox, provider, episode: Episode) -> Grade"
STEP_SIGNATURE = "async def step(self, output: str, episode: Episode) -> Step"


def check_taskset(taskset: TaskSet | type[TaskSet]) -> None:
    """Refuse a task set whose hooks have another signature than rollway calls (HookSignatureError)."""
    check_hook(taskset, "grade", ("task", "sandbox", "provider", "episode"), GRADE_SIGNATURE)
    check_hook(taskset.environment_class, "step", ("output", "episode"), STEP_SIGNATURE)


async def grade_after_agent(taskset: TaskSet, task: Task, sandbox: Sandbox, provider: SandboxProvider,
                            episode: Episode) -> Grade:
    """How the reward stage grades an episode (and `rollway grader check` plays it): `taskset.grade`, where a
    grading that fails is judged by `blame` (base/blame.py). The agent's code has run (the grader runs it
    on the agent's changes), so a failure is the agent's, graded 0 with its reason, unless it was found
    before that code ran or outside the sandbox: those raise (the attempt is retried)."""
    from rollway.base.blame import AGENT_FAILURE, blame, failure_details

    try:
        grade = await taskset.grade(task, sandbox, provider, episode)
    except Exception as err:
        if blame(err, agent_ran=True) == "infrastructure":
            raise
        return Grade(0.0, False, stop_reason=AGENT_FAILURE, details=failure_details(err, "reward"))
    reward = grade.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not abs(reward) <= MAX_REWARD:
        # What a grader reads can come from the agent's code (a test that prints a score): nan, inf or a huge
        # number would reach every advantage of the episode's group, so such a reward is a 0 that says why.
        return Grade(0.0, False, grade.stop_reason, {
            **grade.details, "outcome": "bad_reward",
            "error": f"the grader gave reward {reward!r}, not a finite number within ±{MAX_REWARD:g}"})
    return grade


MAX_REWARD = 1e6
"""Largest reward magnitude a grade may give (a score of 0-1, 0-100 or 0-1000 fits). Past it a reward is an
overflow waiting: Dr.GRPO's advantage is r - mean, and a gradient's squared norm in float32 overflows near
1e19 per element, after which clipping turns every weight to nan."""
