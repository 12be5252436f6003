"""`tasks.type: swebench` (and `swe`): SWE-bench-family rows over a git mirror, each run and graded in its
instance's workspace: its own image (docker sandbox) or its tree exported from the mirror (local sandbox)."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

from rollway.envs.base import Episode, Grade, Task, TaskSet
from rollway.envs.config import SWEBenchTasksConfig
from rollway.envs.image_builds import build_all
from rollway.envs.pytest_guard import bounded_patch
from rollway.envs.split import select_tasks
from rollway.envs.swe import SWE_SYSTEM_PROMPT
from rollway.envs.swe_grading import GradeSettings, GradingEnvError, grade_instance
from rollway.envs.swe_images import InstanceImages, copy_repo_command, prepared_tree
from rollway.envs.swe_rows import SWEInstance, load_swe_instances
from rollway.sandboxes.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec

DEFAULT_BASE_IMAGE = "rollway-sandbox:bookworm"
MODEL_PATCH_CHARS = 200_000


def task_prompt(inst: SWEInstance) -> str:
    """The issue as SWE-bench poses it: repository and problem statement (hints are not shown)."""
    return (f"Repository: {inst.repo} (checked out in the working directory at {inst.base_commit[:12]}).\n\n"
            f"Issue:\n{inst.problem_statement}\n\n"
            "Fix the issue in the library source (not in the tests); your workspace changes are graded.")


def uses_images(provider: SandboxProvider | None = None, sandbox: Any = None) -> bool:
    """Whether SWE workspaces come from per-instance images: with a docker sandbox (the provider that
    grades, else the run's sandbox settings). Any other sandbox (default: the local bubblewrap jail)
    gets the instance's tree exported from the mirror."""
    config = getattr(provider, "config", None) if provider is not None else sandbox
    return getattr(config, "type", "local") == "docker"


def load_rows(cfg: SWEBenchTasksConfig) -> tuple[list[SWEInstance], str | None]:
    """The rows of `tasks.path` and the mirror they are read from. An instances file (the older format,
    `rollway tasks build swe --format instances`) is converted on load: committed into a mirror under the
    cache (or `tasks.mirror`) as SWE-bench rows. A rows file with no `tasks.mirror` reads the `mirror`
    folder next to it (where `rollway tasks build swe` writes it) when there is one."""
    from rollway.envs.swe_export import is_instances_file, rows_from_instances
    from rollway.envs.swe_rows import normalise_row

    path = Path(cfg.path).expanduser()
    if is_instances_file(path):
        rows, mirror = rows_from_instances(path, cfg.cache_dir, cfg.mirror)
        return [normalise_row(row, "swebench") for row in rows], mirror
    beside = path.parent / "mirror"
    return load_swe_instances(path, cfg.row_format), cfg.mirror or (str(beside) if beside.is_dir() else None)


class SWEBenchTaskSet(TaskSet):
    """Tasks from SWE-bench-schema rows (JSONL or Parquet; SWE-Gym, SWE-smith and R2E-Gym rows too, and
    rollway's older instances files, converted on load). One path for every SWE task: the workspace is
    the instance's repository at its base commit, from its image with a docker sandbox, else exported
    from the mirror into a folder (local sandbox); both are graded by `swe_grading.grade_instance`."""

    system_prompt = SWE_SYSTEM_PROMPT
    default_tools = ("bash", "editor", "search", "finish")

    def __init__(self, cfg: SWEBenchTasksConfig) -> None:
        if not cfg.path:
            raise ValueError(f"tasks.type={cfg.type} needs tasks.path, a JSONL or Parquet file of SWE-bench-schema "
                             "rows (`rollway tasks build swe --sdist NAME==VERSION --out FILE` writes one)")
        self.cfg = cfg
        rows, self.mirror = load_rows(cfg)
        self.instances = {inst.instance_id: inst for inst in rows}
        self.images = InstanceImages(self.mirror, cfg.image_template, cfg.base_image or DEFAULT_BASE_IMAGE,
                                     cfg.git_url, network=cfg.build_network)
        self.settings = GradeSettings(cfg.test_timeout_s)
        self._tasks = select_tasks([Task(i.instance_id, task_prompt(i), {"repo": i.repo}) for i in
                                    self.instances.values()], cfg)

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def grading_time_limit_s(self, task: Task) -> float:
        diff = self.sandbox_config.keeper_timeout_s if self.sandbox_config is not None else 0.0
        return diff + self.settings.time_limit_s  # the workspace's diff, then the grading sandbox's steps

    def uses_images(self, provider: SandboxProvider | None = None) -> bool:
        return uses_images(provider, self.sandbox_config)

    def spec_for(self, inst: SWEInstance, provider: SandboxProvider | None = None) -> SandboxSpec:
        """The instance's starting workspace (blocks while an image builds or a tree exports): its image
        and the copy into the workspace (docker), or its tree as the source folder (other sandboxes)."""
        if self.uses_images(provider):
            return SandboxSpec(image=self.images.image_for(inst), setup_commands=[copy_repo_command(inst.repo_dir)])
        return SandboxSpec(source_dir=str(prepared_tree(inst, self.mirror, self.cfg.cache_dir, self.cfg.git_url)))

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return self.spec_for(self.instances[task.task_id])

    async def prepare(self, task: Task) -> None:
        """The instance's image (or tree) found or made in a thread (the init actor's loop goes on meanwhile)."""
        await asyncio.to_thread(self.spec_for, self.instances[task.task_id])

    def build_images(self, workers: int = 2, progress: Any = None) -> dict[str, Any]:
        """Every selected task's image (or tree), found or made (`rollway tasks build-images`, run start)."""
        jobs = [(t.task_id, functools.partial(self._workspace_name, self.instances[t.task_id])) for t in self._tasks]
        return {**build_all(jobs, workers, progress), "built": list(self.images.built)}

    def _workspace_name(self, inst: SWEInstance) -> str:
        spec = self.spec_for(inst)
        return spec.image or str(spec.source_dir)

    async def grade_patch(self, inst: SWEInstance, patch: str, provider: SandboxProvider, owner: str = "") -> Grade:
        """Grade `patch` on a fresh copy of the instance's starting workspace (`grade_instance`; `owner`
        starts the grading sandbox's name)."""
        try:
            spec = await asyncio.to_thread(self.spec_for, inst, provider)
        except SandboxError as exc:
            raise GradingEnvError(f"env_error: no workspace for {inst.instance_id}: {exc}") from exc
        return await grade_instance(inst, patch, provider, spec, self.settings, owner=owner)

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        patch = await sandbox.diff()
        owner = f"{episode.episode_id}-a{episode.attempt}" if episode.episode_id else ""
        grade = await self.grade_patch(self.instances[task.task_id], patch, provider, owner=owner)
        # The predictions file of `rollway eval` reads it. Kept whole up to a cap (a grade rides in one
        # broker message, at most 1 MB), with the whole diff's length and sha256.
        kept = bounded_patch(patch, MODEL_PATCH_CHARS)
        grade.details.update(model_patch=kept["text"], model_patch_chars=kept["chars"],
                             model_patch_sha256=kept["sha256"], model_patch_truncated=kept["truncated"])
        return grade


async def verify_instances(taskset: SWEBenchTaskSet, provider: SandboxProvider,
                           progress: Any = None) -> dict[str, Any]:
    """Grade each instance's gold patch (must resolve) and an empty patch (must not) in its workspace."""
    rows = []
    for inst in taskset.instances.values():
        row: dict[str, Any] = {"instance_id": inst.instance_id}
        for kind, patch in (("gold", inst.patch), ("empty", "")):
            try:
                grade = await taskset.grade_patch(inst, patch, provider)
                row[f"{kind}_resolved"], row[f"{kind}_outcome"] = grade.resolved, grade.details["outcome"]
                if kind == "gold" and not grade.resolved:
                    row["gold_details"] = {k: grade.details.get(k) for k in ("fail_to_pass", "pass_to_pass",
                                                                             "apply_output")}
            except SandboxError as exc:
                row[f"{kind}_resolved"], row[f"{kind}_outcome"] = False, f"env_error: {exc}"[:300]
        rows.append(row)
        if progress is not None:
            progress.update(len(rows), len(taskset.instances), f"{sum(r['gold_resolved'] for r in rows)} gold resolved")
    return {"total": len(rows), "gold_resolved": sum(r["gold_resolved"] for r in rows),
            "empty_resolved": sum(r["empty_resolved"] for r in rows), "instances": rows}
