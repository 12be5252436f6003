"""The extension API: plugins with their own config, per-task tools with an episode context, task-set
hooks (user turns, grade with the episode, reference solutions), the sandbox layout, and the two
examples in examples/plugins/ run for real (real sandboxes; the `rollway up` runs use the real broker)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run
from jobs import run_with_progress
from pydantic import BaseModel, ConfigDict

from rollway.actors.agent import AgentActor
from rollway.actors.init import InitActor
from rollway.actors.learner import LearnerActor
from rollway.actors.services import Services
from rollway.audit.verify import DO_NOTHING_SCRIPT, play_episode
from rollway.config.run import ConfigError, RunConfig, config_secrets, load_config, resolved_config
from rollway.envs.base import Episode
from rollway.envs.factory import build_taskset
from rollway.runtime.actor import MessageMeta
from rollway.schemas import EpisodeKey, InitRequest
from rollway.tools.base import Tool, ToolResult
from rollway.tools.config import ToolsConfig
from rollway.tools.registry import Toolbox, build_tools, register_tool, run_tool_calls


def cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


SHELL = "python:examples/plugins/shell_tasks.py:ShellTaskSet"
DESK_YAML = ROOT / "examples" / "plugins" / "support_desk.yaml"
SHELL_YAML = ROOT / "examples" / "plugins" / "shell_tasks.yaml"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # plugin file paths in the example configs are relative to the repository


def test_an_unknown_key_in_a_fixed_section_names_the_sections_keys_and_the_nearest():
    """A misspelt key and a key that left the config (tools.require_tool_call is a task set's attribute now)
    say which section refused them, its keys and the closest one, not only pydantic's "extra inputs"."""
    with pytest.raises(ConfigError, match=r"agent\.max_turn: not a key of agent \(did you mean 'max_turns'\?\); "
                                          r"its keys: concurrency, .*max_turns"):
        load_config(None, ["agent.max_turn=3"])
    with pytest.raises(ConfigError, match=r"tools\.require_tool_call: not a key of tools; its keys: bash_timeout_s"):
        load_config(None, ["tools.require_tool_call=false"])
    with pytest.raises(ConfigError, match=r"schedular: not a key of the config \(did you mean 'scheduler'\?\)"):
        load_config(None, ["schedular.num_tasks=2"])


def test_plugin_config_class_validates_its_own_fields():
    cfg = load_config(None, [f"tasks.type={SHELL}", "tasks.only=[make-dir]", "tasks.check_timeout_s=3"])
    assert type(cfg.tasks).__name__ == "ShellTasksConfig" and cfg.tasks.check_timeout_s == 3
    assert [t.task_id for t in build_taskset(cfg.tasks).tasks()] == ["shell-make-dir"]
    with pytest.raises(ConfigError, match=r"tasks\.bogus: Extra inputs are not permitted"):
        load_config(None, [f"tasks.type={SHELL}", "tasks.bogus=1"])
    with pytest.raises(ConfigError, match=r"tasks\.check_timeout_s"):
        load_config(None, [f"tasks.type={SHELL}", "tasks.check_timeout_s=-1"])


@pytest.mark.parametrize("overrides, key, section", [
    (["tasks.type=humaneval", "tasks.mirror=/srv/mirror"], "tasks.mirror", "tasks.type=humaneval"),
    (["tasks.type=toy", "tasks.path=x.jsonl"], "tasks.path", "tasks.type=toy"),
    (["tasks.type=harbor", "tasks.count=3"], "tasks.count", "tasks.type=harbor"),
    (["sandbox.type=docker", "sandbox.workdir=/repo"], "sandbox.workdir", "sandbox.type=docker"),
    (["sandbox.type=local", "sandbox.warm_pool=2"], "sandbox.warm_pool", "sandbox.type=local"),
    (["policy.type=scripted", "policy.base_url=http://x/v1"], "policy.base_url", "policy.type=scripted"),
    (["policy.type=local", "policy.launch=true"], "policy.launch", "policy.type=local"),
])
def test_a_key_of_another_built_in_type_fails_naming_the_key_and_the_type(overrides, key, section):
    with pytest.raises(ConfigError, match=rf"{key}: Extra inputs are not permitted: not a field of {section} "):
        load_config(None, overrides)


def test_every_built_in_has_its_own_config_class_and_children_get_it_back():
    from rollway.envs.factory import TASK_SETS
    from rollway.policies.factory import POLICIES
    from rollway.sandboxes.config import DockerSandboxConfig, SandboxConfig
    from rollway.sandboxes.factory import SANDBOXES

    for section, registry in (("tasks", TASK_SETS), ("policy", POLICIES), ("sandbox", SANDBOXES)):
        for name in registry.names():
            extra = {"policy.base_url=http://127.0.0.1:9/v1"} if name == "openai" else set()
            if section == "tasks" and name == "harbor":
                extra = {"sandbox.type=docker"}  # Harbor tasks run in containers only
            cfg = load_config(None, [f"{section}.type={name}", *extra])
            own = getattr(cfg, section)
            assert type(own).implementation == name, (section, name, type(own))
            again = getattr(RunConfig.model_validate(json.loads(json.dumps(resolved_config(cfg)))), section)
            assert type(again) is type(own) and again == own
    cfg = load_config(None, ["tasks.type=swebench", "tasks.mirror=/m", "sandbox.type=docker", "sandbox.warm_pool=2"])
    assert (cfg.tasks.mirror, cfg.sandbox.warm_pool) == ("/m", 2) and not hasattr(cfg.tasks, "count")
    # the section's base class builds the chosen type's class, as a discriminated union does
    assert type(SandboxConfig(type="docker", image="x")) is DockerSandboxConfig
    with pytest.raises(ValueError, match="configures type 'docker', not 'local'"):
        DockerSandboxConfig(type="local")


def test_children_get_the_validated_config_back_equal_with_plugin_fields_and_secrets():
    cfg = load_config(DESK_YAML, ["broker.security_protocol=SASL_PLAINTEXT", "broker.sasl_mechanism=PLAIN",
                                  "broker.sasl_password=s3cret", "tasks.customers=1"])
    cfg.run.id = "r-1"
    data = json.loads(json.dumps(resolved_config(cfg)))
    assert "s3cret" not in json.dumps(data)  # the secret goes by the environment (tests/test_secrets.py)
    data["broker"]["sasl_password"] = config_secrets(cfg)["broker.sasl_password"]
    again = RunConfig.model_validate(data)
    assert again.model_dump() == cfg.model_dump() and again.tasks.customers == 1
    assert again.broker.sasl_password.get_secret_value() == "s3cret"
    assert "fetch_max_wait_ms" not in again.broker.model_fields_set  # defaults stay unset in the child


def test_plugin_module_from_the_working_folder_loads_in_process(tmp_path, monkeypatch):
    (tmp_path / "my_family_x1.py").write_text(
        "from rollway.envs.toy import ToyTaskSet\n\nclass MyTasks(ToyTaskSet):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    cfg = load_config(None, ["tasks.type=python:my_family_x1:MyTasks", "tasks.count=2"])
    assert len(build_taskset(cfg.tasks).tasks()) == 2


class _Named(Tool):
    description, parameters = "", {"type": "object", "properties": {}}

    def __init__(self, cfg: ToolsConfig) -> None:
        pass

    async def call(self, arguments, sandbox, context) -> ToolResult:
        return ToolResult("named")


class Clash(_Named):
    name = "bash"


class LimitedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_rows: int = 3
    """Rows shown."""


class Limited(_Named):
    name = "ext_limited"
    config_class = LimitedOptions

    def __init__(self, cfg: ToolsConfig, options: LimitedOptions) -> None:
        self.options = options


def test_a_plugin_tool_brings_its_own_options():
    ref = "python:tests.test_extension_api:Limited"
    cfg = load_config(None, [f"tools.enabled=['{ref}', finish]", "tools.settings={ext_limited: {max_rows: 5}}"])
    tools = build_tools(cfg.tools.enabled, cfg.tools)
    assert list(tools) == ["ext_limited", "finish"] and tools["ext_limited"].options.max_rows == 5
    with pytest.raises(ConfigError, match=r"tools\.settings\.ext_limited\.max_row: Extra inputs are not permitted"):
        load_config(None, [f"tools.enabled=['{ref}']", "tools.settings={ext_limited: {max_row: 5}}"])
    with pytest.raises(ConfigError, match="tools.settings.bash"):
        load_config(None, ["tools.settings={bash: {x: 1}}"])


class LaxOptions(BaseModel):  # pydantic's default: extra keys ignored
    rows: int = 3
    """Rows shown."""


class Lax(_Named):
    name = "ext_lax"
    config_class = LaxOptions

    def __init__(self, cfg: ToolsConfig, options: LaxOptions) -> None:
        self.options = options


def test_a_misspelt_tool_option_fails_even_where_the_tool_s_class_would_drop_it():
    ref = "python:tests.test_extension_api:Lax"
    with pytest.raises(ConfigError, match=r"tools\.settings\.ext_lax\.row: Extra inputs are not permitted.*rows"):
        load_config(None, [f"tools.enabled=['{ref}']", "tools.settings={ext_lax: {row: 5}}"])
    with pytest.raises(ValueError, match=r"tools\.settings\.ext_lax\.row"):
        build_tools([ref], ToolsConfig(settings={"ext_lax": {"row": 5}}))
    assert build_tools([ref], ToolsConfig(settings={"ext_lax": {"rows": 5}}))["ext_lax"].options.rows == 5


def test_tool_names_collide_with_an_error_never_an_overwrite():
    class Other(_Named):
        name = "ext_test_tool"

    class Another(_Named):
        name = "ext_test_tool"

    register_tool("ext_test_tool", Other)
    register_tool("ext_test_tool", Other)  # the same class again (a module imported twice) is fine
    with pytest.raises(ValueError, match="tool name 'ext_test_tool' is taken"):
        register_tool("ext_test_tool", Another)
    with pytest.raises(ValueError, match="two tools are named 'bash'"):
        build_tools(["bash", "python:tests.test_extension_api:Clash"], ToolsConfig())


def test_enabled_plugin_tool_is_built_after_the_task_set_module_is_imported():
    """The old crash: `tools.enabled` naming a tool the task set's module registers ("unknown tool(s)
    'answer'"). A fresh interpreter, so nothing is imported beforehand."""
    code = ("import asyncio\nfrom rollway.actors.services import Services\nfrom rollway.actors.agent import AgentActor\n"
            "from rollway.config.run import load_config\nfrom pathlib import Path\n"
            "s = Services(load_config(None, ['tasks.type=calc', 'tools.enabled=[calculator,answer,finish]', "
            "'policy.script=[{when: \"\", turns: [hi]}]']), Path('.'))\n"
            "asyncio.run(AgentActor(s).setup())\nprint(sorted(s.toolbox.build(s.taskset.default_tools)))\n")
    out = run_with_progress([sys.executable, "-c", code], cwd=ROOT, env=cli_env())
    assert out.returncode == 0, out.stderr
    assert "['answer', 'calculator', 'finish']" in out.stdout


def test_in_process_engine_with_a_training_learner_is_refused():
    with pytest.raises(ConfigError, match="policy.type=local with a training learner"):
        load_config(None, ["policy.type=local", "learner.type=ppo"])


LEARNING = "python:tests/plugins/learning_plugins.py"


def test_a_plugin_loss_and_advantage_take_their_own_options():
    import torch

    from rollway.learning.advantages import build_advantage_estimator
    from rollway.learning.losses import PPOClipLoss, TokenStats, build_loss

    cfg = load_config(None, ["learner.type=ppo", f"learner.loss.type={LEARNING}:ScaledPPOLoss", "learner.loss.scale=2.5",
                             f"learner.advantage.type={LEARNING}:OffsetAdvantage", "learner.advantage.offset=0.5"])
    assert type(cfg.learner.loss).__name__ == "ScaledLossConfig" and cfg.learner.loss.scale == 2.5
    again = RunConfig.model_validate(json.loads(json.dumps(resolved_config(cfg))))
    assert again.learner.loss == cfg.learner.loss and again.learner.advantage.offset == 0.5
    logp, old = torch.tensor([[-0.5, -1.0]]), torch.tensor([[-0.7, -0.9]])
    ones = torch.ones_like(old, dtype=torch.bool)
    args = (logp, old, torch.tensor([1.0]), old, ones, ones, TokenStats())
    plain = PPOClipLoss(load_config(None, ["learner.type=ppo"]).learner).token_loss(*args)
    assert torch.allclose(build_loss(cfg.learner).token_loss(*args), 2.5 * plain)
    advantages = build_advantage_estimator(cfg.learner).compute(torch.tensor([1.0, 0.0]), torch.tensor([True, True]))
    assert advantages.tolist() == [1.0, 0.0]  # +-0.5 around the mean, plus the 0.5 offset
    # the plain string form still works; an option the chosen class lacks fails naming it
    assert load_config(None, ["learner.loss=cispo"]).learner.loss.type == "cispo"
    with pytest.raises(ConfigError, match=r"learner\.loss\.bogus: Extra inputs are not permitted: not a field of "
                                          r"learner\.loss\.type=python:.*ScaledPPOLoss \(its fields: scale, type\)"):
        load_config(None, [f"learner.loss.type={LEARNING}:ScaledPPOLoss", "learner.loss.bogus=1"])
    with pytest.raises(ConfigError, match=r"learner\.loss\.scale: Extra inputs are not permitted: not a field of "
                                          r"learner\.loss\.type=gspo"):
        load_config(None, ["learner.loss.type=gspo", "learner.loss.scale=2"])
    with pytest.raises(ConfigError, match=r"learner\.loss\.scale: Input should be greater than 0"):
        load_config(None, [f"learner.loss.type={LEARNING}:ScaledPPOLoss", "learner.loss.scale=0"])


def test_a_plugin_learner_type_with_its_own_config_trains_in_the_learner_actor(tmp_path):
    from test_actors import services

    from rollway.learning.testing import make_trajectory, tiny_model_factory

    plugin = f"learner.type={LEARNING}:TaggedTrainer"
    with pytest.raises(ConfigError, match=r"learner\.bogus: Extra inputs are not permitted: not a field of "
                                          r"learner\.type=python:.*TaggedTrainer"):
        load_config(None, [plugin, "learner.bogus=1"])
    with pytest.raises(ConfigError, match=r"learner\.tag: String should match pattern"):
        load_config(None, [plugin, "learner.tag=Blue1"])
    s = services(tmp_path, plugin, "learner.tag=blue", "scheduler.group_size=2", "run.id=rL")
    assert s.cfg.learner.trains and type(s.cfg.learner).__name__ == "TaggedLearnerConfig"

    async def scenario():
        actor = LearnerActor(s, trainer_factory=tiny_model_factory())
        await actor.setup()
        assert type(actor.trainer).__name__ == "TaggedTrainer"
        for i, reward in enumerate((1.0, 0.0)):
            out = await actor.handle(make_trajectory(f"rL-g0-s{i}", "rL-g0", prompt=[1, 2, 3], completion=[10 + i, 11],
                                                     reward=reward, sample_index=i), MessageMeta("trajectories", 0, i))
        await actor.close()
        return out

    [published] = asyncio.run(scenario())
    assert published.value.version == 1
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["tag_blue"] == 1.0


def test_verify_and_eval_replace_a_section_of_another_type_whole():
    """`rollway tasks verify` swaps in the gold/do-nothing policies and `rollway eval` a record-only learner:
    the config's own policy or learner may be of a type whose keys the new one lacks."""
    from rollway.audit.verify import with_policy
    from rollway.runners.cmd_eval import eval_overrides

    served = ["policy.type=openai", "policy.base_url=http://127.0.0.1:9/v1", "policy.request_timeout_s=5",
              "policy.chat_format=bytes-chatml"]
    gold = with_policy(None, served, type="gold")
    assert gold.policy.type == "gold" and "chat_format" in gold.policy.model_fields_set
    plugin = [f"learner.type={LEARNING}:TaggedTrainer", "learner.tag=blue", "learner.lr=0.5"]
    cfg = load_config(None, plugin)
    evaluated = load_config(None, [*plugin, *eval_overrides(cfg)]).learner
    assert (type(evaluated).__name__, evaluated.type, evaluated.lr) == ("LearnerConfig", "record", 0.5)


def test_per_task_tools_and_state_store_survive_a_worker_change(tmp_path):
    """The desk's simulator state lives in the episode's state store: every turn below runs on a fresh
    agent worker that rebuilds the episode from the log, and the refund still counts at grading."""
    cfg = load_config(DESK_YAML, ["tasks.customers=1"])
    s = Services(cfg, tmp_path)

    async def scenario():
        init = InitActor(s)
        await init.setup()
        [out] = await init.handle(InitRequest(episode=EpisodeKey(episode_id="r-g0-s0", group_id="r-g0", task_id="desk-ada"),
                                              issued_at=time.time(), deadline=time.time() + 60),
                                  MessageMeta("init-requests", 0, 0))
        assert {t["function"]["name"] for t in out.value.tools} == {"desk_lookup_order", "desk_refund_order"}
        log = [(0, out.value)]

        async def read_log(topic, partition, start, episode_id):
            return [(o, m) for o, m in log if o >= start and m.episode_id == episode_id]

        offset = 0
        while out.topic.name == "agent-steps":
            [out] = await AgentActor(s, read_log).handle(out.value, MessageMeta("agent-steps", 0, offset))
            offset += 1
            log.append((offset, out.value))
        return out.value

    req = run(scenario())
    assert req.stop_reason == "user_done"
    assert req.turns[0].user_message == "It's order A-17."
    assert req.turns[0].observations == []  # the desk declares that talking needs no tool call
    assert req.turns[-1].state["refunded"] == ["A-17"]
    from rollway.actors.reward import RewardActor

    reward = RewardActor(s)
    [traj] = run(reward.handle(req, MessageMeta("reward-requests", 0, 0)))
    assert traj.value.resolved and traj.value.grade["refunded"] == ["A-17"]
    assert traj.value.grade["user_messages"] == 3  # the opening request, the order id, the goodbye
    assert "It's order A-17." in s.chat.decode(traj.value.token_ids)  # the injected turn is in the token stream


def test_a_tool_tested_outside_a_run_as_the_docs_show_gets_its_task():
    """docs/extending.md (examples/extending/custom_tool.py): outside a run, `run_tool_calls` with
    `outside_episode(task)` as the context. The desk's lookup reads its orders from `context.task`;
    without the context it has no task and fails."""
    from rollway.tools.base import outside_episode

    taskset = build_taskset(load_config(DESK_YAML).tasks)
    task, cfg = taskset.get("desk-ada"), ToolsConfig()
    tools = taskset.environment(task, None, Toolbox(cfg)).tools
    call = '<tool_call>{"name": "desk_lookup_order", "arguments": {"order_id": "A-17"}}</tool_call>'
    [found] = run(run_tool_calls(call, tools, None, cfg, outside_episode(task))).observations
    assert json.loads(found.content)["item"] == "kettle"
    [no_task] = run(run_tool_calls(call, tools, None, cfg)).observations
    assert no_task.internal_error


def test_grade_receives_the_episode_and_a_prompt_too_long_ends_visibly(tmp_path):
    cfg = load_config(SHELL_YAML, ["tasks.only=[make-dir]"])
    traj = run(play_episode(cfg, tmp_path, "shell-make-dir"))
    assert traj.resolved and traj.grade["episode_id"].startswith("verify-") and traj.grade["turns"] == 2
    short = load_config(SHELL_YAML, ["tasks.only=[make-dir]", "agent.max_total_tokens=16"])
    traj = run(play_episode(short, tmp_path, "shell-make-dir"))
    assert traj.stop_reason == "prompt_too_long" and traj.num_turns == 1 and not any(traj.loss_mask)


def test_sandbox_layout_home_persists_workdir_and_env_are_configured(tmp_path):
    from rollway.sandboxes.base import SandboxSpec
    from rollway.sandboxes.factory import build_sandbox_provider

    async def two_commands(*overrides: str) -> tuple[str, int]:
        provider = build_sandbox_provider(load_config(None, [f"sandbox.root={tmp_path}", *overrides]).sandbox)
        box = await provider.create(SandboxSpec(files={"a.txt": "x"}), "layout")
        try:
            first = await box.exec("echo hi > ~/.rc; pwd; echo $HOME $GREETING")
            second = await box.exec("cat ~/.rc")
            assert await box.diff() == ""  # HOME is not part of the workspace
            return first.output, second.exit_code
        finally:
            await box.destroy()

    assert run(two_commands("sandbox.env={GREETING: hello}")) == ("/workspace\n/home/sandbox hello\n", 0)
    assert run(two_commands("sandbox.workdir=/repo"))[0].startswith("/repo\n")
    assert run(two_commands("sandbox.home=tmp"))[1] != 0  # the old layout: a fresh /tmp per command
    with pytest.raises(ConfigError, match="sandbox.workdir"):
        load_config(None, ["sandbox.workdir=/usr/x"])


@pytest.mark.parametrize("config", [SHELL_YAML, DESK_YAML], ids=["shell", "desk"])
def test_tasks_verify_checks_any_task_set(config):
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "tasks", "verify", str(config), "--json"],
                         cwd=ROOT, env=cli_env())
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["total"] >= 2 and summary["gold_resolved"] == summary["total"] and summary["nothing_resolved"] == 0


