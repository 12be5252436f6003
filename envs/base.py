"""The task-set interface: where tasks come from, how their sandbox is built, how they are graded."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from rollway.base.hooks import check_hook
from rollway.sandboxes.base import Sandbox, SandboxProvider, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.schemas.messages import TurnRecord


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
    """One episode as the task set's hooks see it (`next_user_message`, `grade`)."""

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
    """Why the agent stopped (in `grade`); None while the episode runs."""

    @classmethod
    def outside_run(cls, task: Task, episode_id: str = "") -> Episode:
        """An episode with no transcript, for grading a sandbox outside a run (tests, `tasks verify`)."""
        return cls(episode_id=episode_id, attempt=0, task=task, messages=[])


@dataclass
class UserTurn:
    """What `next_user_message` may return besides a plain string."""

    content: str | None = None
    """The next user message; None adds none."""
    ends_episode: bool = False
    """End the episode after this turn (stop reason `user_done`)."""


ReferenceAgent = Callable[[str, int], str]
"""(conversation so far as text, turn) -> that turn's assistant output (a reference solution that reacts
to observations)."""


class TaskCost(NamedTuple):
    """A task's expected cost, as the scheduler's issue order sees it."""

    init_s: float
    """Sandbox start, seconds."""
    grade_s: float
    """Grading, seconds."""


class TaskSet(ABC):
    """A family of tasks. Built once per worker by `build_taskset(config)`."""

    system_prompt: str = "You are a helpful agent. Use the tools to solve the task, then call finish."
    default_tools: tuple[str, ...] = ("bash", "finish")
    require_tool_call: bool = True
    """A model message without a tool call gets an observation explaining the call format. False where
    talking is a turn (a simulated user answers it): such a turn has no observations."""
    describe_tools: bool = True
    """Render the tools' JSON specs into the prompt. Small models may do better with worked
    examples in `initial_messages` instead."""
    sandbox_config: SandboxConfig | None = None
    """The run's sandbox settings (type, image, HOME, workdir, env), set by the framework right after
    construction, so hooks can depend on them instead of repeating them in the task set's own section.
    None when the task set was built without a run config."""
    config_class: ClassVar[type | None] = None
    """Your own config class (a `rollway.envs.config.TasksConfig` subclass with your fields): the
    `tasks` section is validated against it (unknown keys fail) and passed to the constructor."""

    def tools_for(self, task: Task) -> Sequence[Any]:
        """The tools this task's episodes get: registered names, `python:MODULE:CLASS`, or Tool instances
        this task set built from its own data (no global registration; name them with a prefix of your
        family, e.g. `desk.refund`, so they never meet a built-in's name). The init and agent actors
        call it per episode, unless `tools.enabled` is set. Default: `default_tools`."""
        return self.default_tools

    async def next_user_message(self, task: Task, episode: Episode) -> str | UserTurn | None:
        """Called by the agent actor after every turn that does not end the episode (after the turn's
        tool calls ran): a string (or UserTurn) becomes the next user message the model reads
        (multi-turn user simulation); None adds nothing. Default: None."""
        return None

    def observation_hints(self, task: Task, observations: Sequence[Any]) -> list[str]:
        """Called by the agent loop after every turn that does not end the episode, with that turn's
        observations (`schemas.Observation`: tool, arguments, content): hints to append to what the model
        reads next, recorded with the turn's other hints (the reference recipe's task-aware hints, e.g.
        "the definition is in FILE; answer with ..."). Default: none."""
        return []

    def reference_solution(self, task: Task) -> list[str] | ReferenceAgent | None:
        """A known-good agent for this task: the assistant outputs (tool calls in the chat format's
        syntax) of each turn, or a small agent that reads what earlier calls printed: a callable given
        the conversation so far (as the model would read it, decoded) and the turn number, returning
        that turn's output. The `gold` policy plays it; `rollway tasks verify CONFIG` checks that it
        resolves every task and that doing nothing resolves none. None: unknown."""
        return None

    def initial_messages(self, task: Task, system_prompt: str | None = None) -> list[dict[str, Any]]:
        """The chat the model sees first (the init actor calls this). Default: system, then the task."""
        return [{"role": "system", "content": system_prompt or self.system_prompt},
                {"role": "user", "content": task.prompt}]

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

    def cost_estimate(self, task: Task) -> TaskCost | None:
        """Expected sandbox-start and grading seconds of this task, for `scheduler.order` (johnson,
        ends); None when unknown. Default: the metadata keys `expected_init_s` and `expected_grade_s`
        (a task builder writes them from its own timed runs of the task)."""
        init_s, grade_s = task.metadata.get("expected_init_s"), task.metadata.get("expected_grade_s")
        if init_s is None or grade_s is None:
            return None
        return TaskCost(float(init_s), float(grade_s))

    async def prepare(self, task: Task) -> None:
        """Called by the init actor before `sandbox_spec`: make what the task's sandbox needs and may take
        long (an image to build), without blocking the event loop (run blocking work in a thread), so
        that `sandbox_spec` is quick. Default: nothing."""

    @abstractmethod
    def sandbox_spec(self, task: Task) -> SandboxSpec:
        """How the init actor builds this task's sandbox."""

    @abstractmethod
    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        """Called by the reward actor once per episode, before the sandbox is destroyed. `episode`: the
        transcript, the episode id and its state store (`Episode.outside_run(task)` when grading outside a
        run). Every task set's `grade` takes these four arguments."""


GRADE_SIGNATURE = "async def grade(self, task, sandbox, provider, episode: Episode) -> Grade"


def check_taskset(taskset: TaskSet | type[TaskSet]) -> None:
    """Refuse a task set whose hooks have another signature than rollway calls (HookSignatureError)."""
    check_hook(taskset, "grade", ("task", "sandbox", "provider", "episode"), GRADE_SIGNATURE)
    check_hook(taskset, "next_user_message", ("task", "episode"),
               "async def next_user_message(self, task, episode: Episode) -> str | UserTurn | None")


async def grade_after_agent(taskset: TaskSet, task: Task, sandbox: Sandbox, provider: SandboxProvider,
                            episode: Episode) -> Grade:
    """How the reward stage grades an episode (and `rollway grader check` plays it): `taskset.grade`, where a
    grading that fails is judged by `blame` (base/blame.py). The agent's code has run (the grader runs it
    on the agent's changes), so a failure is the agent's, graded 0 with its reason, unless it was found
    before that code ran or outside the sandbox: those raise (the attempt is retried)."""
    from rollway.base.blame import AGENT_FAILURE, blame, failure_details

    try:
        return await taskset.grade(task, sandbox, provider, episode)
    except Exception as err:
        if blame(err, agent_ran=True) == "infrastructure":
            raise
        return Grade(0.0, False, stop_reason=AGENT_FAILURE, details=failure_details(err, "reward"))
