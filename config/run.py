"""Run configuration: one pydantic model per component, YAML files plus dotted overrides."""

from __future__ import annotations

import difflib
import importlib.metadata
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from rollway.base.broker import BrokerConfig, TopicsConfig, unsupported_settings
from rollway.base.config import ConfigError, StrictModel
from rollway.base.redaction import URL_USERINFO, mask_url_credentials
from rollway.base.registry import validate_section
from rollway.envs.config import TasksConfig, ToyTasksConfig
from rollway.envs.factory import TASK_SETS
from rollway.gateway.config import HarnessConfig
from rollway.learning.config import LearnerConfig
from rollway.learning.registries import LEARNERS
from rollway.learning.tracking import TrackingConfig
from rollway.policies.config import PolicyConfig, ScriptedPolicyConfig
from rollway.policies.factory import POLICIES
from rollway.sandboxes.config import DockerSandboxConfig, LocalSandboxConfig, SandboxConfig
from rollway.sandboxes.factory import SANDBOXES
from rollway.tools.config import HintsConfig, ToolsConfig
from rollway.topics.topology import STAGE_NAMES


class StageConfig(StrictModel):
    concurrency: int = Field(4, ge=1)
    """Messages this worker handles at once (in-flight episodes per worker)."""
    prefetch: int = Field(0, ge=0)
    """Messages a worker fetches beyond `concurrency` and holds in a local queue, started by the
    actor's priority when a slot frees (the agent runs later turns first, so episodes closest to
    finishing go ahead of new ones). 0: strict fetch order."""


class SchedulerConfig(StrictModel):
    group_size: int = Field(4, ge=1)
    """Episodes per task (the GRPO group size n)."""
    num_tasks: int | None = Field(None, ge=1)
    """Tasks taken from the task set per epoch; None takes all."""
    epochs: int = Field(1, ge=1)
    """Passes over the task set."""
    max_inflight_episodes: int = Field(16, ge=1)
    """Episodes scheduled but not yet finished; new groups wait while this many are out."""
    episode_deadline_s: float = Field(300.0, gt=0)
    """An episode not finished this long after it was issued is re-issued (same id, next attempt): for
    lost work (a worker gone), so the agent's own time ends before it (`grading_reserve_s`). Once an
    attempt's reward request is on the log, its deadline is its grading's instead: the task set's grading
    limits (`TaskSet.grading_time_limit_s`) plus `grading_reserve_s` after that, and its share of the
    gradings waiting ahead of it (their time over `reward.concurrency`), never earlier than this."""
    grading_reserve_s: float | None = Field(None, ge=0)
    """Time kept for starting the sandbox and grading within an episode's deadline: the agent's phase
    (built-in turns or a harness program) ends `episode_deadline_s` less this after its sandbox is ready,
    with stop reason `agent_timeout`, graded as it stands. An agent that could outlast the deadline (slow
    tool calls, long generations) would otherwise be re-issued and finally recorded failed: no 0 for it.
    The grading then has this plus its own limits (`episode_deadline_s`). None: a fifth of
    `episode_deadline_s`."""
    max_attempts: int = Field(3, ge=1)
    """Attempts per episode before it is recorded failed."""
    max_policy_lag: int | None = Field(None, ge=0)
    """Bounded staleness, both ways. New groups wait while the learner is more than this many
    versions ahead of the oldest in-flight episode's policy version; and, when the learner trains,
    while the episodes issued would exceed (learner version + 1 + max_policy_lag) x episodes per
    update, so rollouts never run more than this many updates ahead of the learner. None: no bound."""
    shuffle: bool = True
    """Shuffle tasks per epoch (seeded by run.seed)."""
    order: Literal["given", "johnson", "ends"] = "given"
    """Issue order within an epoch. `given`: the task set's order (shuffled if `shuffle`). `johnson`:
    Johnson's rule on the tasks' expected sandbox-start and grading times (the task metadata keys
    `expected_init_s` and `expected_grade_s`): first the tasks that start faster than they grade,
    shortest start first (agent slots fill sooner), then the rest by start + grading descending (the
    run ends with its cheapest tasks, so its tail is short). `ends`: order only the ends by those estimates: the first burst of issues
    (min(max_inflight_episodes, agent_slots + init_lookahead) episodes) fastest start first, the last
    max_inflight_episodes cheapest in start + grading, and the given order between (sorting the middle
    lines up slow-starting sandboxes, which a bounded init_lookahead cannot hide). Tasks without an
    estimate are ranked as the median task."""
    init_lookahead: int | None = Field(None, ge=0)
    """Bound on sandboxes started ahead of agent capacity: new episodes wait while the episodes issued
    but not yet handed to the reward stage (initialising, waiting for or in the agent) number
    `agent_slots + init_lookahead` (the scheduler sees episodes leave the agent on reward-requests).
    None: no such bound (only max_inflight_episodes)."""
    final_wave: bool = False
    """Drain fast. Once every episode not yet issued fits within max_inflight_episodes (the final
    wave), issue them all without waiting for init_lookahead, so the last sandboxes are ready when
    agent slots free up, and mark them `final_wave`; an agent worker that sees the mark runs every
    episode's earliest turns first from then on (the episodes with the fewest turns done have the
    most left). A shorter tail for more sandbox-seconds; live sandboxes stay within
    max_inflight_episodes."""
    agent_slots: int | None = Field(None, ge=1)
    """Turns the agent stage runs at once across its workers (workers x (agent.concurrency +
    agent.tool_overlap)), for init_lookahead. None: one agent worker's."""

    @property
    def reserve_s(self) -> float:
        """`grading_reserve_s`, or its default, a fifth of the deadline."""
        return self.episode_deadline_s / 5 if self.grading_reserve_s is None else self.grading_reserve_s

    @property
    def agent_time_s(self) -> float:
        """The longest an episode's agent phase runs from its sandbox being ready: the deadline less the
        grading reserve."""
        return self.episode_deadline_s - self.reserve_s

    @model_validator(mode="after")
    def _reserve_within_deadline(self) -> SchedulerConfig:
        if self.agent_time_s <= 0:
            raise ValueError(f"scheduler.grading_reserve_s={self.grading_reserve_s:g} must be under "
                             f"scheduler.episode_deadline_s={self.episode_deadline_s:g}: the agent would have no time")
        return self


