"""`policy.type: sim`: a minimal OpenAI-completions client for the benchmark's simulated server."""

from __future__ import annotations

import aiohttp

from rollway.policies.base import Generation, InferenceClient, SamplingParams
from rollway.policies.config import PolicyConfig


class SimInferenceClient(InferenceClient):
    """Token ids in (`prompt` as a list of ids), token ids and logprobs out (`token_ids`,
    `logprobs.token_logprobs`), over POST {base_url}/completions."""

    def __init__(self, cfg: PolicyConfig):
        if not cfg.base_url:
            raise ValueError("policy.type=sim needs policy.base_url, e.g. http://127.0.0.1:8000/v1")
        self.url = cfg.base_url.rstrip("/") + "/completions"
        self.model = cfg.model or "sim"
        self.timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
        self.session: aiohttp.ClientSession | None = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self.session is None:  # created lazily: it must belong to the running event loop
            self.session = aiohttp.ClientSession(timeout=self.timeout)
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "logprobs": 1,
                "stop_token_ids": list(params.stop_token_ids), "return_token_ids": True}
        async with self.session.post(self.url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"inference server {self.url} answered {resp.status}: {await resp.text()}")
            choice = (await resp.json())["choices"][0]
        return Generation(choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["finish_reason"], 0)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
