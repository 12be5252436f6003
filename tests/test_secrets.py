"""Credentials reach every Kafka client but never logs or run folders."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import wait_until
from jobs import run_with_progress

from rollway.base.logging import configure_logging, redact
from rollway.config.run import RunConfig, dump_config
from rollway.runtime.kafka import client_kwargs

SECRET = "s3cr3t-Pa55"


def sasl_config() -> RunConfig:
    return RunConfig.model_validate({"broker": {
        "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": "alice", "sasl_password": SECRET}})


def test_sasl_settings_are_passed_to_clients():
    kw = client_kwargs(sasl_config().broker, "k:9092")
    assert kw["security_protocol"] == "SASL_PLAINTEXT" and kw["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kw["sasl_plain_username"] == "alice" and kw["sasl_plain_password"] == SECRET


def test_sasl_without_mechanism_is_rejected():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="sasl_mechanism"):
        RunConfig.model_validate({"broker": {"security_protocol": "SASL_SSL"}})


def test_dumped_config_masks_the_password():
    assert SECRET not in json.dumps(dump_config(sasl_config()))
    assert SECRET not in repr(sasl_config())


def test_logs_redact_credentials(tmp_path):
    configure_logging("test", tmp_path)
    import structlog

    structlog.get_logger().warning("calling server", header=f"Authorization: Bearer-{SECRET}",
                                   url=f"http://x/?api_key={SECRET}")
    logging.getLogger("plain").warning("token=%s", SECRET)
    for h in logging.getLogger().handlers:
        h.flush()
    text = (tmp_path / "logs" / "test.jsonl").read_text()
    assert "calling server" in text and SECRET not in text
    assert redact(f"password: {SECRET}") == "password: ***"


# ---- the redactor: each credential shape, known secrets, tracebacks ----------------------------------------

KNOWN = "kn0wn-Secret-Value"


def test_redactor_masks_each_credential_shape():
    from rollway.base.logging import MASK

    cases = {
        "Authorization: Bearer sk-abc123XYZ": "sk-abc123XYZ",
        "headers={'Authorization': 'Basic dXNlcjpwYXNz'}": "dXNlcjpwYXNz",
        "sent with bearer tok.en_value-1 attached": "tok.en_value-1",
        "GET https://alice:hunter22@example.com/v1/models": "hunter22",
        "connect to kafka://svc-user:pw-in-url@k:9092": "pw-in-url",
        "retry url=http://x/?api_key=AKIA123&page=2": "AKIA123",
        "password=p4ss-word": "p4ss-word",
        '{"sasl_password": "json-pass"}': "json-pass",
        "token: tkn-0001": "tkn-0001",
        "HF_TOKEN=hf_abcdef": "hf_abcdef",
    }
    for line, secret in cases.items():
        masked = redact(line)
        assert secret not in masked and MASK in masked, (line, masked)
    # ordinary words that contain a key name are left alone
    assert redact("max_tokens=256 token_ids=[1, 2]") == "max_tokens=256 token_ids=[1, 2]"


def test_redactor_masks_known_secret_values_anywhere():
    from rollway.base.logging import register_secrets

    register_secrets([KNOWN])
    assert KNOWN not in redact(f"the server said: unexpected prefix {KNOWN}!")
    assert KNOWN not in redact(f"x{KNOWN}y")


def test_tracebacks_are_redacted_in_structlog_and_stdlib_logs(tmp_path):
    """A secret inside an exception message (a failed request quoting its URL) reaches the log only masked."""
    import structlog

    from rollway.base.logging import register_secrets

    register_secrets([KNOWN])
    configure_logging("tb", tmp_path)
    for logger in (structlog.get_logger(), logging.getLogger("plain")):
        try:
            raise ConnectionError(f"POST https://bob:{SECRET}@h/v1 failed; key {KNOWN}")
        except ConnectionError:
            logger.exception("request failed")
    for h in logging.getLogger().handlers:
        h.flush()
    text = (tmp_path / "logs" / "tb.jsonl").read_text()
    assert text.count("Traceback") == 2 and "ConnectionError" in text
    assert SECRET not in text and KNOWN not in text


def test_child_output_is_redacted(tmp_path):
    """What a child process prints (here an uncaught traceback from Python itself) is masked in its .out file."""
    import sys

    from rollway.base.logging import register_secrets, spawn_logged

    register_secrets([KNOWN])
    out = tmp_path / "child.out"
    proc = spawn_logged([sys.executable, "-c", f"print('Bearer abcdef123'); raise SystemExit('{KNOWN}')"], out)
    assert proc.wait(60) == 1

    wait_until(lambda: out.read_text().count("\n") >= 2, timeout_s=30)  # the copier thread drained both lines
    text = out.read_text()
    assert KNOWN not in text and "abcdef123" not in text and text.count("***") == 2, text


# ---- the config: secrets leave through the environment, never a file --------------------------------------


def planted_config() -> RunConfig:
    return RunConfig.model_validate({
        "broker": {"sasl_username": "alice", "sasl_password": SECRET},
        "policy": {"type": "openai", "base_url": "http://bob:url-Pa55word@127.0.0.1:9/v1", "api_key": "sk-Key-123"}})


def test_resolved_config_holds_no_secret_and_round_trips_through_the_environment(tmp_path, monkeypatch):
    from rollway.config.run import SECRETS_ENV, load_config, write_resolved_config

    cfg = planted_config()
    env = write_resolved_config(cfg, tmp_path / "stage-config.json")
    text = (tmp_path / "stage-config.json").read_text()
    for secret in (SECRET, "url-Pa55word", "sk-Key-123"):
        assert secret not in text
    monkeypatch.setenv(SECRETS_ENV, env[SECRETS_ENV])
    again = load_config(tmp_path / "stage-config.json")
    assert again == cfg
    import os

    assert SECRETS_ENV not in os.environ  # read once, not inherited by what the stage starts


def test_dumped_config_masks_url_credentials():
    dumped = json.dumps(dump_config(planted_config()))
    assert "url-Pa55word" not in dumped and "sk-Key-123" not in dumped and SECRET not in dumped
    assert "http://***@127.0.0.1:9/v1" in dumped


# ---- end to end: secrets planted in a real `rollway up` -------------------------------------------------------

API_KEY = "sk-planted-ApiKey-7f3a"
SASL_PASSWORD = "planted-Sasl-Pa55-91c"
URL_PASSWORD = "planted-Url-Pa55-5d2"
PLANTED = (API_KEY, SASL_PASSWORD, URL_PASSWORD)


class _ScriptedServer:
    """An OpenAI-compatible completions server in front of rollway's scripted policy (the only faked part:
    the model). It answers only requests that carry the planted API key, so the run completes only if the
    key reached the agent processes."""

    def __init__(self, script: list) -> None:
        import asyncio
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from rollway.policies.base import SamplingParams
        from rollway.policies.chat import BytesChatML
        from rollway.policies.config import ScriptRule
        from rollway.policies.scripted import ScriptedPolicy

        policy = ScriptedPolicy([ScriptRule(**r) for r in script], BytesChatML())
        self.unauthorized = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                if self.headers.get("Authorization") != f"Bearer {API_KEY}":
                    outer.unauthorized += 1
                    return self._send(401, {"error": {"message": "Unauthorized"}})
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                gen = asyncio.run(policy.generate(body["prompt"], SamplingParams(
                    max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body.get("seed"))))
                self._send(200, {"choices": [{"token_ids": gen.token_ids, "finish_reason": gen.finish_reason,
                                              "logprobs": {"token_logprobs": gen.logprobs}}]})

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("processes", ["per-stage", "one"])
def test_no_planted_secret_reaches_the_run_folder_logs_ps_or_sandboxes(broker, tmp_path, processes):
    """Attack surface of a real `rollway up examples/smoke.yaml`: an API key, a SASL password and a password
    inside policy.base_url are configured. The episodes' first turn runs `env` in the sandbox (its output is
    kept in trajectories.jsonl). While the stage processes live, `ps` is sampled. Afterwards no planted
    value may be found in any file of the run folder (config, stage-config.json, summary, trajectories,
    failures, logs, .out files), in the console output, in any `ps` line or in the environment block of
    any live process (`/proc/PID/environ`, which keeps a process's start-up environment for its whole life;
    before issue 39 every stage process held ROLLWAY_SECRETS there). Both ways of running the stages:
    processes handed the secrets over a pipe, and tasks of `rollway up` itself."""
    import contextlib
    import subprocess
    import sys
    import uuid

    import yaml
    from conftest import ROOT

    cfg = yaml.safe_load((ROOT / "examples" / "smoke.yaml").read_text())
    script = cfg["policy"]["script"]
    script[0]["turns"].insert(0, '<tool_call>{"name": "bash", "arguments": {"command": "env"}}</tool_call>')
    server = _ScriptedServer(script)
    cfg["policy"] = {"type": "openai", "model": "scripted", "chat_format": "bytes-chatml", "api_key": API_KEY,
                     "base_url": f"http://rollway:{URL_PASSWORD}@127.0.0.1:{server.port}/v1", "max_retries": 2}
    cfg["broker"] = {"sasl_username": "alice", "sasl_password": SASL_PASSWORD}  # PLAINTEXT: kept, never sent
    config = tmp_path / "planted.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir, console_path = tmp_path / "run", tmp_path / "console.txt"
    console_file = console_path.open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "rollway.runners", "up", str(config), "--bootstrap",
                             broker.bootstrap, "--run-dir", str(run_dir), f"runtime.processes={processes}",
                             f"topics.prefix=secrets{uuid.uuid4().hex[:6]}-"],
                            cwd=ROOT, stdout=console_file, stderr=subprocess.STDOUT)
    ps_lines: set[str] = set()
    environ_hits: set[str] = set()
    try:
        while proc.poll() is None:  # sample the live processes' command lines until the job ends
            ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True).stdout
            ps_lines |= {line for line in ps.splitlines() if "rollway" in line}
            environ_hits |= planted_in_environ_blocks()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        console_file.close()
        server.close()
    console = console_path.read_text(errors="replace")
    assert proc.returncode == 0, console[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes_completed"] == 8 and server.unauthorized == 0, summary
    # The sampling saw this run's stage processes (other tests' may run beside it: only lines with its folder)
    stage_processes = any("rollway.runners stage agent" in line and str(run_dir) in line for line in ps_lines)
    assert stage_processes == (processes == "per-stage")
    trajectories = (run_dir / "trajectories.jsonl").read_text()
    assert "PATH=" in trajectories  # `env` ran in the sandboxes, and its output is there to search
    found = []
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found += [f"{path.relative_to(run_dir)}: {s}" for s in PLANTED if s.encode() in data]
    found += [f"console: {s}" for s in PLANTED if s in console]
    found += [f"ps: {line}" for line in ps_lines for s in PLANTED if s in line]
    found += sorted(environ_hits)
    assert not found, found
    assert json.loads((run_dir / "stage-config.json").read_text())["policy"]["api_key"] is None


def planted_in_environ_blocks(planted: tuple[str, ...] = PLANTED) -> set[str]:
    """`/proc/PID/environ: VALUE` for every live process whose environment block holds a planted value."""
    import os

    hits = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            block = open(f"/proc/{pid}/environ", "rb").read()
            command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")[:120].decode(errors="replace")
        except OSError:
            continue
        hits |= {f"/proc/{pid}/environ ({command}): {s}" for s in planted if s.encode() in block}
    return hits


def test_a_child_takes_its_secrets_from_a_pipe_never_its_environment_block_or_argv(tmp_path):
    """Child(secrets=...): the value reaches the child (take_secret), but neither its /proc/PID/environ nor
    its argv holds it while it runs, and nothing it starts inherits it."""
    import sys

    from rollway.base.process import Child

    secret = "planted-Pipe-Secret-44e1"
    code = ("import subprocess, sys; from rollway.base.secret_pipe import take_secret; "
            "v = take_secret('X_SECRET'); print('got', v == sys.argv[1][::-1], flush=True); "
            "env = subprocess.run(['env'], capture_output=True, text=True).stdout; "
            "print('grandchild', sys.argv[1][::-1] in env, flush=True); sys.stdin.readline()")
    log = tmp_path / "child.log"
    child = Child([sys.executable, "-c", code, secret[::-1]], log, stdin_pipe=True, secrets={"X_SECRET": secret})
    child.start()
    try:
        from conftest import wait_until

        wait_until(lambda: "grandchild" in log.read_text(), timeout_s=120)
        block = open(f"/proc/{child.pid}/environ", "rb").read()
        argv = open(f"/proc/{child.pid}/cmdline", "rb").read()
        assert secret.encode() not in block and secret.encode() not in argv
        assert b"ROLLWAY_SECRET_FD=" in block  # the descriptor's number is all its environment says
    finally:
        child.send("")
        assert child.wait(120) == 0
    assert log.read_text().split() == ["got", "True", "grandchild", "False"]


def test_errors_of_an_unreachable_engine_do_not_carry_its_url_password(broker, tmp_path):
    """Attack surface: the failure path. Every request to an engine whose base_url holds a password fails;
    the error texts (failure records on the broker and in failures.jsonl, dead letters, logs) name the URL,
    never its password."""
    import sys
    import uuid

    import yaml
    from conftest import ROOT

    cfg = {"run": {"name": "failing", "timeout_s": 200}, "tasks": {"type": "toy", "count": 2},
           "scheduler": {"group_size": 1, "max_attempts": 1, "episode_deadline_s": 60},
           "policy": {"type": "openai", "model": "scripted", "chat_format": "bytes-chatml", "max_retries": 0,
                      "base_url": f"http://bob:{URL_PASSWORD}@127.0.0.1:9/v1"}}  # port 9: nothing listens
    config, run_dir = tmp_path / "failing.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump(cfg))
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "up", str(config), "--bootstrap", broker.bootstrap,
                          "--run-dir", str(run_dir), f"topics.prefix=failing{uuid.uuid4().hex[:6]}-"],
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    failures = (run_dir / "failures.jsonl").read_text()
    assert "127.0.0.1:9/v1/completions" in failures  # the reason names the endpoint it could not reach
    leaks = [str(p) for p in run_dir.rglob("*") if p.is_file() and URL_PASSWORD.encode() in p.read_bytes()]
    assert not leaks and URL_PASSWORD not in out.stdout + out.stderr, leaks