class AgentConfig(StageConfig):
    concurrency: int = Field(4, ge=1)
    """Model calls this worker has at the inference server at once (its share of the server's
    sequences); with tool_overlap 0 also the turns it handles at once."""
    tool_overlap: int = Field(0, ge=0)
    """Turns handled beyond `concurrency`. A turn then holds one of the `concurrency` model-call slots
    only while the model generates, not while its tool calls run in the sandbox, so another turn's
    generation fills the slot meanwhile (waiting turns take freed slots in `priority` order). The
    server never sees more than `concurrency` sequences from this worker. 0: a turn holds its slot
    through generation and tools."""
    max_turns: int = Field(8, ge=1)
    """Turns (model calls) per episode before it stops with stop_reason `max_turns`."""
    max_tokens_per_turn: int = Field(256, ge=1)
    """Completion tokens per model call."""
    max_total_tokens: int = Field(8192, ge=16)
    """Episode context bound (prompt + completions + observations); beyond it the episode stops."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling."""
    system_prompt: str | None = None
    """Overrides the task set's system prompt."""
    harness: HarnessConfig | None = None
    """An external agent program plays each episode instead of the built-in loop (docs/harness.md);
    None: the built-in loop."""


class RewardConfig(StageConfig):
    concurrency: int = Field(2, ge=1)


class SinkConfig(StrictModel):
    format: Literal["jsonl", "parquet"] = "jsonl"
    """File format of the trajectories the sink writes into the run folder."""


class EvalConfig(StrictModel):
    attempts: int = Field(4, ge=1)
    """Samples per task (`rollway eval` runs them as one group per task)."""
    ks: list[int] = Field(default_factory=lambda: [1])
    """pass@k values reported besides pass@attempts."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature during evaluation."""


class RunSection(StrictModel):
    name: str = "rollway"
    """Run name, used in the run folder and logs."""
    id: str | None = None
    """Run identity, the prefix of every episode id; `rollway up` sets a fresh one. The sink and the
    learner keep only episodes of this run (None: keep every episode they read)."""
    seed: int = 0
    """Seed for task sampling and anything else random in the pipeline."""
    dir: str | None = None
    """Run folder; `rollway up --run-dir` overrides it. Default runs/<name>-<time>."""
    timeout_s: float = Field(3600.0, gt=0)
    """`rollway up` gives up (non-zero exit) after this long."""
    trace: bool = False
    """Stage workers also record when each message was polled and fetched (the broker-transit figure of
    `rollway bench pipeline`) in their telemetry lines (telemetry/STAGE-HOST.PID.jsonl in the run folder),
    which are written either way."""


