"""Policy (inference) configuration (owned by the policies package): the chat format every policy has
(`PolicyConfig`) and one config class per policy type with its own fields, chosen by `policy.type`."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, SecretStr, model_validator

from rollway.base.config import StrictModel
from rollway.base.plugins import PluginRef
from rollway.base.registry import SectionConfig


class ScriptRule(StrictModel):
    """One script of the scripted policy: used for prompts that match `when`."""


    when: str = ""
    """Regular expression searched in the decoded prompt; "" matches every prompt."""
    turns: list[str]
    """Assistant outputs, one per turn; the last one repeats if the episode runs longer."""
    alternatives: list[list[str]] = []
    """Other scripts for the same prompts. With temperature > 0 each episode plays `turns` or one of
    these with equal probability, chosen by the episode's request seed (so samples of one group can
    differ, deterministically)."""
    seconds: float = Field(0.0, ge=0, le=3600)
    """How long each answer of this rule takes, as a slow engine or a model that rambles to its token limit
    would (tests of time limits)."""


class PolicyConfig(SectionConfig):
    """The `policy:` section's fields common to every policy (how messages become tokens); a policy's own
    fields are on its config class below (plugins: their `config_class`)."""

    registry: ClassVar[str | None] = "rollway.policies.factory:POLICIES"

    type: Literal["scripted", "openai", "local", "gold"] | PluginRef = "scripted"
    """`scripted`: deterministic outputs from `script` (tests, smoke job). `openai`: an
    OpenAI-compatible completions endpoint (`rollway serve`, vLLM, others) at `base_url`. `local`:
    the built-in batching engine inside this process (loads `model`; no HTTP). `gold`: plays the task
    set's `reference_solution` (`rollway tasks verify`). `python:MODULE:CLASS`: your own
    InferenceClient subclass, constructed as `Class(config, chat_format)` (its `config_class`, a
    PolicyConfig subclass, may add options)."""
    chat_format: Literal["bytes-chatml", "hf"] = "bytes-chatml"
    """How messages become token ids. `bytes-chatml`: ChatML over UTF-8 bytes (scripted policy).
    `hf`: the model's own tokenizer and chat template (from `tokenizer`, else `model`)."""
    model: str | None = None
    """Local model: 'smollm2' (the bundled SmolLM2-135M-Instruct GGUF), a .gguf file or a Hugging Face
    folder. For `openai`, also the model name sent to the server (None: the server's first model)."""
    tokenizer: str | None = None
    """Where the `hf` chat format loads its tokenizer (a local folder, a .gguf or 'smollm2'). None:
    `model` when it names a local model, else the model the server says it serves (`root` in its
    /v1/models, when that folder is readable here); otherwise an error asks for this field."""


class ScriptedPolicyConfig(PolicyConfig):
    """`policy.type: scripted`."""

    implementation = "scripted"
    script: list[ScriptRule] = Field(default_factory=list)
    """Scripted policy: the first rule whose `when` matches the prompt plays its turns."""
    max_model_len: int | None = Field(None, ge=2)
    """The context the stand-in model declares, prompt and output tokens (None: unbounded): a longer
    prompt is refused as an engine refuses it, to see what a program does at its context's end."""


class GoldPolicyConfig(PolicyConfig):
    """`policy.type: gold` (plays the task set's reference solutions)."""

    implementation = "gold"


class EnginePolicyConfig(PolicyConfig):
    """Settings of a built-in engine: the in-process one (`local`) or one `openai` launches."""

    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Weights dtype (bf16 decodes batches faster on CPU; fp32 for bit-stable tests)."""
    device: str | None = None
    """Torch device; None picks CUDA when present, else CPU."""
    max_batch: int = Field(8, ge=1)
    """Sequences decoded together (continuous batching)."""
    max_model_len: int = Field(2048, ge=16)
    """Prompt + completion tokens per sequence."""
    threads: int = Field(0, ge=0)
    """Torch CPU threads; 0 keeps torch's default (1 is faster on shared, busy cores)."""


