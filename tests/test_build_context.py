"""The rollway image's build context (what `docker-compose build` / `docker build .` sends to the engine and
`COPY . /app` puts in the image) is the tracked source and nothing else. Computed with the Docker SDK's
own `.dockerignore` matcher, the one docker-compose uses to make the context it sends."""

from __future__ import annotations

import shutil
import subprocess
import tomllib

from conftest import ROOT
from docker.utils.build import exclude_paths


def _context(root) -> set[str]:
    patterns = [p.strip() for p in (root / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    return {p for p in exclude_paths(str(root), patterns) if (root / p).is_file()}


def test_what_sits_beside_the_code_never_reaches_the_image(tmp_path):
    """A checkout holds more than its source: virtual environments (a local one was 851 MB, copied into every
    image built here and sent to the engine on every build), run folders with trajectories, data sets, a
    `.env` or key file. None of it may enter the build context; every file the image is built from must."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tracked_files = [f for f in tracked.decode().split("\0") if f and (ROOT / f).is_file()]
    for name in tracked_files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / ".build").mkdir()
    (tmp_path / ".build" / "ca-certificates.crt").write_text("a proxy's CA bundle (setup-docker.sh copies it)")
    beside = [".env", "credentials.json", "id_rsa", ".venv-mlflow/lib/python3.11/site-packages/mlflow/__init__.py",
              ".venv-anything/bin/python", "venv/pyvenv.cfg", "runs/smoke/trajectories.jsonl", "data/swe/rows.jsonl",
              "site/index.html", "actors/__pycache__/x.cpython-311.pyc", "notes.txt", "gateway/scratch.log"]
    for name in beside:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("not source")

    context = _context(tmp_path)
    assert not context & set(beside), sorted(context & set(beside))
    assert context <= set(tracked_files) | {".build/ca-certificates.crt"}, sorted(context - set(tracked_files))

    # Everything the image is built from: the packages, the project file (with the README it names) and the
    # job files compose.yaml runs.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values()) | {"examples"}
    needed = {f for f in tracked_files if f.split("/")[0] in folders} | {"pyproject.toml", project["project"]["readme"]}
    assert needed <= context, sorted(needed - context)
    assert ".build/ca-certificates.crt" in context


def test_this_checkouts_build_context_is_its_source():
    """The same on this checkout as it is (with its own environments, runs and caches): small, source only."""
    context = _context(ROOT)
    size = sum((ROOT / p).stat().st_size for p in context)
    assert not [p for p in context if p.startswith((".venv", "runs/", "site/"))]
    assert size < 20 * 2**20, f"{size / 2**20:.0f} MiB"