class MetricsConfig(StrictModel):
    """Prometheus metrics of the stage processes (runtime/metrics.py, docs/observability.md)."""

    enabled: bool = True
    """Every stage process serves its metrics in the Prometheus text format at a path of its own
    (`/metrics/ID`) and announces address and path in the run folder (prometheus/targets/HOST.PID.json), which
    the run's prometheus/prometheus.yml scrapes."""
    host: str = "127.0.0.1"
    """Address the endpoint listens on; `0.0.0.0` to let another machine's Prometheus scrape it (it is
    then announced under this machine's host name)."""
    port: int = Field(9450, ge=0, le=65535)
    """First port tried; a port in use moves on to the next free one (the one taken is announced); 0: any
    free port."""
    final_scrape_timeout_s: float = Field(0.0, ge=0, le=10)
    """A stopping stage waits up to this long for a scrape to read its final figures (its last handled
    counts, a lag of 0); 0: it stops at once. Worth a scrape interval for short runs."""
    scrape_interval_s: float = Field(15.0, gt=0)
    """The scrape and rule evaluation interval of the prometheus.yml `rollway up` writes."""


Engine = Literal["aiokafka", "faust"]
StageName = Literal[STAGE_NAMES]  # type: ignore[valid-type]  # the stages topics/topology.py declares


def faust_installed() -> bool:
    """faust-streaming (the optional `rollway[faust]` extra) is installed. Its metadata, not an import
    look-up: an imported faust has no module spec."""
    try:
        importlib.metadata.version("faust-streaming")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class RuntimeConfig(StrictModel):
    engine: Engine = "aiokafka"
    """Stream engine of every stage worker: `aiokafka` (the built-in StageWorker) or `faust` (a
    faust-streaming agent with a changelog-backed dedup table; runtime/faust.py; an optional extra:
    `pip install 'rollway[faust]'`)."""
    engines: dict[StageName, Engine] = Field(default_factory=dict)
    """Per-stage overrides of `engine`, e.g. {sink: faust, learner: faust}
    (command line: runtime.engines.sink=faust)."""

    processes: Literal["auto", "one", "per-stage"] = "auto"
    """How `rollway up` and `rollway eval` run the stages on one machine: `per-stage`, an OS process per
    stage worker (a crash or a kill takes one worker; what `rollway chaos` needs); `one`, every stage
    as a task in the command's own process, each the sole worker of its stage, taking its partitions
    without a consumer-group join (seconds less per run; a stage that crashes is restarted in place);
    `auto`, `one` when the command started its own broker (with `--bootstrap` another machine's `rollway
    stage` could join a stage's group) and every stage has one worker on the aiokafka engine and no fault
    points are armed, else `per-stage`. `rollway stage` processes always join their group."""

    def engine_for(self, stage: StageName) -> Engine:
        """The engine that runs `stage`: its override, else `engine`."""
        return self.engines.get(stage, self.engine)

    @model_validator(mode="after")
    def _one_process_engines(self) -> RuntimeConfig:
        if "faust" in {self.engine, *self.engines.values()} and not faust_installed():
            raise ValueError("the faust engine needs faust-streaming, an optional extra: pip install 'rollway[faust]' "
                             "(or use runtime.engine=aiokafka, the default)")
        if self.processes == "one" and "faust" in {self.engine, *self.engines.values()}:
            raise ValueError("runtime.processes=one runs the built-in aiokafka engine only; the faust engine "
                             "needs runtime.processes=per-stage (or auto)")
        return self


