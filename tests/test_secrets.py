"""Credentials reach every Kafka client but never logs or run folders."""

from __future__ import annotations

import json
import logging

from conftest import wait_until

from rollway.core.config import RunConfig, dump_config
from rollway.core.kafka import client_kwargs
from rollway.core.logging import configure_logging, redact

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
    from rollway.core.logging import MASK

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
    from rollway.core.logging import register_secrets

    register_secrets([KNOWN])
    assert KNOWN not in redact(f"the server said: unexpected prefix {KNOWN}!")
    assert KNOWN not in redact(f"x{KNOWN}y")


def test_tracebacks_are_redacted_in_structlog_and_stdlib_logs(tmp_path):
    """A secret inside an exception message (a failed request quoting its URL) reaches the log only masked."""
    import structlog

    from rollway.core.logging import register_secrets

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

    from rollway.core.logging import register_secrets, spawn_logged

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
    from rollway.core.config import SECRETS_ENV, load_config, write_resolved_config

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
