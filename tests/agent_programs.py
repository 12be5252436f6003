"""The real agent programs harness tests run (scripts/setup-agents.sh installs them, cached in
$ROLLWAY_AGENTS_DIR; it is run again here when one is missing, so a test fails, never skips, without them)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_DEFAULT = Path("/opt/rollway/agents") if os.getuid() == 0 else Path.home() / ".cache" / "rollway" / "agents"
CACHE = Path(os.environ.get("ROLLWAY_AGENTS_DIR", _DEFAULT))
MINI_VERSION = "2.4.6"
QWEN_VERSION = "0.15.10"


def _ensure(folder: Path, version: str) -> Path:
    ready = folder / ".ready"
    if not (ready.exists() and ready.read_text().strip() == version):
        env = {**os.environ, "ROLLWAY_SKIP_AGENTS": "0"}
        proc = subprocess.run(["bash", str(REPO / "scripts" / "setup-agents.sh")], capture_output=True, text=True,
                              env=env, timeout=900)
        assert proc.returncode == 0, f"scripts/setup-agents.sh failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    assert ready.exists() and ready.read_text().strip() == version, f"setup-agents.sh left no {ready}"
    return folder


def mini_swe_agent() -> Path:
    """The mini-swe-agent virtualenv (bin/mini)."""
    return _ensure(CACHE / f"mini-swe-agent-{MINI_VERSION}", MINI_VERSION)


def qwen_code() -> Path:
    """The Qwen Code folder: bin/node, node_modules/@qwen-code/qwen-code/cli.js, settings.json."""
    return _ensure(CACHE / f"qwen-code-{QWEN_VERSION}", QWEN_VERSION)


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
    # reserve far less address space, which the local jail limits per process (sandbox.memory_mb).
    "NODE_OPTIONS": "--disable-wasm-trap-handler --max-old-space-size=1024",
}
