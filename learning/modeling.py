"""Loading the policy model for training through the policies package's loader (one loader for
inference and training), plus device/dtype helpers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ModelFactory = Callable[[str | None], tuple[Any, Any | None]]
"""path_or_none -> (causal LM, tokenizer or None). The trainer calls it with a checkpoint folder
on resume and with None for the configured initial model."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    """`auto` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def load_policy_model(spec: str | None, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any | None]:
    """(model, tokenizer) for `spec`: None or "smollm2" (bundled SmolLM2-135M GGUF, converted once),
    a `.gguf` file, or a local HF folder (a rollway checkpoint is one). Tokenizer None when the
    folder holds no tokenizer files (the checkpoints then hold none either)."""
    from rollway.policies.model_loading import load_causal_lm, load_tokenizer

    name = next(k for k, v in DTYPES.items() if v == dtype)
    model = load_causal_lm(spec, dtype=name, device=str(device))
    try:
        tokenizer = load_tokenizer(spec)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


RANDOM_PREFIX = "random:"


def default_factory(model_path: str | None, device: torch.device, dtype: torch.dtype) -> ModelFactory:
    """Factory over `load_policy_model`: None means `model_path` (the configured initial model).
    `random:SEED` is a tiny random 2-layer Llama (vocab 300, for byte-level chat formats): tests
    and chaos runs train a real model without loading one."""
    if model_path and model_path.startswith(RANDOM_PREFIX):
        from rollway.learning.testing import tiny_model_factory

        return tiny_model_factory(int(model_path[len(RANDOM_PREFIX):] or 0))
    return lambda path: load_policy_model(path or model_path, device, dtype)
