"""`tasks.type: swebench`: SWE-bench-family rows, each run and graded in its own instance image."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from rollway.envs.base import Episode, Grade, Task, TaskSet
from rollway.envs.config import SWEBenchTasksConfig
from rollway.envs.image_builds import build_all
from rollway.envs.pytest_guard import bounded_patch
from rollway.envs.split import select_tasks
from rollway.envs.swe import SWE_SYSTEM_PROMPT
from rollway.envs.swe_grading import GradeSettings, GradingEnvError, grade_instance
from rollway.envs.swe_images import InstanceImages, copy_repo_command
from rollway.envs.swe_rows import SWEInstance, load_swe_instances
from rollway.sandboxes.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec

DEFAULT_BASE_IMAGE = "rollway-sandbox:bookworm"
MODEL_PATCH_CHARS = 200_000


def task_prompt(inst: SWEInstance) -> str:
    """The issue as SWE-bench poses it: repository and problem statement (hints are not shown)."""
    return (f"Repository: {inst.repo} (checked out in the working directory at {inst.base_commit[:12]}).\n\n"
            f"Issue:\n{inst.problem_statement}\n\n"
            "Fix the issue in the library source (not in the tests); your workspace changes are graded.")


class SWEBenchTaskSet(TaskSet):
    """Tasks from SWE-bench-schema rows (JSONL or Parquet; SWE-Gym, SWE-smith and R2E-Gym rows too).
    Needs sandbox.type=docker: each episode's workspace is a copy of its instance image's repository."""

    system_prompt = SWE_SYSTEM_PROMPT
    default_tools = ("bash", "editor", "search", "finish")

    def __init__(self, cfg: SWEBenchTasksConfig) -> None:
        if not cfg.path:
            raise ValueError("tasks.type=swebench needs tasks.path, a JSONL or Parquet file of SWE-bench-schema rows")
        self.cfg = cfg
        self.instances = {inst.instance_id: inst for inst in load_swe_instances(cfg.path, cfg.row_format)}
        self.images = InstanceImages(cfg.mirror, cfg.image_template, cfg.base_image or DEFAULT_BASE_IMAGE,
                                     cfg.git_url, network=cfg.build_network)
        self.settings = GradeSettings(cfg.test_timeout_s, tuple(cfg.failure_outcomes))
        self._tasks = select_tasks([Task(i.instance_id, task_prompt(i), {"repo": i.repo}) for i in
                                    self.instances.values()], cfg)

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def spec_for(self, inst: SWEInstance) -> SandboxSpec:
        """The instance's image (found or built; blocks while building) and the copy into the workspace."""
        return SandboxSpec(image=self.images.image_for(inst), setup_commands=[copy_repo_command(inst.repo_dir)])

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return self.spec_for(self.instances[task.task_id])

    async def prepare(self, task: Task) -> None:
        """The instance's image found or built in a thread (the init actor's loop goes on meanwhile)."""
        await asyncio.to_thread(self.images.image_for, self.instances[task.task_id])

    def build_images(self, workers: int = 2, progress: Any = None) -> dict[str, Any]:
        """Every selected task's image, found or built (`rollway tasks build-images`, run start)."""
        jobs = [(t.task_id, functools.partial(self.images.image_for, self.instances[t.task_id])) for t in self._tasks]
        return {**build_all(jobs, workers, progress), "built": list(self.images.built)}

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        inst = self.instances[task.task_id]
        patch = await sandbox.diff()
        try:
            spec = self.spec_for(inst)
        except SandboxError as exc:
            raise GradingEnvError(f"env_error: no image for {inst.instance_id}: {exc}") from exc
        grade = await grade_instance(inst, patch, provider, spec, self.settings)
        # The predictions file of `rollway eval` reads it. Kept whole up to a cap (a grade rides in one
        # broker message, at most 1 MB), with the whole diff's length and sha256.
        kept = bounded_patch(patch, MODEL_PATCH_CHARS)
        grade.details.update(model_patch=kept["text"], model_patch_chars=kept["chars"],
                             model_patch_sha256=kept["sha256"], model_patch_truncated=kept["truncated"])
        return grade


async def verify_instances(taskset: SWEBenchTaskSet, provider: SandboxProvider,
                           progress: Any = None) -> dict[str, Any]:
    """Grade each instance's gold patch (must resolve) and an empty patch (must not) in its image."""
    rows = []
    for inst in taskset.instances.values():
        row: dict[str, Any] = {"instance_id": inst.instance_id}
        for kind, patch in (("gold", inst.patch), ("empty", "")):
            try:
                grade = await grade_instance(inst, patch, provider, taskset.spec_for(inst), taskset.settings)
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
