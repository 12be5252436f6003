"""A custom sandbox: a plain folder per episode, no isolation (trusted code only).
Run: python examples/extending/custom_sandbox.py"""

import asyncio
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rollway.config.run import load_config
from rollway.sandboxes.base import ExecResult, Sandbox, SandboxError, SandboxProvider, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.factory import build_sandbox_provider


class FolderSandbox(Sandbox):
    """All state lives in the folder, so any worker can reattach from `handle`."""

    def __init__(self, box: Path) -> None:
        self.box, self.workspace = box, box / "workspace"

    @property
    def handle(self) -> dict[str, Any]:
        return {"kind": "folder", "path": str(self.box)}

    async def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        proc = await asyncio.create_subprocess_shell(command, cwd=self.workspace, stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s or 30)
        except TimeoutError:
            proc.kill()
            return ExecResult(-9, "timed out", timed_out=True)
        return ExecResult(proc.returncode, out.decode(errors="replace"))

    def _path(self, path: str) -> Path:
        target = (self.workspace / path).resolve()
        if not target.is_relative_to(self.workspace.resolve()):
            raise SandboxError(f"{path!r} is outside the workspace")
        return target

    async def read_file(self, path: str) -> str:
        return self._path(path).read_text()

    async def write_file(self, path: str, content: str) -> None:
        self._path(path).parent.mkdir(parents=True, exist_ok=True)
        self._path(path).write_text(content)

    async def diff(self) -> str:
        # git diff --no-index exits 1 when the trees differ; that is the expected case.
        proc = subprocess.run(["git", "diff", "--no-index", "--src-prefix=a/", "--dst-prefix=b/", "base", "workspace"],
                              cwd=self.box, capture_output=True, text=True)
        return proc.stdout.replace("a/base/", "a/").replace("b/workspace/", "b/")

    async def destroy(self) -> None:
        shutil.rmtree(self.box, ignore_errors=True)


class FolderSandboxProvider(SandboxProvider):
    def __init__(self, cfg: SandboxConfig) -> None:
        self.root = Path(cfg.root or tempfile.gettempdir()) / "rollway-folder-sandboxes"

    async def create(self, spec: SandboxSpec, name: str) -> FolderSandbox:
        box = self.root / name
        shutil.rmtree(box, ignore_errors=True)
        workspace = box / "workspace"
        if spec.source_dir:
            shutil.copytree(spec.source_dir, workspace)
        workspace.mkdir(parents=True, exist_ok=True)
        sandbox = FolderSandbox(box)
        for path, content in spec.files.items():
            await sandbox.write_file(path, content)
        for command in spec.setup_commands:
            await sandbox.exec(command)
        shutil.copytree(workspace, box / "base")  # the snapshot `diff` compares against
        return sandbox

    async def attach(self, handle: dict[str, Any]) -> FolderSandbox:
        if handle.get("kind") != "folder" or not Path(handle["path"]).is_dir():
            raise SandboxError(f"no folder sandbox at {handle!r}")
        return FolderSandbox(Path(handle["path"]))

    async def check(self) -> dict[str, Any]:
        return {"network_isolated": False, "filesystem_isolated": False}


async def main() -> None:
    cfg = load_config(None, ["sandbox.type=python:examples/extending/custom_sandbox.py:FolderSandboxProvider"])
    provider = build_sandbox_provider(cfg.sandbox)
    sandbox = await provider.create(SandboxSpec(files={"hello.txt": "hello\n"}), "demo-sandbox")
    try:
        await sandbox.exec("echo world >> hello.txt")
        again = await provider.attach(sandbox.handle)  # what the agent and reward workers do
        print(await again.read_file("hello.txt"), await again.diff(), sep="")
        assert "+world" in await again.diff()
    finally:
        await sandbox.destroy()


if __name__ == "__main__":
    asyncio.run(main())
