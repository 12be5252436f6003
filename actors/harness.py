"""Harness episodes: an external agent program plays the whole episode inside its sandbox, talking to
the worker's gateway; its captured calls become the episode's turns (one TurnRecord per call), which
the reward stage grades and assembles exactly as for built-in episodes."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shlex
import time
from pathlib import Path
from typing import Any

import structlog

from rollway.base.blame import AGENT_FAILURE, InfrastructureFailure, blame, failure_details, failure_reason
from rollway.episode.calls import HarnessOutcome, outcome_of
from rollway.gateway.config import INSTRUCTION_FILE, HarnessConfig
from rollway.gateway.recorder import CallRecorder
from rollway.gateway.server import EpisodeHandle, Gateway
from rollway.sandboxes.base import Sandbox, SandboxError, open_workspace_folder, unlink_in_folder
from rollway.schemas.messages import CapturedCall, EpisodeKey

log = structlog.get_logger()

SOCKET_NAME = "gateway.sock"
SOCKET = f".rollway/{SOCKET_NAME}"
"""The gateway's unix socket, relative to the workspace (the jail's working folder): the only way out
of a sandbox without network. `.rollway/` is left out of the diff that is graded."""

CALLS_DIR = "gateway-calls"
"""The run folder's copy of each harness attempt's calls (`EPISODE.ATTEMPT.jsonl`)."""

OUTPUT_TAIL = 2000
"""Characters of the program's output quoted in a crash's reason."""

# Run by the sandbox's own python: read the spec (the episode's key among it) from the file the host wrote
# and remove it at once (never on argv: `ps` shows argv to every user of the host), listen on the sandbox's
# loopback, forward each connection to the gateway's socket, run the program with OPENAI_BASE_URL pointing
# there, exit with its exit code.
LAUNCHER = r"""
import json, os, socket, subprocess, sys, threading
with open(sys.argv[1]) as f:
    c = json.load(f)
