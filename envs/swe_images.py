"""Repositories from a local mirror folder and per-instance images: found by name, else built here and cached.

An instance's image holds its repository at `base_commit` (plus `pre_patch`) in `repo_dir` (/testbed, as
SWE-bench's images do). The name comes from the row (`image_name`) or from `tasks.image_template`; when
an image of that name is on the engine it is used, with the row's `pre_patch` (a SWE-smith row's bug:
its image holds the repository without it) applied in `repo_dir` unless it is there already (it applies
in reverse): an image made FROM it (`rollway-prepatched/IMAGE:KEY`), or EnvPrepError naming the instance
when it applies neither way; else an image without `repo_dir/.git` (`rollway-nohistory/IMAGE:KEY`: its
history holds the commits around `base_commit`); then without installed copies of the repository
(sandboxes/images.py).
Otherwise rollway builds one FROM the base image (`tasks.base_image`, default the sandbox base
`rollway-sandbox:bookworm`), never pulling: the tree is exported from the mirror with `git archive`,
copied in, and the row's `install` command run in it. Built images are tagged `rollway-swe/ID:KEY`, KEY a
hash of everything that went in, so a second request (another worker, another run) finds it and builds
nothing. Every build runs without network unless `tasks.build_network` says otherwise (rows' install
commands only; a derived image's build is always without).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import structlog

from rollway.base.files import publish_dir
from rollway.envs.image_builds import KeyedLocks
from rollway.envs.swe_rows import SWEInstance
from rollway.envs.task_data import CONTAINER_DIR
from rollway.sandboxes.base import SandboxError
from rollway.sandboxes.images import derive_image, without_installed_copies
from rollway.sandboxes.task_tree import NORMALISE_COMMAND, normalise_tree

_HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
BUILD_NETWORKS = ("none", "bridge", "host")
"""`none` (default): a row's install command runs with no network. `bridge`: the engine's isolated default
network (the index reachable, the host's loopback services not). `host`: the host's network, as it was."""
log = structlog.get_logger(__name__)


class EnvPrepError(SandboxError):
    """The repository or the image cannot be prepared; the message says what to do. Found before any
    agent code runs (base/blame.py): infrastructure."""

    found_before_agent_code = True


def docker_id(instance_id: str) -> str:
    """The instance id as SWE-bench writes it into image names: lower case, `__` as `_1776_`."""
    return instance_id.lower().replace("__", "_1776_")


def template_name(template: str, inst: SWEInstance) -> str:
    """`template` with {instance_id}, {id_lower}, {id_docker}, {repo}, {repo_docker}, {commit} filled in."""
    return template.format(instance_id=inst.instance_id, id_lower=inst.instance_id.lower(),
                           id_docker=docker_id(inst.instance_id), repo=inst.repo,
                           repo_docker=inst.repo.lower().replace("/", "_1776_"), commit=inst.base_commit)


# ---------------------------------------------------------------- the mirror


def mirror_candidates(mirror: Path, repo: str) -> list[Path]:
    flat = repo.replace("/", "__")
    return [mirror / f"{flat}.git", mirror / flat, mirror / f"{repo}.git", mirror / repo]


def find_repo(mirror: str | None, repo: str, git_url: str | None = None) -> Path:
    """The git repository of `repo` in the mirror folder; cloned there from `git_url` (a template with
    {repo}) when missing and a URL is configured."""
    if not mirror:
        raise EnvPrepError(f"repository {repo}: set tasks.mirror to a folder of git repositories "
                                "(OWNER__NAME.git, OWNER__NAME or OWNER/NAME)")
    root = Path(mirror).expanduser()
    for path in mirror_candidates(root, repo):
        if path.is_dir():
            return path
    if git_url:
        dest = root / f"{repo.replace('/', '__')}.git"
        root.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["git", "clone", "--mirror", "-q", git_url.format(repo=repo), str(dest)],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return dest
        raise EnvPrepError(f"repository {repo} is not in {root} and cloning {git_url.format(repo=repo)} "
                                f"failed: {done.stderr.strip()[-300:]}")
    raise EnvPrepError(f"repository {repo} is not in the mirror {root} (looked for "
                            f"{', '.join(p.name for p in mirror_candidates(root, repo)[:2])}); add a clone "
                            "there (git clone --mirror URL) or set tasks.git_url")


def export_tree(repo_path: Path, commit: str, dest: Path, pre_patch: str = "") -> None:
    """The tree of `commit` (no .git) written into `dest`, then `pre_patch` applied."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo_path), "archive", "--format=tar", commit],
                             capture_output=True)
    if archive.returncode != 0:
        raise EnvPrepError(f"commit {commit} is not in {repo_path}: {archive.stderr.decode()[-300:]}; "
                                "fetch it into the mirror (git -C REPO fetch --all)")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    if pre_patch.strip():
        done = apply_patch(dest, pre_patch)
        if done.returncode != 0:
            raise EnvPrepError(f"the row's bug patch does not apply to {commit}: {done.stderr.decode()[-300:]}")
    normalise_tree(dest)  # `git apply` rewrote the changed files only: their times would name them


