"""The domain objects stages share (task set, sandboxes, chat format, inference, tools), built once
per worker from config and imported late so a worker only loads what its stage uses."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from rollway.config.run import RunConfig


class Services:
    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = run_dir

    @cached_property
    def taskset(self):
        from rollway.envs.factory import build_taskset

        return build_taskset(self.cfg.tasks, self.cfg.sandbox)

    @cached_property
    def sandboxes(self):
        from rollway.sandboxes.factory import build_sandbox_provider

        return build_sandbox_provider(self.cfg.sandbox)

    @cached_property
    def chat(self):
        from rollway.policies.factory import build_chat_format

        return build_chat_format(self.cfg.policy)

    @cached_property
    def inference(self):
        from rollway.policies.factory import build_inference

        return build_inference(self.cfg.policy, self.chat, self.taskset if self.cfg.policy.type == "gold" else None)

    @cached_property
    def toolbox(self):
        """This worker's tools (each distinct list built once), with the run's tool settings."""
        from rollway.tools.registry import Toolbox

        return Toolbox(self.cfg.tools)

    def environment(self, task, sandbox=None):
        """`task`'s environment (`TaskSet.environment`) with this worker's tools, over `sandbox`."""
        return self.taskset.environment(task, sandbox, self.toolbox)

    async def close(self) -> None:
        """Release what was built (the inference client's HTTP session); called once at worker exit."""
        if "inference" in self.__dict__:  # built: cached_property stores it on the instance
            await self.inference.close()