os.unlink(sys.argv[1])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(64)
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass
def serve():
    while True:
        client, _ = srv.accept()
        up = socket.socket(socket.AF_UNIX)
        try:
            up.connect(c["socket"])
        except OSError:
            client.close(); continue
        for a, b in ((client, up), (up, client)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()
threading.Thread(target=serve, daemon=True).start()
url = "http://127.0.0.1:%d" % srv.getsockname()[1]
env = {**os.environ, **c["env"], "OPENAI_BASE_URL": url + "/v1", "ANTHROPIC_BASE_URL": url}
if c["instruction_file"]:
    with open(c["instruction_file"], "w") as f:
        f.write(c["instruction"])
proc = subprocess.Popen(c["argv"], env=env, stdin=subprocess.PIPE if c["stdin"] else subprocess.DEVNULL)  # in-sandbox
if c["stdin"]:
    try:
        proc.stdin.write(c["instruction"].encode()); proc.stdin.close()
    except BrokenPipeError:
        pass
code = proc.wait()
sys.stdout.flush()
os._exit(code if code >= 0 else 128 - code)
"""


class HarnessCrashed(RuntimeError):
    """The program exited non-zero on its own (a crash, a kill, `kill -9 -1`): the agent's failure
    (base/blame.py), graded 0 with its exit code and output, never retried."""


class HarnessUnsupported(HarnessCrashed):
    """The program asked the gateway for an endpoint or option it does not serve and then did not end
    cleanly. Graded 0 like any crash, never a failure without a grade: a command the model has the program
    run can ask the same (a way out of a 0). The gateway logs it once; a program that always asks it scores
    0 on every episode (`graded_failures`: `agent: HarnessUnsupported`)."""


class KeepingRecorder(CallRecorder):
    """Writes each call through `inner` (the log) and, once acknowledged, keeps it in memory by
    episode attempt, so the driver rebuilds the attempt from exactly what the log acknowledged.
    Keyed by attempt, and taken however the attempt ends: calls of an attempt that failed for the
    infrastructure or was cancelled stay in the log only, never in a later attempt's trajectory (a
    program that crashed is graded with its own calls)."""

    def __init__(self, inner: CallRecorder) -> None:
        self.inner = inner
        self.kept: dict[tuple[str, int], list[CapturedCall]] = {}

    async def record(self, call: CapturedCall) -> None:
        await self.inner.record(call)
        self.kept.setdefault((call.episode_id, call.episode.attempt), []).append(call)

    def take(self, episode: EpisodeKey) -> list[CapturedCall]:
        return self.kept.pop((episode.episode_id, episode.attempt), [])

    async def close(self) -> None:
        await self.inner.close()


class HarnessRunner:
    """Plays harness episodes on one worker's gateway (started once per worker process)."""

    def __init__(self, cfg: HarnessConfig, gateway: Gateway, recorder: KeepingRecorder,
                 calls_dir: Path | None = None) -> None:
        self.cfg, self.gateway, self.recorder = cfg, gateway, recorder
        self.calls_dir = calls_dir
        """Where each attempt's acknowledged calls are also written (`EPISODE.ATTEMPT.jsonl`), so a run
        folder holds them after the broker is gone. None: the log only."""

    async def close(self) -> None:
        await self.gateway.stop()
        await self.recorder.close()

    async def play(self, episode: EpisodeKey, instruction: str, sandbox: Sandbox, fallback_prompt: list[int],
                   deadline: float | None = None) -> HarnessOutcome:
        """Run the program to its end or a limit in `sandbox`; the episode's turns from its calls.
        `deadline`: when the agent phase ends (unix seconds; episode/deadline.py), when it has an end."""
        folder, sandbox_socket = await gateway_socket(sandbox)
        failure = None
        try:
            handle = self.gateway.open_episode(episode, self.cfg.max_calls, max_segments=self.cfg.max_segments,
                                               max_trained_tokens=self.cfg.max_trained_tokens)
            # The socket's folder stays open from here to the end: every operation on the socket goes through
            # that descriptor, so a `.rollway` the agent swaps for a link sends none of them elsewhere.
            unlink_in_folder(folder, SOCKET_NAME)
            site = await self.gateway.listen_unix(f"/proc/self/fd/{folder}/{SOCKET_NAME}", handle)
            try:
                stop_reason = await self._run(handle, instruction, sandbox, sandbox_socket, deadline)
            except Exception as err:
                # The program has started (its launch is the first thing `_run` does): its failure is the
                # agent's unless the gateway saw the inference engine or the broker fail under it.
                if handle.infrastructure_failure is not None:
                    raise InfrastructureFailure(
                        f"{failure_reason(err)[:500]} (after {handle.infrastructure_failure})") from err
                if blame(err, agent_ran=True) == "infrastructure":
                    raise
                stop_reason, failure = AGENT_FAILURE, failure_details(err, "agent")
            finally:
                await self.gateway.close_episode(handle)  # no call of this attempt is recorded after this
                await site.stop()
                unlink_in_folder(folder, SOCKET_NAME)
                # Calls of an attempt that fails (retried) stay in the log only; a graded one keeps them.
                calls = self.recorder.take(episode)
        finally:
            os.close(folder)
            if hasattr(sandbox, "close_gateway"):  # another host's engine: the relay into its container
                await sandbox.close_gateway()
        self._write_calls(episode, calls)
        log.info("harness episode ended", episode_id=episode.episode_id, stop_reason=stop_reason, calls=len(calls),
                 failure=(failure or {}).get("failure", "")[:300])
        outcome = outcome_of(calls, stop_reason, fallback_prompt)
        outcome.failure = failure
        return outcome

    def _write_calls(self, episode: EpisodeKey, calls: list[CapturedCall]) -> None:
        if self.calls_dir is None or not calls:
            return
        import msgspec

        self.calls_dir.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(msgspec.to_builtins(c)) for c in sorted(calls, key=lambda c: c.call_index)]
        path = self.calls_dir / f"{episode.episode_id}.{episode.attempt}.jsonl"
        path.write_text("\n".join(lines) + "\n")

    async def _run(self, handle: EpisodeHandle, instruction: str, sandbox: Sandbox, socket: str,
                   deadline: float | None) -> str:
        limit = self.cfg.time_limit_s
        if deadline is not None:
            limit = max(0.001, min(limit, deadline - time.time()))
        command = await self._command(handle, instruction, socket, sandbox)
        run = asyncio.create_task(sandbox.exec(command, timeout_s=limit))
        try:
            stop_reason = await self._watch(handle, run)
        finally:
            if not run.done():
                await _stop(run, sandbox)
        result = run.result() if stop_reason is None else None
        if handle.unsupported is not None and (result is None or result.exit_code != 0 or result.timed_out):
            # Named without the episode: every episode of this program fails with the same reason.
            raise HarnessUnsupported(f"the agent program asked for what the gateway does not serve: "
                                     f"{handle.unsupported}")
        if result is None:
            return stop_reason
        if handle.stop_reason is not None:
            return f"harness_{handle.stop_reason}"  # the refused call may have made the program exit non-zero
        if result.timed_out:
            return "harness_time_limit"
        if result.exit_code != 0:
            raise HarnessCrashed(f"episode {handle.episode.episode_id}: the harness program exited with code "
                                 f"{result.exit_code}; its output ends:\n{result.output[-OUTPUT_TAIL:]}")
        return "harness_exit"

    async def _watch(self, handle: EpisodeHandle, run: asyncio.Task) -> str | None:
        """Wait for the program; a stop reason when a limit ends it first (None: it exited). Silence is time
        without a model call of the program's being served: while one is (the gateway holds the episode's
        lock until it is recorded), the program waits on the engine, whose speed is not the agent's doing."""
        served_at = 0.0
        while not run.done():
            if handle.lock.locked():
                served_at = time.monotonic()
            since = max(handle.last_call_at or handle.opened_at, served_at)
            silent_for = time.monotonic() - since
            if silent_for >= self.cfg.silence_limit_s:
                return "harness_silence"
            if handle.stop_reason is not None:  # a limit the gateway enforced (calls, refusals, segments, tokens)
                return f"harness_{handle.stop_reason}"
            # A gateway limit is noticed within this poll; the silence limit exactly when due.
            await asyncio.wait({run}, timeout=min(0.2, self.cfg.silence_limit_s - silent_for))
        return None

    async def _command(self, handle: EpisodeHandle, instruction: str, socket: str, sandbox: Sandbox) -> str:
        """The launcher's command line; its spec (the episode's key among it) goes into a file of the
        sandbox that the launcher removes as it starts, never on argv."""
        cfg = self.cfg
        spec = {"socket": socket, "argv": cfg.argv(instruction), "instruction": instruction,
                "env": {**cfg.env, "OPENAI_API_KEY": handle.api_key, "OPENAI_MODEL": self.gateway.model_name,
                        "ANTHROPIC_API_KEY": handle.api_key},
                "stdin": cfg.stdin_instruction,
                "instruction_file": INSTRUCTION_FILE if any("{instruction_file}" in a for a in cfg.command) else None}
        spec_file = f".rollway/launch-{secrets.token_hex(8)}.json"
        await sandbox.write_bytes(spec_file, json.dumps(spec).encode())
        return f"python3 -c {shlex.quote(LAUNCHER)} {spec_file}"


