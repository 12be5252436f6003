"""Per-file definitions and identifier uses found with tree-sitter, cached by content in the process."""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import tree_sitter
import tree_sitter_javascript
import tree_sitter_python

LANGUAGE_BY_SUFFIX = {
    ".py": "python",
    ".pyi": "python",
    ".js": "javascript",
    ".mjs": "javascript",
    ".cjs": "javascript",
    ".jsx": "javascript",
}
_LANGUAGES = {
    "python": tree_sitter.Language(tree_sitter_python.language()),
    "javascript": tree_sitter.Language(tree_sitter_javascript.language()),
}
_IDENTIFIER_TYPES = {
    "identifier",
    "property_identifier",
    "private_property_identifier",
    "shorthand_property_identifier",
    "shorthand_property_identifier_pattern",
}
_JS_FUNCTION_VALUES = {"arrow_function", "function_expression", "function", "generator_function"}
# Statements whose bodies may hold definitions that still belong to the enclosing scope.
_CONTAINER_SUFFIXES = (
    "_statement",
    "_clause",
    "block",
    "module",
    "program",
    "class_body",
    "statement_block",
    "declaration_list",
)
CACHE_MAX_FILES = 20_000
"""Symbol tables kept (small: names and line numbers)."""
TREE_CACHE_MAX_BYTES = 8_000_000
"""Source bytes whose syntax trees are kept. A tree takes about 19 times its source in memory
(measured on transformers), so this bounds the cache near 150 MB per worker process."""


@dataclass(frozen=True)
class Symbol:
    """One definition. `line` is the line of its name; `start_line` includes decorators."""

    name: str
    qualname: str
    """Dotted path inside the file, e.g. `Loader.construct_mapping`."""
    kind: str
    """class, function, method, variable (module level) or attribute (class level)."""
    line: int
    start_line: int
    end_line: int
    depth: int


@dataclass(frozen=True)
class FileIndex:
    """Definitions of one file in source order."""

    symbols: tuple[Symbol, ...]
    name_points: frozenset[tuple[int, int]]
    """(row, byte column) of every definition's name, so `find_uses` can leave them out."""


def language_of(path: str) -> str | None:
    """The tree-sitter language for a file name, None when search does not support it."""
    dot = path.rfind(".")
    return LANGUAGE_BY_SUFFIX.get(path[dot:]) if dot != -1 else None


_symbols: OrderedDict[tuple[str, bytes], FileIndex] = OrderedDict()
_trees: OrderedDict[tuple[str, bytes], tuple[tree_sitter.Tree, int]] = OrderedDict()
_tree_bytes = 0
_cache_lock = threading.Lock()
_local = threading.local()


def _key(source: bytes, language: str) -> tuple[str, bytes]:
    """Content-hash key: the many copies of one repository that parallel episodes hold (a GRPO
    group) share one parse, and an edited file is parsed afresh."""
    return language, hashlib.blake2b(source, digest_size=16).digest()


def index_file(source: bytes, language: str) -> FileIndex:
    """The definitions of one file (cached)."""
    key = _key(source, language)
    with _cache_lock:
        if key in _symbols:
            _symbols.move_to_end(key)
            return _symbols[key]
    symbols: list[Symbol] = []
    points: set[tuple[int, int]] = set()
    walker = _PythonWalker if language == "python" else _JavaScriptWalker
    walker(symbols, points).walk(_tree(source, language, key).root_node, [], "module")
    index = FileIndex(tuple(symbols), frozenset(points))
    with _cache_lock:
        _symbols[key] = index
        while len(_symbols) > CACHE_MAX_FILES:
            _symbols.popitem(last=False)
    return index


