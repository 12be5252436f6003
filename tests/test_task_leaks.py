"""Task data hands out no answer (issue 39 item 5): a built task (buglocal, an SWE row made by mutating a
snapshot) leaves no trace of which file was changed in a fresh sandbox: modification and access times,
folder times, stale bytecode, git history, a clean copy of the library on the interpreter's path. The
probe (`envs/leak_probe.py`) is the hostile policy; real builder, real sandboxes (local jail and Docker)."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest

from rollway.envs.config import TasksConfig
from rollway.envs.factory import build_taskset
from rollway.envs.leak_probe import leaking_channels, probe_sandbox, probe_task
from rollway.sandboxes.base import SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.factory import build_sandbox_provider
from rollway.sandboxes.task_tree import FIXED_TIME, normalise_tree


def run(coro):
    return asyncio.run(coro)


def _probe_all(taskset, sandbox_type: str) -> list[tuple[str, dict]]:
    provider = build_sandbox_provider(SandboxConfig(type=sandbox_type))  # type: ignore[arg-type]

    async def go():
        try:
            return [(t.task_id, await probe_task(taskset, t, provider, f"leak-{uuid.uuid4().hex[:10]}"))
                    for t in taskset.tasks()]
        finally:
            await provider.close()

    return run(go())


@pytest.mark.slow
@pytest.mark.parametrize("sandbox_type", ["local", "docker"])
def test_no_channel_names_the_changed_file_of_a_buglocal_task(toolz_two_tasks, sandbox_type):
    """Before the fix the mutated file was the only one with a recent mtime (`find . -newer` named it) and
    the bytecode the builder's test runs left behind did not match it."""
    if sandbox_type == "docker":
        from docker_engine import ensure_engine

        ensure_engine()
    taskset = build_taskset(TasksConfig(type="buglocal", path=str(toolz_two_tasks), difficulty="all"))
    for task_id, probed in _probe_all(taskset, sandbox_type):
        assert probed is not None and len(probed["report"]["candidates"]) > 4, task_id
        assert probed["leaks"] == [], (task_id, probed["changed_file"], {
            c: probed["report"]["channels"][c] for c in probed["leaks"]})
        assert probed["report"]["pyc_files"] == 0 and not probed["report"]["git_folder"]


@pytest.mark.slow
def test_no_channel_names_the_changed_file_of_an_swe_row(toolz_swebench_row):
    """An SWE row over git: its tree exported at the base commit, then the row's bug patch applied (which
    rewrote the changed file, and only it, with the current time)."""
    taskset = build_taskset(TasksConfig(type="swe", path=str(toolz_swebench_row / "rows.jsonl"),
                                        mirror=str(toolz_swebench_row / "mirror"), limit=1))
    [(task_id, probed)] = _probe_all(taskset, "local")
    assert probed is not None and probed["leaks"] == [], (task_id, probed)


@pytest.mark.parametrize("sandbox_type", ["local", "docker"])
def test_a_fresh_workspace_has_one_access_time_after_the_base_snapshot(tmp_path, sandbox_type):
    """The base snapshot (`git add`) reads every file in path order, and each first read moved that file's
    access time to the clock's current tick: the files read after a tick boundary were the newest, so the
    atime channel named the tree's last files (a changed `zipp.py` after six `other*.py`, one Docker run in
    three). Nothing the agent can see may say in what order anything was read: every entry keeps FIXED_TIME
    (on Docker, below the workspace's root: the volume's own root keeps the time of the copy, as in every task)."""
    if sandbox_type == "docker":
        from docker_engine import ensure_engine

        ensure_engine()
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    for i in range(40):
        (tree / "pkg" / f"m{i:02d}.py").write_text(f"x = {i}\n" * 2000)
    provider = build_sandbox_provider(SandboxConfig(type=sandbox_type))  # type: ignore[arg-type]

    async def go() -> str:
        box = await provider.create(SandboxSpec(source_dir=str(tree)), f"atime-{uuid.uuid4().hex[:10]}")
        try:
            return (await box.exec("find . -path ./.rollway -prune -o -printf '%A@ %p\\n'")).output
        finally:
            await box.destroy()
            await provider.close()

    listed = [line.split(" ", 1) for line in run(go()).splitlines() if line.strip()]
    assert len(listed) >= 42, listed
    moved = sorted(path for when, path in listed if float(when) != FIXED_TIME and (sandbox_type, path) != ("docker", "."))
    assert moved == [], f"{len(moved)} of {len(listed)} entries were read after the tree was retimed: {moved[:8]}"