def apply_patch(tree: Path, patch: str, *flags: str) -> subprocess.CompletedProcess[bytes]:
    """`git apply FLAGS` of `patch` in the folder `tree` (no repository: git looks no higher than it)."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
    return subprocess.run(["git", "apply", "--whitespace=nowarn", *flags, "-"], cwd=tree, input=patch.encode(),
                          capture_output=True, env=env)


def patch_paths(patch: str) -> list[str]:
    """The files `patch` touches (each file's new name, else its old one, and the old name of a rename or
    copy), relative to the tree; EnvPrepError for one that leaves it or is not a plain printable name."""
    listed = subprocess.run(["git", "apply", "--numstat", "-z", "-"], input=patch.encode(), capture_output=True,
                            env={**os.environ, "GIT_CEILING_DIRECTORIES": "/"}, cwd="/")
    names = [entry.split(b"\t", 2)[-1] for entry in listed.stdout.split(b"\0") if entry]
    names += [line.split(b" ", 2)[2] for line in patch.encode().splitlines()
              if line.startswith((b"rename from ", b"copy from "))]
    paths = sorted({name.decode(errors="replace") for name in names})
    for path in paths:
        if not path.isprintable() or path.startswith("/") or ".." in path.split("/") or '"' in path:
            raise EnvPrepError(f"the bug patch names the file {path!r}: not a plain path inside the repository")
    return paths


def prepared_tree(inst: SWEInstance, mirror: str | None, cache_dir: str | None = None,
                  git_url: str | None = None) -> Path:
    """The instance's starting tree as a folder (the repository at `base_commit` plus `pre_patch`, no .git),
    exported from the mirror once under the cache (`CACHE/swe-trees`): the workspace of sandboxes without
    images (sandbox.type=local). The folder's name hashes what went in, so a changed row gets a new one."""
    from rollway.envs.sdist import cache_root

    repo_path = find_repo(mirror, inst.repo, git_url)
    key = hashlib.sha256("\0".join([str(repo_path.resolve()), inst.repo, inst.base_commit,
                                     inst.pre_patch]).encode()).hexdigest()[:12]
    dest = cache_root(cache_dir) / "swe-trees" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', inst.instance_id)[:80]}-{key}"

    def fill(scratch: Path) -> Path:
        export_tree(repo_path, inst.base_commit, scratch / "tree", inst.pre_patch)
        return scratch / "tree"

    return publish_dir(dest, fill)


# ---------------------------------------------------------------- images


def build_key(inst: SWEInstance, base_image_id: str) -> str:
    parts = [inst.repo, inst.base_commit, inst.pre_patch, inst.install, inst.repo_dir, base_image_id]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


INSTALL_SCRIPT = "rollway-install.sh"
"""The row's install command, as a file in the build context: run by one RUN step, never Dockerfile text."""


def dockerfile(base: str, repo_dir: str, install: str, has_ca: bool, labels: dict[str, str]) -> str:
    """The instance image's Dockerfile. Row data enters it only as checked names (`repo_dir`, a plain
    folder) and JSON-quoted label values; the install command stays in INSTALL_SCRIPT, so a newline in it
    cannot start an instruction of its own."""
    lines = [f"FROM {base}"]
    if has_ca:
        lines += ["COPY ca-certificates.crt /etc/ssl/certs/rollway-build-ca.crt",
                  "ENV PIP_CERT=/etc/ssl/certs/rollway-build-ca.crt"]
    lines += [f"COPY repo/ {checked_dir(repo_dir)}/", f"WORKDIR {repo_dir}"]
    if install.strip():
        lines += [f"COPY {INSTALL_SCRIPT} /tmp/{INSTALL_SCRIPT}", f"RUN sh /tmp/{INSTALL_SCRIPT}"]
    lines.append(f"RUN chmod -R a+rX {repo_dir}")
    lines += [f"LABEL {k}={json.dumps(v)}" for k, v in labels.items()]
    return "\n".join(lines) + "\n"


def checked_dir(repo_dir: str) -> str:
    if not CONTAINER_DIR.fullmatch(repo_dir) or ".." in repo_dir:
        raise EnvPrepError(f"repo_dir {repo_dir!r} is not a plain absolute folder; fix the row")
    return repo_dir


