"""The package import graph has no cycles: every import between rollway's top-level packages,
at module level or inside a function, goes one way (TYPE_CHECKING-only imports excluded)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def packages() -> dict[str, Path]:
    """rollway.<name> -> its folder, from pyproject's package-dir."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name.removeprefix("rollway."): ROOT / folder for name, folder in dirs.items()}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    return skip


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found |= {n.split(".")[1] for n in names if n.startswith("rollway.") and n.count(".") >= 1}
    return found


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> {imported package -> [files importing it]}."""
    graph: dict[str, dict[str, list[str]]] = {}
    for name, folder in packages().items():
        edges = graph.setdefault(name, {})
        for path in sorted(folder.rglob("*.py")):
            for other in imported_packages(path) - {name}:
                edges.setdefault(other, []).append(str(path.relative_to(ROOT)))
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_between_packages():
    graph = package_graph()
    cycle = find_cycle(graph)
    if cycle:
        where = [f"{a} -> {b}: {', '.join(graph[a][b][:3])}" for a, b in zip(cycle, cycle[1:], strict=False)]
        raise AssertionError("import cycle between packages: " + " -> ".join(cycle) + "\n" + "\n".join(where))


def test_base_is_the_bottom_layer():
    """`rollway.base` (plugins, registry, files, fault points) imports no other rollway package but
    `schemas`, so every package may import it."""
    assert set(package_graph()["base"]) <= {"schemas"}


def test_the_checker_sees_a_cycle():
    """A guard for the guard: a made-up two-package loop is found."""
    assert find_cycle({"a": {"b": ["x"]}, "b": {"a": ["y"]}}) in (["a", "b", "a"], ["b", "a", "b"])


LAYERS = (
    ("schemas", "base"),
    ("topics",),
    ("runtime",),
    ("sandboxes", "tools", "envs", "policies", "learning", "gateway"),
    ("episode",),
    ("config",),
    ("docgen",),
    ("actors",),
    ("reports", "audit"),
    ("runners",),
    ("bench",),
)
"""Bottom to top: messages and the lowest helpers; the topics and the topology; the stream runtime; the
domain packages; an episode's life (episode); the config root (config); the generated docs (docgen); the
actors; what reads a run back (reports) and the checks that play episodes through the actors (audit);
processes and the CLI; benchmarks. A package imports only packages of its own layer or below (within a layer
the graph must stay acyclic)."""


def test_packages_import_only_their_layer_or_below():
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    graph = package_graph()
    assert set(graph) <= set(rank), f"packages without a layer: {sorted(set(graph) - set(rank))}"
    upward = [f"{a} ({LAYERS[rank[a]]}) -> {b} ({LAYERS[rank[b]]}): {', '.join(files[:3])}"
              for a, edges in graph.items() for b, files in edges.items() if rank[b] > rank[a]]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_the_stream_runtime_loads_no_domain_package():
    """Importing the runtime (worker, Faust engine, log scans, Kafka clients, telemetry) loads only the
    schemas, the topics, base and itself: no task set, tool, policy, sandbox or learner, nor faust."""
    import subprocess
    import sys

    code = ("import sys, rollway.runtime.worker, rollway.runtime.faust, rollway.runtime.scan, rollway.runtime.kafka, "
            "rollway.runtime.telemetry, rollway.runtime.actor; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('rollway.')}), 'faust' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("]")[0] + "]" == str(sorted(["base", "runtime", "schemas", "topics"])) and out.strip().endswith("False")


def test_the_episode_package_loads_neither_the_runtime_nor_the_config_root():
    """An episode's life (state, token stream, stop rules, budget, deadline, hints, turn records) is free of
    any transport and of the run's config: importing every module of `rollway.episode` loads neither
    `rollway.runtime` nor `rollway.config`."""
    import subprocess
    import sys

    modules = sorted(f"rollway.episode.{p.stem}" for p in (ROOT / "episode").glob("*.py") if p.stem != "__init__")
    code = (f"import sys, {', '.join(modules)}; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('rollway.')}))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert modules and "'runtime'" not in loaded and "'config'" not in loaded, loaded


def test_the_agent_turn_imports_only_the_packages_of_its_walk():
    """docs/concepts.md, one message's walk: the agent actor and its turn code (actors/agent.py, actors/turn.py)
    call into the episode package, the runtime (the model call's metrics) and the sandboxes (the turn's claim)
    only; the environment with its tools, and the engine, are objects the worker built (actors/services.py). An
    import of another package here adds a hop to the walk the page counts."""
    used = imported_packages(ROOT / "actors" / "agent.py") | imported_packages(ROOT / "actors" / "turn.py")
    assert used <= {"actors", "base", "episode", "runtime", "sandboxes", "schemas", "topics"}, sorted(used)