def test_probe_names_a_changed_file_by_time_bytecode_and_git(tmp_path):
    """The probe itself finds each channel when it is open (a tree made as the builder made it before:
    the mutated file written last, its bytecode compiled from the original, a git repository), so a probe
    that scores 0 above measured something."""
    tree = tmp_path / "tree"
    (tree / "pkg" / "__pycache__").mkdir(parents=True)
    for i in range(8):
        (tree / "pkg" / f"m{i}.py").write_text(f"def f{i}():\n    return {i}\n")
        os.utime(tree / "pkg" / f"m{i}.py", (FIXED_TIME, FIXED_TIME))
    import py_compile

    py_compile.compile(str(tree / "pkg" / "m3.py"), cfile=str(tree / "pkg" / "__pycache__" / "m3.cpython-311.pyc"))
    (tree / "pkg" / "m3.py").write_text("def f3():\n    return -3\n")
    provider = build_sandbox_provider(SandboxConfig(type="local"))

    async def probe(spec: SandboxSpec, normalise: bool) -> dict:
        box = await provider.create(spec, f"leak-{uuid.uuid4().hex[:10]}")
        try:
            if not normalise:  # as a sandbox was made before: the tree's times and caches carried in
                os.utime(Path(box.workspace_path) / "pkg" / "m3.py", None)
                await box.exec("mkdir -p pkg/__pycache__ && cp -p " + str(tree / "pkg" / "__pycache__" / "*")
                               + " pkg/__pycache__/ 2>/dev/null; cp pkg/m3.py /tmp/x && git init -q && git add -A"
                               " && git -c user.name=a -c user.email=a@a commit -qm base && cp /tmp/x pkg/m3.py"
                               " && echo '# changed' >> pkg/m3.py")
            return await probe_sandbox(box)
        finally:
            await box.destroy()

    opened = run(probe(SandboxSpec(source_dir=str(tree)), normalise=False))
    assert {"mtime", "git"} <= set(leaking_channels(opened, "pkg/m3.py")), opened["channels"]
    closed = run(probe(SandboxSpec(source_dir=str(tree)), normalise=True))
    assert leaking_channels(closed, "pkg/m3.py") == [], closed["channels"]
    assert closed["pyc_files"] == 0


