"""`tasks.type: harbor`: Harbor / Terminal-Bench 2 task folders, run and verified in the task's own image.

A task folder holds `instruction.md`, `task.toml` (timeouts under [agent], [verifier], [environment]),
`environment/Dockerfile` (with its build context), `tests/test.sh` (writes the reward to
/logs/verifier/reward.txt, or a JSON object with `reward` to reward.json) and optionally
`solution/solve.sh`.

How it maps onto rollway's docker sandbox (which runs every command as an unprivileged user in a
read-only container whose only writable tree is /workspace):
- FROM lines name images rollway never pulls: an image the engine has is kept; any other is replaced by
  `tasks.base_image` (default `rollway-sandbox:bookworm`, Debian bookworm with python3, git, procps).
- The Dockerfile's last WORKDIR (default /app) is moved aside at build time and becomes a link to
  /workspace; the episode's workspace starts as a copy of it. /tests and /logs are links into rollway's
  own folder in the container (/rollway-judge/harbor, the keeper's, made afresh by the verifier), and
  /solution into /workspace/.rollway/ (outside the graded diff), so test scripts read and write their
  usual absolute paths.
- The verifier runs apart from the agent (envs/harbor_verifier.py, docs/security/harbor.md): by default
  (`[verifier] environment_mode = "separate"`) in a fresh container of the task's image holding a copy of
  the agent's working directory, as `[verifier] user` (default: the sandbox user) with `[verifier] env`.
  Tests and solutions run without network: a test script that installs packages at verification time
  (apt-get, curl | sh) fails here; bake its tools into the image.
- Task folders are data: symlinks leaving the folder, devices, and names or paths that could inject into
  image tags, container names or Dockerfile lines are refused at load, naming the task and the field.
- Image builds get no network unless `tasks.build_network` says otherwise (logged as a warning).
- task.toml limits apply per episode: [agent] timeout_sec ends the agent phase (stop reason
  `agent_timeout`, then graded; Task.metadata `agent_timeout_s`, read by the agent actor), [verifier]
  timeout_sec kills the tests (`test_timeout`), and [environment] cpus / memory_mb / storage_mb (or the
  older memory / storage = "4G") replace sandbox.cpus / memory_mb / workspace_mb for the task's sandbox.
- Files of tests/ and solution/ are copied byte for byte (binary fixtures too), executable bits kept.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import os
import re
import shutil
import tempfile
import tomllib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import structlog

from rollway.envs.base import Episode, Grade, Task, TaskSet
from rollway.envs.config import MAX_TASK_TIMEOUT_S, HarborTasksConfig
from rollway.envs.harbor_verifier import (
    HARBOR_DIR,
    LINKS,
    VERIFIER_TIMEOUT_S,
    VerifierSettings,
    copy_folder,
    verify,
)
from rollway.envs.harbor_verifier import HarborEnvError as HarborEnvError  # re-exported: raised by grade
from rollway.envs.image_builds import KeyedLocks, build_all
from rollway.envs.split import select_tasks
from rollway.envs.task_data import TaskDataError, read_task_text
from rollway.sandboxes.base import (
    OutputLost,
    Sandbox,
    SandboxError,
    SandboxProvider,
    SandboxSpec,
    again_while_output_lost,
)
from rollway.sandboxes.config import SandboxConfig

log = structlog.get_logger()

DEFAULT_BASE_IMAGE = "rollway-sandbox:bookworm"
STASH = "/rollway-task"
"""Where the task's working directory is kept in its image (copied into the workspace at start)."""
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@/+-]{0,199}")
"""Task names: they end up in image tags, container names and messages."""
_SAFE_PATH = re.compile(r"/[A-Za-z0-9_.@+/-]*")
"""Container paths written into the Dockerfile rollway appends (WORKDIR) and task.toml paths."""
_SAFE_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@-]*")
HARBOR_SYSTEM_PROMPT = """You are an expert at the Linux command line. Solve the task in the terminal with the
tools, working in the current directory (it is the task's working directory). Call finish when done."""


class HarborTaskError(ValueError):
    """A task folder is not in Harbor's format; the message names the file."""


TIMEOUTS = (("agent", "timeout_sec"), ("verifier", "timeout_sec"), ("environment", "build_timeout_sec"))
"""The time limits a task.toml sets: each a finite number of seconds above 0, at most `tasks.max_timeout_s`."""


