"""Settings of the learner beyond one process: ranks and sharding, LoRA adapters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollway.base.config import StrictModel


class DistConfig(StrictModel):
    """How many learner ranks train one model (FSDP2 `fully_shard`), and how they talk."""


    ranks: int = Field(1, ge=1)
    """Learner processes. 1: the single-process trainer (unless `fsdp`). N > 1: the learner process is
    rank 0 (it alone consumes, commits and publishes) and starts ranks 1..N-1 itself; `rollway up
    --workers learner=N` sets this. Under `torchrun` the rank count comes from WORLD_SIZE instead."""
    fsdp: bool = False
    """Shard with FSDP2 even with one rank (its checkpoints then resume with any rank count)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend: `auto` is NCCL on CUDA, gloo on CPU."""
    collective_timeout_s: float = Field(300.0, gt=0)
    """A collective (or the start-up rendezvous) that has not finished after this long fails the step
    on every rank instead of hanging (a rank died or stalled)."""
    master_port: int | None = Field(None, ge=1, le=65535)
    """Rendezvous port rank 0 listens on when it starts the other ranks itself; None picks a free one."""


class LoraConfig(StrictModel):
    """Low-rank adapters (peft): only the adapters train, are checkpointed and are sent to the engine."""


    enabled: bool = False
    """Train LoRA adapters on the frozen base model instead of every weight."""
    r: int = Field(8, ge=1)
    """Adapter rank."""
    alpha: float = Field(16.0, gt=0)
    """Scaling numerator: the update is (alpha / r) * B @ A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter input (0 keeps pi_old and pi_theta equal on the on-policy step)."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get adapters."""
