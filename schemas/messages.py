"""One msgspec Struct per topic. Every per-episode message holds its identity once (`episode`) and is
keyed by its episode id."""

from __future__ import annotations

from typing import Any

import msgspec

SCHEMA_VERSION = 2
"""Bumped on any incompatible change; decoders reject other versions. 2: the episode identity is one
nested `episode` field (EpisodeKey); stage timings, stamps and `sent_at` left the messages (the stage
runtimes record them as telemetry, runtime/telemetry.py)."""


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    schema_version: int = SCHEMA_VERSION


class EpisodeKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who an episode is: held once by every per-episode message (`episode`) and passed on whole to
    the episode's next message. An episode is one sample of a GRPO group; a re-issued episode keeps
    its id and group and gets the next `attempt`. The Kafka key of its messages is `episode_id`."""

    episode_id: str
    group_id: str
    task_id: str
    attempt: int = 0
    sample_index: int = 0
    """Position of this episode inside its group (0..n-1)."""


class EpisodeMessage(Message, kw_only=True):
    """A message about one episode. The identity's fields read through as properties
    (`msg.episode_id`), so consumers need not spell out `msg.episode.episode_id`."""

    episode: EpisodeKey

    @property
    def episode_id(self) -> str:
        return self.episode.episode_id

    @property
    def group_id(self) -> str:
        return self.episode.group_id

    @property
    def task_id(self) -> str:
        return self.episode.task_id

    @property
    def attempt(self) -> int:
        return self.episode.attempt

    @property
    def sample_index(self) -> int:
        return self.episode.sample_index


class InitRequest(EpisodeMessage, kw_only=True):
    """scheduler -> init actor: create this episode's sandbox and first turn."""

    issued_at: float
    """Wall-clock time (unix seconds) the scheduler issued this attempt."""
    deadline: float
    """Wall-clock time after which the scheduler re-issues the episode."""
    final_wave: bool = False
    """Issued in the run's final wave (scheduler.final_wave): tells the agents the run is draining."""


class Observation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one tool call returned, as the model will read it: the one tool-outcome type from the
    agent's tool run (`tools/registry.py` `Step`) to the trajectory. A tool itself returns a
    `ToolResult` (its author-facing form); `run_call` makes the Observation from it."""

    tool: str = ""
    """Tool name, or "" for a call that could not be parsed (or a message without a call)."""
    arguments: dict[str, Any] = {}
    """The call's arguments as parsed ({} when they could not be)."""
    content: str
    is_error: bool = False
    call_id: str | None = None
    """The model's id for the call, when its tool-call format gives one."""
    ends_episode: bool = False
    """The call ended the episode (`finish`)."""
    truncated: bool = False
    """`content` was cut to tools.max_observation_chars."""
    internal_error: bool = False
    """The tool itself failed (a bug or a broken sandbox), not the model's call."""


class TurnRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The delta one agent turn adds to the episode: the completion, then the observation tokens.

    Invariants: `logprobs` has the length of `completion_ids`; appending `completion_ids` then
    `observation_ids` to the previous token sequence gives the sequence the model sees next.
    """

    turn: int
    completion_ids: list[int]
    logprobs: list[float]
    policy_version: int
    finish_reason: str
    assistant_text: str
    observations: list[Observation] = []
    hints: list[str] = []
    """Hints the framework appended to this turn's observation (recorded for analysis)."""
    observation_ids: list[int] = []
    """Tool output and the next generation prompt (loss mask 0). Empty on the final turn."""
    gen_seconds: float = 0.0
    tool_seconds: float = 0.0
    template_drift: bool = False
    """True when re-rendering the history from scratch differed from the accumulated ids."""
    gen_started_at: float = 0.0
    """Wall-clock time (unix seconds) generation started; 0.0 in messages from before it existed."""
    gen_ended_at: float = 0.0
    """Wall-clock time generation returned (tool calls start right after)."""
    tool_ended_at: float = 0.0
    """Wall-clock time the turn's tool calls finished."""
    user_message: str | None = None
    """A user message the environment gave after this turn (a simulated user: `Environment.step`); it follows
    the observations in the chat and its tokens are part of `observation_ids`. None: none."""
    state: dict[str, Any] | None = None
    """The episode's state store after this turn when the turn changed it (None: unchanged). The store
    of turn k is the last non-None `state` of turns 0..k, so a worker rebuilding the episode from the
    log restores it."""
    segment_prompt_ids: list[int] | None = None
    """Harness episodes (an external program through the gateway): this turn's model call did not
    extend the previous one's context (the program rewrote its history), so it opens a new token
    stream: the full prompt the engine saw, placed before `completion_ids` (loss mask 0); the previous
    turn's `observation_ids` are then empty. None: the turn continues the current stream."""
    segment_reason: str | None = None
    """Why the segment opened (history_rewritten, system_changed, tools_changed, prompt_changed)."""
    temperature: float | None = None
    """Harness episodes: the temperature this turn was sampled at (`CapturedCall.temperature`); the
    learner computes the turn's logprobs under it or refuses the episode. None: the configured one."""
    top_p: float | None = None
    """Harness episodes: the top_p this turn was sampled at. None: the configured one."""
    call_index: int | None = None
    """Harness episodes: the gateway call this turn is (`CapturedCall.call_index`; a retried call's turn
    is its retry's, so indices may skip). `observations` and `user_message` then hold what the program
    sent back after this call's reply (the next call's tool results and user messages). None: a turn of
    the built-in loop."""
    segment_messages: list[dict[str, Any]] | None = None
    """Harness episodes, on the turn that opens a later segment: the chat messages the program sent for
    it (its rewritten history, canonical form: role, content, tool_calls, tool_call_id, name); the first
    segment's are the trajectory's `messages`. None elsewhere."""
    call_attempt: int | None = None
    """Harness episodes: the attempt whose `gateway-calls` record this turn is (with `call_index`, the log
    tells which attempt's acknowledged call a trained turn came from). None: a built-in turn."""


