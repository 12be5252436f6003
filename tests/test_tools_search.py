"""Code search on real source: PyYAML and click from the venv (expected lines computed with `ast`), plus JS."""

from __future__ import annotations

import ast
import asyncio
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import yaml
from conftest import HiddenFolderSandbox

from rollway.sandboxes.base import Sandbox, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.local import LocalSandboxProvider, remove_tree
from rollway.tools.base import outside_episode
from rollway.tools.config import ToolsConfig
from rollway.tools.search import SearchTool, search_folder

SITE = str(Path(yaml.__file__).parent.parent)
"""The folder holding the installed `yaml/` and `click/` packages; searches are narrowed to them."""


def ast_tree(relative: str) -> ast.Module:
    return ast.parse(Path(SITE, relative).read_text())


def ast_def(relative: str, qualname: str) -> ast.AST:
    """The node of `qualname` (dotted through classes) in a file, found independently of tree-sitter."""
    scope: list[ast.stmt] = ast_tree(relative).body
    node = None
    for part in qualname.split("."):
        node = next(n for n in scope if getattr(n, "name", None) == part)
        scope = node.body
    return node


def search(action: str, name: str = "", under: str = "yaml", **cfg) -> str:
    result = search_folder(SITE, action, name, under, ToolsConfig(**cfg))
    return result.content


def first_hit(text: str) -> str:
    return re.search(r"^(\S+:\d+)  ", text, re.MULTILINE).group(1)


def test_definition_of_function() -> None:
    expected = ast_def("yaml/__init__.py", "dump").lineno
    assert first_hit(search("definition", "dump")) == f"yaml/__init__.py:{expected}"


def test_qualified_method_and_module_qualified_lookup() -> None:
    expected = ast_def("yaml/loader.py", "Loader.__init__").lineno
    text = search("definition", "Loader.__init__")
    assert text.startswith("1 definition of `Loader.__init__`")  # the other loaders' __init__ are left out
    assert first_hit(text) == f"yaml/loader.py:{expected}"
    assert (
        first_hit(search("definition", "yaml.constructor.SafeConstructor"))
        == f"yaml/constructor.py:{ast_def('yaml/constructor.py', 'SafeConstructor').lineno}"
    )


def test_method_on_click_group() -> None:
    node = ast_def("click/core.py", "Group.add_command")
    text = search("definition", "Group.add_command", under="click")
    assert first_hit(text) == f"click/core.py:{node.lineno}" and "method Group.add_command" in text


def test_unqualified_name_ranks_top_level_before_methods() -> None:
    text = search("definition", "load")
    hits = re.findall(r"^(\S+:\d+)  (\w+) (\S+):", text, re.MULTILINE)
    assert hits[0] == (f"yaml/__init__.py:{ast_def('yaml/__init__.py', 'load').lineno}", "function", "load")


def test_source_spans_the_whole_definition() -> None:
    node = ast_def("yaml/constructor.py", "BaseConstructor.construct_mapping")
    text = search("source", "BaseConstructor.construct_mapping")
    numbered = re.findall(r"^\s+(\d+)\t", text, re.MULTILINE)
    assert (int(numbered[0]), int(numbered[-1])) == (node.lineno, node.end_lineno)
    assert "Other matches" not in text  # the qualified name rules out SafeConstructor.construct_mapping
    assert "Other matches: yaml/constructor.py" in search("source", "construct_mapping")


def test_references_in_several_files_without_the_definition() -> None:
    used_in = set()
    for path in Path(SITE, "yaml").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id == "ScalarNode":
                used_in.add(f"yaml/{path.name}")
    text = search("references", "ScalarNode", search_max_results=500)
    found = set(re.findall(r"^(\S+):\d+  ", text, re.MULTILINE))
    assert len(used_in) >= 3 and used_in <= found
    definition_line = ast_def("yaml/nodes.py", "ScalarNode").lineno
    assert f"yaml/nodes.py:{definition_line}  " not in text


def test_results_are_bounded_with_notice() -> None:
    text = search("references", "self", search_max_results=5)
    assert len(re.findall(r"^\S+:\d+  ", text, re.MULTILINE)) == 5
    assert re.search(r"^\.\.\. \d+ more", text, re.MULTILINE)


def test_outline_matches_ast() -> None:
    text = search("outline", under="yaml/loader.py")
    expected = [
        f"class {c.name}  [{c.lineno}-{c.end_lineno}]"
        for c in ast_tree("yaml/loader.py").body
        if isinstance(c, ast.ClassDef)
    ]
    top_level = [line for line in text.splitlines() if line.startswith("class ")]
    assert top_level == expected
    init = ast_def("yaml/loader.py", "Loader.__init__")
    assert f"  method __init__  [{init.lineno}-{init.end_lineno}]" in text


def test_folder_outline_and_misses() -> None:
    assert "yaml/loader.py: BaseLoader:" in search("outline", under="yaml")
    missing = search("definition", "safeload")
    assert missing.startswith("No definition of `safeload`") and "safe_load" in missing


