"""Build the configured chat format and inference client."""

from __future__ import annotations

from pathlib import Path

from rollway.base.registry import Registry
from rollway.policies.base import ChatFormat, InferenceClient
from rollway.policies.config import PolicyConfig

POLICIES = Registry("policy", "policy.type", "rollway.policies.base:InferenceClient")
"""`policy.type` -> InferenceClient class and its config class; `build_inference` builds every one, built-in
or plugin, with `Class.from_config(config, chat, taskset)` (default: `Class(config, chat)`)."""
POLICIES.add("scripted", "rollway.policies.scripted:ScriptedPolicy", "rollway.policies.config:ScriptedPolicyConfig")
POLICIES.add("openai", "rollway.policies.openai_client:OpenAICompletionsClient", "rollway.policies.config:OpenAIPolicyConfig")
POLICIES.add("local", "rollway.policies.local:LocalEngineClient", "rollway.policies.config:LocalPolicyConfig")
POLICIES.add("gold", "rollway.policies.gold:GoldPolicy", "rollway.policies.config:GoldPolicyConfig")


def build_chat_format(cfg: PolicyConfig) -> ChatFormat:
    if cfg.chat_format == "bytes-chatml":
        from rollway.policies.chat import BytesChatML

        return BytesChatML()
    if cfg.chat_format == "hf":
        from rollway.policies.hf_chat import HFChatFormat
        from rollway.policies.model_loading import load_tokenizer

        return HFChatFormat(load_tokenizer(tokenizer_source(cfg)))
    raise NotImplementedError(f"policy.chat_format={cfg.chat_format!r} is not built yet")


def tokenizer_source(cfg: PolicyConfig) -> str | None:
    """Where the `hf` chat format's tokenizer comes from: `tokenizer`, else `model` when it names a
    local model (or for in-process and launched engines, which serve `model`), else the folder the
    server reports serving. Never silently the bundled model for some other served model."""
    if cfg.tokenizer:
        return cfg.tokenizer
    if cfg.type != "openai" or cfg.launch or _is_local_model(cfg.model):
        return cfg.model
    root = _served_root(cfg)
    if root is not None and _is_local_model(root):
        return root
    raise ValueError(f"policy.tokenizer is not set and the served model ({cfg.model or root!r}) is not a "
                     "folder readable here: set policy.tokenizer to the served model's tokenizer (a local "
                     "Hugging Face folder, a .gguf file or 'smollm2')")


def _is_local_model(spec: str | None) -> bool:
    if spec in (None, "", "smollm2"):
        return spec == "smollm2"
    path = Path(spec).expanduser()
    return path.suffix == ".gguf" and path.is_file() or (path / "config.json").is_file() or (
        path.is_dir() and any(path.glob("*.gguf")))


def _served_root(cfg: PolicyConfig) -> str | None:
    """The `root` (vLLM: the model's path or hub name) of the served model in /v1/models."""
    from rollway.base.http import http_get

    urls = cfg.base_urls()
    if not urls:
        return None
    key = cfg.api_key_value()
    try:
        models = http_get(f"{urls[0].rstrip('/')}/models", timeout_s=10,
                          headers={"Authorization": f"Bearer {key}"} if key else None).json()["data"]
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"could not ask {urls[0]}/models which model it serves ({err}); set policy.tokenizer "
                         "to the served model's tokenizer") from err
    chosen = next((m for m in models if m.get("id") == cfg.model), models[0] if models else None)
    return None if chosen is None else chosen.get("root") or chosen.get("id")


def build_inference(cfg: PolicyConfig, chat: ChatFormat, taskset: object = None) -> InferenceClient:
    """The configured inference client: the class `policy.type` names, built by its `from_config`.
    `taskset`: the run's task set, for the `gold` policy."""
    return POLICIES.load(cfg.type).from_config(cfg, chat, taskset)
