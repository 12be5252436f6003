"""Prometheus metrics against a real Prometheus (Debian's `prometheus`, installed by scripts/setup.sh): one smoke
job with every stage in its own process, scraped through the prometheus.yml `rollway up` writes, its figures read
back with PromQL; the shipped alert rules (promtool) and one of them firing while a stage is stopped; every
panel query of the shipped Grafana dashboard evaluated."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, wait_until

from rollway.base.run_dir import RunDir, read_trajectories, worker_name
from rollway.runtime.metrics import ALERT_RULES, DASHBOARD, write_scrape_config
from rollway.runtime.telemetry import read_telemetry

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ALLOWED_LABELS = {"__name__", "job", "instance", "run", "stage", "topic", "partition", "outcome", "cause", "state", "le",
                  "api", "code", "engine"}
"""Every label a rollway series may carry: bounded sets only (no episode, task or sandbox id)."""
STAGE_PROCESSES = {"scheduler", "init", "agent", "reward", "sink", "learner"}


def tool(name: str) -> str:
    """The path of `name` (prometheus, promtool): Debian's `prometheus` package, installed here when missing
    and this is root; else the test is skipped saying so."""
    if shutil.which(name) is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], capture_output=True, timeout=600,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed and could not be installed here (apt-get install prometheus, as root)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server of its own (config, data folder and port in a temporary folder)."""

    def __init__(self, config: Path, data: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data.with_suffix(".log")
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        wait_until(self.ready, timeout_s=120, what=f"prometheus ready (log: {self.log})")

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return urllib.request.urlopen(f"{self.url}/-/ready", timeout=5).status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> object:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        body = json.loads(urllib.request.urlopen(url, timeout=30).read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query's vector (or scalar as one sample)."""
        data = self.api("query", query=expr, **({"time": at} if at else {}))
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def values(self, expr: str, by: str) -> dict[str, float]:
        return {r["metric"].get(by, ""): float(r["value"][1]) for r in self.query(expr)}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def test_shipped_alert_rules_pass_promtool_and_fire_on_their_conditions(tmp_path):
    """`promtool check rules` on the shipped file, and `promtool test rules` with synthetic series: each rule
    fires on its condition (and the stalled-stage rule not while the stage makes progress)."""
    promtool = tool("promtool")
    out = subprocess.run([promtool, "check", "rules", str(ALERT_RULES)], capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS: 6 rules found" in out.stdout, out.stdout + out.stderr
    tests = {"rule_files": [str(ALERT_RULES)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            # agent: 3 turns waiting, nothing handled for 20 minutes; reward: waiting but handling
            {"series": 'rollway_consumer_lag_messages{run="r",stage="agent",topic="agent-steps",partition="0"}',
             "values": "3x30"},
            {"series": 'rollway_messages_handled_total{run="r",stage="agent",topic="agent-steps",outcome="handled"}',
             "values": "5x30"},
            {"series": 'rollway_consumer_lag_messages{run="r",stage="reward",topic="reward-requests",partition="0"}',
             "values": "2x30"},
            {"series": 'rollway_messages_handled_total{run="r",stage="reward",topic="reward-requests",outcome="handled"}',
             "values": "0+10x30"},
            {"series": 'rollway_dead_letters_total{run="r",stage="reward",cause="handler"}', "values": "0+2x30"},
            {"series": 'rollway_inference_requests_in_flight{run="r",instance="a"}', "values": "0x30"},
            {"series": 'up{job="rollway",instance="h:9450",run="r"}', "values": "1 1 0x28"},
            {"series": 'rollway_scheduler_policy_lag{run="r"}', "values": "2x30"},
            {"series": 'rollway_scheduler_max_policy_lag{run="r"}', "values": "2x30"},
            {"series": 'rollway_worker_heartbeat_timestamp_seconds{run="r",stage="init",instance="h:9451"}', "values": "0x30"},
        ],
        "alert_rule_test": [
            {"eval_time": "25m", "alertname": "RollwayStageStalled", "exp_alerts": [
                {"exp_labels": {"severity": "critical", "run": "r", "stage": "agent"},
                 "exp_annotations": {"summary": "rollway stage agent has 3 messages waiting and handled none for 10 minutes",
                                     "description": yaml.safe_load(ALERT_RULES.read_text())["groups"][0]["rules"][0]
                                     ["annotations"]["description"]}}]},
            {"eval_time": "25m", "alertname": "RollwayDeadLetterRate", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "run": "r", "stage": "reward"},
                 "exp_annotations": {"summary": "rollway stage reward dead-letters 20% of its messages",
                                     "description": "Read the reasons with `rollway replay dead-letters`."}}]},
        ]}]}
    # Only the label sets are compared for the other rules (their annotations are checked by promtool's syntax pass).
    for name, at, labels in [("RollwayWorkerDown", "10m", {"severity": "critical", "job": "rollway", "instance": "h:9450", "run": "r"}),
                             ("RollwayPolicyLagAtBound", "20m", {"severity": "warning", "run": "r"}),
                             ("RollwayEngineIdle", "10m", {"severity": "warning", "run": "r"}),
                             ("RollwayWorkerLoopStuck", "10m", {"severity": "critical", "run": "r", "stage": "init", "instance": "h:9451"})]:
        rule = next(r for r in yaml.safe_load(ALERT_RULES.read_text())["groups"][0]["rules"] if r["alert"] == name)
        tests["tests"][0]["alert_rule_test"].append({"eval_time": at, "alertname": name, "exp_alerts": [
            {"exp_labels": labels, "exp_annotations": _annotations(rule, labels)}]})
    test_file = tmp_path / "alerts_test.yml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _annotations(rule: dict, labels: dict) -> dict:
    """A rule's annotations with `{{ $labels.X }}` filled in (the rules tested this way print no $value)."""
    return {k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], v)
            for k, v in rule["annotations"].items()}


