"""The real agent programs harness tests run (scripts/setup-agents.sh installs them, cached in
$ROLLWAY_AGENTS_DIR; it is run again here when one is missing, so a test fails, never skips, without them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from jobs import run_with_progress

REPO = Path(__file__).resolve().parent.parent
_DEFAULT = Path("/opt/rollway/agents") if os.getuid() == 0 else Path.home() / ".cache" / "rollway" / "agents"
CACHE = Path(os.environ.get("ROLLWAY_AGENTS_DIR", _DEFAULT))
MINI_VERSION = "2.4.6"
QWEN_VERSION = "0.15.10"
CODEX_VERSION = "0.171.0"
OPENCODE_VERSION = "1.18.33"


def _ensure(folder: Path, version: str) -> Path:
    ready = folder / ".ready"
    if not (ready.exists() and ready.read_text().strip() == version):
        env = {**os.environ, "ROLLWAY_SKIP_AGENTS": "0"}
        proc = run_with_progress(["bash", str(REPO / "scripts" / "setup-agents.sh")], env=env)
        assert proc.returncode == 0, f"scripts/setup-agents.sh failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    assert ready.exists() and ready.read_text().strip() == version, f"setup-agents.sh left no {ready}"
    return folder


def mini_swe_agent() -> Path:
    """The mini-swe-agent virtualenv (bin/mini)."""
    return _ensure(CACHE / f"mini-swe-agent-{MINI_VERSION}", MINI_VERSION)


MINI_ENV = {
    # Set up already: no first-run questions, no cost look-up that fails for a local model, quiet start.
    "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_SILENT_STARTUP": "1",
    # litellm's model cost map from the package instead of GitHub (three tries, with back-off, offline).
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    # mini-swe-agent loads a global `.env` at import (API keys, MSWEA_* settings) from its config folder,
    # by default under HOME: kept in the sandbox's own /tmp, so no user configuration is ever read.
    "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mini-swe-agent",
}
# mini-swe-agent's entry point run by the sandbox's own python3 (a docker image's): the virtualenv's
# bin/mini names the host interpreter it was made from, which a container does not have. Its packages
# are built for that interpreter's minor version (3.11), which the image's python3 must share.
MINI_MAIN = "import sys; sys.path.insert(0, {site!r}); from minisweagent.run.mini import app; sys.exit(app())"


def mini_harness(venv: Path, own_python: bool = False, configs: tuple[str, ...] | list[str] = ("mini_textbased.yaml",)) -> dict:
    """`agent.harness` running mini-swe-agent from `venv` (bound read-only) in its text format: actions
    are fenced `mswea_bash_command` blocks in the reply's text (litellm_textbased reads them).
    `own_python`: start it with the sandbox's python3 instead of the virtualenv's (docker images).
    `configs`: its `-c` specs, merged in order: files under minisweagent/config, or KEY=VALUE."""
    site = next(venv.glob("lib/python3.*/site-packages"))
    specs = [c if "=" in c else str(site / "minisweagent" / "config" / c) for c in configs]
    program = ["python3", "-c", MINI_MAIN.format(site=str(site))] if own_python else [str(venv / "bin" / "mini")]
    return {
        "command": [*program, *(a for spec in specs for a in ("-c", spec)), "-m", "openai/rollway-policy",
                    "--model-class", "litellm_textbased", "-t", "{instruction}", "-y", "--exit-immediately",
                    "-l", "0", "-o", "/tmp/mini.traj.json"],
        "env": dict(MINI_ENV),
        "install": {"type": "host_dir", "path": str(venv)},
    }


def qwen_code() -> Path:
    """The Qwen Code folder: bin/node, node_modules/@qwen-code/qwen-code/cli.js, settings.json."""
    return _ensure(CACHE / f"qwen-code-{QWEN_VERSION}", QWEN_VERSION)


def codex_cli() -> Path:
    """The Codex CLI folder: node_modules/.bin/codex (Responses API only)."""
    return _ensure(CACHE / f"codex-{CODEX_VERSION}", CODEX_VERSION)


def opencode() -> Path:
    """The opencode folder: node_modules/.bin/opencode (a self-contained binary; chat completions)."""
    return _ensure(CACHE / f"opencode-{OPENCODE_VERSION}", OPENCODE_VERSION)


def opencode_config(context: int = 65536, title: bool = False) -> dict:
    """opencode's settings for offline, unattended runs (docs/harness.md names each): the gateway as an
    OpenAI-compatible provider, the model's context limit, no title agent unless `title`."""
    model = {"name": "rollway-policy", "limit": {"context": context, "output": 1024}}
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "rollway", "models": {"rollway-policy": model},
                "options": {"baseURL": "{env:OPENAI_BASE_URL}", "apiKey": "{env:OPENAI_API_KEY}"}}
    cfg = {"model": "rollway/rollway-policy", "small_model": "rollway/rollway-policy", "autoupdate": False,
           "share": "disabled", "provider": {"rollway": provider},
           "tools": {"webfetch": False, "task": False, "skill": False, "todowrite": False}}
    return cfg if title else {**cfg, "agent": {"title": {"disable": True}}}