class RunConfig(StrictModel):
    """Everything one job needs; every stage process reads the same file."""

    run: RunSection = Field(default_factory=RunSection)
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    tasks: SerializeAsAny[TasksConfig] = Field(default_factory=ToyTasksConfig)
    """Validated by the task set's own config class (envs/config.py for built-ins, `config_class` for plugins:
    a TasksConfig subclass); a key of another type fails naming it."""
    policy: SerializeAsAny[PolicyConfig] = Field(default_factory=ScriptedPolicyConfig)
    """Validated by the policy's own config class (policies/config.py, or a plugin's `config_class`)."""
    sandbox: SerializeAsAny[SandboxConfig] = Field(default_factory=LocalSandboxConfig)
    """Validated by the sandbox provider's own config class (sandboxes/config.py, or a plugin's `config_class`)."""
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    hints: HintsConfig = Field(default_factory=HintsConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    init: StageConfig = Field(default_factory=StageConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    learner: SerializeAsAny[LearnerConfig] = Field(default_factory=LearnerConfig)
    """Validated by a plugin learner's own config class (`config_class`, a LearnerConfig subclass) when it has one."""
    sink: SinkConfig = Field(default_factory=SinkConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @field_validator("tasks", mode="before")
    @classmethod
    def _tasks_by_type(cls, data: Any) -> Any:
        return validate_section(data, TasksConfig, TASK_SETS)

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_by_type(cls, data: Any) -> Any:
        return validate_section(data, PolicyConfig, POLICIES)

    @field_validator("sandbox", mode="before")
    @classmethod
    def _sandbox_by_type(cls, data: Any) -> Any:
        return validate_section(data, SandboxConfig, SANDBOXES)

    @field_validator("learner", mode="before")
    @classmethod
    def _learner_by_type(cls, data: Any) -> Any:
        return validate_section(data, LearnerConfig, LEARNERS)

    @model_validator(mode="after")
    def _tools_settings_valid(self) -> RunConfig:
        """Each `tools.settings.NAME` is checked by that tool's own config class now, not at its first call."""
        from rollway.tools.registry import check_tool_settings

        check_tool_settings(self.tools)
        return self

    @model_validator(mode="after")
    def _harness_install_reachable(self) -> RunConfig:
        """A harness installed in a host folder is bound read-only into every local jail or docker
        container; docker containers get a host folder for the gateway's socket."""
        harness = self.agent.harness
        if harness is not None and harness.time_limit_s >= self.scheduler.episode_deadline_s:
            raise ValueError(f"agent.harness.time_limit_s={harness.time_limit_s:g} must be under "
                             f"scheduler.episode_deadline_s={self.scheduler.episode_deadline_s:g} (with time left to "
                             "grade), or the scheduler re-issues episodes whose program is still running")
        if harness is not None and isinstance(self.sandbox, DockerSandboxConfig) and not self.sandbox.gateway_root:
            self.sandbox.gateway_root = "/tmp/rollway-gateway"
        if harness is None or harness.install.type != "host_dir":
            return self
        if not isinstance(self.sandbox, LocalSandboxConfig | DockerSandboxConfig):
            raise ValueError(f"agent.harness.install.type=host_dir needs sandbox.type=local or docker (got "
                             f"{self.sandbox.type}); bake the program into the sandbox and use install.type=image")
        if harness.install.path not in self.sandbox.ro_binds:
            self.sandbox.ro_binds = [*self.sandbox.ro_binds, harness.install.path]
        return self

    @model_validator(mode="after")
    def _sandbox_the_tasks_run_in(self) -> RunConfig:
        """A task set that runs only in some sandbox types (`TasksConfig.sandbox_types`) is refused once here, not
        at every episode's init."""
        allowed = type(self.tasks).sandbox_types
        if allowed is not None and self.sandbox.type not in allowed:
            raise ValueError(f"tasks.type={self.tasks.type} runs in sandbox.type={' or '.join(allowed)}, not "
                             f"sandbox.type={self.sandbox.type}: set sandbox.type={allowed[0]}")
        return self

    @model_validator(mode="after")
    def _engine_gets_new_weights(self) -> RunConfig:
        """A training learner needs an engine it can send weights to; an in-process engine is one per
        worker process, out of the learner's reach."""
        if self.learner.trains and self.policy.type == "local":
            raise ValueError("policy.type=local with a training learner (learner.type=" + self.learner.type + "): "
                             "each agent worker would sample from its own in-process engine, which never receives "
                             "the learner's weights. Use policy.type=openai with policy.launch=true (the launched "
                             "engine loads every checkpoint), or learner.type=record to only evaluate")
        return self

    @model_validator(mode="after")
    def _engines_can_honour_it(self) -> RunConfig:
        """Refuse settings a stage's engine cannot honour (runtime/faust.py lists Faust's)."""
        faust_stages = [s for s in STAGE_NAMES
                        if self.runtime.engine_for(s) == "faust"]
        if faust_stages:
            problems = unsupported_settings(self.broker, faust_stages)
            if problems:
                raise ValueError("; ".join(problems))
        return self


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in nested dict `data`; the value is parsed as YAML (so 8 is an int)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form key.path=value")
    path, raw = override.split("=", 1)
    keys = path.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override {override!r} has an empty key")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {key!r} is not a section")
        node = child
    node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def _section_model(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class of the config section at `loc` (None where it is not one fixed model)."""
    model: Any = RunConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        model = field.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden" and (section := _section_model(e["loc"][:-1])) is not None:
            keys = sorted(section.model_fields)
            near = difflib.get_close_matches(str(e["loc"][-1]), keys, n=1, cutoff=0.6)
            msg = (f"not a key of {'.'.join(map(str, e['loc'][:-1])) or 'the config'}"
                   + (f" (did you mean {near[0]!r}?)" if near else "") + f"; its keys: {', '.join(keys)} "
                   "(docs/configuration.md)")
        sections = tuple(f"{name}." for name in RunConfig.model_fields)
        named = msg.startswith(f"{key}.") or (key == "config" and msg.startswith(sections))
        lines.append(f"  {msg}" if named else f"  {key}: {msg}")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML config (or defaults when path is None), apply dotted overrides, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
        data = loaded
        source = str(p)
    for override in overrides:
        apply_override(data, override)
    _apply_secrets(data)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


SECRETS_ENV = "ROLLWAY_SECRETS"
"""The name under which a parent hands its children the config's secrets (JSON: dotted key -> value): over a
pipe (`rollway.base.secret_pipe`, how `rollway up` starts its stages), or, set by hand, an environment
variable. `load_config` takes it once and removes it, so nothing the child starts inherits it."""
def _walk_secrets(value: Any, path: tuple[str | int, ...], found: dict[tuple[str | int, ...], str]) -> Any:
    """`value` (a python-mode dump) without secrets; each secret (a SecretStr, or a string holding a URL
    with user-info) is recorded in `found` under its path. A SecretStr leaves a None, a URL its masked form."""
    if isinstance(value, SecretStr):
        found[path] = value.get_secret_value()
        return None
    if isinstance(value, str) and URL_USERINFO.search(value):
        found[path] = value
        return mask_url_credentials(value)
    if isinstance(value, dict):
        return {k: _walk_secrets(v, (*path, k), found) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_walk_secrets(v, (*path, i), found) for i, v in enumerate(value)]
    return value


def _split(cfg: RunConfig) -> tuple[dict[str, Any], dict[tuple[str | int, ...], str]]:
    import json

    found: dict[tuple[str | int, ...], str] = {}
    public = _walk_secrets(cfg.model_dump(mode="python", exclude_defaults=True), (), found)
    return json.loads(json.dumps(public, default=str)), found


def resolved_config(cfg: RunConfig) -> dict[str, Any]:
    """The validated config as plain data that `load_config` reads back into an equal RunConfig (with
    `config_secrets` in the environment): what a parent process hands its children (a file, never override
    strings). It holds no secret: SecretStr fields are left out (None), URLs with credentials masked.
    Fields at their default are left out, so the child sees the same `model_fields_set` (which some
    checks read) as the parent."""
    return _split(cfg)[0]


def config_secrets(cfg: RunConfig) -> dict[str, str]:
    """The secrets `resolved_config` leaves out, as `{dotted key: value}` (list items by index)."""
    return {".".join(str(k) for k in path): value for path, value in _split(cfg)[1].items()}


def secret_values(cfg: RunConfig) -> list[str]:
    """Every secret string of `cfg` (and each URL's user-info and password alone), for the log redactor."""
    values = []
    for value in config_secrets(cfg).values():
        values.append(value)
        for m in URL_USERINFO.finditer(value):
            values += [m.group(2), m.group(2).partition(":")[2]]
    return [v for v in values if v]


def write_resolved_config(cfg: RunConfig, path: Path) -> dict[str, str]:
    """Write `resolved_config(cfg)` as the JSON file `rollway stage` loads (it holds no secret), and
    return the secrets to hand the children (`{SECRETS_ENV: JSON}`, for `Child(secrets=...)`; empty: none)."""
    import json
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # owner only still: it names hosts and paths
    with os.fdopen(fd, "w") as f:
        json.dump(resolved_config(cfg), f, indent=1)
    tmp.replace(path)
    secrets = config_secrets(cfg)
    return {SECRETS_ENV: json.dumps(secrets)} if secrets else {}


def _apply_secrets(data: dict[str, Any]) -> None:
    """Put the secrets a parent passed as `SECRETS_ENV` (its pipe, else the variable) back into `data` (exact
    strings, never parsed as YAML); taken once, so sandboxes, tools and engines this process starts never see it."""
    import json

    from rollway.base.secret_pipe import take_secret

    raw = take_secret(SECRETS_ENV)
    if not raw:
        return
    for dotted, value in json.loads(raw).items():
        *parents, last = [int(k) if k.isdigit() else k for k in dotted.split(".")]
        node: Any = data
        for key in parents:
            node = node[key] if isinstance(node, list) else node.setdefault(key, {})
        node[last] = value


def dump_config(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain data with secrets masked (safe to write into a run folder): SecretStr fields
    as `**********`, credentials inside URLs as `***`."""
    import json

    return json.loads(mask_url_credentials(json.dumps(cfg.model_dump(mode="json"))))