def test_verify_says_why_a_cut_reference_solution_failed_and_keeps_its_trajectories(tmp_path):
    """A turn limit below the reference solution's length: verify names the limit to raise (it said only
    "gold NOT resolved"), and both policies' episodes are kept for `rollway show`."""
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "tasks", "verify", str(SHELL_YAML),
                          "agent.max_tokens_per_turn=8", "--json", "--run-dir", str(tmp_path)],
                         cwd=ROOT, env=cli_env())
    assert out.returncode == 1, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["gold_resolved"] == 0
    assert all("agent.max_tokens_per_turn=8" in row["gold_why"] for row in summary["tasks"])
    for policy in ("gold", "nothing"):
        rows = [json.loads(line) for line in (tmp_path / policy / "trajectories.jsonl").read_text().splitlines()]
        assert sorted(r["episode"]["task_id"] for r in rows) == sorted(r["task_id"] for r in summary["tasks"])
    shown = run_with_progress([sys.executable, "-m", "rollway.runners", "show", str(tmp_path / "gold")],
                           cwd=ROOT, env=cli_env())
    assert shown.returncode == 0 and summary["tasks"][0]["task_id"] in shown.stdout, shown.stderr[-2000:]


def _up(config: Path, run_dir: Path, *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollway.runners", "up", "--no-report", str(config), "--run-dir", str(run_dir),
                           "run.timeout_s=240", *overrides], capture_output=True, text=True, cwd=ROOT,
                          env=cli_env(), timeout=timeout)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("config", [SHELL_YAML, DESK_YAML], ids=["shell", "desk"])
