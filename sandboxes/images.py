"""Task images for docker sandboxes, built FROM rollway's local base image (never pulled)."""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rollway.sandboxes.base import SandboxError
from rollway.sandboxes.config import DockerSandboxConfig

_HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
"""Copied into the build when present: hosts that reach PyPI through a proxy with its own CA need it."""


def dockerfile(base: str, pip: list[str], run: list[str], has_ca: bool) -> str:
    """The Dockerfile of a task image: the base, packages from PyPI, then any extra commands."""
    lines = [f"FROM {base}"]
    if has_ca:
        lines += ["COPY ca-certificates.crt /etc/ssl/certs/rollway-build-ca.crt",
                  "ENV PIP_CERT=/etc/ssl/certs/rollway-build-ca.crt"]  # fmt: skip
    if pip:
        packages = " ".join(shlex.quote(p) for p in pip)
        lines.append(f"RUN python3 -m pip install --no-cache-dir --break-system-packages {packages}")
    lines += [f"RUN {command}" for command in run]
    return "\n".join(lines) + "\n"


def build_image(
    tag: str, pip: list[str], run: list[str], base: str | None = None, client: Any | None = None
) -> dict[str, Any]:
    """Build `tag` FROM `base` (default: sandbox.image, the setup's base) with host networking, so pip
    reaches PyPI at build time while the sandboxes themselves stay offline. Returns id and size."""
    from rollway.sandboxes.docker import DockerSandboxProvider, engine_errors

    base = base or DockerSandboxConfig().image
    provider = DockerSandboxProvider(DockerSandboxConfig(image=base), client)
    provider._require_image(base)
    with tempfile.TemporaryDirectory(prefix="rollway-image-") as ctx:
        has_ca = os.path.isfile(_HOST_CA)
        if has_ca:
            shutil.copy(_HOST_CA, Path(ctx, "ca-certificates.crt"))
        Path(ctx, "Dockerfile").write_text(dockerfile(base, pip, run, has_ca))
        try:
            with engine_errors(f"build {tag}"):
                image, _log = provider.client.images.build(path=ctx, tag=tag, network_mode="host", rm=True,
                                                           pull=False)  # fmt: skip
        except SandboxError:
            raise
    return {"image": tag, "id": image.id, "size_mb": round(image.attrs["Size"] / 2**20)}


def without_installed_copies(client: Any, image: str, names: list[str]) -> str:
    """`image`, or when its interpreter holds any of the libraries `names` (names, or absolute folders of the
    image whose libraries count) in its site-packages (a task image with the task's library `pip install`ed),
    an image made FROM it without them: their files, bytecode and dist-info RECORD removed
    (task_tree.INSTALLED_COPIES_SCRIPT finds them, run by the image's python3 in a container without network
    or capabilities). Tagged by what went in, so it is built once per engine. A sandbox cannot hide them
    itself (its root file system is read-only): docs/security/task-data.md."""
    import hashlib
    import json

    from rollway.sandboxes.docker import engine_errors
    from rollway.sandboxes.task_tree import INSTALLED_COPIES_SCRIPT

    with engine_errors(f"look for installed copies of {', '.join(names)} in {image}"):
        found = client.images.get(image)
        key = hashlib.sha256("\0".join([INSTALLED_COPIES_SCRIPT, *names]).encode()).hexdigest()[:12]
        tag = f"rollway-hidden/{found.id.split(':')[-1][:12]}:{key}"
        if client.images.list(name=tag):
            return tag
        try:
            out = client.containers.run(found.id, ["python3", "-I", "-c", INSTALLED_COPIES_SCRIPT, *names],
                                        entrypoint=[], working_dir="/", user="65534:65534", remove=True,
                                        network_disabled=True, network_mode="none", cap_drop=["ALL"],
                                        read_only=True, security_opt=["no-new-privileges"], stderr=False)
        except Exception as exc:
            if type(exc).__name__ != "ContainerError" and "executable file not found" not in str(exc):
                raise
            return image  # no python3 (or it failed): no interpreter finds a copy, nothing to hide
        # Only absolute one-line paths: the image's own interpreter printed them, and they enter a RUN line.
        paths = [p for p in json.loads(out or b"[]") if isinstance(p, str) and p.startswith("/") and p.isprintable()]
        if not paths:
            return image
        with tempfile.TemporaryDirectory(prefix="rollway-hidden-") as ctx:
            derive_image(client, found, tag, ctx, ["RUN rm -rf " + " ".join(shlex.quote(p) for p in paths),
                                                   f"LABEL rollway.hidden={json.dumps(' '.join(names))}"])
    return tag


def derive_image(client: Any, found: Any, tag: str, ctx: str | os.PathLike[str], steps: list[str]) -> None:
    """Build `tag` FROM the engine image `found` with Dockerfile `steps` run as root (the image's own user
    restored after them), from the build context folder `ctx`, without network and never pulling."""
    user = found.attrs.get("Config", {}).get("User") or ""
    lines = [f"FROM {found.id}", "USER root", *steps, *([f"USER {user}"] if user else [])]
    Path(ctx, "Dockerfile").write_text("\n".join(lines) + "\n")
    client.images.build(path=str(ctx), tag=tag, network_mode="none", rm=True, pull=False)