class LocalPolicyConfig(EnginePolicyConfig):
    """`policy.type: local`: the built-in batching engine inside this process."""

    implementation = "local"


class OpenAIPolicyConfig(EnginePolicyConfig):
    """`policy.type: openai`: an OpenAI-compatible server (the engine settings apply when `launch`)."""

    implementation = "openai"

    base_url: str | None = None
    """OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1. With `engine: vllm`, several vLLM
    replicas may be given separated by commas."""
    launch: bool = False
    """`rollway up`/`eval`/`chaos` start the engine (`engine`) on free loopback ports
    and point `base_url` at it; the learner's new policies are loaded into it."""
    engine: Literal["auto", "builtin", "vllm"] = "auto"
    """Which server `launch` starts, and how the client talks to it. `vllm`: vLLM's OpenAI server from
    the vLLM environment (`scripts/setup-vllm.sh`), token route with per-response weight versions,
    updates through pause/reload/resume. `builtin`: `rollway serve`. `auto`: `vllm` when launching
    and the vLLM environment exists, else `builtin` (with a message saying how to get vLLM)."""
    replicas: int = Field(1, ge=1)
    """`launch` with `engine: vllm`: servers started; requests go to the least-loaded live one and
    every replica is updated to the same version."""
    api: Literal["completions", "chat"] = "completions"
    """Not launched: `completions` sends token ids and reads token ids and logprobs back
    (what training needs); `chat` sends messages to `/chat/completions`, for endpoints that take no
    token ids (evaluation only: logprobs are zero, so such runs must not train)."""
    api_key: SecretStr | None = None
    """Bearer token sent to the server. None: the environment variable `OPENAI_API_KEY` when set."""
    pause_mode: Literal["wait", "abort"] = "wait"
    """vLLM weight updates: `wait` lets running turns finish on the old weights before the reload;
    `abort` ends them at once and the client samples those turns again on the new weights."""
    enforce_eager: bool = True
    """vLLM: `--enforce-eager` (no compile warm-up). Measured here with SmolLM2: ready in about 1
    minute instead of about 3."""
    kv_cache_gib: float = Field(2.0, gt=0)
    """vLLM on CPU: KV cache size per replica (`VLLM_CPU_KVCACHE_SPACE`)."""
    vllm_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for each vLLM server."""
    start_timeout_s: float = Field(900.0, gt=0)
    """How long a launched engine may take to answer /health."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Per-request timeout to the inference server. A generation is not given up for being long (its length
    is the model's and the program's doing): each time this passes without its answer, the server is asked
    GET /v1/models, and the generation is given up (the engine's failure, retried) only when that goes
    unanswered too, or, on vLLM, when the server, not paused, processed no token since the last such check
    (a whole timeout without work: its engine is stuck; keep it above the engine's longest step)."""
    max_retries: int = Field(5, ge=0)
    """Retries (exponential backoff from 0.5 s) on connection errors and 5xx answers."""

    @model_validator(mode="after")
    def _needs(self) -> OpenAIPolicyConfig:
        if not self.base_url and not self.launch:
            raise ValueError("policy.type=openai needs policy.base_url (e.g. http://127.0.0.1:8000/v1) "
                             "or policy.launch=true")
        if self.api == "chat" and (self.launch or self.engine == "vllm"):
            raise ValueError("policy.api=chat is for external endpoints without token ids; a launched "
                             "engine and vLLM serve token ids: use policy.api=completions")
        return self

    def base_urls(self) -> list[str]:
        """The servers in `base_url` (comma-separated for several vLLM replicas)."""
        return [u.strip() for u in (self.base_url or "").split(",") if u.strip()]

    def api_key_value(self) -> str | None:
        import os

        return self.api_key.get_secret_value() if self.api_key else os.environ.get("OPENAI_API_KEY") or None