def test_example_plugins_run_end_to_end_with_gold_and_do_nothing_policies(config, tmp_path):
    gold = _up(config, tmp_path / "gold")
    assert gold.returncode == 0, gold.stderr[-3000:]
    summary = json.loads((tmp_path / "gold" / "summary.json").read_text())
    assert summary["episodes_failed"] == 0 and summary["pass_rate"] == 1.0
    assert summary["trajectories_written"] == summary["episodes_planned"] >= 4
    nothing = _up(config, tmp_path / "nothing", "policy.type=scripted", f"policy.script={DO_NOTHING_SCRIPT}")
    assert nothing.returncode == 0, nothing.stderr[-3000:]
    summary = json.loads((tmp_path / "nothing" / "summary.json").read_text())
    assert summary["episodes_failed"] == 0 and summary["pass_rate"] == 0.0
    assert set(summary["stop_reasons"]) == {"max_turns"}
    assert oct((tmp_path / "gold" / "stage-config.json").stat().st_mode & 0o777) == "0o600"


@pytest.mark.e2e
@pytest.mark.slow
def test_a_stage_that_can_never_start_fails_the_run_at_once(tmp_path):
    """Every agent and init worker dies at setup (an unknown tool): the run stops with that error after
    the workers' restarts, not at run.timeout_s."""
    started = time.monotonic()
    out = _up(ROOT / "examples" / "smoke.yaml", tmp_path / "run", "tools.enabled=[bash,no_such_tool]")
    assert out.returncode != 0
    assert "cannot run" in out.stderr and "unknown tool 'no_such_tool'" in out.stderr, out.stderr[-3000:]
    assert time.monotonic() - started < 200


