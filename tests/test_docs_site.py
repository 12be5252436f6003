"""The documentation: the mkdocs site builds with no warning (a broken link or anchor fails it), the
generated configuration reference is current, and the README's configuration and links are real."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT
from jobs import run_with_progress


def mkdocs_build(project, site_dir) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of the project folder holding mkdocs.yml and docs/."""
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("mkdocs is not installed: it is in the dev extra, pip install -e '.[dev]' (or make setup)")
    return run_with_progress([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                          cwd=project)


def test_docs_site_builds_strict_without_warnings(tmp_path):
    out = mkdocs_build(ROOT, tmp_path / "site")
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "WARNING" not in log, log[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def test_a_broken_link_or_anchor_fails_the_docs_build(tmp_path):
    """The same build on a copy of the docs with one dead link and one dead anchor: it must fail, naming
    both (so the test above would catch them)."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "testing.md", "a") as f:
        f.write("\nSee [the old page](no-such-page.md) and [a section](guarantees.md#no-such-section).\n")
    out = mkdocs_build(tmp_path, tmp_path / "site")
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]
    assert "no-such-page.md" in log and "no-such-section" in log, log[-3000:]


def test_configuration_reference_is_current():
    from rollway.docgen.pages import COMMAND, config_reference

    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_reference(), (
        f"docs/configuration.md is stale (a config model changed): run `{COMMAND}` from the repository root "
        "and commit the result")


def test_configuration_reference_covers_every_section_and_built_in_type():
    from rollway.config.run import RunConfig
    from rollway.docgen.pages import POLYMORPHIC, _target, config_reference

    page = config_reference()
    for name in RunConfig.model_fields:
        assert f"## `{name}`" in page, name
    for path, poly in POLYMORPHIC.items():
        for type_name in _target(poly.registry).names():
            assert f"`{path}.type: {type_name}`" in page, (path, type_name)
    # A documented field: its type, default and docstring reach the table.
    assert "| `max_turns` | `int` | `8` |" in page
    assert "| `fetch_max_wait_ms` | `int` | `500` | Longest a consumer's fetch waits" in page


def test_docs_config_check_names_the_command_when_stale(tmp_path, capsys):
    from rollway.runners.cli import main

    out = tmp_path / "configuration.md"
    out.write_text("# an old reference\n")
    assert main(["docs", "config", "--check", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "is stale" in err and "run `rollway docs config`" in err, err
    assert main(["docs", "config", "--out", str(out)]) == 0
    assert main(["docs", "config", "--check", "--out", str(out)]) == 0
    assert out.read_text() == (ROOT / "docs" / "configuration.md").read_text()


def test_readme_shows_the_smoke_config_in_full_and_it_loads():
    from rollway.config.run import load_config

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```\n", readme, re.S)
    assert blocks == [(ROOT / "examples" / "smoke.yaml").read_text()], "README's config block is not smoke.yaml"
    cfg = load_config(ROOT / "examples" / "smoke.yaml")
    assert cfg.tasks.type == "toy" and cfg.policy.type == "scripted"


def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert readme.index("make run") < readme.index("make test") < readme.index("scheduler -> init -> agent")
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links
    for link in links:
        if not link.startswith(("http://", "https://")):
            assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_every_benchmark_section_shows_the_command_that_reproduces_it():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    sections = re.split(r"\n(?=## )", page)[1:]
    assert len(sections) >= 10
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(r"```bash\n(rollway|make|bash) ", section), f"benchmarks.md {title!r} shows no command"