class AgentStep(EpisodeMessage, kw_only=True):
    """init -> agent (turn 0) and agent -> agent (turn k): run turn `turn` of this episode.

    Event-sourced: turn 0 carries the initial prompt; turn k > 0 carries only the previous turn's
    delta (`last`). The full state is the turn-0 message plus every later `last`, in order.
    """

    turn: int
    sandbox: dict[str, Any]
    """Sandbox handle; any worker reattaches to the sandbox from it."""
    start_offset: int | None = None
    """Offset of this episode's turn-0 message in the same partition (None on turn 0 itself); a
    worker without the episode in memory rebuilds it from there."""
    prompt_ids: list[int] | None = None
    """Turn 0 only: the initial prompt token ids (loss mask 0)."""
    messages: list[dict[str, Any]] | None = None
    """Turn 0 only: the initial chat messages (system, user)."""
    tools: list[dict[str, Any]] | None = None
    """Turn 0 only: OpenAI tool specs offered to the model."""
    last: TurnRecord | None = None
    """Turn k > 0: the delta of turn k-1."""
    deadline: float = 0.0
    ready_at: float = 0.0
    """Turn 0 only: wall-clock time (unix seconds) the episode's sandbox was ready; a task's agent time
    (`agent_timeout_s`) counts from here. 0.0 on later turns (the turn-0 message keeps it)."""
    final_wave: bool = False
    """Copied from the InitRequest. An agent worker that sees it ranks its backlog earliest turn
    first from then on, for every episode (in the drain, the episodes with the most turns left
    decide when the run ends)."""


class RewardRequest(EpisodeMessage, kw_only=True):
    """agent -> reward actor: the finished episode, to be graded. One message per episode, so
    carrying every turn here keeps bytes per episode linear in its length."""

    sandbox: dict[str, Any]
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    turns: list[TurnRecord]
    stop_reason: str
    """Why the agent stopped: finish, max_turns, max_tokens, length, agent_failure, ..."""
    side_calls: list[dict[str, Any]] = []
    """Harness episodes: the program's side conversations, as `Trajectory.side_calls`."""
    deadline: float = 0.0
    failure: dict[str, str] | None = None
    """Set when the episode ended in a failure after the agent's code ran (base/blame.py): the grade
    details of that failure (outcome, failure_kind, failure_stage, failure). The reward stage grades it 0
    without running the grader, and tears the sandbox down as usual. None: the episode ended normally."""


class Trajectory(EpisodeMessage, kw_only=True):
    """reward actor -> learner, sink, scheduler: a graded episode, token-exact.

    Invariants: `token_ids`, `loss_mask` and `logprobs` have equal length (the whole episode:
    prompt, completions, observations); `loss_mask` is 1 exactly on tokens the model produced;
    `logprobs` holds the behaviour logprob there and None elsewhere; `turn_policy_versions` and
    `turn_spans` have one entry per turn.
    """

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    turn_policy_versions: list[int]
    turn_spans: list[tuple[int, int]]
    """[start, end) of each turn's completion inside `token_ids`."""
    reward: float
    resolved: bool
    stop_reason: str
    num_turns: int
    prompt_length: int
    """Tokens of the initial prompt (the start of `token_ids`)."""
    grade: dict[str, Any] = {}
    """Grader details: partial test counts and the like."""
    turns: list[TurnRecord] = []
    """Per-turn record (text, tool calls, observations, hints) for viewers and replay."""
    messages: list[dict[str, Any]] = []
    """Initial chat messages."""
    template_drift_turns: int = 0
    created_at: float = 0.0
    """When the reward actor graded it (unix seconds). Stage times are telemetry (runtime/telemetry.py);
    each turn's generation and tool times are on `turns` (the agent needs them)."""
    side_calls: list[dict[str, Any]] = []
    """Harness episodes: the program's side conversations (`CapturedCall.side_call`), never trained:
    per call {call_index, name, system (its system prompt, cut), text (the sampled text, cut),
    output_tokens}. Empty: none."""
    segment_starts: list[int] = []
    """Harness episodes whose program rewrote its history: the offset in `token_ids` where each token
    stream after the first begins (its prompt). Tokens of a segment were seen by the model only with
    the tokens from its own start, not with earlier segments. Empty: one stream."""


