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

    def tool_names(self, task=None) -> list[str]:
        """The tools of `task`'s episodes (every episode's when `tools.enabled` is set); the task set's
        default list when `task` is None. The task set is built first, so the module that defines
        (and registers) its tools is always imported before a tool is looked up."""
        taskset = self.taskset
        if self.cfg.tools.enabled:
            return list(self.cfg.tools.enabled)
        return list(taskset.default_tools if task is None else taskset.tools_for(task))

    @cached_property
    def tools(self):
        """The tools of `tool_names()` (default list), by the name the model calls."""
        return self.tools_for(None)

    def tools_for(self, task):
        """`task`'s tools by the name the model calls; each distinct list is built once per worker."""
        from rollway.tools.registry import build_tools

        names = tuple(self.tool_names(task))
        cache = self.__dict__.setdefault("_tool_sets", {})
        if names not in cache:
            cache[names] = build_tools(names, self.cfg.tools)
        return cache[names]

    async def close(self) -> None:
        """Release what was built (the inference client's HTTP session); called once at worker exit."""
        if "inference" in self.__dict__:  # built: cached_property stores it on the instance
            await self.inference.close()
