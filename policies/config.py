"""Policy (inference) configuration (owned by the policies package)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ScriptRule(BaseModel):
    """One script of the scripted policy: used for prompts that match `when`."""

    model_config = ConfigDict(extra="forbid")

    when: str = ""
    """Regular expression searched in the decoded prompt; "" matches every prompt."""
    turns: list[str]
    """Assistant outputs, one per turn; the last one repeats if the episode runs longer."""
    alternatives: list[list[str]] = []
    """Other scripts for the same prompts. With temperature > 0 each episode plays `turns` or one of
    these with equal probability, chosen by the episode's request seed (so samples of one group can
    differ, deterministically)."""


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["scripted", "openai", "local"] = "scripted"
    """`scripted`: deterministic outputs from `script` (tests, smoke job). `openai`: an
    OpenAI-compatible completions endpoint (`rollway serve`, vLLM, others) at `base_url`. `local`:
    the built-in batching engine inside this process (loads `model`; no HTTP)."""
    chat_format: Literal["bytes-chatml", "hf"] = "bytes-chatml"
    """How messages become token ids. `bytes-chatml`: ChatML over UTF-8 bytes (scripted policy).
    `hf`: the model's own tokenizer and chat template (from `tokenizer`, else `model`)."""
    script: list[ScriptRule] = Field(default_factory=list)
    """Scripted policy: the first rule whose `when` matches the prompt plays its turns."""
    base_url: str | None = None
    """OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1."""
    launch: bool = False
    """`openai` only: `rollway up`/`eval`/`chaos` start the built-in engine (`rollway serve` with
    model, dtype, max_batch, max_model_len, threads) on a free loopback port and point `base_url`
    at it; the learner's new policies are loaded into it."""
    model: str | None = None
    """Local model: 'smollm2' (the bundled SmolLM2-135M-Instruct GGUF), a .gguf file or a Hugging Face
    folder. For `openai`, also the model name sent to the server (None: the server's first model)."""
    tokenizer: str | None = None
    """Where the `hf` chat format loads its tokenizer when `model` is only a server-side name
    (a local folder or 'smollm2'). None: `model`, else the bundled SmolLM2."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Per-request timeout to the inference server."""
    max_retries: int = Field(5, ge=0)
    """Retries (exponential backoff from 0.5 s) on connection errors and 5xx answers."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """`local`: weights dtype (bf16 decodes batches faster on CPU; fp32 for bit-stable tests)."""
    device: str | None = None
    """`local`: torch device; None picks CUDA when present, else CPU."""
    max_batch: int = Field(8, ge=1)
    """`local`: sequences decoded together (continuous batching)."""
    max_model_len: int = Field(2048, ge=16)
    """`local`: prompt + completion tokens per sequence."""
    threads: int = Field(0, ge=0)
    """`local`: torch CPU threads; 0 keeps torch's default (1 is faster on shared, busy cores)."""

    @model_validator(mode="after")
    def _needs(self) -> PolicyConfig:
        if self.type == "openai" and not self.base_url and not self.launch:
            raise ValueError("policy.type=openai needs policy.base_url (e.g. http://127.0.0.1:8000/v1) "
                             "or policy.launch=true")
        return self