def test_extending_page_lists_the_file_to_touch_per_extension():
    """docs/extending.md lists the files to touch per extension; each exists."""
    text = (ROOT / "docs" / "extending.md").read_text()
    for path in ("examples/plugins/shell_tasks.py", "examples/plugins/support_desk.py", "learning/losses.py",
                 "policies/factory.py", "tools/registry.py", "envs/factory.py", "envs/config.py",
                 "learning/registries.py", "sandboxes/config.py", "policies/config.py"):
        assert path in text and (ROOT / path).exists(), path
    assert os.path.exists(ROOT / "examples" / "plugins" / "shell_tasks.yaml")


def test_task_selection_applies_to_plugin_task_sets():
    """`tasks.split`, `test_fraction` and `limit` are fields every task set has: the framework applies
    them (the shell plugin gave 4/4 tasks for every split)."""


    def ids(*overrides: str) -> list[str]:
        return [t.task_id for t in build_taskset(load_config(SHELL_YAML, list(overrides)).tasks).tasks()]

    everything = ids()
    train, test = ids("tasks.split=train", "tasks.test_fraction=0.5"), ids("tasks.split=test", "tasks.test_fraction=0.5")
    assert len(everything) >= 4 and sorted(train + test) == sorted(everything) and not set(train) & set(test)
    assert ids("tasks.limit=2") == everything[:2]
    taskset = build_taskset(load_config(SHELL_YAML, ["tasks.limit=1"]).tasks)
    with pytest.raises(KeyError, match="is not in this"):
        taskset.get(everything[1])


