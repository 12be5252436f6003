"""Prometheus metrics of a stage process: every metric rollway exports, declared once here; the `/metrics`
endpoint each stage process serves (one per process, shared by the stages of a one-process job); and its
announcement in the run folder as a Prometheus file-based service discovery target (`RunDir.metrics_targets`),
which the `prometheus.yml` that `rollway up` writes (`write_scrape_config`) reads.

Conventions: base units in names (`_seconds`, `_messages`), counters end in `_total`, labels are bounded
(stage, topic, partition, outcome, cause, state, api, code, engine): never an episode, task or sandbox id. Every
series has a `stage` label, so a process exports only the series of the stages it runs (no zeros from the others)."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from rollway.base.files import write_json_atomic
from rollway.base.run_dir import RunDir, worker_name

if TYPE_CHECKING:
    from rollway.config.run import MetricsConfig
    from rollway.policies.base import Generation, InferenceClient, SamplingParams

log = structlog.get_logger()

disable_created_metrics()  # no `_created` series beside every counter and histogram: half the series, no use here
REGISTRY = CollectorRegistry()
"""This process's metrics (not prometheus_client's global one: nothing else leaks into /metrics)."""

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


def _gauge(name: str, doc: str, *labels: str) -> Gauge:
    return Gauge(name, doc, ["stage", *labels], registry=REGISTRY)


def _counter(name: str, doc: str, *labels: str) -> Counter:
    return Counter(name, doc, ["stage", *labels], registry=REGISTRY)


def _seconds(name: str, doc: str, *labels: str) -> Histogram:
    return Histogram(name, doc, ["stage", *labels], buckets=_SECONDS, registry=REGISTRY)


# -- every stage worker (runtime/worker.py)
CONSUMER_LAG = _gauge("rollway_consumer_lag_messages", "Messages on an input partition the stage's consumer group "
                      "has not committed yet (log end offset minus committed offset, Kafka's convention), per "
                      "partition this worker owns", "topic", "partition")
HANDLED = _counter("rollway_messages_handled_total", "Input messages a worker finished: handled (a handler error "
                   "included, which dead-letters it) or undecodable", "topic", "outcome")
HANDLE_SECONDS = _seconds("rollway_message_handle_seconds", "Time a handler took on one message")
QUEUE_SECONDS = _seconds("rollway_message_queue_seconds", "Time from a message's production to the start of its "
                         "handling (broker transit plus waiting for a free slot)")
PRODUCED = _counter("rollway_messages_produced_total", "Messages a stage produced")
IN_FLIGHT = _gauge("rollway_messages_in_flight", "Messages a worker is handling now")
BACKLOG = _gauge("rollway_messages_backlog", "Messages fetched ahead (prefetch) waiting for a free slot")
PAUSED = _gauge("rollway_consumer_paused", "1 while back-pressure holds a worker's fetches (every slot busy)")
CONCURRENCY = _gauge("rollway_worker_concurrency", "Messages a worker handles at once at most")
DEAD_LETTERS = _counter("rollway_dead_letters_total", "Inputs sent to the dead-letters topic, by cause (decode, "
                        "handler, output)", "cause")
REDELIVERIES = _counter("rollway_redeliveries_total", "Messages delivered again that the stage had already handled "
                        "(a crash or a rebalance), skipped")
PARTITIONS = _gauge("rollway_partitions_assigned", "Input partitions a worker owns")
HEARTBEAT = _gauge("rollway_worker_heartbeat_timestamp_seconds", "When a worker's consumer loop last went round "
                   "(unix time): a wedged loop stops it while /metrics still answers")

# -- scheduler (actors/scheduler.py)
EPISODES = _gauge("rollway_scheduler_episodes", "The run's episodes by state (pending, inflight, completed, failed)",
                  "state")
EPISODE_RETRIES = _gauge("rollway_scheduler_episode_retries", "Attempts re-issued after the first")
MAX_INFLIGHT = _gauge("rollway_scheduler_max_inflight_episodes", "scheduler.max_inflight_episodes")
POLICY_LAG = _gauge("rollway_scheduler_policy_lag", "Policy versions between the newest version and the oldest "
                    "in-flight episode's")
POLICY_LAG_BOUND = _gauge("rollway_scheduler_max_policy_lag", "scheduler.max_policy_lag (absent when unbounded)")

# -- model calls (`generate` below: the agent's turns, the gateway's calls)
INFERENCE_IN_FLIGHT = _gauge("rollway_inference_requests_in_flight", "Model calls waiting on the inference engine")
INFERENCE_SECONDS = _seconds("rollway_inference_request_seconds", "Time one model call took")
GENERATED_TOKENS = _counter("rollway_inference_generated_tokens_total", "Tokens the engine generated for this "
                            "worker (its rate: the engine's tokens per second for the run)")

# -- gateway (gateway/server.py, gateway/bounds.py), in the agent stage of program-driven episodes
GATEWAY_CALL_SECONDS = _seconds("rollway_gateway_call_seconds", "Time the gateway took to answer one model call "
                                "it served (engine, recording and reply), by API (chat, completions, responses, "
                                "messages)", "api")
GATEWAY_REFUSALS = _counter("rollway_gateway_refusals_total", "Requests the gateway answered with an error, by HTTP "
                            "status (401 a wrong key, 409 an episode's limit, 413/408 a bound, 503 not recorded)",
                            "code")

# -- sandboxes (actors/init.py, sandboxes/): `engine` is a fleet engine's id (`sandbox.engines`), else `local`
SANDBOXES_CREATING = _gauge("rollway_sandboxes_creating", "Sandboxes being created now on each engine", "engine")
SANDBOXES_LIVE = _gauge("rollway_sandboxes_live", "The run's sandboxes each engine holds (every init worker counts "
                        "them all: take the max)", "engine")
SANDBOXES_CREATED = _counter("rollway_sandboxes_created_total", "Sandboxes created", "engine")
SANDBOX_CREATE_SECONDS = _seconds("rollway_sandbox_create_seconds", "Time one sandbox took to create")

# -- learner (actors/learner.py)
POLICY_VERSION = _gauge("rollway_policy_version", "The learner's newest policy version")
LEARNER_UPDATES = _counter("rollway_learner_updates_total", "Policy updates the learner made")
LEARNER_STEP_SECONDS = _seconds("rollway_learner_step_seconds", "Time one policy update took (forward, backward, "
                                "optimizer)")
EPISODES_TRAINED = _gauge("rollway_learner_episodes_trained", "Episodes the learner has consumed")
WEIGHT_SYNC_SECONDS = _seconds("rollway_weight_sync_seconds", "Time the inference engine took to load a new policy")


class _BusyTime(Collector):
    """`rollway_inference_busy_seconds_total`: per stage, the time at least one of the worker's model calls was
    waiting on the engine, up to the scrape (a call longer than the scrape interval counts as it goes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # calls change on the event loop, scrapes read on the server's thread
        self.calls: dict[str, int] = {}
        self.since: dict[str, float] = {}
        self.total: dict[str, float] = {}

    def change(self, stage: str, by: int) -> None:
        with self.lock:
            self._advance(stage, time.monotonic())
            self.calls[stage] = self.calls.get(stage, 0) + by

    def _advance(self, stage: str, now: float) -> None:
        if self.calls.get(stage, 0) > 0:
            self.total[stage] += now - self.since[stage]
        self.total.setdefault(stage, 0.0)
        self.since[stage] = now

    def collect(self):
        family = CounterMetricFamily("rollway_inference_busy_seconds", "Time at least one of this worker's model "
                                     "calls was waiting on the engine (its rate: the fraction of time the engine "
                                     "was busy for it)", labels=["stage"])
        with self.lock:
            for stage in self.total:
                self._advance(stage, time.monotonic())
                family.add_metric([stage], self.total[stage])
        yield family


_BUSY = _BusyTime()
REGISTRY.register(_BUSY)


async def generate(engine: InferenceClient, prompt_ids: list[int], params: SamplingParams, stage: str) -> Generation:
    """One model call of `stage`, counted: in flight, time, tokens generated, engine busy time."""
    t0 = time.perf_counter()
    _BUSY.change(stage, 1)
    try:
        with INFERENCE_IN_FLIGHT.labels(stage).track_inprogress():
            gen = await engine.generate(prompt_ids, params)
    finally:
        _BUSY.change(stage, -1)
    INFERENCE_SECONDS.labels(stage).observe(time.perf_counter() - t0)
    GENERATED_TOKENS.labels(stage).inc(len(gen.token_ids))
    return gen


class _ScrapeCounter(Collector):
    """Counts scrapes (exports nothing), so a stopping worker can wait for its final figures to be read."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = threading.Condition()

    def collect(self):
        with self.changed:
            self.count += 1
            self.changed.notify_all()
        return []

    def wait_past(self, mark: int, timeout_s: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.count >= mark, timeout_s)


SCRAPES = _ScrapeCounter()
REGISTRY.register(SCRAPES)

PORT_SEARCH = 100
"""Ports tried upwards from `metrics.port` before the operating system picks one."""


class MetricsServer:
    """The process's `/metrics` endpoint (a daemon thread) and its announcement file. One per process:
    the stages of a one-process job share it (`acquire`/`release` count them)."""

    _current: MetricsServer | None = None
    _lock = threading.Lock()

    def __init__(self, cfg: MetricsConfig, run_dir: Path | None, run_id: str | None) -> None:
        self.cfg, self.users = cfg, 0
        # A path of this process's own: a crashed worker's announcement stays (its target must read as down),
        # and another run's process soon listens on its port (every run starts at metrics.port); at another
        # path that process answers 404, so a scrape never files its figures under this run's target.
        path = f"/metrics/{uuid.uuid4().hex}"
        self.httpd, self.thread, self.port = serve(cfg.host, cfg.port, path)
        self.url = f"http://{announced_host(cfg.host)}:{self.port}{path}"
        self.target: Path | None = None
        if run_dir is not None:
            labels = {"__metrics_path__": path, **({"run": run_id} if run_id else {})}
            self.target = announce(run_dir, worker_name(), f"{announced_host(cfg.host)}:{self.port}", labels)
        log.info("metrics served", url=self.url, announced=str(self.target) if self.target else None)

    @classmethod
    def acquire(cls, cfg: MetricsConfig, run_dir: Path | None, run_id: str | None) -> MetricsServer | None:
        """The process's server, started at the first call (None when metrics are off)."""
        if not cfg.enabled:
            return None
        with cls._lock:
            if cls._current is None:
                try:
                    cls._current = MetricsServer(cfg, run_dir, run_id)
                except OSError as err:  # the stage runs on without its endpoint
                    log.error(f"cannot serve /metrics on {cfg.host}: {err}; set metrics.host to an address of this "
                              "machine (or metrics.enabled=false)")
                    return None
            cls._current.users += 1
            return cls._current

    async def release(self, clean: bool = True) -> None:
        """A stage of this process has stopped. Cleanly (its final figures set): wait up to
        `metrics.final_scrape_timeout_s` for a scrape that read them. The last stage out stops the server;
        after a clean stop it also removes the announcement (a target that vanishes is a finished worker);
        a crashed one's stays, so its target reads as down until `rollway up` restarts it."""
        timeout = self.cfg.final_scrape_timeout_s
        if clean and timeout > 0:
            # Two scrapes past now: the first may have begun before the final figures were set.
            if not await asyncio.to_thread(SCRAPES.wait_past, SCRAPES.count + 2, timeout):
                log.info("no scrape read this worker's final metrics", waited_s=timeout)
        with MetricsServer._lock:
            self.users -= 1
            if self.users > 0:
                return
            MetricsServer._current = None
        if clean and self.target is not None:
            self.target.unlink(missing_ok=True)
        self.httpd.shutdown()
        self.httpd.server_close()


def serve(host: str, first: int, path: str = "/metrics") -> tuple[Any, threading.Thread, int]:
    """An HTTP server of REGISTRY at `path` only (any other path: 404) on `first`, or on the next free port
    above it (0, or none free in PORT_SEARCH: a port the operating system picks); (server, thread, port)."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

    metrics = make_wsgi_app(REGISTRY)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") != path:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not this process's metrics path\n"]
        return metrics(environ, start_response)

    # The address family of `host` (an IPv6 address or a name that resolves to one), as start_http_server chose it.
    family, _, _, _, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:  # a line per scrape on stderr otherwise
            pass

    for port in [*(range(first, first + PORT_SEARCH) if first else ()), 0]:
        try:
            httpd = make_server(sockaddr[0], port, app, Server, handler_class=Quiet)
        except OSError as err:
            if err.errno != errno.EADDRINUSE or port == 0:
                raise
            continue
        thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
        thread.start()
        return httpd, thread, httpd.server_port
    raise AssertionError("unreachable")


def announce(run_dir: Path, name: str, address: str, labels: dict[str, str]) -> Path:
    """`address` (host:port) announced as a scrape target of the run (file service discovery); the file."""
    target = RunDir(run_dir).metrics_target(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(target, [{"targets": [address], "labels": labels}])
    return target


def announce_engine(run_dir: Path, base_urls: list[str], run_id: str | None) -> list[Path]:
    """A launched vLLM's own `/metrics` (open without the key: policies/vllm_plugins/rollway_vllm_guard.py)
    announced beside the stages, one target per replica (`engine-N`, label `replica`): the engine's figures as
    it counts them (tokens, requests running and waiting, KV cache use), next to rollway's view of its calls."""
    return [announce(run_dir, f"engine-{i}", urlsplit(url).netloc, {"replica": str(i), **({"run": run_id} if run_id else {})})
            for i, url in enumerate(base_urls)]


def announced_host(host: str) -> str:
    """The address a scraper reaches a server bound to `host` at (this machine's name for a wildcard)."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


def drop_stage_partitions(stage: str, partitions: list[tuple[str, int]]) -> None:
    """Forget the lag of partitions this worker no longer owns (their new owner reports them)."""
    for topic, partition in partitions:
        try:
            CONSUMER_LAG.remove(stage, topic, str(partition))
        except KeyError:
            pass


def write_scrape_config(run_dir: Path, scrape_interval_s: float = 15.0) -> Path:
    """`RunDir.prometheus_config`: a Prometheus configuration that scrapes every process of the run (file
    service discovery over the targets the processes announce) and loads the shipped alert rules, copied
    beside it: `prometheus --config.file=RUN/prometheus/prometheus.yml`."""
    rd = RunDir(run_dir)
    rd.prometheus_dir.mkdir(parents=True, exist_ok=True)
    rules = rd.prometheus_dir / "alerts.yml"
    rules.write_text(ALERT_RULES.read_text())
    interval = f"{int(scrape_interval_s * 1000)}ms"
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules.resolve())],
        "scrape_configs": [
            {
                "job_name": "rollway",
                "file_sd_configs": [
                    {"files": [str(rd.metrics_targets.resolve() / "*.json")], "refresh_interval": "5s"}
                ],
            }
        ],
    }
    path = rd.prometheus_config
    path.write_text(json.dumps(config, indent=1) + "\n")  # JSON is YAML
    return path


MONITORING = Path(__file__).parent / "monitoring"
ALERT_RULES = MONITORING / "alerts.yml"
"""The shipped Prometheus alerting rules."""
DASHBOARD = MONITORING / "grafana-dashboard.json"
"""The shipped Grafana dashboard over these metrics."""


DEAD_LETTER_CAUSES = ("decode", "handler", "output")


class WorkerMetrics:
    """One stage worker's series (children bound once: the consumer loop sets them every round)."""

    def __init__(self, stage: str, concurrency: int) -> None:
        self.stage = stage
        self.in_flight, self.backlog = IN_FLIGHT.labels(stage), BACKLOG.labels(stage)
        self.paused, self.partitions = PAUSED.labels(stage), PARTITIONS.labels(stage)
        self.heartbeat, self.produced = HEARTBEAT.labels(stage), PRODUCED.labels(stage)
        self.handle_s, self.queue_s = HANDLE_SECONDS.labels(stage), QUEUE_SECONDS.labels(stage)
        CONCURRENCY.labels(stage).set(concurrency)
        self.lagging: set[tuple[str, int]] = set()

    def loop(self, in_flight: int, backlog: int, paused: bool, partitions: int) -> None:
        self.in_flight.set(in_flight)
        self.backlog.set(backlog)
        self.paused.set(1 if paused else 0)
        self.partitions.set(partitions)
        self.heartbeat.set_to_current_time()

    def handled(
        self, topic: str, outcome: str, produced_at: float, started_at: float, ended_at: float
    ) -> None:
        HANDLED.labels(self.stage, topic, outcome).inc()
        if outcome == "handled":
            self.handle_s.observe(ended_at - started_at)
            self.queue_s.observe(max(0.0, started_at - produced_at))

    def dead_letter(self, reason: str) -> None:
        cause = reason.split(":", 1)[0]
        DEAD_LETTERS.labels(self.stage, cause if cause in DEAD_LETTER_CAUSES else "other").inc()

    def forget(self, partitions: set[tuple[str, int]]) -> None:
        """Partitions given away: their new owner reports their lag."""
        drop_stage_partitions(self.stage, sorted(self.lagging & partitions))
        self.lagging -= partitions

    def lag(self, lags: dict[tuple[str, int], int]) -> None:
        """Set the lag of every partition owned now; forget the ones no longer owned."""
        drop_stage_partitions(self.stage, sorted(self.lagging - set(lags)))
        for (topic, partition), lag in lags.items():
            CONSUMER_LAG.labels(self.stage, topic, str(partition)).set(lag)
        self.lagging = set(lags)
