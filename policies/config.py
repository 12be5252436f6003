"""Policy (inference) configuration (owned by the policies package)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ScriptRule(BaseModel):
    """One script of the scripted policy: used for prompts that match `when`."""

    model_config = ConfigDict(extra="forbid")

    when: str = ""
    """Regular expression searched in the decoded prompt; "" matches every prompt."""
    turns: list[str]
    """Assistant outputs, one per turn; the last one repeats if the episode runs longer."""


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["scripted", "openai", "sim"] = "scripted"
    """`scripted`: deterministic outputs from `script` (tests, smoke job). `openai`: an
    OpenAI-compatible completions endpoint (`rollway serve`, vLLM, others) at `base_url`. `sim`: the
    benchmark's simulated inference server at `base_url` (`rollway.bench.sim_server`)."""
    chat_format: Literal["bytes-chatml", "hf"] = "bytes-chatml"
    """How messages become token ids. `bytes-chatml`: ChatML over UTF-8 bytes (scripted policy).
    `hf`: the model's own tokenizer and chat template."""
    script: list[ScriptRule] = Field(default_factory=list)
    """Scripted policy: the first rule whose `when` matches the prompt plays its turns."""
    base_url: str | None = None
    """OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1."""
    model: str | None = None
    """Model name sent to the server, or a local model folder / GGUF file for the tokenizer."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Per-request timeout to the inference server."""