def test_normalise_tree_retimes_everything_and_drops_caches_without_following_links(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("host file")
    before = outside.stat().st_mtime_ns
    tree = tmp_path / "tree"
    (tree / "a" / "__pycache__").mkdir(parents=True)
    (tree / "a" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0" * 16)
    (tree / ".pytest_cache").mkdir()
    (tree / "a" / "x.py").write_text("x = 1\n")
    (tree / "a" / "old.pyc").write_bytes(b"\0")
    (tree / "link").symlink_to(outside)
    normalise_tree(tree)
    left = sorted(str(p.relative_to(tree)) for p in tree.rglob("*"))
    assert left == ["a", "a/x.py", "link"]
    assert {os.lstat(p).st_mtime for p in [tree, *tree.rglob("*")]} == {FIXED_TIME}
    assert outside.stat().st_mtime_ns == before  # the link itself was retimed, not its target


def test_a_clean_copy_of_the_library_on_the_jails_interpreter_path_is_hidden(tmp_path):
    """A task built from a library the sandbox's interpreter also holds (rollway's own environment holds
    `six`, say): the installed copy, its bytecode and its dist-info (whose RECORD holds every file's hash)
    would name the changed file. Here the interpreter is a virtual environment made for the test
    (`sandbox.python`) with the library installed in it; the jail hides each of those, and the workspace's
    copy is the one imported."""
    import py_compile
    import subprocess
    import sys

    from rollway.sandboxes.config import LocalSandboxConfig
    from rollway.sandboxes.local import LocalSandboxProvider

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    [site] = list(venv.glob("lib/python3*/site-packages"))
    source, tree = _leaky_tree(tmp_path)
    (site / "leaky.py").write_text(source)
    py_compile.compile(str(site / "leaky.py"), cfile=str(site / "__pycache__" / "leaky.cpython-311.pyc"))
    (site / "leaky-1.0.dist-info").mkdir()
    (site / "leaky-1.0.dist-info" / "RECORD").write_text("leaky.py,sha256=x,1\n")
    provider = LocalSandboxProvider(LocalSandboxConfig(root=str(tmp_path / "boxes"), python=str(venv / "bin" / "python")))
    report, seen = run(_probe_installed_copy(provider, tree, site, "python"))
    assert leaking_channels(report, "leaky.py") == [], report["channels"]
    assert seen.split() == ["0", "-3"], seen  # nothing of the installed copy can be read; the workspace's is used


async def _probe_installed_copy(provider, tree: Path, site: str | Path, python: str) -> tuple[dict, str]:
    """A sandbox of `tree`: the leak probe's report, and the bytes it reads of the installed copy of `leaky` in
    `site` (module, bytecode, dist-info) with what `import leaky` gives (the workspace's copy: f3() is -3)."""
    box = await provider.create(SandboxSpec(source_dir=str(tree)), f"leak-{uuid.uuid4().hex[:10]}")
    try:
        report = await probe_sandbox(box)  # first: the import below reads leaky.py, which moves its access time
        seen = await box.exec(f"cat {site}/leaky.py {site}/__pycache__/leaky* {site}/leaky-1.0.dist-info/* 2>/dev/null"
                              f" | wc -c; {python} -c 'import leaky; print(leaky.f3())'")
        return report, seen.output
    finally:
        await box.destroy()


def _leaky_tree(tmp_path: Path) -> tuple[str, Path]:
    """A library module `leaky.py` (clean), and a task tree holding it with one line changed among others."""
    source = "".join(f"def f{i}():\n    return {i}\n" for i in range(8))
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "leaky.py").write_text(source.replace("return 3", "return -3"))
    for i in range(4):
        (tree / f"other{i}.py").write_text(f"x = {i}\n")
    return source, tree


@pytest.mark.slow
def test_a_clean_copy_of_the_library_in_a_docker_images_site_packages_is_hidden(tmp_path):
    """A task image that holds the task's library in its interpreter's site-packages (a `pip install` of it,
    here written in by hand: the module, its bytecode, a dist-info whose RECORD lists it) and a task whose
    workspace holds that library with one function changed. Before the fix the probe's `site_packages`
    channel named the changed file (the image's copy is readable in the container); now nothing of the
    installed copy can be read and the workspace's copy is the one imported. Real engine, real image build."""
    import base64
    import hashlib

    from docker_engine import ensure_engine

    from rollway.sandboxes.config import DockerSandboxConfig
    from rollway.sandboxes.docker import DockerSandboxProvider
    from rollway.sandboxes.images import build_image

    client = ensure_engine()
    source, tree = _leaky_tree(tmp_path)
    site = "/usr/local/lib/python3.11/dist-packages"
    data = base64.b64encode(source.encode()).decode()
    tag = f"rollway-test/leaky:{hashlib.sha256(source.encode()).hexdigest()[:12]}"
    build_image(tag, [], [f"mkdir -p {site}/leaky-1.0.dist-info && echo {data} | base64 -d > {site}/leaky.py && "
                          f"python3 -m py_compile {site}/leaky.py && echo 'leaky.py,sha256=x,1' > "
                          f"{site}/leaky-1.0.dist-info/RECORD"], client=client)
    provider = DockerSandboxProvider(DockerSandboxConfig(image=tag))

    async def probe() -> tuple[dict, str]:
        try:
            return await _probe_installed_copy(provider, tree, site, "python3")
        finally:
            await provider.close()

    report, seen = run(probe())
    assert leaking_channels(report, "leaky.py") == [], report["channels"]
    assert seen.split() == ["0", "-3"], seen  # nothing of the installed copy can be read; the workspace's is used


@pytest.mark.slow
def test_an_swe_rows_own_image_with_a_clean_copy_in_site_packages_hands_out_no_answer(toolz_swebench_row, tmp_path):
    """An SWE row whose own image (`image_name`, found on the engine: rollway did not build it) holds the
    repository at /testbed with the bug, as SWE-bench images do, and the fixed library installed in its
    site-packages (a clean `pip install` of the project). Before the fix the probe's `site_packages` channel
    named the changed file in the workspace copied from /testbed. Real engine, real image, real task set."""
    import json
    import shutil
    import subprocess

    from docker_engine import ensure_engine

    from rollway.envs.swe_images import export_tree, find_repo

    client = ensure_engine()
    [row] = [json.loads(line) for line in (toolz_swebench_row / "rows.jsonl").read_text().splitlines()]
    ctx = tmp_path / "ctx"
    export_tree(find_repo(str(toolz_swebench_row / "mirror"), row["repo"]), row["base_commit"], ctx / "repo")
    shutil.copytree(ctx / "repo", ctx / "fixed")
    subprocess.run(["git", "apply", "-"], cwd=ctx / "fixed", input=row["patch"].encode(), check=True)
    (ctx / "Dockerfile").write_text("FROM rollway-sandbox:bookworm\nCOPY repo/ /testbed/\n"
                                    "COPY fixed/toolz/ /usr/local/lib/python3.11/dist-packages/toolz/\n")
    image = f"rollway-test/swe-own-image:{row['instance_id'].lower().replace('_', '-')[:60]}"
    client.images.build(path=str(ctx), tag=image, network_mode="none", rm=True, pull=False)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({**row, "image_name": image}) + "\n")
    taskset = build_taskset(TasksConfig(type="swebench", path=str(rows), mirror=str(toolz_swebench_row / "mirror")),
                            SandboxConfig(type="docker"))
    [(task_id, probed)] = _probe_all(taskset, "docker")
    assert len(probed["report"]["candidates"]) > 4 and probed["leaks"] == [], (task_id, probed["changed_file"], probed["report"]["channels"])


