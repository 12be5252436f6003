"""`policy.type: local`: the built-in batching engine in this process, no HTTP in between."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollway.policies.base import Generation, InferenceClient, InferenceRequestError, SamplingParams
from rollway.policies.config import LocalPolicyConfig


class LocalEngineClient(InferenceClient):
    """Sends each turn straight to a `BatchEngine` (concurrent turns share its batches)."""

    def __init__(self, engine: Any):
        self.engine = engine

    @classmethod
    def from_config(cls, cfg: LocalPolicyConfig, chat: Any = None, taskset: Any = None) -> LocalEngineClient:
        import torch  # late: heavy

        from rollway.policies.batching import BatchEngine
        from rollway.policies.model_loading import eos_token_ids, load_causal_lm

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        model = load_causal_lm(cfg.model, dtype=cfg.dtype, device=cfg.device)
        return cls(BatchEngine(model, eos_token_ids(model), cfg.max_batch, cfg.max_model_len).start())

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        from rollway.policies.batching import EngineRequest, RequestRefused

        try:
            out = await self.engine.generate(EngineRequest(list(prompt_ids), params))
        except RequestRefused as err:  # what was asked (a prompt too long, an id outside the vocabulary)
            raise InferenceRequestError(str(err)) from None
        return Generation(out.token_ids, out.logprobs, out.finish_reason, out.policy_version)

    supports_weight_sync = True

    async def load_weights(self, path: str | Path, version: int) -> int:
        """Load a safetensors checkpoint folder as policy `version` (after running turns finish)."""
        return await self.engine.update_weights(path, version)

    async def served_version(self) -> int | None:
        return self.engine.policy_version

    async def context_tokens(self) -> int | None:
        return self.engine.max_model_len

    async def close(self) -> None:
        self.engine.stop()