def test_a_task_set_gives_tools_built_from_its_data_without_registering_them(tmp_path):
    """A simulator's function docs become tools at run time (the BFCL case: 130 tools made with type()
    before): the task set's environment gets instances, namespaced by its family; nothing global."""
    from rollway.envs.base import Environment
    from rollway.envs.toy import ToyTaskSet
    from rollway.tools.base import Tool, ToolResult
    from rollway.tools.registry import TOOLS

    class LookupTool(Tool):
        def __init__(self, name: str, table: dict[str, str]) -> None:
            self.name, self.table = name, table
            self.description = f"look a key up in {name}"
            self.parameters = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}

        async def call(self, arguments, sandbox, context):
            return ToolResult(content=self.table.get(arguments["key"], "unknown key"))

    class DataToolsTaskSet(ToyTaskSet):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.data_tools = [LookupTool(f"sim.{n}", {"a": f"{n}-A"}) for n in ("rates", "stock")]

        def environment(self, task, sandbox, toolbox):
            return Environment(self, task, toolbox.build([*self.data_tools, "finish"]), sandbox, toolbox.cfg)

    s = Services(load_config(ROOT / "examples" / "smoke.yaml"), tmp_path)
    s.__dict__["taskset"] = DataToolsTaskSet(s.cfg.tasks)
    task = s.taskset.tasks()[0]
    env = s.environment(task)
    assert list(env.tools) == ["sim.rates", "sim.stock", "finish"] and "sim.rates" not in TOOLS
    assert s.environment(task).tools is env.tools  # built once per worker
    call = '<tool_call>{"name": "sim.stock", "arguments": {"key": "a"}}</tool_call>'
    step = run(env.step(call, Episode("e", 0, task, [], [])))
    assert [(o.tool, o.content, o.is_error) for o in step.observations] == [("sim.stock", "stock-A", False)]