class EpisodeFailure(EpisodeMessage, kw_only=True):
    """any stage -> scheduler: this attempt failed in infrastructure (not a low reward). A failure the
    agent caused is never one: it is a graded 0 on `trajectories` (base/blame.py)."""

    stage: str
    reason: str
    retryable: bool = True
    at: float = 0.0


class PolicyVersion(Message, kw_only=True):
    """learner -> inference engines, scheduler: a new policy is available."""

    version: int
    checkpoint: str | None = None
    """Folder with the weights (safetensors), None for a learner that does not train."""
    step: int = 0
    episodes_trained: int = 0
    created_at: float = 0.0
    metrics: dict[str, float] = {}


class DeadLetter(Message, kw_only=True):
    """any stage -> dead-letters: a message that could not be decoded or handled."""

    source_topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    """The original bytes, untouched."""
    reason: str
    stage: str
    at: float


class CapturedCall(EpisodeMessage, kw_only=True):
    """gateway -> gateway-calls (learner, viewers): one model call an external agent program made,
    token-exact, written and acknowledged before the program receives the response.

    Event-sourced per segment: a segment's token stream is rebuilt by, for each of its calls in
    `call_index` order, cutting the stream to `prompt_start`, appending `prompt_ids` (loss mask 0) and
    then `output_ids` (loss mask 1). A call that opens a segment has `segment_reason` set and
    `prompt_start` 0. A retry cuts back to the retried call's prompt, so the stream holds each position
    once. Invariants: `logprobs` has the length of `output_ids`; `call_index` counts the episode's
    recorded calls from 0 without gaps.
    """

    call_index: int
    segment: int
    """0-based segment of the episode; a new one starts when the program rewrites its history."""
    segment_reason: str | None = None
    """Set on the call that opens a segment: start, history_rewritten, system_changed, tools_changed,
    prompt_changed (completions). None on a call that continues its segment."""
    retry_of: int | None = None
    """The call index this call repeats (same request again, e.g. after a client timeout); the
    retried call's output is superseded. None: not a retry."""
    continues_call: int | None = None
    """The earlier call whose answer, superseded by a retry, this call goes on from (the program kept
    that answer, not the retry's): the stream is cut back to the end of that call's prompt and its
    output put back (loss mask 1, it is trained) before this call's `prompt_ids`. None: not so."""
    prompt_start: int
    """Where in the segment's stream `prompt_ids` go (the stream is cut there first)."""
    prompt_ids: list[int]
    """The new prompt tokens (rendered messages, loss mask 0); the whole prompt when a segment opens."""
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    api: str = "chat"
    """chat (/v1/chat/completions) or completions (/v1/completions)."""
    new_messages: list[dict[str, Any]] = []
    """The chat messages this call added (all of them when a segment opens), canonical form: role,
    content, tool_calls [{id, name, arguments}], tool_call_id, name."""
    tools: list[dict[str, Any]] | None = None
    """The OpenAI tool specs offered; set when a segment opens (None: unchanged)."""
    raw_text: str = ""
    """The sampled ids decoded (tool-call markup included): how the assistant turn is rendered."""
    content: str = ""
    """The text returned to the program (tool calls taken out, cut at a stop string)."""
    tool_calls: list[dict[str, Any]] = []
    """The tool calls returned to the program: [{id, name, arguments}]."""
    side_call: str | None = None
    """Set on a side conversation (a title or memory call the program makes beside its main one,
    matched by `agent.harness.side_calls`): the rule's name. Such a call renders its own whole prompt
    (`prompt_start` 0, `segment` -1), belongs to no segment, is never trained, and leaves the episode's
    stream as it was. None: a call of the episode's conversation."""
    temperature: float | None = None
    """The temperature the engine sampled this call at (the program's, or the configured one where the
    harness enforces its sampling). None: a record written before sampling was recorded."""
    top_p: float | None = None
    """The top_p the engine sampled this call at. None as for `temperature`."""
    sampling_overridden: bool = False
    """True when the program asked for other sampling than the engine used (the harness enforces the
    configured temperature and top_p: `agent.harness.sampling: enforce`)."""
    template_drift: bool = False
    """True when rendering this call's messages from scratch gives other ids than the prompt the engine
    saw (sampled ids that re-tokenise differently, or a template that is not append-only). The
    recorded ids are the ones the engine saw either way; only the gateway's drift check sets it."""
    created_at: float = 0.0