@dataclass
class HarborTask:
    name: str
    root: Path
    instruction: str
    config: dict[str, Any] = field(default_factory=dict)
    verifier: VerifierSettings = field(default_factory=VerifierSettings)
    max_timeout_s: float = MAX_TASK_TIMEOUT_S
    """The operator's ceiling on every time limit the task sets (`tasks.max_timeout_s`)."""

    def table(self, section: str) -> dict[str, Any]:
        """The task.toml table `section` ({} when absent); HarborTaskError when it is not a table."""
        return _table(self.config.get(section), f"task {self.name}: [{section}]")

    def timeout(self, section: str, default: float, key: str = "timeout_sec") -> float:
        """[section] `key` in seconds (checked at load: a finite number above 0), at most `max_timeout_s`."""
        return min(float(self.table(section).get(key, default)), self.max_timeout_s)

    def resources(self, env: dict[str, Any] | None = None) -> dict[str, Any]:
        """The [environment] limits (or those of `env`, e.g. [verifier.environment]) as SandboxSpec fields
        (memory_mb, cpus, workspace_mb), None where the task sets none. Harbor spells them `cpus`,
        `memory_mb`, `storage_mb`; the older `memory` and `storage` ("4G", "512M", or MB) are read too."""
        where = "[verifier.environment]" if env is not None else "[environment]"
        env = self.table("environment") if env is None else env

        def size(name: str) -> int | None:
            key = f"{name}_mb" if f"{name}_mb" in env else name
            return None if env.get(key) is None else _megabytes(env[key], self.name, f"{where} {key}")

        cpus = env.get("cpus")
        return {"memory_mb": size("memory"),
                "cpus": None if cpus is None else _positive(cpus, f"task {self.name}: {where} cpus"),
                "workspace_mb": size("storage")}

    @property
    def has_solution(self) -> bool:
        return (self.root / "solution" / "solve.sh").is_file()

    def files(self, sub: str) -> list[tuple[str, Path]]:
        """(name relative to `sub`, path) of every file under the task's `sub` folder, checked again as it
        is read (a link that now leaves the task folder is refused)."""
        check_folder(self.root, self.name)
        base = self.root / sub
        return [(p.relative_to(base).as_posix(), p) for p in sorted(base.rglob("*")) if p.is_file()]


def _megabytes(value: Any, task: str, key: str) -> int:
    """A size in MB from a number (MB) or a string with a unit (K, M, G, T; optional trailing B or i)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return max(1, int(_positive(value, f"task {task}: {key}")))
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]?)i?B?\s*", value if isinstance(value, str) else "",
                         re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise HarborTaskError(f"task {task}: {key} = {value!r} is not a size; write e.g. 2048 (in MB) or \"2G\"")
    scale = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[match.group(2).upper()]
    return max(1, int(float(match.group(1)) * scale))


def _positive(value: Any, what: str) -> float:
    """`value` as a float when it is a finite number above 0 (not a boolean or a string); else
    HarborTaskError naming `what` (`task NAME: [section] key`)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise HarborTaskError(f"{what} = {value!r} must be a finite number above 0")
    return float(value)