class InstanceImages:
    """Finds or builds each instance's image on the engine (one per process; thread-safe)."""

    def __init__(self, mirror: str | None, template: str, base_image: str, git_url: str | None = None,
                 client: Any | None = None, network: str = "none") -> None:
        if network not in BUILD_NETWORKS:
            raise ValueError(f"image build network {network!r}: use one of {', '.join(BUILD_NETWORKS)}")
        if network != "none":
            log.warning("instance images are built with network access: a row's install command can reach "
                        "the network (and, with host, the host's own services)", network=network)
        self.mirror, self.template, self.base_image, self.git_url = mirror, template, base_image, git_url
        self.network = network
        self._client = client
        self._known: dict[tuple[str, str, str], str] = {}
        self._locks = KeyedLocks()
        self.built: list[str] = []
        """Tags this object built (not found), in order: what a prebuild or an episode had to build."""

    @property
    def client(self) -> Any:
        if self._client is None:
            from rollway.sandboxes.docker import _connect

            self._client = _connect(None)
        return self._client

    def _exists(self, name: str) -> bool:
        try:
            self.client.images.get(name)
            return True
        except Exception as exc:
            if type(exc).__name__ in ("ImageNotFound", "NotFound") or "invalid reference format" in str(exc):
                return False  # absent, or a name no image can have (a template over an odd instance id)
            raise EnvPrepError(f"looking up image {name}: {exc}") from exc

    def image_for(self, inst: SWEInstance) -> str:
        """The image name to run `inst` in, building it first when needed. Blocking: call it in a thread
        (TaskSet.prepare does). One lock per instance: a second caller for it waits for the first
        one's build; other instances are not held up."""
        ident = (inst.instance_id, inst.base_commit, hashlib.sha256(inst.pre_patch.encode()).hexdigest(),
                 inst.install, inst.image_name)
        with self._locks.lock(ident):
            known = self._known.get(ident)
            if known:
                return known
            for name in filter(None, [inst.image_name, template_name(self.template, inst)]):
                if self._exists(name):  # not built here: a clean copy of the repository may be installed in it
                    image = self._with_pre_patch(inst, name) if inst.pre_patch.strip() else name
                    if image == name:  # used as found: its repository's history is still there
                        image = self._without_history(inst, name)
                    self._known[ident] = without_installed_copies(self.client, image, [inst.repo_dir])
                    return self._known[ident]
            name = self._build(inst)
            self._known[ident] = name
            return name

    def _build(self, inst: SWEInstance) -> str:
        try:
            base = self.client.images.get(self.base_image)
        except Exception as exc:
            raise EnvPrepError(f"base image {self.base_image} is not on the engine (rollway never pulls): "
                                    "run bash scripts/setup-docker.sh, or set tasks.base_image") from exc
        key = build_key(inst, base.id)
        tag = f"rollway-swe/{re.sub(r'[^a-z0-9_.-]', '-', docker_id(inst.instance_id))[:100]}:{key}"
        if self._exists(tag):
            return tag
        self.built.append(tag)
        repo_path = find_repo(self.mirror, inst.repo, self.git_url)
        with tempfile.TemporaryDirectory(prefix="rollway-swe-image-") as ctx:
            export_tree(repo_path, inst.base_commit, Path(ctx) / "repo", inst.pre_patch)
            has_ca = os.path.isfile(_HOST_CA)
            if has_ca:
                shutil.copy(_HOST_CA, Path(ctx, "ca-certificates.crt"))
            labels = {"rollway.swe.instance": inst.instance_id, "rollway.swe.key": key}
            Path(ctx, INSTALL_SCRIPT).write_text(inst.install)
            Path(ctx, "Dockerfile").write_text(dockerfile(self.base_image, inst.repo_dir, inst.install, has_ca,
                                                          labels))
            try:
                self.client.images.build(path=ctx, tag=tag, network_mode=self.network, rm=True, pull=False)
            except Exception as exc:
                raise EnvPrepError(f"building the image of {inst.instance_id} failed: {exc}; check the row's "
                                        "install command") from exc
        return tag

    def _without_history(self, inst: SWEInstance, name: str) -> str:
        """The found image `name` without `repo_dir/.git`, made once per image. The workspace is a copy without
        it, but the image's own folder stays readable in the sandbox, and its history holds the commits around
        `base_commit` (the clean parent of an injected bug, or a later fix in a full clone)."""
        from rollway.sandboxes.docker import engine_errors

        repo_dir = checked_dir(inst.repo_dir)
        with engine_errors(f"remove the history in {inst.repo_dir} of image {name} for {inst.instance_id}"):
            found = self.client.images.get(name)
            tag = f"rollway-nohistory/{found.id.split(':')[-1][:12]}:{hashlib.sha256(repo_dir.encode()).hexdigest()[:12]}"
            if self._exists(tag):
                return tag
            with tempfile.TemporaryDirectory(prefix="rollway-no-history-") as ctx:
                return self._derive(found, tag, ctx, [f"RUN rm -rf {repo_dir}/.git"],
                                    f"removing {inst.repo_dir}/.git from image {name} for {inst.instance_id}")

    def _with_pre_patch(self, inst: SWEInstance, name: str) -> str:
        """The found image `name` with the row's `pre_patch` in `repo_dir`: `name` itself when the patch is
        already applied there (it applies in reverse), else an image made FROM it with the patched files
        copied in, `repo_dir/.git` removed (it would diff against the clean commit) and the tree retimed
        and without bytecode (NORMALISE_COMMAND). The files the patch touches are read out of the image and
        patched here with git, so the image needs no tool. A patch that applies neither way is an
        EnvPrepError: an episode never starts on a tree without the bug."""
        from rollway.sandboxes.docker import engine_errors

        repo_dir = checked_dir(inst.repo_dir)
        with engine_errors(f"read {inst.repo_dir} of image {name} for the bug patch of {inst.instance_id}"):
            found = self.client.images.get(name)
            key = hashlib.sha256("\0".join([inst.pre_patch, inst.repo_dir, NORMALISE_COMMAND]).encode()).hexdigest()
            tag = f"rollway-prepatched/{found.id.split(':')[-1][:12]}:{key[:12]}"
            if self._exists(tag):
                return tag
            with tempfile.TemporaryDirectory(prefix="rollway-pre-patch-") as ctx:
                tree, paths = Path(ctx, "repo"), patch_paths(inst.pre_patch)
                tree.mkdir()
                copy_out(self.client, found.id, inst.repo_dir, paths, tree)
                if apply_patch(tree, inst.pre_patch, "--check", "-R").returncode == 0:
                    return name  # the image holds the bug already
                done = apply_patch(tree, inst.pre_patch)
                if done.returncode != 0:
                    raise EnvPrepError(f"{inst.instance_id}: the row's pre_patch (its bug) applies neither way to "
                                       f"{inst.repo_dir} of image {name}: {done.stderr.decode()[-300:]}; fix the "
                                       "row, or give it an image of the repository at its base_commit")
                gone = " ".join(shlex.quote(p) for p in paths if not (tree / p).exists())
                return self._derive(found, tag, ctx, [
                    f"COPY repo/ {repo_dir}/", f"RUN cd {repo_dir} && rm -rf .git {gone} && {NORMALISE_COMMAND}",
                    f"LABEL rollway.swe.instance={json.dumps(inst.instance_id)}"],
                    f"applying the bug patch of {inst.instance_id} to image {name}")

    def _derive(self, found: Any, tag: str, ctx: str, steps: list[str], what: str) -> str:
        """`tag` built FROM the found image with `steps` (sandboxes/images.derive_image); EnvPrepError saying
        `what` failed."""
        self.built.append(tag)
        try:
            derive_image(self.client, found, tag, ctx, steps)
        except Exception as exc:
            raise EnvPrepError(f"{what} failed: {exc}") from exc
        return tag


