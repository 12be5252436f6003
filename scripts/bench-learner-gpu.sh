#!/usr/bin/env bash
# The learner's GPU table in docs/benchmarks.md ("The learner", "On one H100"):
# Qwen3-shaped models initialised at random from their configuration (no weights are downloaded),
# then `rollway bench learner` at 4,096-token episodes. Needs a CUDA GPU and a Python where rollway,
# torch and transformers import (PYTHON, default python3).
set -uo pipefail
PY=${PYTHON:-python3}
DIR=${1:-/tmp/rollway-qwen3-shapes}
mkdir -p "$DIR"
"$PY" - "$DIR" <<'PY'
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

shapes = {"0.6b": dict(hidden_size=1024, intermediate_size=3072),
          "1.7b": dict(hidden_size=2048, intermediate_size=6144)}
for name, kw in shapes.items():
    cfg = Qwen3Config(vocab_size=151936, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
                      rope_theta=1000000, **kw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(f"{sys.argv[1]}/{name}")
    print(name, sum(p.numel() for p in model.parameters()), "parameters")
PY
C="--json --device cuda --dtype float32 --autocast-bf16 --batch 8 --seq-len 4096 --prompt-len 512 --steps 3"
run() { echo "== $*"; "$PY" -m rollway.learning.bench $C "$@" 2>&1 | tail -1; }
run --model "$DIR/0.6b" --micro-batch-tokens 8192
run --model "$DIR/0.6b" --micro-batch-tokens 16384 --fsdp --ranks 1
run --model "$DIR/0.6b" --micro-batch-tokens 16384 --gradient-checkpointing
run --model "$DIR/0.6b" --micro-batch-tokens 16384 --lora --lora-r 16
run --model "$DIR/1.7b" --micro-batch-tokens 8192
run --model "$DIR/1.7b" --micro-batch-tokens 16384 --fsdp --ranks 1 --gradient-checkpointing