def opencode_harness(folder: Path, **config: object) -> dict:
    """`agent.harness` running `opencode run --auto INSTRUCTION` from `folder` (bound read-only)."""
    return {
        "command": [str(folder / "node_modules" / ".bin" / "opencode"), "run", "--auto", "{instruction}"],
        "env": {"OPENCODE_CONFIG_CONTENT": json.dumps(opencode_config(**config)), "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_DISABLE_AUTOUPDATE": "1"},
        "install": {"type": "host_dir", "path": str(folder)},
    }


def qwen_harness(folder: Path) -> dict:
    """`agent.harness` running Qwen Code non-interactively from `folder` (bound read-only)."""
    return {
        "command": [str(folder / "bin" / "node"), str(folder / "node_modules" / "@qwen-code" / "qwen-code" / "cli.js"),
                    "-p", "{instruction}", "--yolo"],
        "env": dict(QWEN_ENV, QWEN_CODE_SYSTEM_SETTINGS_PATH=str(folder / "settings.json")),
        "install": {"type": "host_dir", "path": str(folder)},
    }


QWEN_ENV = {
    # One node process: Qwen Code otherwise relaunches itself with a larger heap (twice the start-up).
    "QWEN_CODE_NO_RELAUNCH": "1",
    # Node's fetch and Qwen Code's shell parser use WebAssembly; without the trap handler its memories
    # reserve far less address space (16 GB instead of 43 GB measured for `cli.js --help`), which matters
    # where a local jail limits it per process (sandbox.address_space_mb, or a host without memory cgroups).
    "NODE_OPTIONS": "--disable-wasm-trap-handler --max-old-space-size=1024",
}


def assert_captured_tokens(t: dict, texts: list[str], prompt_has: list[str]) -> None:
    """Issue 27 item 3's checks on a trajectory a real program made through the gateway, with the
    scripted policy (bytes-chatml) as the model: each captured call's output ids and logprobs equal
    what the scripted engine returned for `texts` (encode(text) + the stop token, each with
    SCRIPTED_LOGPROB), the loss mask covers exactly those, the gateway's re-render of every continued
    call matched the prompt the engine saw (one segment, no drift), and the prompt holds `prompt_has`
    (the program's own system prompt and the task's instruction reached the engine)."""
    from rollway.policies.config import ScriptedPolicyConfig
    from rollway.policies.factory import build_chat_format
    from rollway.policies.scripted import SCRIPTED_LOGPROB

    chat = build_chat_format(ScriptedPolicyConfig(script=[{"when": "", "turns": ["x"]}], chat_format="bytes-chatml"))
    returned = [chat.encode(text) + list(chat.stop_token_ids[:1]) for text in texts]
    assert [t["token_ids"][s:e] for s, e in t["turn_spans"]] == returned
    assert [t["logprobs"][s:e] for s, e in t["turn_spans"]] == [[SCRIPTED_LOGPROB] * len(r) for r in returned]
    assert [turn["completion_ids"] for turn in t["turns"]] == returned
    assert sum(t["loss_mask"]) == sum(e - s for s, e in t["turn_spans"])
    assert t["segment_starts"] == [] and not any(turn["template_drift"] for turn in t["turns"])
    prompt = chat.decode(t["token_ids"][: t["turn_spans"][0][0]])
    assert all(part in prompt for part in prompt_has), prompt[-2000:]
