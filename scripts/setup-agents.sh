#!/usr/bin/env bash
# Idempotent: the real agent programs that harness episodes are tested with, installed once into
# $ROLLWAY_AGENTS_DIR from this machine's configured registries (pip's and npm's own
# configuration; no registry address is written here):
#   mini-swe-agent-$MINI_VERSION/  a virtualenv with mini-swe-agent (bin/mini)
#   qwen-code-$QWEN_VERSION/       Qwen Code (node_modules/@qwen-code/qwen-code/cli.js) and bin/node, a copy of
#                                  this machine's node, so that one folder bound read-only into a jail or a
#                                  container carries all the program needs, and settings.json
#   codex-$CODEX_VERSION/          the Codex CLI (@openai/codex: node_modules/.bin/codex and its static binary),
#                                  which speaks only the Responses API
#   opencode-$OPENCODE_VERSION/    opencode (opencode-ai: node_modules/.bin/opencode and its self-contained binary,
#                                  which needs no node at run time)
# Each folder gets a .ready file holding its version once complete. Skip with ROLLWAY_SKIP_AGENTS=1.
# Qwen Code 0.15.10 is the last release that runs on Node.js 20 (later ones ask for node >= 22).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${ROLLWAY_SKIP_AGENTS:-0}" = 1 ]; then
  echo "setup-agents: skipped (ROLLWAY_SKIP_AGENTS=1)"
  exit 0
fi
# Default /opt/rollway/agents as root, else ~/.cache/rollway/agents. Not under /root: a docker sandbox binds
# the folder at the same path, and its unprivileged user cannot pass through the image's /root (mode 700).
if [ "$(id -u)" = 0 ]; then DEFAULT_AGENTS=/opt/rollway/agents; else DEFAULT_AGENTS=$HOME/.cache/rollway/agents; fi
CACHE=${ROLLWAY_AGENTS_DIR:-$DEFAULT_AGENTS}
MINI_VERSION=${ROLLWAY_MINI_SWE_AGENT_VERSION:-2.4.6}
QWEN_VERSION=${ROLLWAY_QWEN_CODE_VERSION:-0.15.10}
CODEX_VERSION=${ROLLWAY_CODEX_VERSION:-0.171.0}
OPENCODE_VERSION=${ROLLWAY_OPENCODE_VERSION:-1.18.33}
say() { echo "setup-agents: $*" >&2; }
ready() { [ -f "$1/.ready" ] && [ "$(cat "$1/.ready")" = "$2" ]; }
mkdir -p "$CACHE"
chmod 755 "$CACHE"

# The interpreter of the virtualenv must be one the local jail shows (docs/harness.md): rollway's own
# python's base installation, i.e. the one .venv was made from.
base_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if [ -x .venv/bin/python ]; then
    .venv/bin/python -c 'import os, sys; print(os.path.join(sys.base_prefix, "bin", "python3"))'
  else
    command -v python3
  fi
}

install_mini() {
  local dir="$CACHE/mini-swe-agent-$MINI_VERSION"
  if ready "$dir" "$MINI_VERSION"; then say "mini-swe-agent $MINI_VERSION ready ($dir)"; return; fi
  local py; py=$(base_python)
  [ -x "$dir/bin/python" ] || "$py" -m venv "$dir"
  "$dir/bin/python" -m pip install -q "mini-swe-agent==$MINI_VERSION"
  "$dir/bin/python" -c "import minisweagent"
  echo "$MINI_VERSION" > "$dir/.ready"
  say "mini-swe-agent $MINI_VERSION installed ($dir)"
}

install_qwen() {
  local dir="$CACHE/qwen-code-$QWEN_VERSION"
  if ready "$dir" "$QWEN_VERSION"; then say "Qwen Code $QWEN_VERSION ready ($dir)"; return; fi
  command -v node >/dev/null && command -v npm >/dev/null || {
    say "Qwen Code needs Node.js >= 20 and npm: apt-get install nodejs npm (or ROLLWAY_SKIP_AGENTS=1)"; exit 1; }
  mkdir -p "$dir/bin"
  npm install --prefix "$dir" --no-save --no-audit --no-fund --omit=optional "@qwen-code/qwen-code@$QWEN_VERSION" >/dev/null
  cp "$(readlink -f "$(command -v node)")" "$dir/bin/node"
  "$dir/bin/node" "$dir/node_modules/@qwen-code/qwen-code/cli.js" --version >/dev/null
  echo "$QWEN_VERSION" > "$dir/.ready"
  say "Qwen Code $QWEN_VERSION installed ($dir)"
}

# install_npm_binary LABEL FOLDER PACKAGE VERSION BIN: an npm program whose binary comes in the platform's
# optional package (so not --omit=optional), in $CACHE/FOLDER-VERSION, checked by `BIN --version`.
install_npm_binary() {
  local label=$1 dir="$CACHE/$2-$4" package=$3 version=$4 bin=$5
  if ready "$dir" "$version"; then say "$label $version ready ($dir)"; return; fi
  command -v node >/dev/null && command -v npm >/dev/null || {
    say "$label needs Node.js and npm to install: apt-get install nodejs npm (or ROLLWAY_SKIP_AGENTS=1)"; exit 1; }
  mkdir -p "$dir"
  npm install --prefix "$dir" --no-save --no-audit --no-fund "$package@$version" >/dev/null
  "$dir/node_modules/.bin/$bin" --version >/dev/null
  echo "$version" > "$dir/.ready"
  say "$label $version installed ($dir)"
}

install_mini
install_qwen
install_npm_binary "the Codex CLI" codex @openai/codex "$CODEX_VERSION" codex
install_npm_binary opencode opencode opencode-ai "$OPENCODE_VERSION" opencode
# Qwen Code's settings for offline, non-interactive runs (examples/qwen-code/settings.json), beside the
# program so that the one bound folder holds them (QWEN_CODE_SYSTEM_SETTINGS_PATH names the file).
# Copied on every run: editing the example takes effect with `bash scripts/setup-agents.sh`.
cp examples/qwen-code/settings.json "$CACHE/qwen-code-$QWEN_VERSION/settings.json"