@pytest.mark.slow
def test_a_swe_smith_rows_own_image_without_the_bug_starts_with_the_bug(toolz_swebench_row, tmp_path):
    """A SWE-smith row (its bug-introducing patch is `pre_patch`) whose own image (`image_name`, found on the
    engine) holds the repository WITHOUT the bug at /testbed, with its .git, as SWE-smith's images do. Before
    the fix the image was used as is: the workspace started clean and doing nothing was graded resolved
    (reward 1). Now the workspace and the image's /testbed hold the bug and no .git, doing nothing scores 0,
    the gold patch 1; an image that already holds the bug is used unchanged; a bug patch that applies
    neither way fails the task's preparation, naming the instance. Real engine, images and task set."""
    import dataclasses
    import hashlib
    import json
    import subprocess

    from docker_engine import ensure_engine

    from rollway.envs.base import Episode
    from rollway.envs.swe_export import as_variant
    from rollway.envs.swe_images import EnvPrepError, find_repo

    client = ensure_engine()
    [row] = [json.loads(line) for line in (toolz_swebench_row / "rows.jsonl").read_text().splitlines()]
    repo = find_repo(str(toolz_swebench_row / "mirror"), row["repo"])
    tag = row["instance_id"].lower().replace("_", "-")[:60]
    images = {}
    for kind, commit in (("clean", row["environment_setup_commit"]), ("buggy", row["base_commit"])):
        ctx = tmp_path / kind  # a clone, .git and all, at the commit before the bug / at the bug
        subprocess.run(["git", "clone", "-q", "--no-checkout", str(repo), str(ctx / "repo")], check=True)
        subprocess.run(["git", "-C", str(ctx / "repo"), "checkout", "-q", commit], check=True)
        (ctx / "Dockerfile").write_text("FROM rollway-sandbox:bookworm\nCOPY repo/ /testbed/\n")
        images[kind] = f"rollway-test/swe-smith-{kind}:{tag}"
        client.images.build(path=str(ctx), tag=images[kind], network_mode="none", rm=True, pull=False)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({**as_variant(row, "swe-smith"), "image_name": images["clean"]}) + "\n")
    taskset = build_taskset(TasksConfig(type="swebench", path=str(rows), mirror=str(toolz_swebench_row / "mirror"),
                                        test_timeout_s=600), SandboxConfig(type="docker"))
    [task] = taskset.tasks()
    inst = taskset.instances[task.task_id]
    assert inst.source_format == "swe-smith" and inst.pre_patch.strip()
    changed = inst.patch.split(" b/", 1)[1].split("\n", 1)[0]
    buggy = subprocess.run(["git", "-C", str(repo), "show", f"{row['base_commit']}:{changed}"], capture_output=True,
                           text=True, check=True).stdout
    provider = build_sandbox_provider(SandboxConfig(type="docker"))

    async def do_nothing():
        try:
            await taskset.prepare(task)
            box = await provider.create(taskset.sandbox_spec(task), f"prepatch-{uuid.uuid4().hex[:8]}")
            try:
                seen = await box.read_file(changed)
                image_tree = await box.exec(f"cmp /testbed/{changed} {changed} && echo same; ls -a /testbed")
                graded = await taskset.grade(task, box, provider, Episode.outside_run(task))
            finally:
                await box.destroy()
            gold = await taskset.grade_patch(inst, inst.patch, provider)
            return seen, image_tree.output, graded, gold
        finally:
            await provider.close()

    try:
        seen, image_tree, graded, gold = run(do_nothing())
        assert (graded.reward, gold.reward) == (0.0, 1.0), (graded.details, gold.details)  # doing nothing is no fix
        assert seen == buggy, "the workspace starts without the row's bug"
        assert "same" in image_tree and ".git" not in image_tree.split(), image_tree  # /testbed: the bug, no history
        # An image that holds the bug already (the patch applies in reverse), or a row without a bug patch
        # (SWE-bench's, SWE-Gym's): used as found, but without its history, whose parent commit is the fix.
        for variant in (dataclasses.replace(inst, image_name=images["buggy"]),
                        dataclasses.replace(inst, image_name=images["buggy"], pre_patch="")):
            derived = taskset.images.image_for(variant)
            listing = client.containers.run(derived, ["sh", "-c", f"ls -a /testbed; sha256sum /testbed/{changed}"],
                                            entrypoint=[], network_disabled=True, remove=True).decode()
            assert derived != images["buggy"] and ".git" not in listing.split(), listing
            assert hashlib.sha256(buggy.encode()).hexdigest() in listing, listing  # the tree as found: the bug
        junk = "diff --git a/README.rst b/README.rst\n--- a/README.rst\n+++ b/README.rst\n@@ -1 +1 @@\n-no such line\n+x\n"
        with pytest.raises(EnvPrepError, match=inst.instance_id):
            taskset.images.image_for(dataclasses.replace(inst, pre_patch=junk))
    finally:  # the clean clone's image is new each run (file times): leave none of its images behind
        for image in [*taskset.images.built, *images.values()]:
            client.images.remove(image, force=True)
