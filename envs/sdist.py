"""Source archives from the package index, unpacked once into cached repository snapshots."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollway.base.files import publish_dir

DEFAULT_CACHE = Path("~/.cache/rollway").expanduser()


class SdistError(RuntimeError):
    """The source archive cannot be fetched or unpacked; the message says what to try."""


@dataclass(frozen=True)
class Snapshot:
    """An unpacked source archive: the clean repository every task of one library starts from."""

    sdist: str
    """Requirement that names it, `name==version`."""
    archive: str
    """File name of the archive on the index."""
    sha256: str
    path: str
    """Folder holding the unpacked tree (the archive's top folder)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE


# A project name as the package index spells it (PEP 508) and a version: nothing pip could read as an
# option or a URL, nothing that leaves a cache folder name.
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+!_-]{0,63}")


def parse_requirement(sdist: str) -> tuple[str, str]:
    name, sep, version = sdist.partition("==")
    name, version = name.strip(), version.strip()
    if not sep or not name or not version:
        raise SdistError(f"--sdist {sdist!r}: pin one version, e.g. --sdist toolz==1.2.0")
    if not _NAME.fullmatch(name) or not _VERSION.fullmatch(version) or ".." in version:
        raise SdistError(f"--sdist {sdist!r} is not NAME==VERSION with a plain project name and version "
                         "(letters, digits, . _ - and for versions + !), e.g. toolz==1.2.0")
    return name, version


def download_sdist(sdist: str, cache: Path) -> Path:
    """The archive for `name==version`, downloaded with pip into `cache/sdists` unless already there."""
    name, version = parse_requirement(sdist)
    folder = cache / "sdists"
    found = _find_archive(folder, name, version)
    if found:
        return found
    folder.mkdir(parents=True, exist_ok=True)
    # Into a private folder, then renamed: a process sharing the cache (a parallel test worker, a second
    # build) never sees a half-written archive.
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        # No binary of the project itself; its build backend may come as a wheel (`:all:` also refused
        # those, and a backend with no pure source form, uv_build's maturin, could never be built here).
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name,
               "--disable-pip-version-check", "-q", "-d", tmp, f"{name}=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        got = _find_archive(Path(tmp), name, version)
        if got is not None and _find_archive(folder, name, version) is None:
            os.replace(got, folder / got.name)
    found = _find_archive(folder, name, version)
    if done.returncode != 0 or not found:
        said = [line for line in (done.stderr or done.stdout).strip().splitlines() if not line.startswith("WARNING:")]
        tail = said[-3:]
        raise SdistError(
            f"could not download the source archive of {sdist} ({' | '.join(tail)}); check the name and "
            f"version on the package index, or put the archive into {folder} by hand"
        )
    return found


def _find_archive(folder: Path, name: str, version: str) -> Path | None:
    if not folder.is_dir():
        return None
    # Index file names normalise the project name (dashes, dots and case differ between releases).
    wanted = {name.lower().replace("-", "_").replace(".", "_")}
    for path in sorted(folder.iterdir()):
        stem = path.name
        for suffix in (".tar.gz", ".zip", ".tar.bz2", ".tgz"):
            if stem.endswith(suffix):
                base, _, ver = stem[: -len(suffix)].rpartition("-")
                if ver == version and base.lower().replace("-", "_").replace(".", "_") in wanted:
                    return path
    return None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack into `dest` (atomically: a half-written folder is never visible) and return it."""

    def fill(scratch: Path) -> Path:
        out = scratch / "unpacked"
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(out)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(out, filter="data")
        tops = list(out.iterdir())
        return tops[0] if len(tops) == 1 and tops[0].is_dir() else out

    return publish_dir(dest, fill)


def prepare_snapshot(sdist: str, cache_dir: str | os.PathLike[str] | None = None) -> Snapshot:
    """Download (if needed) and unpack `name==version` under the cache; return where it lives."""
    cache = cache_root(cache_dir)
    archive = download_sdist(sdist, cache)
    sha = sha256_file(archive)
    name, version = parse_requirement(sdist)
    path = unpack(archive, snapshot_dir(cache, sdist, sha))
    return Snapshot(sdist=f"{name}=={version}", archive=archive.name, sha256=sha, path=str(path))


def snapshot_dir(cache_dir: str | os.PathLike[str] | None, sdist: str, sha256: str) -> Path:
    """Where the snapshot of `sdist` with this archive digest lives: rollway's only place for snapshots."""
    name, version = parse_requirement(sdist)
    return cache_root(cache_dir) / "snapshots" / f"{name}-{version}-{sha256[:12]}"


def ensure_snapshot(info: dict[str, Any], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The snapshot an instance names: its folder in the cache (derived from the sdist and the sha256, never
    taken from the row, which could name any host folder) when present, else fetched again and checked
    against the recorded sha256, so an instances file works on another machine."""
    expected = snapshot_dir(cache_dir, info["sdist"], info["sha256"])
    if expected.is_dir() and not expected.is_symlink():
        return expected
    snapshot = prepare_snapshot(info["sdist"], cache_dir)
    if snapshot.sha256 != info["sha256"]:
        shutil.rmtree(snapshot.path, ignore_errors=True)
        raise SdistError(
            f"the index now serves a different archive for {info['sdist']} (sha256 {snapshot.sha256[:12]}, "
            f"instances expect {info['sha256'][:12]}); rebuild the instances with `rollway tasks build swe`"
        )
    return Path(snapshot.path)