def test_a_plugin_written_against_the_old_hooks_still_plays_and_is_warned(tmp_path):
    """A task set of the release before `Environment` (tools_for, initial_messages, next_user_message,
    observation_hints on the TaskSet) still plays a whole episode through the agent's turn: its tools, its
    opening, its simulated user and its hints all reach the trajectory, and a DeprecationWarning names the
    hooks and the way forward."""
    from rollway.envs.toy import ToyTaskSet

    class OldStyle(ToyTaskSet):
        def tools_for(self, task):
            return ["bash", "finish"]

        def initial_messages(self, task, system_prompt=None):
            return [{"role": "system", "content": "old opening"}, {"role": "user", "content": task.prompt}]

        async def next_user_message(self, task, episode):
            return f"user after turn {episode.turns[-1].turn}"

        def observation_hints(self, task, observations):
            return [f"hint after {len(observations)} observation(s)"]

    cfg = load_config(ROOT / "examples" / "smoke.yaml")
    s = Services(cfg, tmp_path)
    s.__dict__["taskset"] = OldStyle(cfg.tasks)
    with pytest.warns(DeprecationWarning, match="tools_for, next_user_message, observation_hints, initial_messages"):
        traj = run(play_episode(cfg, tmp_path, s.taskset.tasks()[0].task_id, services=s))
    assert traj.messages[0]["content"] == "old opening" and traj.reward == 1.0
    assert [t.user_message for t in traj.turns[:-1]] == [f"user after turn {t.turn}" for t in traj.turns[:-1]]
    assert all(t.hints[-1].startswith("hint after") for t in traj.turns[:-1]) and traj.num_turns > 1


