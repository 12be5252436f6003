"""The `agent.harness` section: an external agent program plays each episode inside its sandbox,
talking to the gateway, instead of rollway's built-in loop (off when absent)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rollway.base.config import StrictModel
from rollway.gateway.side import SHIPPED, Program, SideCallRule

INSTRUCTION_FILE = "/tmp/rollway-instruction.txt"
"""Where the program finds the task's instruction inside the sandbox (`{instruction_file}`)."""
PLACEHOLDERS = ("{instruction}", "{instruction_file}")


class HarnessInstall(StrictModel):
    """How the program gets into the sandbox."""

    type: Literal["image", "host_dir"] = "image"
    """`image`: already in the task image (or on the jail's PATH: /usr, the configured python).
    `host_dir`: the host folder `path`, bound read-only at the same path into the local jail or the
    docker container."""
    path: str | None = None
    """The host folder of `host_dir` (the program's files and, say, its virtualenv); a relative path is
    taken from the folder rollway is started in (every stage process shares it). `{install_path}` in
    `command` becomes the absolute path."""

    @model_validator(mode="after")
    def _path_for_host_dir(self) -> HarnessInstall:
        if self.type == "host_dir":
            if not self.path:
                raise ValueError("agent.harness.install.path must name a host folder with install.type=host_dir")
            if not os.path.isabs(self.path):
                self.path = os.path.abspath(self.path)  # validated again on assignment: absolute then
            if not os.path.isdir(self.path):
                raise ValueError(f"agent.harness.install.path={self.path!r} is not a folder on this host")
        elif self.path is not None:
            raise ValueError("agent.harness.install.path is only read with install.type=host_dir")
        return self


class GatewayLimits(StrictModel):
    """Per-episode bounds at the gateway (docs/gateway.md, "Limits"). Every episode of a worker shares its
    gateway, its event loop and its descriptors; these keep one episode's program from exhausting them."""

    max_connections: int = Field(16, ge=1)
    """Open connections of one episode on its socket. One more is accepted and closed at once (the
    program sees a closed connection) and counts as a refused request; OpenAI clients keep a small pool."""
    max_request_bytes: int = Field(4 * 2**20, ge=1024)
    """Size of one request body. A larger `Content-Length` is refused (413) before anything is read; a
    body without one is cut off when it passes this size. A 32k-token conversation with its tools is
    a few hundred KiB; parsing a body holds the interpreter for up to about 0.1 s per MiB."""
    header_timeout_s: float = Field(30.0, gt=0)
    """Time a connection may take to send a complete request head, from when it opens or its last
    answer ended; an idle or trickling connection is closed then."""
    body_timeout_s: float = Field(60.0, gt=0)
    """Time to read one request body once its head arrived; past it the request is refused (408)."""
    max_refused: int = Field(200, ge=1)
    """Requests and connections of one episode the gateway may refuse for these limits or as malformed
    (too many connections, too large, too slow, not JSON, not a valid request). At this count the
    episode ends with `harness_refused_limit` (graded as it stands)."""
    parse_threads: int = Field(4, ge=1)
    """Threads that parse request bodies, render prompts and decode outputs for all episodes of the
    gateway, so that heavy requests do not stall the event loop the episodes share."""


class SideCallsConfig(StrictModel):
    """Which calls are side conversations (docs/harness.md#side-conversations)."""

    programs: list[Program] = Field(default_factory=lambda: ["opencode", "qwen-code"])
    """Programs whose shipped rules apply (opencode's title generator; Qwen Code's memory extraction,
    dream and selection calls)."""
    rules: list[SideCallRule] = Field(default_factory=list)
    """More rules: a call whose first system message starts with `system_prefix` is a side call."""
    train: bool = False
    """Train side calls as the episode's segments (as any other call). False: recorded and shown as side
    calls, never trained, and the episode's token stream goes on as if they had not happened."""

    def all_rules(self) -> tuple[SideCallRule, ...]:
        """The rules in force (none when side calls are trained as the episode)."""
        if self.train:
            return ()
        return (*(r for p in self.programs for r in SHIPPED[p]), *self.rules)


class HarnessConfig(StrictModel):
    """An agent program run once per episode in the episode's sandbox (docs/harness.md). Its model
    calls go to the worker's gateway (OPENAI_BASE_URL, OPENAI_API_KEY are set); the episode ends when
    it exits or at a limit, and the reward stage grades the sandbox as for built-in episodes."""

    command: list[str] = Field(min_length=1)
    """The program's argv. `{instruction}` in an argument becomes the task's instruction,
    `{instruction_file}` a file inside the sandbox holding it; with neither, the instruction is the
    program's stdin. `{install_path}` becomes `install.path` (install.type=host_dir)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment of the program (rollway's OPENAI_* variables win over these)."""
    install: HarnessInstall = Field(default_factory=HarnessInstall)
    """How the program is installed: in the task image, or a host folder bound read-only."""
    time_limit_s: float = Field(240.0, gt=0)
    """Wall time of the program; then it is killed and the episode ends with `harness_time_limit`
    (a task's own agent time, when shorter, wins). Must stay under `scheduler.episode_deadline_s`,
    leaving time to grade, or the scheduler re-issues episodes whose program is still running."""
    max_calls: int = Field(50, ge=1)
    """Model calls per episode; the next one is refused and the episode ends with `harness_call_limit`."""
    max_segments: int | None = Field(None, ge=1)
    """Token streams (segments) per episode: a call that would open one more (a program compacting or
    rewriting its history) is refused and the episode ends with `harness_segment_limit`, graded and
    trained on the segments it has. None: no bound."""
    max_trained_tokens: int | None = Field(None, ge=1)
    """Sampled tokens (what the learner trains) per episode: each call may sample only what is left,
    the call after that is refused and the episode ends with `harness_token_limit`, graded and trained
    up to the bound. None: no bound."""
    silence_limit_s: float = Field(120.0, gt=0)
    """Time without a model call (from the start) after which the program is killed and the episode
    ends with `harness_silence`. A call being served (waiting on the engine) is not silence."""
    side_calls: SideCallsConfig = Field(default_factory=SideCallsConfig)
    """Side conversations (a title or memory call with its own system prompt): recorded, shown, not trained."""
    sampling: Literal["enforce", "record"] = "enforce"
    """Whose sampling the engine uses. `enforce`: the configured `agent.temperature` and `agent.top_p`,
    whatever the program sends (most programs send their own, or none: 1.0); each call records that it
    was overridden. `record`: the program's, recorded with each call. Either way the learner trains
    only turns sampled at `learner.temperature` with top_p 1 and refuses any other episode with a
    warning (its group trains without it): never a silent mismatch."""
    model_name: str = "rollway-policy"
    """The model name the gateway serves (OPENAI_MODEL)."""
    limits: GatewayLimits = Field(default_factory=GatewayLimits)
    """Per-episode bounds at the gateway: connections, request size and read times, refusals."""

    @field_validator("command")
    @classmethod
    def _command_not_blank(cls, value: list[str]) -> list[str]:
        if not value[0].strip():
            raise ValueError("agent.harness.command[0] must name the program to run")
        return value

    @property
    def stdin_instruction(self) -> bool:
        """True when no argument names the instruction: the program reads it on stdin."""
        return not any(p in arg for arg in self.command for p in PLACEHOLDERS)

    def argv(self, instruction: str) -> list[str]:
        """The command with its placeholders filled."""
        return [a.replace("{install_path}", self.install.path or "").replace("{instruction_file}", INSTRUCTION_FILE)
                .replace("{instruction}", instruction) for a in self.command]
