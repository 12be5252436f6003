"""Build the configured chat format and inference client."""

from __future__ import annotations

from rollway.policies.base import ChatFormat, InferenceClient
from rollway.policies.config import PolicyConfig


def build_chat_format(cfg: PolicyConfig) -> ChatFormat:
    if cfg.chat_format == "bytes-chatml":
        from rollway.policies.chat import BytesChatML

        return BytesChatML()
    raise NotImplementedError(f"policy.chat_format={cfg.chat_format!r} is not built yet")


def build_inference(cfg: PolicyConfig, chat: ChatFormat) -> InferenceClient:
    if cfg.type == "scripted":
        from rollway.policies.scripted import ScriptedPolicy

        return ScriptedPolicy(cfg.script, chat)
    if cfg.type == "sim":
        from rollway.bench.sim_client import SimInferenceClient

        return SimInferenceClient(cfg)
    raise NotImplementedError(f"policy.type={cfg.type!r} is not built yet")
