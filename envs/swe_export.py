"""Self-built instances as SWE-bench rows over a real git repository: the clean sdist is a commit, each
injected bug a commit on it (the instance's base_commit), each fix a commit on the bug (R2E's commit_hash).

Commits carry fixed authors and dates, so building the same library twice gives the same hashes and
the mirror can be shared by builds of several libraries.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rollway.envs.mutations import Mutation, apply_mutation
from rollway.envs.pytest_report import node_file, pytest_command
from rollway.envs.r2e_diffs import file_diffs_from_patch
from rollway.envs.sdist import ensure_snapshot, parse_requirement
from rollway.envs.swe_rows import FORMATS
from rollway.envs.task_data import resolve_in_tree

_GIT_ENV = {"GIT_AUTHOR_NAME": "rollway", "GIT_AUTHOR_EMAIL": "rollway@localhost",
            "GIT_COMMITTER_NAME": "rollway", "GIT_COMMITTER_EMAIL": "rollway@localhost",
            "GIT_AUTHOR_DATE": "2020-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2020-01-01T00:00:00Z",
            "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env={**os.environ, **_GIT_ENV})
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {cwd} failed: {done.stderr.strip()[-500:]}")
    return done.stdout.strip()


def _commit_all(work: Path, message: str) -> str:
    _git(work, "add", "-A", "-f", ".")
    _git(work, "commit", "-q", "--allow-empty", "--no-verify", "-m", message)
    return _git(work, "rev-parse", "HEAD")


def repo_name(sdist: str) -> str:
    """`pypi/NAME`: the repository a library's rows name (mirror folder `pypi__NAME.git`)."""
    return f"pypi/{parse_requirement(sdist)[0].lower()}"


def export_swebench(instances: list[dict[str, Any]], mirror: str | os.PathLike[str],
                    cache_dir: str | None = None) -> list[dict[str, Any]]:
    """Commit each instance's clean and buggy trees into the mirror; return SWE-bench rows for them."""
    rows: list[dict[str, Any]] = []
    by_sdist: dict[str, list[dict[str, Any]]] = {}
    for inst in instances:
        by_sdist.setdefault(inst["snapshot"]["sdist"], []).append(inst)
    for sdist, group in by_sdist.items():
        rows += _export_library(sdist, group, Path(mirror).expanduser(), cache_dir)
    return rows


def _export_library(sdist: str, group: list[dict[str, Any]], mirror: Path, cache_dir: str | None) -> list[dict]:
    snapshot = ensure_snapshot(group[0]["snapshot"], cache_dir)
    bare = mirror / f"{repo_name(sdist).replace('/', '__')}.git"
    if not bare.is_dir():
        bare.mkdir(parents=True)
        _git(bare, "init", "-q", "--bare")
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollway-swe-export-") as tmp:
        work = Path(tmp) / "repo"
        shutil.copytree(snapshot, work, symlinks=True)
        for stale in work.rglob(".git"):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        _git(work, "init", "-q", "-b", "main")
        clean = _commit_all(work, f"Import {sdist} from its source archive")
        for inst in group:
            mutation = Mutation.from_dict(inst["mutation"])
            # A real file of the copied tree: a symlink planted in the snapshot would carry the write out.
            target = resolve_in_tree(inst["instance_id"], "mutation.path", work, mutation.path)
            original = target.read_bytes()
            target.write_bytes(apply_mutation(original, mutation))
            bug = _commit_all(work, f"Change {mutation.function}")
            target.write_bytes(original)
            fix = _commit_all(work, f"Fix {mutation.function}")
            _git(work, "tag", "-f", f"rollway/{inst['instance_id']}", bug)
            _git(work, "checkout", "-q", "--detach", clean)
            rows.append(_row(inst, sdist, clean, bug, fix))
        _git(work, "checkout", "-q", "-B", "main", clean)
        _git(work, "push", "-q", "-f", str(bare), "main", "--tags")
    return rows


def _row(inst: dict[str, Any], sdist: str, clean: str, bug: str, fix: str) -> dict[str, Any]:
    name, version = parse_requirement(sdist)
    return {
        "instance_id": inst["instance_id"], "repo": repo_name(sdist), "base_commit": bug,
        "problem_statement": inst["problem_statement"], "hints_text": "", "created_at": "2020-01-01T00:00:00Z",
        "patch": inst["patch"], "test_patch": "", "version": version, "environment_setup_commit": clean,
        "FAIL_TO_PASS": json.dumps(inst["FAIL_TO_PASS"]), "PASS_TO_PASS": json.dumps(inst["PASS_TO_PASS"]),
        # Made from the checked test ids and import roots, never taken from the instance's own field (an
        # instances file converted on load may come from anyone; the builder writes this same command).
        "test_command": pytest_command(sorted({node_file(t) for t in inst["FAIL_TO_PASS"] + inst["PASS_TO_PASS"]}),
                                       python_path=tuple(inst.get("python_path", ["."]))),
        "log_parser": "pytest", "install": "",
        # Not part of SWE-bench's schema: what the other formats' rows are made from.
        "bug_patch": inst.get("bug_patch", ""), "fix_commit": fix,
    }