def test_test_files_rank_after_source(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def helper():\n    pass\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "deep").mkdir()
    (tmp_path / "pkg" / "deep" / "a.py").write_text("\n\ndef helper():\n    return 1\n")
    text = search_folder(str(tmp_path), "definition", "helper").content
    assert first_hit(text) == "pkg/deep/a.py:3"


JS = """\
import { parse } from './parser.js';

export class Store extends Base {
  items = [];
  add(item) {
    this.items.push(parse(item));
  }
}

const render = (store) => store.items.map(String);
function* ids() { yield 1; }
Store.prototype.clear = function () { this.items = []; };
module.exports.version = '1.0';
"""


def test_javascript(tmp_path: Path) -> None:
    (tmp_path / "store.js").write_text(JS)
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "node_modules" / "dep.js").write_text("function render() {}\n")
    run = lambda *args: search_folder(str(tmp_path), *args).content  # noqa: E731
    assert first_hit(run("definition", "Store.add")) == "store.js:5"
    assert first_hit(run("definition", "render")) == "store.js:10"  # node_modules is skipped
    assert first_hit(run("definition", "Store.clear")) == "store.js:12"
    outline = run("outline", "", "store.js")
    assert (
        "class Store  [3-8]" in outline
        and "  method add  [5-7]" in outline
        and "function ids  [11-11]" in outline
    )
    refs = run("references", "parse")
    assert re.findall(r"^(\S+:\d+)  ", refs, re.MULTILINE) == ["store.js:1", "store.js:6"]


@pytest.fixture(scope="module")
def yaml_box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    """A real local sandbox holding a copy of PyYAML and a symlink pointing out of the workspace."""
    source = tmp_path_factory.mktemp("src")
    shutil.copytree(Path(SITE, "yaml"), source / "yaml", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    secret = tmp_path_factory.mktemp("host") / "secret.py"
    secret.write_text("def leaked_secret():\n    pass\n")
    (source / "escape.py").symlink_to(secret)
    root = tempfile.mkdtemp(prefix="rollway-tools-test-")  # the jail user cannot traverse tmp_path parents
    provider = LocalSandboxProvider(SandboxConfig(root=root))
    yield asyncio.run(provider.create(SandboxSpec(source_dir=str(source)), "search-test"))
    remove_tree(Path(root))


@pytest.mark.parametrize("hide_folder", [False, True])
def test_tool_in_real_sandbox(yaml_box: Sandbox, hide_folder: bool) -> None:
    sandbox = HiddenFolderSandbox(yaml_box) if hide_folder else yaml_box
    tool = SearchTool(ToolsConfig())
    run = lambda **arguments: asyncio.run(tool.call(arguments, sandbox, outside_episode()))  # noqa: E731
    expected = ast_def("yaml/loader.py", "SafeLoader.__init__").lineno
    assert (
        first_hit(run(action="definition", name="SafeLoader.__init__").content)
        == f"yaml/loader.py:{expected}"
    )
    assert "yaml/composer.py:" in run(action="references", name="ScalarNode").content
    assert "class Loader  [" in run(action="outline", path="/workspace/yaml/loader.py").content
    assert run(action="definition", name="leaked_secret").content.startswith("No definition")
    assert run(action="outline").is_error and run(action="references").is_error
    assert run(action="outline", path="../etc").is_error


@pytest.mark.parametrize("module", [yaml, click])
def test_every_top_level_definition_is_found(module) -> None:
    """Outline agrees with ast on every top-level class and function of each file of the package."""
    root = Path(module.__file__).parent
    for path in sorted(root.glob("*.py"))[:8]:
        relative = f"{root.name}/{path.name}"
        text = search("outline", under=relative)
        for node in ast_tree(relative).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                assert f"\n{kind} {node.name}  [{node.lineno}-" in text, (relative, node.name)


@pytest.mark.parametrize("action", ["references", "definition"])
def test_a_file_as_large_as_search_reads_is_answered_within_a_call_limit(tmp_path: Path, action: str) -> None:
    """The workspace is the agent's: one file at search's size limit (about 2 MB) holding 45,000 definitions
    named `f` that each use `f`. Each hit's line used to be found by splitting the whole file again, so the
    time grew with hits x size: about 90 s for this file on an idle 2-core machine, longer than a call's limit
    (`tools.call_timeout_s`), eight such calls per turn, and the thread still parsing after its call was
    given up. Linear now: well under a second idle; 30 s allows for a loaded machine."""
    import time

    from rollway.tools.search import MAX_FILE_BYTES

    body = "".join(f"def f(x{i}):\n    return f(x{i}) + {i}\n" for i in range(45_000))
    assert len(body) < MAX_FILE_BYTES  # read, not skipped
    (tmp_path / "big.py").write_text(body)
    started = time.monotonic()
    result = search_folder(str(tmp_path), action, "f")
    elapsed = time.monotonic() - started
    assert not result.metadata.get("not_found"), result.content[:300]
    assert "45000" in result.content.splitlines()[0], result.content.splitlines()[0]
    assert elapsed < 30, f"{action} took {elapsed:.0f} s"