@pytest.fixture(scope="module", params=["aiokafka", "faust"])
def scraped_run(tmp_path_factory, request):
    """One smoke job, every stage its own process on one stream engine (`runtime.engine`: the aiokafka
    worker, or Faust), scraped by a real Prometheus every 0.5 s through the prometheus.yml `rollway up`
    writes (its alert rules a test copy with `for: 1s`). Midway the scheduler is stopped (SIGSTOP) until
    RollwayWorkerDown fires, then continued; the job runs to its end."""
    tmp = tmp_path_factory.mktemp("prom")
    run_dir = tmp / "run"
    config = write_scrape_config(run_dir, scrape_interval_s=0.5)  # what `rollway up` writes (it writes it again)
    quick_rules = tmp / "alerts-quick.yml"
    quick_rules.write_text(re.sub(r"for: \d+m", "for: 1s", ALERT_RULES.read_text()))
    prom_config = json.loads(config.read_text())
    assert prom_config["scrape_configs"][0]["file_sd_configs"][0]["files"] == [str((run_dir / "prometheus/targets").resolve() / "*.json")]
    prom_config["rule_files"] = [str(quick_rules)]
    (tmp / "prometheus.yml").write_text(json.dumps(prom_config))
    (run_dir / "prometheus" / "targets").mkdir(parents=True)
    prom = Prometheus(tmp / "prometheus.yml", tmp / "data")
    seen: dict[str, set] = {"metrics": set(), "up_targets": set()}
    fired: dict = {}
    try:
        up = subprocess.Popen(
            [sys.executable, "-m", "rollway.runners", "up", "examples/smoke.yaml", "--run-dir", str(run_dir), "--no-report",
             "runtime.processes=per-stage", f"runtime.engine={request.param}", "metrics.final_scrape_timeout_s=10",
             "metrics.scrape_interval_s=0.5"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def watch() -> bool:
            """While the job runs: the metric families and healthy targets Prometheus knows (the metadata
            API lists only live targets' families); once episodes flow, the scheduler's stall."""
            seen["metrics"] |= set(prom.api("metadata"))
            seen["up_targets"] |= {t["scrapeUrl"] for t in prom.api("targets")["activeTargets"] if t["health"] == "up"}
            if not fired and prom.query('rollway_messages_handled_total{stage="agent"} > 0'):
                fired.update(stall_scheduler(prom, run_dir))
            return up.poll() is not None

        wait_until(watch, timeout_s=400, interval_s=0.5, what="the smoke job to end")
        output = up.stdout.read()
        assert up.returncode == 0, output[-4000:]
        yield prom, run_dir, seen, fired
    finally:
        if up.poll() is None:
            up.kill()
        prom.stop()


def stall_scheduler(prom: Prometheus, run_dir: Path) -> dict:
    """SIGSTOP the scheduler process until Prometheus fires RollwayWorkerDown for its target, then SIGCONT."""
    status = [json.loads(p.read_text()) for p in (run_dir / "status").glob("scheduler-*.json")]
    pid = status[0]["pid"]
    target = json.loads(RunDir(run_dir).metrics_target(worker_name(pid)).read_text())[0]["targets"][0]
    started = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        wait_until(lambda: any(a["labels"]["alertname"] == "RollwayWorkerDown" and a["state"] == "firing"
                               and a["labels"]["instance"] == target for a in prom.api("alerts")["alerts"]),
                   timeout_s=120, interval_s=0.2, what="RollwayWorkerDown to fire for the stopped scheduler")
        return {"instance": target, "after_s": time.monotonic() - t0, "at": time.time(), "started": started}
    finally:
        os.kill(pid, signal.SIGCONT)


def last(prom: Prometheus, expr: str, by: tuple[str, ...]) -> dict[tuple, float]:
    """Per label set: the last value scraped in the last hour (the processes have stopped: `last_over_time`
    reads past the staleness markers their removal left)."""
    return {tuple(r["metric"].get(k, "") for k in by): float(r["value"][1])
            for r in prom.query(f"last_over_time({expr}[1h])")}


def test_every_stage_process_is_scraped_and_its_lag_ends_at_zero(scraped_run):
    prom, run_dir, seen, _ = scraped_run
    stages = {s for (s,) in last(prom, "rollway_worker_heartbeat_timestamp_seconds", ("stage",))}
    assert stages == STAGE_PROCESSES
    assert len(seen["up_targets"]) == len(STAGE_PROCESSES), seen["up_targets"]  # one endpoint per process
    instances = {i for (i,) in last(prom, 'up{job="rollway"}', ("instance",))}
    assert len(instances) == len(STAGE_PROCESSES)
    lag = last(prom, "rollway_consumer_lag_messages", ("stage", "topic", "partition"))
    assert {s for s, _, _ in lag} >= STAGE_PROCESSES - {"scheduler"}, lag
    assert not {k: v for k, v in lag.items() if v}, lag
    # Every partition of an input topic is reported by its stage (one worker each: it owns all of them).
    topics = json.loads((run_dir / "config.json").read_text())["topics"]
    assert len([k for k in lag if k[:2] == ("agent", f"{topics['prefix']}agent-steps")]) == \
        topics["partitions"].get("agent-steps", topics["default_partitions"])
    # The stages' targets carry the run id, so one Prometheus can tell runs apart.
    run_id = json.loads((run_dir / "summary.json").read_text())["run_id"]
    assert {r["metric"].get("run") for r in prom.query('last_over_time(up{job="rollway"}[1h])')} == {run_id}


def test_handled_totals_equal_the_runs_counts(scraped_run):
    prom, run_dir, _, _ = scraped_run
    summary = json.loads((run_dir / "summary.json").read_text())
    handled = last(prom, "rollway_messages_handled_total", ("stage", "topic", "outcome"))
    telemetry: dict[tuple, int] = {}
    for r in read_telemetry(run_dir):
        telemetry[(r.stage, r.topic, r.outcome)] = telemetry.get((r.stage, r.topic, r.outcome), 0) + 1
    assert {k: int(v) for k, v in handled.items()} == telemetry  # every handling, per stage, topic and outcome
    per_stage: dict[str, float] = {}
    for (stage, topic, _), v in handled.items():
        per_stage[f"{stage}:{topic}"] = per_stage.get(f"{stage}:{topic}", 0) + v
    trajs = read_trajectories(run_dir)
    prefix = json.loads((run_dir / "config.json").read_text())["topics"]["prefix"]
    assert summary["episodes_completed"] == len(trajs) == 8
    assert per_stage[f"init:{prefix}init-requests"] == summary["episodes_scheduled"] + summary["episodes_retried"]
    assert per_stage[f"reward:{prefix}reward-requests"] == summary["episodes_completed"]
    assert per_stage[f"sink:{prefix}trajectories"] == per_stage[f"learner:{prefix}trajectories"] == len(trajs)
    assert per_stage[f"agent:{prefix}agent-steps"] == sum(t["num_turns"] for t in trajs)
    assert last(prom, 'rollway_scheduler_episodes{state="completed"}', ()) == {(): 8.0}
    # Sandboxes per engine: the smoke job's bubblewrap sandboxes are all on the `local` engine.
    assert last(prom, "rollway_sandboxes_created_total", ("engine",)) == {("local",): float(
        summary["episodes_scheduled"] + summary["episodes_retried"])}
    live = prom.query('max_over_time(rollway_sandboxes_live[1h])')
    assert [r["metric"]["engine"] for r in live] == ["local"]
    assert 0 <= float(live[0]["value"][1]) <= 8  # the init worker's listing, never above in-flight
    assert last(prom, "rollway_sandboxes_creating", ("engine",)) == {("local",): 0.0}
    # The engine's figures as the agent saw them: every token it generated, and its busy time, which is at
    # most the calls' summed time (calls overlap) and more than none.
    generated = last(prom, 'rollway_inference_generated_tokens_total{stage="agent"}', ())[()]
    trained = sum(sum(t["loss_mask"]) for t in trajs)  # a retried episode's lost attempt generated more
    assert generated == trained if not summary["episodes_retried"] else generated >= trained, (generated, trained)
    busy = last(prom, 'rollway_inference_busy_seconds_total{stage="agent"}', ())[()]
    calls = last(prom, 'rollway_inference_request_seconds_sum{stage="agent"}', ())[()]
    assert 0 < busy <= calls + 1e-6, (busy, calls)
    produced = last(prom, 'rollway_messages_produced_total{stage="reward"}', ())
    assert produced[()] >= 8  # a trajectory per episode, and its done notice
    hist = last(prom, 'rollway_message_handle_seconds_count{stage="reward"}', ())
    assert hist == {(): per_stage[f"reward:{prefix}reward-requests"]}


def test_no_series_per_episode(scraped_run):
    prom, run_dir, _, _ = scraped_run
    now = time.time()
    series = prom.api("series", **{"match[]": ['{__name__=~"rollway_.+"}', "up"], "start": now - 3600, "end": now})
    labels = {k for s in series for k in s}
    assert labels <= ALLOWED_LABELS, labels - ALLOWED_LABELS
    ids = {t["episode"]["episode_id"] for t in read_trajectories(run_dir)} | \
          {t["episode"]["group_id"] for t in read_trajectories(run_dir)}
    leaked = [s for s in series for v in s.values() for i in ids if i in v]
    assert not leaked, leaked[:3]
    # The series a run makes does not grow with its episodes: bounded by stages x topics x partitions x outcomes.
    assert len(series) < 400, len(series)


def test_a_stopped_stage_fires_worker_down(scraped_run):
    """The scheduler process was stopped (SIGSTOP) mid-run: its scrape fails, `up` is 0, and the shipped
    RollwayWorkerDown rule (test copy: `for: 1s`) fired for its instance; the job still finished."""
    prom, _, _, fired = scraped_run
    assert fired and fired["after_s"] < 120, fired
    alerts = prom.query('ALERTS{alertname="RollwayWorkerDown", alertstate="firing"}', at=fired["at"])
    assert {a["metric"]["instance"] for a in alerts} == {fired["instance"]}  # the stopped one only
    before = prom.query('max_over_time(ALERTS{alertname="RollwayWorkerDown"}[1h])', at=fired["started"])
    assert not before, before  # nothing fired while every process ran


def test_every_dashboard_panel_queries_metrics_that_exist(scraped_run):
    """Each panel query of the shipped Grafana dashboard names only metric families the run's processes
    exported (Prometheus' metadata while they ran) and evaluates without error against the real server."""
    prom, _, seen, _ = scraped_run
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 20 and all(p["datasource"]["type"] == "prometheus" for p in dashboard["panels"])
    missing, answered = [], 0
    for expr in exprs:
        for name in set(re.findall(r"\b(rollway_[a-z_]+)", expr)):
            # a family's samples: NAME, NAME_total (OpenMetrics names the family without it), NAME_bucket/_sum/_count
            family = {name, re.sub(r"_(total|bucket|sum|count)$", "", name)}
            if not family & seen["metrics"]:
                missing.append(f"{name} in {expr}")
        query = expr.replace("$__rate_interval", "1m").replace("$run", ".*")
        result = prom.api("query_range", query=query, start=time.time() - 600, end=time.time(), step="5s")
        answered += bool(result["result"])
    assert not missing, missing
    assert answered >= len(exprs) // 2, f"only {answered} of {len(exprs)} panel queries returned data"
    variable = dashboard["templating"]["list"][1]["definition"]
    name = re.search(r"label_values\((\w+), run\)", variable).group(1)
    assert name in seen["metrics"]


def test_a_metrics_port_in_use_moves_to_the_next_free_one_and_announces_it(tmp_path):
    """Two processes' worth of servers asking for the same port: the second takes the next free one, and the
    announcement names the port really served (the first server's port is held by a real listener)."""
    import asyncio

    from rollway.config.run import MetricsConfig
    from rollway.runtime.metrics import MetricsServer, serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = MetricsServer.acquire(MetricsConfig(port=port), tmp_path, "run-x")
        try:
            assert server.port != port
            (announced,) = json.loads(RunDir(tmp_path).metrics_target(worker_name()).read_text())
            path = announced["labels"].pop("__metrics_path__")
            assert announced == {"targets": [f"127.0.0.1:{server.port}"], "labels": {"run": "run-x"}}
            assert server.url == f"http://127.0.0.1:{server.port}{path}"
            body = urllib.request.urlopen(server.url, timeout=10).read().decode()
            assert "# TYPE rollway_consumer_lag_messages gauge" in body
            httpd, _, second = serve("127.0.0.1", server.port)  # and the port after a taken one is free
            assert second not in (port, server.port)
            httpd.shutdown()
            httpd.server_close()
        finally:
            asyncio.run(server.release())
    assert not RunDir(tmp_path).metrics_target(worker_name()).exists()  # a clean stop withdraws it


def test_every_metric_is_documented():
    from rollway.runtime.metrics import REGISTRY

    page = (ROOT / "docs" / "observability.md").read_text()
    names = [f.name + ("_total" if f.type == "counter" else "") for f in REGISTRY.collect() if f.name.startswith("rollway")]
    assert len(names) > 20 and [n for n in names if f"`{n}`" not in page] == []


def test_a_metrics_address_that_cannot_be_bound_does_not_stop_the_stage(tmp_path):
    """metrics.host not of this machine: the stage gets no endpoint (and says how to fix it) instead of crashing."""
    from rollway.config.run import MetricsConfig
    from rollway.runtime.metrics import MetricsServer

    assert MetricsServer.acquire(MetricsConfig(host="192.0.2.1"), tmp_path, "run-x") is None  # TEST-NET-1
    assert not (tmp_path / "prometheus").exists()


def test_gateway_and_engine_series_from_a_real_scrape(tmp_path):
    """The gateway of program-driven episodes, in this process with its /metrics announced in a run folder and
    scraped by a real Prometheus through the scrape configuration `rollway up` writes: each served call's time
    per API, each refusal per HTTP status, the tokens the engine generated and its busy time. The scripted
    policy stands in for the model (the only fake part)."""
    import asyncio

    import openai
    from test_gateway import SCRIPT, LoggedEngine, key

    from rollway.config.run import MetricsConfig
    from rollway.gateway import Gateway, MemoryRecorder
    from rollway.policies.chat import BytesChatML
    from rollway.runtime.metrics import REGISTRY, MetricsServer

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, {"stage": "agent", **labels}) or 0.0

    names = [("rollway_gateway_call_seconds_count", {"api": "chat"}), ("rollway_gateway_call_seconds_count",
             {"api": "completions"}), ("rollway_gateway_refusals_total", {"code": "401"}),
             ("rollway_gateway_refusals_total", {"code": "409"}), ("rollway_inference_generated_tokens_total", {}),
             ("rollway_inference_busy_seconds_total", {}), ("rollway_inference_request_seconds_sum", {})]
    before = [sample(n, **labels) for n, labels in names]  # this process's registry may hold earlier tests' calls
    run_dir = tmp_path / "run"
    prom_config = write_scrape_config(run_dir, scrape_interval_s=0.5)
    server = MetricsServer.acquire(MetricsConfig(port=0), run_dir, "run-gw")
    prom = Prometheus(prom_config, tmp_path / "data")
    class SlowEngine(LoggedEngine):
        """Takes 50 ms a call, as an engine does. The scripted policy answers in about a tenth of a
        millisecond, and once busy came to 0.18 ms of 1.72 ms of calls in a whole run: most likely a call
        blocked on the busy counter's lock while a scrape's thread held it waiting for the GIL (a call is timed
        from before that lock, counted busy from after it), which only instant calls notice."""

        async def generate(self, prompt_ids, params):
            await asyncio.sleep(0.05)
            return await super().generate(prompt_ids, params)

    engine = SlowEngine(SCRIPT * 2)
    secret: list[str] = []

    async def episode() -> None:
        gateway = Gateway(engine, BytesChatML(), MemoryRecorder())
        await gateway.start()
        try:
            handle = gateway.open_episode(key("ep-7f3a"), max_calls=2)
            secret.append(handle.api_key)
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=handle.api_key, max_retries=0)
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            await client.completions.create(model="m", prompt="hello")
            with pytest.raises(openai.ConflictError):  # its limit of 2 calls
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
            with pytest.raises(openai.AuthenticationError):
                await openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="sk-guess", max_retries=0
                                         ).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        finally:
            await gateway.stop()

    try:
        asyncio.run(episode())
        tokens = sum(len(g.token_ids) for _, g in engine.log)
        want = [1, 1, 1, 1, tokens]
        queries = [n + "{" + ",".join(f'{k}="{v}"' for k, v in {"stage": "agent", **labels}.items()) + "}"
                   for n, labels in names]

        def scraped() -> list[float]:
            return [sum(float(r["value"][1]) for r in prom.query(q)) for q in queries]

        wait_until(lambda: [a - b for a, b in zip(scraped()[:5], before, strict=False)] == want, timeout_s=120,
                   interval_s=0.5, what=f"Prometheus to scrape the gateway's figures {want} (log: {prom.log})")
        busy, calls = (v - b for v, b in zip(scraped()[5:], before[5:], strict=True))
        assert len(engine.log) == 2 and tokens > 0
        assert 0 < busy <= calls + 1e-6, (busy, calls)  # one call at a time here: busy is their summed time
        assert busy == pytest.approx(calls, rel=0.5)
        # Their labels: API and status only, never the episode or its key.
        series = prom.api("series", **{"match[]": ['{__name__=~"rollway_gateway_.+"}']})
        assert {k for s in series for k in s} <= ALLOWED_LABELS \
        and not [x for x in ("ep-7f3a", *secret) if x in json.dumps(series)]
    finally:
        prom.stop()
        asyncio.run(server.release(clean=False))