def find_uses(source: bytes, language: str, name: str) -> list[int]:
    """Sorted distinct lines where `name` is used as an identifier (not in strings or comments,
    not where it is defined). Looks only at the places the text occurs, not at every node."""
    pattern = re.compile(rb"(?<![\w$])" + re.escape(name.encode()) + rb"(?![\w$])")
    spans = [match.span() for match in pattern.finditer(source)]
    if not spans:
        return []
    key = _key(source, language)
    root, defined = _tree(source, language, key).root_node, index_file(source, language).name_points
    lines = set()
    for start, end in spans:
        node = root.descendant_for_byte_range(start, end)
        if (
            node is not None
            and node.type in _IDENTIFIER_TYPES
            and (node.start_byte, node.end_byte) == (start, end)
        ):
            if node.start_point not in defined:
                lines.add(node.start_point[0] + 1)
    return sorted(lines)


def could_define(name: str) -> Callable[[bytes], bool]:
    """A test that accepts (a superset of) the files that can define `name`, so search parses only
    those: def/class/function NAME, NAME = ..., NAME: ..., a, NAME = ..., JS methods and fields."""
    n = re.escape(name.encode())
    line_pattern = re.compile(
        rb"(?:def|class|function\*?)\s+" + n + rb"(?![\w$])"
        rb"|(?<![\w$])" + n + rb"[ \t]*=(?!=)"
        rb"|^[ \t]*(?:[\w$]+[ \t]+)*[*#]?" + n + rb"[ \t]*[:;(,=]",
        re.MULTILINE,
    )
    needle = name.encode()

    def test(data: bytes) -> bool:
        # Only the lines holding the name go through the regex: running it over whole files is slow.
        start = data.find(needle)
        while start != -1:
            line_start = data.rfind(b"\n", 0, start) + 1
            line_end = data.find(b"\n", start)
            line_end = len(data) if line_end == -1 else line_end
            if line_pattern.search(data, line_start, line_end):
                return True
            start = data.find(needle, line_end)
        return False

    return test


def _tree(source: bytes, language: str, key: tuple[str, bytes]) -> tree_sitter.Tree:
    global _tree_bytes
    with _cache_lock:
        if key in _trees:
            _trees.move_to_end(key)
            return _trees[key][0]
    tree = _parser(language).parse(source)
    with _cache_lock:
        if key not in _trees:
            _trees[key] = (tree, len(source))
            _tree_bytes += len(source)
        while _tree_bytes > TREE_CACHE_MAX_BYTES and len(_trees) > 1:
            _tree_bytes -= _trees.popitem(last=False)[1][1]
    return tree


def _parser(language: str) -> tree_sitter.Parser:
    # Parsers are not shared between threads (search runs in worker threads).
    parsers = _local.__dict__.setdefault("parsers", {})
    if language not in parsers:
        parsers[language] = tree_sitter.Parser(_LANGUAGES[language])
    return parsers[language]


class _Walker:
    """Collects definitions, tracking the enclosing qualified name and scope kind."""

    def __init__(self, symbols: list[Symbol], name_positions: set[tuple[int, int]]) -> None:
        self.symbols = symbols
        self.name_positions = name_positions

    def add(
        self,
        name_node: tree_sitter.Node,
        scope: list[str],
        kind: str,
        node: tree_sitter.Node,
        start: tree_sitter.Node | None = None,
    ) -> list[str]:
        name = name_node.text.decode("utf-8", "replace")
        self.name_positions.add(name_node.start_point)
        self.symbols.append(
            Symbol(
                name=name,
                qualname=".".join([*scope, name]),
                kind=kind,
                line=name_node.start_point[0] + 1,
                start_line=(start or node).start_point[0] + 1,
                end_line=node.end_point[0] + 1,
                depth=len(scope),
            )
        )
        return [*scope, name]

    def walk(self, node: tree_sitter.Node, scope: list[str], scope_kind: str) -> None:
        for child in node.named_children:
            if not self.visit(child, scope, scope_kind) and child.type.endswith(_CONTAINER_SUFFIXES):
                self.walk(child, scope, scope_kind)

    def visit(self, node: tree_sitter.Node, scope: list[str], scope_kind: str) -> bool:
        """Handle a definition node; False when `node` is not one."""
        raise NotImplementedError