def as_variant(row: dict[str, Any], fmt: str) -> dict[str, Any]:
    """A SWE-bench row from `export_swebench` written as a row of another format (fixtures for the loader)."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: use one of {', '.join(FORMATS)}")
    ext = {k: row[k] for k in ("test_command", "log_parser", "install")}
    f2p, p2p = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
    if fmt == "swebench":
        return dict(row)  # bug_patch and fix_commit stay: tools reading SWE-bench rows ignore extra fields
    if fmt == "swe-gym":
        keys = ("instance_id", "hints_text", "patch", "test_patch", "created_at", "problem_statement", "repo",
                "base_commit", "version")
        return {**{k: row[k] for k in keys}, "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, **ext}
    if fmt == "swe-smith":
        owner_name = row["repo"].replace("/", "__")
        return {"instance_id": row["instance_id"], "repo": f"swesmith/{owner_name}.{row['environment_setup_commit'][:8]}",
                "patch": row["bug_patch"], "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
                "image_name": f"swesmith.x86_64.{owner_name.lower()}.{row['environment_setup_commit'][:8]}",
                "problem_statement": row["problem_statement"], **ext}
    return {"repo_name": row["repo"].replace("/", "__"), "docker_image": f"r2e/{row['instance_id'].lower()}",
            "commit_hash": row["fix_commit"], "problem_statement": row["problem_statement"],
            "parsed_commit_content": json.dumps({"old_commit_hash": row["base_commit"],
                                                 "new_commit_hash": row["fix_commit"],
                                                 "file_diffs": file_diffs_from_patch(row["patch"]
                                                                                     + row.get("test_patch", ""))}),
            "expected_output_json": json.dumps(dict.fromkeys(f2p + p2p, "PASSED")),
            "execution_result_content": "", "instance_id": row["instance_id"], **ext}


async def validate_rows(rows: list[dict[str, Any]], mirror: str, sandbox: str = "local",
                        base_image: str = "rollway-sandbox:bookworm", cache_dir: str | None = None,
                        log: Any = print) -> list[dict[str, Any]]:
    """Grade each row's gold patch in the workspace the task path gives it (as SWE-bench validates its
    instances): its tree in the local jail, or its image with `sandbox="docker"`. PASS_TO_PASS tests that
    fail there (the image lacks something the build host had) are dropped; a row whose FAIL_TO_PASS
    tests do not all pass with the gold patch is dropped."""
    from rollway.envs.swe_grading import GradeSettings, grade_instance
    from rollway.envs.swe_images import InstanceImages, copy_repo_command, prepared_tree
    from rollway.envs.swe_rows import normalise_row
    from rollway.sandboxes.base import SandboxSpec
    from rollway.sandboxes.config import SandboxConfig
    from rollway.sandboxes.factory import build_sandbox_provider

    images = InstanceImages(mirror, "rollway-never-prebuilt/{id_docker}:none", base_image)
    provider = build_sandbox_provider(SandboxConfig(type=sandbox, **({"image": base_image} if sandbox == "docker"
                                                                     else {})))

    def spec_for(inst: Any) -> SandboxSpec:
        if sandbox == "docker":
            return SandboxSpec(image=images.image_for(inst), setup_commands=[copy_repo_command(inst.repo_dir)])
        return SandboxSpec(source_dir=str(prepared_tree(inst, mirror, cache_dir)))

    kept = []
    for row in rows:
        inst = normalise_row(row)
        grade = await grade_instance(inst, inst.patch, provider, spec_for(inst),
                                     GradeSettings(timeout_s=600, all_failed=True))
        if "fail_to_pass" not in grade.details:
            log(f"{inst.instance_id}: dropped, its gold patch graded {grade.details['outcome']} ({sandbox})")
            continue
        if grade.details["fail_to_pass"]["failed"]:
            log(f"{inst.instance_id}: dropped, FAIL_TO_PASS tests fail ({sandbox}) with the gold patch: "
                f"{grade.details['fail_to_pass']['failed'][:3]}")
            continue
        broken = set(grade.details["pass_to_pass"]["failed"])
        if broken:
            log(f"{inst.instance_id}: {len(broken)} PASS_TO_PASS tests fail ({sandbox}), dropped from the row "
                f"(e.g. {sorted(broken)[:2]})")
            row = {**row, "PASS_TO_PASS": json.dumps([t for t in inst.pass_to_pass if t not in broken])}
        kept.append(row)
    return kept


def is_instances_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is rollway's older instances format (`rollway tasks build swe --format instances`:
    JSONL rows carrying `mutation` and `snapshot`) rather than SWE-bench-schema rows."""
    file = Path(path).expanduser()
    if file.suffix != ".jsonl" or not file.is_file():
        return False
    with file.open() as lines:
        first = next((line for line in lines if line.strip()), "")
    try:
        row = json.loads(first) if first else {}
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict) and "mutation" in row and "snapshot" in row


def rows_from_instances(path: str | os.PathLike[str], cache_dir: str | None = None,
                        mirror: str | os.PathLike[str] | None = None) -> tuple[list[dict[str, Any]], str]:
    """An instances file converted on load: its instances (checked by `load_instances`) committed into
    a git mirror (default `CACHE/swe-mirror`) as SWE-bench rows, which are returned with the mirror.

    Converted once per file content: the rows are kept beside the mirror, and workers converting the
    same file at once take turns on a lock (the commits are deterministic, so any of them may write)."""
    import fcntl
    import hashlib

    from rollway.envs.sdist import cache_root
    from rollway.envs.swe import load_instances

    file = Path(path).expanduser()
    instances = load_instances(file, cache_dir)  # every field checked before anything is written
    root = Path(mirror).expanduser() if mirror else cache_root(cache_dir) / "swe-mirror"
    root.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    done = root / "converted" / f"{key}.jsonl"
    with open(root / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file() and all((root / f"{repo_name(i['snapshot']['sdist']).replace('/', '__')}.git").is_dir()
                                  for i in instances):
            return [json.loads(line) for line in done.read_text().splitlines() if line.strip()], str(root)
        rows = export_swebench(instances, root, cache_dir)
        done.parent.mkdir(exist_ok=True)
        tmp = done.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        os.replace(tmp, done)
    return rows, str(root)