def copy_out(client: Any, image: str, folder: str, paths: list[str], dest: Path) -> None:
    """The files `paths` (relative to `folder`) of `image` copied into `dest`, those it lacks skipped; links
    and names that would leave `dest` are refused by tarfile's data filter."""
    import io
    import tarfile

    box = client.containers.create(image, ["true"], entrypoint=[], network_disabled=True)
    try:
        for path in paths:
            try:
                stream, _stat = box.get_archive(f"{folder.rstrip('/')}/{path}")
            except Exception as exc:
                if type(exc).__name__ in ("NotFound", "ImageNotFound"):
                    continue  # a file the patch creates
                raise
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                tar.extractall(dest / path.rpartition("/")[0], filter="data")
    finally:
        box.remove(force=True)


def copy_repo_command(repo_dir: str) -> str:
    """Setup command: the image's repository (without .git) copied into the workspace, owned by the
    sandbox user. A sandbox without the folder (not docker, or a foreign image) fails with the fix."""
    q = repo_dir.rstrip("/") or "/"
    return (f"test -d {q} || {{ echo 'rollway: {q} is missing: an image-based SWE workspace needs an image holding "
            f"the repository at {q}'; exit 1; }}; "
            f"tar -C {q} --exclude=./.git -cf - . | tar -xf - --no-same-owner")
