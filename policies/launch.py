"""`policy.launch`: start the inference servers a job's agents share and its learner updates.

`engine: vllm` starts `replicas` vLLM servers from the vLLM environment (`scripts/setup-vllm.sh`);
`builtin` starts `rollway serve`; `auto` takes vLLM where that environment exists. The servers are
children of the job in their own process groups, stopped with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import structlog

from rollway.policies.config import PolicyConfig
from rollway.policies.vllm import INSTALL_HINT, vllm_python, vllm_serve_command, vllm_serve_env, wait_ready

log = structlog.get_logger()


def resolve_engine(cfg: PolicyConfig) -> str:
    """`builtin` or `vllm` for a launched engine; `vllm` without its environment is an error."""
    has_vllm = vllm_python() is not None
    if cfg.engine == "vllm" and not has_vllm:
        raise RuntimeError(f"policy.engine=vllm: {INSTALL_HINT}")
    if cfg.engine == "auto" and not has_vllm:
        log.info(f"using the built-in engine; {INSTALL_HINT}")
    return "vllm" if cfg.engine == "vllm" or (cfg.engine == "auto" and has_vllm) else "builtin"


class ServerProcess:
    """One server child: argv, log file, process group."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log_path: Path):
        self.argv, self.env, self.port, self.log_path = argv, env, port, log_path
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **self.env})
        return self

    def wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        wait_ready(f"http://127.0.0.1:{self.port}/health", self.proc, timeout_s, self.log_path)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class LaunchedEngine:
    """The servers of one job. `overrides()` are the config overrides that point workers at them."""

    def __init__(self, engine: str, servers: list[ServerProcess]):
        self.engine, self.servers = engine, servers

    @property
    def base_url(self) -> str:
        return ",".join(s.base_url for s in self.servers)

    def overrides(self) -> list[str]:
        return [f"policy.base_url={self.base_url}", f"policy.engine={self.engine}"]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def vllm_server(cfg: PolicyConfig, port: int, log_path: Path) -> ServerProcess:
    from rollway.policies.model_loading import resolve_model_folder

    python = vllm_python()
    if python is None:
        raise RuntimeError(INSTALL_HINT)
    folder = resolve_model_folder(cfg.model)  # vLLM needs a Hugging Face folder: GGUF converted once, cached
    argv = vllm_serve_command(str(folder), port=port, max_model_len=cfg.max_model_len, dtype=cfg.dtype,
                              python=str(python), enforce_eager=cfg.enforce_eager,
                              api_key=cfg.api_key_value(), extra_args=tuple(cfg.vllm_args))
    return ServerProcess(argv, vllm_serve_env(cfg.kv_cache_gib), port, log_path)


def builtin_server(cfg: PolicyConfig, port: int, log_path: Path) -> ServerProcess:
    argv = [sys.executable, "-m", "rollway.runners", "serve", *([cfg.model] if cfg.model else []),
            "--port", str(port), "--max-batch", str(cfg.max_batch), "--max-model-len", str(cfg.max_model_len),
            "--dtype", cfg.dtype, "--threads", str(cfg.threads), *(["--device", cfg.device] if cfg.device else [])]
    return ServerProcess(argv, {}, port, log_path)


def launch_engine(cfg: PolicyConfig, log_dir: Path) -> LaunchedEngine:
    """Start the configured servers and wait until every one answers /health."""
    from rollway.runners.broker import free_port

    engine = resolve_engine(cfg)
    count = cfg.replicas if engine == "vllm" else 1
    make = vllm_server if engine == "vllm" else builtin_server
    name = "vllm" if engine == "vllm" else "engine"
    servers = [make(cfg, free_port(), log_dir / (f"{name}-{i}.out" if count > 1 else f"{name}.out"))
               for i in range(count)]
    launched = LaunchedEngine(engine, servers)
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