async def _stop(run: asyncio.Task, sandbox: Sandbox) -> None:
    """End the program before its time: cancelling a local jail's command kills its process group
    (and pid namespace); a container's command runs on in the engine, so every process of the
    sandbox user is killed there too."""
    run.cancel()
    if sandbox.workspace_path is None:
        await sandbox.exec("kill -9 -1 2>/dev/null; true", timeout_s=10)
    await asyncio.gather(run, return_exceptions=True)


async def gateway_socket(sandbox: Sandbox) -> tuple[int, str]:
    """(a descriptor of the host folder that holds the socket, the socket's path inside the sandbox): the
    local jail's workspace `.rollway/`, or the folder a docker container has at /rollway-gateway (bound from
    this host, or relayed into a container on another host's engine: DockerSandbox.gateway_dir).
    The folder is opened without following links (`open_workspace_folder`): the workspace holds task data
    and the agent's work, and a `.rollway` that is a link would have the gateway (root) bind, chmod and
    unlink its socket wherever the link points on the host. The caller closes the descriptor."""
    if sandbox.workspace_path is not None:
        try:
            # Made as the workspace's owner (the jail user): the launcher removes its spec file from it.
            fd = open_workspace_folder(sandbox.workspace_path, (".rollway",), create=True,
                                       owner=os.stat(sandbox.workspace_path).st_uid)
        except SandboxError as err:
            raise SandboxError(f"{err}; rollway keeps its own files in .rollway/: remove a link or file of that "
                               "name from the task") from err
        return fd, SOCKET
    folder = await sandbox.gateway_dir() if hasattr(sandbox, "gateway_dir") else None
    if folder is None:
        raise SandboxError("harness episodes need a way out to the gateway: a local jail, or a docker container "
                           "started with sandbox.gateway_root set (agent.harness sets it; a sandbox created "
                           "before that, or another sandbox type, has none)")
    from rollway.sandboxes.docker import GATEWAY_DIR

    parent, name = os.path.split(folder)  # made by the provider, root-owned, bound read-only: no link in it
    return open_workspace_folder(parent, (name,)), f"{GATEWAY_DIR}/{SOCKET_NAME}"


async def start_harness_runner(services: Any, bootstrap: str | None) -> HarnessRunner:
    """A gateway in front of the worker's inference client, recording to the run's gateway-calls topic."""
    from rollway.base.config import ConfigError
    from rollway.gateway.recorder import KafkaRecorder

    cfg = services.cfg
    if not bootstrap:
        raise ConfigError("agent.harness needs the broker's address to record the program's calls: run the agent "
                          "stage with a log reader (rollway up / rollway stage) or set broker.bootstrap")
    recorder = KeepingRecorder(await KafkaRecorder.connect(cfg.broker, cfg.topics, bootstrap))
    enforced = (cfg.agent.temperature, cfg.agent.top_p) if cfg.agent.harness.sampling == "enforce" else None
    gateway = Gateway(services.inference, services.chat, recorder, model_name=cfg.agent.harness.model_name,
                      default_max_tokens=cfg.agent.max_tokens_per_turn, limits=cfg.agent.harness.limits,
                      enforce_sampling=enforced, side_rules=cfg.agent.harness.side_calls.all_rules())
    await gateway.start()
    return HarnessRunner(cfg.agent.harness, gateway, recorder, Path(services.run_dir) / CALLS_DIR)