class _PythonWalker(_Walker):
    def visit(self, node: tree_sitter.Node, scope: list[str], scope_kind: str, start=None) -> bool:
        if node.type == "decorated_definition":
            definition = node.child_by_field_name("definition")
            return definition is not None and self.visit(definition, scope, scope_kind, start=node)
        name = node.child_by_field_name("name")
        if node.type in ("function_definition", "class_definition") and name is not None:
            is_class = node.type == "class_definition"
            kind = "class" if is_class else "method" if scope_kind == "class" else "function"
            inner = self.add(name, scope, kind, node, start)
            self.walk(node.child_by_field_name("body") or node, inner, "class" if is_class else "function")
            return True
        if node.type == "expression_statement" and scope_kind in ("module", "class"):
            kind = "variable" if scope_kind == "module" else "attribute"
            for assignment in node.named_children:
                self._assignment(assignment, scope, kind, node)
            return True
        return False

    def _assignment(
        self, node: tree_sitter.Node, scope: list[str], kind: str, statement: tree_sitter.Node
    ) -> None:
        while node.type == "assignment":
            left = node.child_by_field_name("left")
            targets = (
                [left]
                if left is not None and left.type == "identifier"
                else ([c for c in left.named_children if c.type == "identifier"] if left is not None else [])
            )
            for target in targets:
                self.add(target, scope, kind, statement)
            node = node.child_by_field_name("right") or statement  # `a = b = 1` chains assignments


class _JavaScriptWalker(_Walker):
    def visit(self, node: tree_sitter.Node, scope: list[str], scope_kind: str) -> bool:
        name = node.child_by_field_name("name")
        if node.type in ("function_declaration", "generator_function_declaration") and name is not None:
            self.walk(
                node.child_by_field_name("body") or node, self.add(name, scope, "function", node), "function"
            )
            return True
        if node.type in ("class_declaration", "class") and name is not None:
            self.walk(node.child_by_field_name("body") or node, self.add(name, scope, "class", node), "class")
            return True
        if node.type == "method_definition" and name is not None:
            self.walk(
                node.child_by_field_name("body") or node, self.add(name, scope, "method", node), "function"
            )
            return True
        if node.type == "field_definition" and node.child_by_field_name("property") is not None:
            self.add(node.child_by_field_name("property"), scope, "attribute", node)
            return True
        if node.type in ("lexical_declaration", "variable_declaration"):
            for declarator in node.named_children:
                self._declarator(declarator, scope, scope_kind, node)
            return True
        if node.type == "expression_statement" and node.named_children:
            return self._member_assignment(node.named_children[0], scope, node)
        return False

    def _declarator(
        self, node: tree_sitter.Node, scope: list[str], scope_kind: str, statement: tree_sitter.Node
    ) -> None:
        name, value = node.child_by_field_name("name"), node.child_by_field_name("value")
        if name is None or name.type != "identifier":
            return
        if value is not None and value.type in _JS_FUNCTION_VALUES | {"class"}:
            kind = "class" if value.type == "class" else "function"
            inner = self.add(name, scope, kind, statement)
            self.walk(
                value.child_by_field_name("body") or value, inner, "class" if kind == "class" else "function"
            )
        elif scope_kind == "module":
            self.add(name, scope, "variable", statement)

    def _member_assignment(
        self, node: tree_sitter.Node, scope: list[str], statement: tree_sitter.Node
    ) -> bool:
        """`Foo.prototype.bar = function` and `module.exports.baz = () => ...` define functions."""
        left, right = node.child_by_field_name("left"), node.child_by_field_name("right")
        if node.type != "assignment_expression" or left is None or right is None:
            return False
        if left.type != "member_expression" or right.type not in _JS_FUNCTION_VALUES:
            return False
        owner = left.child_by_field_name("object").text.decode("utf-8", "replace")
        owner_parts = [p for p in owner.split(".") if p not in ("prototype", "module", "exports")]
        kind = "method" if owner_parts else "function"
        inner = self.add(left.child_by_field_name("property"), [*scope, *owner_parts], kind, statement)
        self.walk(right.child_by_field_name("body") or right, inner, "function")
        return True
