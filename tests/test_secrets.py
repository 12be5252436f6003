"""Credentials reach every Kafka client but never logs or run folders."""

from __future__ import annotations

import json
import logging

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