def test_a_task_set_reads_the_runs_sandbox_settings_and_a_workdir_may_be_a_users_home(tmp_path):
    """Settings a task set depends on (the sandbox's HOME, its type, its workdir) come from the run's
    sandbox section, not a copy in the task set's own section; /home/<user> is a valid workdir (a task
    expecting its repository there), /home/sandbox (the jail's HOME) is not."""
    from rollway.sandboxes.base import SandboxSpec

    cfg = load_config(ROOT / "examples" / "smoke.yaml", ["sandbox.workdir=/home/agent/repo", "sandbox.home=tmp"])
    s = Services(cfg, tmp_path)
    assert (s.taskset.sandbox_config.workdir, s.taskset.sandbox_config.home) == ("/home/agent/repo", "tmp")

    async def pwd():
        sandbox = await s.sandboxes.create(SandboxSpec(), "home-workdir")
        try:
            return (await sandbox.exec("pwd; echo $HOME")).output.split()
        finally:
            await sandbox.destroy()

    assert run(pwd()) == ["/home/agent/repo", "/tmp"]
    with pytest.raises(ConfigError, match="jail's HOME"):
        load_config(ROOT / "examples" / "smoke.yaml", ["sandbox.workdir=/home/sandbox"])


def test_the_reference_policy_can_be_an_agent_that_reads_observations(tmp_path):
    """`tasks verify`'s gold may react to what a command printed (it played fixed text only): the toy
    task set's reference agent cats the file and writes the sum it read. Planting other numbers in the
    file shows the answer comes from the observation, not from the task's metadata."""
    from rollway.audit.verify import with_policy
    from rollway.envs.toy import ToyTaskSet
    from rollway.sandboxes.base import SandboxSpec

    cfg = with_policy(str(ROOT / "examples" / "smoke.yaml"), ["tasks.count=1"], type="gold")
    s = Services(cfg, tmp_path)
    traj = run(play_episode(cfg, tmp_path, "toy-000", s))
    assert traj.resolved and [o.tool for t in traj.turns for o in t.observations] == ["bash", "bash", "finish"]

    class PlantedNumbers(ToyTaskSet):
        def sandbox_spec(self, task):
            return SandboxSpec(files={"numbers.txt": "40 2\n"})

    s2 = Services(cfg, tmp_path / "planted")
    s2.__dict__["taskset"] = PlantedNumbers(cfg.tasks)
    traj = run(play_episode(cfg, tmp_path / "planted", "toy-000", s2))
    assert not traj.resolved and traj.grade["answer"] == "42"
