"""The pipeline declared once (topics/topology.py): what derives from it, and that the actors keep to it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from rollway.base.registry import import_target
from rollway.topics import ALL_TOPICS, DEAD_LETTERS
from rollway.topics.topology import (
    STAGE_NAMES,
    STAGES,
    UndeclaredOutput,
    check_output,
    get_stage,
    readers_of,
    start_order,
)

ROOT = Path(__file__).resolve().parent.parent


def test_every_actor_subscribes_to_what_its_stage_declares():
    for stage in STAGES:
        actor = import_target(stage.actor)
        assert actor.name == stage.name
        assert set(actor.inputs) == set(stage.consumes), stage.name


def _topics_returned(actor_module: Path) -> set[str]:
    """Topic constants passed as the first argument of `Output(...)` anywhere in the module."""
    tree = ast.parse(actor_module.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Output" and node.args:
            found.add(ast.unparse(node.args[0]))
    return found


def test_outputs_written_in_each_actor_are_declared():
    """Read from the actors' source, so an `Output(TOPIC, ...)` added without declaring it fails here
    (the runtime also refuses it at run time: `check_output`)."""
    by_constant = {name: spec for name, spec in vars(__import__("rollway.topics", fromlist=["x"])).items()
                   if spec in ALL_TOPICS}
    for stage in STAGES:
        module = ROOT / "actors" / (stage.actor.split(":")[0].rsplit(".", 1)[1] + ".py")
        for constant in _topics_returned(module):
            assert by_constant[constant] in stage.produces, f"{stage.name} writes {constant} undeclared"
    # failure_output (runtime/actor.py) writes episode-failures for init, agent and reward
    for name in ("init", "agent", "reward"):
        assert any(t.name == "episode-failures" for t in get_stage(name).produces)


def test_an_undeclared_output_is_refused():
    check_output("init", get_stage("agent").consumes[0])
    with pytest.raises(UndeclaredOutput, match="sink.*dead-letters|dead-letters.*sink"):
        check_output("sink", DEAD_LETTERS)


def test_every_topic_written_has_a_reader_and_every_stage_is_reached():
    for stage in STAGES:
        for topic in stage.produces:
            assert readers_of((topic,)), f"{topic.name} from {stage.name} is read by no stage"
    fed = {s.name for t in {t for s in STAGES for t in s.produces} for s in readers_of((t,))}
    assert fed == set(STAGE_NAMES)


def test_start_order_starts_readers_before_writers_and_the_scheduler_last():
    order = start_order()
    assert sorted(order) == sorted(STAGE_NAMES) and order[-1] == "scheduler"
    for stage in STAGES:
        for reader in readers_of(stage.produces):
            if reader.name not in (stage.name, "scheduler"):
                assert order.index(reader.name) < order.index(stage.name), (reader.name, stage.name)


def test_no_other_module_spells_the_stage_list():
    """The stage names listed literally anywhere but the declaration is a second source of truth."""
    listed = re.compile(r"""["']scheduler["'],\s*["']init["'],\s*["']agent["']""")
    offenders = [str(p.relative_to(ROOT)) for folder in ("actors", "base", "config", "envs", "learning", "policies",
                                                         "audit", "docgen", "reports", "runners", "sandboxes", "schemas",
                                                         "tools", "topics", "bench")
                 for p in (ROOT / folder).rglob("*.py") if listed.search(p.read_text())]
    assert offenders == []


def test_readme_and_concepts_carry_the_declared_topology():
    """The pipeline block of the README and docs/concepts.md is generated from the declaration."""
    from rollway.topics.topology import text_diagram, with_diagram

    for name in ("README.md", "docs/concepts.md"):
        text = (ROOT / name).read_text()
        assert text_diagram() in text and with_diagram(text) == text, f"run `rollway docs topology` ({name})"


def test_the_runtime_refuses_an_output_the_stage_does_not_declare():
    """`check_output` is the runtime's, on every output it produces: an actor's output to a topic its
    stage does not declare is refused (its input dead-lettered), a dead letter is the runtime's own."""
    from rollway.config.run import RunConfig
    from rollway.runtime.actor import Output, OutputRefused
    from rollway.runtime.worker import OutputSender
    from rollway.schemas.messages import DeadLetter
    from rollway.topics import AGENT_STEPS

    sender = OutputSender("sink", RunConfig(), None, {})  # type: ignore[arg-type]
    letter = DeadLetter(source_topic="t", partition=0, offset=0, key=None, value=b"", reason="r", stage="sink", at=0.0)
    assert sender.encode(Output(DEAD_LETTERS, None, letter))[0].endswith("dead-letters")
    with pytest.raises(OutputRefused, match="stage 'sink' produced to 'agent-steps'"):
        sender.encode(Output(AGENT_STEPS, "ep", letter))


def test_an_actor_takes_its_name_and_inputs_from_its_stage_and_declares_neither():
    """Name and inputs come from topics/topology.py, never from a second declaration in the actor's module."""
    for stage in STAGES:
        source = (ROOT / "actors" / (stage.actor.split(":")[0].rsplit(".", 1)[1] + ".py")).read_text()
        assert not re.search(r"^    (name|inputs)\s*=", source, re.M), stage.name  # class level
        assert "self.inputs" not in source, stage.name


def test_rollway_up_branches_on_no_stage_name():
    """Per-stage facts (one process, ranks, who issues the work, who drains last) come from the
    declaration: no string literal naming a stage in runners/up.py's code."""
    tree = ast.parse((ROOT / "runners" / "up.py").read_text())
    compared = {c.value for node in ast.walk(tree) if isinstance(node, ast.Compare)
                for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in STAGE_NAMES}
    assert compared == set()


def test_the_in_process_driver_chains_the_rollout_stages_as_declared(tmp_path):
    """runtime/inprocess.py takes its chain from the declaration: the stages between the issuer and the
    drain stages, each fed the topics it reads. Like the runtime it refuses an output the stage does not
    declare, and an episode a stage drops says where. (Stand-in init actors: one forges a reward request,
    which init never may; one skips the request, as init does for another run's episode.)"""
    import asyncio

    from rollway.actors.services import Services
    from rollway.config.run import load_config
    from rollway.runtime.actor import Output
    from rollway.runtime.inprocess import InProcessDriver
    from rollway.schemas.messages import EpisodeKey
    from rollway.topics import REWARD_REQUESTS

    driver = InProcessDriver(Services(load_config(None, []), tmp_path))
    assert list(driver.actors) == ["init", "agent", "reward"]
    assert {t.name: s.name for t, s in driver.reader.items()} == {
        "init-requests": "init", "agent-steps": "agent", "reward-requests": "reward"}

    class Forging:
        async def handle(self, msg, meta):
            return [Output(REWARD_REQUESTS, msg.episode_id, msg)]

    class Skipping:
        async def handle(self, msg, meta):
            return []

    key = EpisodeKey(episode_id="e", group_id="e", task_id="t")
    driver.actors["init"] = Forging()
    with pytest.raises(UndeclaredOutput, match="stage 'init' produced to 'reward-requests'"):
        asyncio.run(driver.play(key))
    driver.actors["init"] = Skipping()
    with pytest.raises(RuntimeError, match="task t: stage init produced 0 messages"):
        asyncio.run(driver.play(key))
