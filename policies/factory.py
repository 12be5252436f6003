"""Build the configured chat format and inference client."""

from __future__ import annotations

from rollway.policies.base import ChatFormat, InferenceClient
from rollway.policies.config import PolicyConfig


def build_chat_format(cfg: PolicyConfig) -> ChatFormat:
    if cfg.chat_format == "bytes-chatml":
        from rollway.policies.chat import BytesChatML

        return BytesChatML()
    if cfg.chat_format == "hf":
        from rollway.policies.hf_chat import HFChatFormat
        from rollway.policies.model_loading import load_tokenizer

        source = cfg.tokenizer or (cfg.model if cfg.type != "openai" else None)
        return HFChatFormat(load_tokenizer(source))
    raise NotImplementedError(f"policy.chat_format={cfg.chat_format!r} is not built yet")


def build_inference(cfg: PolicyConfig, chat: ChatFormat) -> InferenceClient:
    if cfg.type == "scripted":
        from rollway.policies.scripted import ScriptedPolicy

        return ScriptedPolicy(cfg.script, chat)
    if cfg.type == "openai":
        from rollway.policies.openai_client import OpenAICompletionsClient

        return OpenAICompletionsClient(cfg.base_url or "", cfg.model, cfg.request_timeout_s, cfg.max_retries)
    if cfg.type == "local":
        from rollway.policies.local import LocalEngineClient

        return LocalEngineClient.from_config(cfg)
    raise NotImplementedError(f"policy.type={cfg.type!r} is not built yet")
