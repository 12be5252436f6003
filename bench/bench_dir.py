"""The files a benchmark writes in its own folder, beside what any run folder holds (base/run_dir.py)."""

from __future__ import annotations

from pathlib import Path

from rollway.base.run_dir import RunDir


class BenchDir(RunDir):
    """A benchmark's output folder: a run folder plus the benchmark's own files."""

    @property
    def plans(self) -> Path:
        """The seeded workload's episode plans: written by the benchmark, read by its sim server."""
        return self.path / "plans.jsonl"

    @property
    def sim_server_log(self) -> Path:
        """The simulated inference server's output (bench/run.py `SimServer`)."""
        return self.path / "sim-server.log"

    @property
    def bench_broker_log(self) -> Path:
        """The output of the broker a benchmark starts for all its runs."""
        return self.path / "broker.log"

    @property
    def engine_log(self) -> Path:
        """The output of the vLLM server `bench pipeline --real` starts for both its modes."""
        return self.path / "vllm.out"

    @property
    def profile(self) -> Path:
        """`bench ceiling`'s cProfile of its profiled pass, read back for the CPU breakdown."""
        return self.path / "profiled.pstats"

    @property
    def utilisation_plot(self) -> Path:
        """`bench pipeline`'s plot of busy slots over time per mode."""
        return self.path / "utilisation.png"

    @property
    def training_plot(self) -> Path:
        """`bench training`'s plot of the importance-ratio histogram and the timeline."""
        return self.path / "training.png"

    def mode_result(self, mode: str) -> Path:
        """One mode's figures of `bench pipeline --real`, written as soon as that mode ends."""
        return self.path / f"{mode}.json"

    @property
    def result(self) -> Path:
        """A benchmark's result, written at its end (bench run, real, ceiling, weight sync)."""
        return self.path / "result.json"

    @property
    def learn_bench_result(self) -> Path:
        """bench learn's result: pass rates before and after and the paired difference."""
        return self.path / "learn-bench.json"