def _scrape_announced(target: Path) -> tuple[int, str]:
    """What Prometheus reads from an announced target: its address and path (`__metrics_path__`, else /metrics)."""
    (group,) = json.loads(target.read_text())
    url = f"http://{group['targets'][0]}{group['labels'].get('__metrics_path__', '/metrics')}"
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""


def test_a_crashed_workers_target_never_reads_the_figures_of_a_process_that_took_its_port(tmp_path):
    """Attack (seen in a whole run: one run's Prometheus held another run's topics under its own `run` label):
    a crashed stage's announcement stays (its target must read as down), and every run's processes start at
    the same `metrics.port`, so another run's process soon listens there. A scrape of the dead worker's target
    must not get that process's figures; the new process's own target must."""
    import signal
    import textwrap

    worker = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from rollway.config.run import MetricsConfig
        from rollway.runtime.metrics import MetricsServer, CONSUMER_LAG
        server = MetricsServer.acquire(MetricsConfig(port=int(sys.argv[1])), Path(sys.argv[2]), sys.argv[3])
        CONSUMER_LAG.labels(sys.argv[3], sys.argv[3] + "-topic", "0").set(7)
        print("PORT", server.port, flush=True)
        time.sleep(600)
    """)
    port = free_port()
    runs = {name: tmp_path / name for name in ("first", "second")}
    procs = {}
    try:
        for name in ("first", "second"):
            procs[name] = subprocess.Popen([sys.executable, "-c", worker, str(port), str(runs[name]), name],
                                           cwd=ROOT, stdout=subprocess.PIPE, text=True)
            line = ""
            while not line.startswith("PORT "):  # its log lines come first
                line = procs[name].stdout.readline()
                assert line, f"the {name} worker ended before serving"
            assert int(line.split()[1]) == port  # each in turn got the configured port
            if name == "first":  # crashes: no clean stop, its announcement stays
                procs[name].send_signal(signal.SIGKILL)
                procs[name].wait()
        (dead,) = (runs["first"] / "prometheus" / "targets").glob("*.json")
        (live,) = (runs["second"] / "prometheus" / "targets").glob("*.json")
        status, body = _scrape_announced(dead)
        assert status != 200 and "second-topic" not in body, f"the dead worker's target read {status}: {body[-300:]}"
        status, body = _scrape_announced(live)
        assert status == 200 and 'topic="second-topic"' in body
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
