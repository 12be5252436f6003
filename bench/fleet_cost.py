"""What a remote engine costs over the local socket, side by side in one run: sandbox create, exec round
trip (p50, p99) and teardown, on the local engine and on the first engine of a fleet.

    mapfile -t FLEET < <(sudo bash scripts/fleet-up.sh 1)
    python -m rollway.bench.fleet_cost "${FLEET[@]}" -n 10 --execs 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

from rollway.config.run import load_config
from rollway.sandboxes.base import SandboxSpec
from rollway.sandboxes.config import DockerSandboxConfig, EngineConfig
from rollway.sandboxes.fleet import FleetSandboxProvider


def _pct(xs: list[float], q: float) -> float:
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)


async def measure(cfg: DockerSandboxConfig, n: int, execs: int) -> dict[str, Any]:
    """`n` sandboxes one after another on the fleet `cfg` (one engine): create, `execs` round trips of
    `true`, destroy."""
    provider = FleetSandboxProvider(cfg)
    creates, rounds, teardowns = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        box = await provider.create(SandboxSpec(files={"a.py": "x = 1\n"}), f"bench-{uuid.uuid4().hex[:10]}")
        creates.append(time.perf_counter() - t0)
        for _ in range(execs):
            t1 = time.perf_counter()
            await box.exec("true")
            rounds.append(time.perf_counter() - t1)
        t2 = time.perf_counter()
        await box.destroy()
        teardowns.append(time.perf_counter() - t2)
    await provider.close()
    return {"create_p50_ms": _pct(creates, 0.5), "create_p99_ms": _pct(creates, 0.99),
            "exec_p50_ms": _pct(rounds, 0.5), "exec_p99_ms": _pct(rounds, 0.99),
            "teardown_p50_ms": _pct(teardowns, 0.5), "teardown_p99_ms": _pct(teardowns, 0.99)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="+", help="the fleet (scripts/fleet-up.sh's output lines)")
    parser.add_argument("-n", type=int, default=10, help="sandboxes per engine")
    parser.add_argument("--execs", type=int, default=20, help="exec round trips per sandbox")
    args = parser.parse_args(argv)
    fleet: DockerSandboxConfig = load_config(None, ["sandbox.type=docker", *args.overrides]).sandbox  # type: ignore
    remote = fleet.model_copy(update={"engines": [fleet.engines[0]]})
    local = fleet.model_copy(update={"engines": [EngineConfig()]})
    rows = {}
    for name, cfg in (("local socket", local), (f"remote {fleet.engines[0].id} (TLS)", remote)):
        rows[name] = asyncio.run(measure(cfg, args.n, args.execs))
    print(json.dumps({"n": args.n, "execs_per_sandbox": args.execs, "engines": rows}, indent=2))


if __name__ == "__main__":
    main()