def _table(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HarborTaskError(f"{what} must be a table, got {value!r}"[:300])
    return value


def load_task(root: Path) -> HarborTask:
    """A task folder read and checked as data (see `check_folder`, `check_config`)."""
    for rel in ("instruction.md", "task.toml", "environment/Dockerfile", "tests/test.sh"):
        if not (root / rel).is_file():
            raise HarborTaskError(f"{root} is not a Harbor task folder: {rel} is missing")
    try:
        config = tomllib.loads(_text(root / "task.toml"))
    except tomllib.TOMLDecodeError as exc:
        raise HarborTaskError(f"{root / 'task.toml'}: {exc}") from exc
    name = _table(config.get("task"), f"{root}: [task]").get("name") or root.name
    if not isinstance(name, str):
        raise HarborTaskError(f"{root}: [task] name must be a string, got {name!r}"[:300])
    if not _SAFE_NAME.fullmatch(name) or ".." in name:
        raise HarborTaskError(f"{root}: [task] name (or the folder's name) {name!r} may hold only letters, digits "
                              "and _.@/+- (it names images and containers); rename the task")
    check_folder(root, name)
    task = HarborTask(name=name, root=root, instruction=_text(root / "instruction.md"), config=config)
    check_config(task)
    task.verifier = verifier_settings(task)
    return task


def _text(path: Path) -> str:
    """A task file's text; HarborTaskError naming the file when it is not UTF-8."""
    try:
        return read_task_text(path)
    except TaskDataError as err:
        raise HarborTaskError(str(err)) from None


def check_folder(root: Path, name: str) -> None:
    """Every entry of the task folder is a regular file, a folder, or a link that stays inside the folder
    (inside environment/ for the build context); refused otherwise, naming the task and the file."""
    top = root.resolve()
    for dirpath, dirnames, filenames in os.walk(root):  # not following links: a linked folder is checked as a link
        for entry in dirnames + filenames:
            path = Path(dirpath) / entry
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                inside = top / "environment" if rel.startswith("environment/") else top
                if not path.resolve().is_relative_to(inside):
                    where = "the build context (environment/)" if inside != top else "the task folder"
                    raise HarborTaskError(f"task {name}: {rel} is a symlink to {os.readlink(path)}, outside {where}; "
                                          "replace it with the file itself")
            elif not (path.is_dir() or path.is_file()):
                raise HarborTaskError(f"task {name}: {rel} is not a regular file or folder (a device, fifo or "
                                      "socket); remove it")


def _container_path(value: Any, task: str, key: str) -> str:
    """An absolute container path of plain characters without `..`, else HarborTaskError naming `key`."""
    text = str(value)
    if not _SAFE_PATH.fullmatch(text) or ".." in PurePosixPath(text).parts:
        raise HarborTaskError(f"task {task}: {key} {text!r} must be an absolute path of letters, digits and "
                              "_.@+/- without '..'")
    return text


def check_config(task: HarborTask) -> None:
    """Paths the task gives (the Dockerfile's WORKDIR, which rollway writes into a RUN line; [environment]
    workdir and skills_dir; artifact destinations) checked before any of them is used."""
    _container_path(workdir_of(_text(task.root / "environment" / "Dockerfile")), task.name,
                    "WORKDIR (the last one in environment/Dockerfile)")
    for section, key in TIMEOUTS:
        if (seconds := task.table(section).get(key)) is not None:
            _positive(seconds, f"task {task.name}: [{section}] {key}")
    task.resources()  # checked: finite sizes and CPUs above 0
    env = task.table("environment")
    for key in ("workdir", "skills_dir"):
        if env.get(key) is not None:
            _container_path(env[key], task.name, f"[environment] {key}")
    artifacts = task.config.get("artifacts") or []
    if not isinstance(artifacts, list):
        raise HarborTaskError(f"task {task.name}: artifacts must be an array of tables ([[artifacts]])")
    for i, artifact in enumerate(artifacts):
        dest = artifact.get("destination") if isinstance(artifact, dict) else None
        if dest is not None and (PurePosixPath(str(dest)).is_absolute() or ".." in PurePosixPath(str(dest)).parts):
            raise HarborTaskError(f"task {task.name}: [[artifacts]] #{i} destination {dest!r} must be relative, "
                                  "without '..'")


def verifier_settings(task: HarborTask) -> VerifierSettings:
    """[verifier] environment_mode (rollway's default: separate), user, env and environment, checked."""
    section = task.table("verifier")
    mode = section.get("environment_mode") or "separate"
    if mode not in ("separate", "shared"):
        raise HarborTaskError(f"task {task.name}: [verifier] environment_mode = {mode!r} must be \"separate\" "
                              "or \"shared\"")
    environment = _table(section.get("environment"), f"task {task.name}: [verifier.environment]") \
        if section.get("environment") is not None else None
    if environment is not None and mode == "shared":
        raise HarborTaskError(f"task {task.name}: [verifier] environment_mode = \"shared\" cannot have "
                              "[verifier.environment]; remove one")
    unsupported = sorted(set(environment or {}) - {"cpus", "memory_mb", "memory", "storage_mb", "storage",
                                                    "build_timeout_sec"})
    if unsupported:
        raise HarborTaskError(f"task {task.name}: [verifier.environment] {', '.join(unsupported)} is not supported "
                              "by rollway (the verifier runs in the task's own image); remove it")
    return VerifierSettings(mode=mode, user=_verifier_user(task, section.get("user")),
                            env=_verifier_env(task, section.get("env", {})),
                            resources={k: v for k, v in task.resources(environment or {}).items() if v is not None})


def _verifier_user(task: HarborTask, user: Any) -> str | None:
    if user is None:
        return None
    if isinstance(user, bool) or not isinstance(user, int | str) or not _SAFE_USER.fullmatch(str(user)):
        raise HarborTaskError(f"task {task.name}: [verifier] user = {user!r} must be a user name or uid of the "
                              "image (optionally :group)")
    return str(user)


def _verifier_env(task: HarborTask, env: Any) -> dict[str, str]:
    """Values are passed literally (no ${VAR} from the host: the host's environment never enters a sandbox)."""
    if not isinstance(env, dict):
        raise HarborTaskError(f"task {task.name}: [verifier] env must be a table of NAME = \"value\"")
    for key, value in env.items():
        if not _ENV_KEY.fullmatch(str(key)) or not isinstance(value, str) or "\0" in value:
            raise HarborTaskError(f"task {task.name}: [verifier] env {key!r} = {value!r}: names are letters, digits "
                                  "and _, values strings")
    return dict(env)


def load_tasks(path: str | Path) -> list[HarborTask]:
    """One task folder, or every task folder directly under `path` (sorted by folder name)."""
    root = Path(path).expanduser()
    if (root / "task.toml").is_file():
        return [load_task(root)]
    if not root.is_dir():
        raise FileNotFoundError(f"{root} does not exist; point tasks.path at a Harbor task folder or a folder of them")
    tasks = [load_task(p) for p in sorted(root.iterdir()) if (p / "task.toml").is_file()]
    if not tasks:
        raise HarborTaskError(f"no task folders (with task.toml) under {root}")
    return tasks


# ---------------------------------------------------------------- images


def workdir_of(dockerfile: str) -> str:
    found = re.findall(r"(?im)^\s*WORKDIR\s+(\S+)\s*$", dockerfile)
    return found[-1] if found and found[-1].rstrip("/") else "/app"


def map_from_lines(dockerfile: str, has_image: Any, base_image: str) -> tuple[str, dict[str, str]]:
    """FROM lines naming an image the engine lacks rewritten to `base_image`; returns the text and the mapping.
    A FROM naming an earlier build stage is kept."""
    stages: set[str] = set()
    mapped: dict[str, str] = {}
    lines = []
    for line in dockerfile.splitlines():
        match = re.match(r"(?i)^(\s*FROM\s+)(?:--platform=\S+\s+)?(\S+)(.*)$", line)
        if match:
            image, rest = match.group(2), match.group(3)
            alias = re.search(r"(?i)\bAS\s+(\S+)", rest)
            if image.lower() not in stages and not has_image(image):
                mapped[image] = base_image
                line = f"{match.group(1)}{base_image}{rest}"
            if alias:
                stages.add(alias.group(1).lower())
        lines.append(line)
    return "\n".join(lines) + "\n", mapped


def rollway_layer(workdir: str) -> str:
    """Appended to the task's Dockerfile: the working directory stashed and linked to /workspace, and
    /tests, /logs, /solution linked where LINKS says."""
    links = " && ".join(f"rm -rf {path} && ln -s {target} {path}" for path, target in LINKS.items())
    return (f"\nUSER root\nRUN mkdir -p {workdir} && rm -rf {STASH} && cp -a {workdir} {STASH} && rm -rf {workdir} "
            f"&& ln -s /workspace {workdir} && {links} && chmod -R a+rX {STASH}\nWORKDIR /workspace\n")


class HarborImages:
    """Builds each task's image once (tag from the hash of its environment folder and the mapping), with
    no network unless `network` names one (`tasks.build_network`)."""

    def __init__(self, base_image: str, client: Any | None = None, network: str = "none") -> None:
        if not _IMAGE.fullmatch(base_image):
            raise ValueError(f"tasks.base_image = {base_image!r} is not an image name (it is written into FROM lines)")
        self.base_image = base_image
        self.network = network
        self._client = client
        self._known: dict[str, str] = {}
        self._locks = KeyedLocks()
        self.built: list[str] = []
        """Tags this object built (not found), in order."""

    @property
    def client(self) -> Any:
        if self._client is None:
            from rollway.sandboxes.docker import _connect

            self._client = _connect(None)
        return self._client

    def _has(self, image: str) -> bool:
        try:
            self.client.images.get(image)
            return True
        except Exception:
            return False

    def image_for(self, task: HarborTask) -> str:
        """The task's image, built first when the engine lacks it. Blocking (TaskSet.prepare runs it in a
        thread); one lock per task, so two episodes of one task build it once."""
        with self._locks.lock(task.name):
            return self._image_for(task)

    def _image_for(self, task: HarborTask) -> str:
        if task.name in self._known:
            return self._known[task.name]
        env = task.root / "environment"
        check_folder(task.root, task.name)  # again: the folder may have changed since it was loaded
        text, mapped = map_from_lines((env / "Dockerfile").read_text(), self._has, self.base_image)
        text += rollway_layer(_container_path(workdir_of(text), task.name, "WORKDIR"))
        digest = hashlib.sha256(text.encode())
        for path in sorted(env.rglob("*")):  # links hashed as links, never followed
            content = os.readlink(path).encode() if path.is_symlink() else path.read_bytes() if path.is_file() else b""
            digest.update(str(path.relative_to(env)).encode() + b"\0" + content)
        tag = f"rollway-harbor/{re.sub(r'[^a-z0-9_.-]', '-', task.name.lower())[:100]}:{digest.hexdigest()[:12]}"
        if not self._has(tag):
            self._build(task, env, text, tag)
            self.built.append(tag)
        self._known[task.name] = tag
        return tag

    def _build(self, task: HarborTask, env: Path, text: str, tag: str) -> None:
        """`docker build` of a copy of environment/ (links copied as links: checked to stay inside it)."""
        with tempfile.TemporaryDirectory(prefix="rollway-harbor-") as ctx:
            shutil.copytree(env, ctx, symlinks=True, dirs_exist_ok=True)
            Path(ctx, "Dockerfile").write_text(text)
            try:
                self.client.images.build(path=ctx, tag=tag, network_mode=self.network, rm=True, forcerm=True,
                                         pull=False,
                                         timeout=math.ceil(task.timeout("environment", 600.0, "build_timeout_sec")))
            except Exception as exc:
                raise SandboxError(f"building the image of Harbor task {task.name} failed: {exc}; its FROM lines are "
                                   f"mapped to {self.base_image} (tasks.base_image) when the engine lacks them") from exc


# ---------------------------------------------------------------- running and verifying


async def run_solution(task: HarborTask, sandbox: Sandbox) -> str:
    """The oracle: solution/solve.sh run in the task's working directory, as the agent; returns its output."""
    await copy_folder(sandbox, task.files("solution"), f"{HARBOR_DIR}/solution")
    result = await sandbox.exec("bash /solution/solve.sh 2>&1", timeout_s=task.timeout("agent", 600.0))
    return result.output


class HarborTaskSet(TaskSet):
    """Harbor task folders under tasks.path. Needs sandbox.type=docker."""

    system_prompt = HARBOR_SYSTEM_PROMPT
    default_tools = ("bash", "finish")

    def __init__(self, cfg: HarborTasksConfig) -> None:
        if not cfg.path:
            raise ValueError("tasks.type=harbor needs tasks.path, a Harbor task folder or a folder of them")
        self.cfg = cfg
        self.by_name = {t.name: t for t in load_tasks(cfg.path)}
        cut = []
        for task in self.by_name.values():
            task.max_timeout_s = cfg.max_timeout_s
            cut += [f"{task.name} [{section}] {key}" for section, key in TIMEOUTS
                    if float(task.table(section).get(key, 0)) > cfg.max_timeout_s]
        if cut:  # the operator's ceiling wins; said once, naming each limit it shortened
            log.warning("task time limits cut to tasks.max_timeout_s", max_timeout_s=cfg.max_timeout_s,
                        limits=cut[:20], more=max(0, len(cut) - 20))
        if cfg.build_network != "none":  # an explicit opt-in, said out loud
            reach = "this host's loopback (broker, vLLM, learner)" if cfg.build_network == "host" else "the internet"
            log.warning("harbor task images build with network", network=cfg.build_network,
                        risk=f"a task's Dockerfile RUN steps can reach {reach}")
        self.images = HarborImages(cfg.base_image or DEFAULT_BASE_IMAGE, network=cfg.build_network)
        self._tasks = select_tasks([Task(t.name, t.instruction, {"agent_timeout_s": t.timeout("agent", 600.0)})
                                    for t in self.by_name.values()], cfg)

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def grading_time_limit_s(self, task: Task) -> float:
        """test.sh's limit, and in separate mode the carry of the agent's workspace into the verifier."""
        harbor_task = self.by_name[task.task_id]
        separate = harbor_task.verifier.mode == "separate"
        carry = (self.sandbox_config or SandboxConfig()).keeper_timeout_s if separate else 0.0
        return harbor_task.timeout("verifier", VERIFIER_TIMEOUT_S) + carry

    def spec_for(self, task: HarborTask) -> SandboxSpec:
        return SandboxSpec(image=self.images.image_for(task), **task.resources(), setup_commands=[
            f"test -d {STASH} || {{ echo 'rollway: not a rollway Harbor image; tasks.type=harbor needs "
            f"sandbox.type=docker'; exit 1; }}; tar -C {STASH} -cf - . | tar -xf - --no-same-owner"])

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return self.spec_for(self.by_name[task.task_id])

    async def prepare(self, task: Task) -> None:
        """The task's image found or built in a thread (the init actor's loop goes on meanwhile)."""
        await asyncio.to_thread(self.images.image_for, self.by_name[task.task_id])

    def build_images(self, workers: int = 2, progress: Any = None) -> dict[str, Any]:
        """Every selected task's image, found or built (`rollway tasks build-images`, run start)."""
        jobs = [(t.task_id, functools.partial(self.images.image_for, self.by_name[t.task_id])) for t in self._tasks]
        return {**build_all(jobs, workers, progress), "built": list(self.images.built)}

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        """Graded apart from the agent (envs/harbor_verifier.py)."""
        harbor_task = self.by_name[task.task_id]
        spec = await asyncio.to_thread(self.spec_for, harbor_task)
        return await verify(harbor_task, sandbox, provider, spec, harbor_task.files("tests"))


async def check_task(task: HarborTask, provider: SandboxProvider, spec: SandboxSpec, oracle: bool,
                     on_lost: Callable[[OutputLost], None] | None = None) -> Grade:
    """One verification run in a fresh sandbox: the solution first when `oracle`, else nothing (the
    empty run); the sandbox is always destroyed. Played again in another fresh sandbox while the engine
    loses a command's output (a task's verdict must not be an accident of the engine, moby#27289);
    `on_lost` is told of each loss played again."""
    return await again_while_output_lost(functools.partial(_check_once, task, provider, spec, oracle),
                                         on_lost or (lambda lost: None))


async def _check_once(task: HarborTask, provider: SandboxProvider, spec: SandboxSpec, oracle: bool) -> Grade:
    # A fresh name each run: two verifications of one task at once (two `tasks verify`, two tests) must not
    # share a container (a fixed name made the second remove the first's mid-run).
    sandbox = await provider.create(spec, f"verify-{re.sub(r'[^A-Za-z0-9_.-]', '_', task.name)[:40]}-"
                                          f"{'o' if oracle else 'e'}{uuid.uuid4().hex[:8]}")
    try:
        if oracle:
            await run_solution(task, sandbox)
        return await verify(task, sandbox, provider, spec, task.files("tests"))
    finally:
        await sandbox.destroy()


async def _check_row(task: HarborTask, provider: SandboxProvider, spec: SandboxSpec, kind: str) -> dict[str, Any]:
    """One check's fields of its task's row: the reward and outcome, or None and the error; `KIND_tries`
    says how many plays it took when the engine lost a command's output (check_task)."""
    lost: list[OutputLost] = []

    def note(err: OutputLost) -> None:
        lost.append(err)
        log.warning("the engine lost a command's output; the check again in a fresh sandbox", task=task.name,
                    check=kind, error=str(err)[:300])

    try:
        grade = await check_task(task, provider, spec, oracle=kind == "oracle", on_lost=note)
        fields = {f"{kind}_reward": grade.reward, f"{kind}_outcome": grade.details.get("outcome")}
    except SandboxError as exc:
        fields = {f"{kind}_reward": None, f"{kind}_outcome": f"env_error: {exc}"[:300]}
    return {**fields, **({f"{kind}_tries": len(lost) + 1} if lost else {})}


async def verify_tasks(taskset: HarborTaskSet, provider: SandboxProvider) -> dict[str, Any]:
    """Each task's solution (must score 1) and an empty run (must score 0)."""
    rows = []
    for task in taskset.by_name.values():
        spec = taskset.spec_for(task)
        row: dict[str, Any] = {"task": task.name}
        for kind in ("oracle", "empty"):
            if kind == "oracle" and not task.has_solution:
                row["oracle_reward"] = None
                continue
            row.update(await _check_row(task, provider, spec, kind))
        rows.append(row)
    with_solution = [r for r in rows if r["oracle_reward"] is not None or "oracle_outcome" in r]
    return {"total": len(rows), "oracle_passed": sum((r.get("oracle_reward") or 0) >= 1 for r in rows),
            "with_solution": len(with_solution), "empty_passed": sum((r.get("empty_reward") or 0) >= 1 for r in rows),
            "tasks": rows}
