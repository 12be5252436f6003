"""Per-file symbol and identifier index built with tree-sitter, cached by content in the process."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import tree_sitter
import tree_sitter_javascript
import tree_sitter_python

LANGUAGE_BY_SUFFIX = {
    ".py": "python", ".pyi": "python",
    ".js": "javascript", ".mjs": "javascript", ".cjs": "javascript", ".jsx": "javascript",
}
_LANGUAGES = {
    "python": tree_sitter.Language(tree_sitter_python.language()),
    "javascript": tree_sitter.Language(tree_sitter_javascript.language()),
}
_IDENTIFIER_QUERIES = {
    "python": "(identifier) @id",
    "javascript": "[(identifier) (property_identifier) (private_property_identifier) "
                  "(shorthand_property_identifier) (shorthand_property_identifier_pattern)] @id",
}
_JS_FUNCTION_VALUES = {"arrow_function", "function_expression", "function", "generator_function"}
# Statements whose bodies may hold definitions that still belong to the enclosing scope.
_CONTAINER_SUFFIXES = ("_statement", "_clause", "block", "module", "program", "class_body",
                       "statement_block", "declaration_list")
CACHE_MAX_FILES = 20_000


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
    """Definitions in source order and identifier uses by name (definition names left out)."""

    symbols: tuple[Symbol, ...]
    uses: dict[str, tuple[int, ...]]
    """name -> sorted distinct line numbers where the identifier is used."""


def language_of(path: str) -> str | None:
    """The tree-sitter language for a file name, None when search does not support it."""
    dot = path.rfind(".")
    return LANGUAGE_BY_SUFFIX.get(path[dot:]) if dot != -1 else None


_cache: OrderedDict[tuple[str, bytes], FileIndex] = OrderedDict()
_cache_lock = threading.Lock()
_local = threading.local()


def index_file(source: bytes, language: str) -> FileIndex:
    """The index of one file. Keyed by content hash, so the many copies of one repository that
    parallel episodes hold (a GRPO group) share one parse."""
    key = (language, hashlib.blake2b(source, digest_size=16).digest())
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    index = _build_index(source, language)
    with _cache_lock:
        _cache[key] = index
        while len(_cache) > CACHE_MAX_FILES:
            _cache.popitem(last=False)
    return index


def _parser(language: str) -> tree_sitter.Parser:
    # Parsers are not shared between threads (search runs in worker threads).
    parsers = _local.__dict__.setdefault("parsers", {})
    if language not in parsers:
        parsers[language] = tree_sitter.Parser(_LANGUAGES[language])
    return parsers[language]


def _build_index(source: bytes, language: str) -> FileIndex:
    root = _parser(language).parse(source).root_node
    symbols: list[Symbol] = []
    name_positions: set[tuple[int, int]] = set()
    walker = _PythonWalker if language == "python" else _JavaScriptWalker
    walker(symbols, name_positions).walk(root, [], "module")
    return FileIndex(tuple(symbols), _identifier_uses(root, language, name_positions))


def _identifier_uses(root: tree_sitter.Node, language: str, skip: set[tuple[int, int]]) -> dict[str, tuple[int, ...]]:
    query = tree_sitter.Query(_LANGUAGES[language], _IDENTIFIER_QUERIES[language])
    uses: dict[str, set[int]] = {}
    for node in tree_sitter.QueryCursor(query).captures(root).get("id", []):
        if node.start_point not in skip:
            uses.setdefault(node.text.decode("utf-8", "replace"), set()).add(node.start_point[0] + 1)
    return {name: tuple(sorted(lines)) for name, lines in uses.items()}


class _Walker:
    """Collects definitions, tracking the enclosing qualified name and scope kind."""

    def __init__(self, symbols: list[Symbol], name_positions: set[tuple[int, int]]) -> None:
        self.symbols = symbols
        self.name_positions = name_positions

    def add(self, name_node: tree_sitter.Node, scope: list[str], kind: str, node: tree_sitter.Node,
            start: tree_sitter.Node | None = None) -> list[str]:
        name = name_node.text.decode("utf-8", "replace")
        self.name_positions.add(name_node.start_point)
        self.symbols.append(Symbol(
            name=name, qualname=".".join([*scope, name]), kind=kind, line=name_node.start_point[0] + 1,
            start_line=(start or node).start_point[0] + 1, end_line=node.end_point[0] + 1, depth=len(scope),
        ))
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

    def _assignment(self, node: tree_sitter.Node, scope: list[str], kind: str, statement: tree_sitter.Node) -> None:
        while node.type == "assignment":
            left = node.child_by_field_name("left")
            targets = [left] if left is not None and left.type == "identifier" else (
                [c for c in left.named_children if c.type == "identifier"] if left is not None else [])
            for target in targets:
                self.add(target, scope, kind, statement)
            node = node.child_by_field_name("right") or statement  # `a = b = 1` chains assignments


class _JavaScriptWalker(_Walker):
    def visit(self, node: tree_sitter.Node, scope: list[str], scope_kind: str) -> bool:
        name = node.child_by_field_name("name")
        if node.type in ("function_declaration", "generator_function_declaration") and name is not None:
            self.walk(node.child_by_field_name("body") or node, self.add(name, scope, "function", node), "function")
            return True
        if node.type in ("class_declaration", "class") and name is not None:
            self.walk(node.child_by_field_name("body") or node, self.add(name, scope, "class", node), "class")
            return True
        if node.type == "method_definition" and name is not None:
            self.walk(node.child_by_field_name("body") or node, self.add(name, scope, "method", node), "function")
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

    def _declarator(self, node: tree_sitter.Node, scope: list[str], scope_kind: str, statement: tree_sitter.Node) -> None:
        name, value = node.child_by_field_name("name"), node.child_by_field_name("value")
        if name is None or name.type != "identifier":
            return
        if value is not None and value.type in _JS_FUNCTION_VALUES | {"class"}:
            kind = "class" if value.type == "class" else "function"
            inner = self.add(name, scope, kind, statement)
            self.walk(value.child_by_field_name("body") or value, inner, "class" if kind == "class" else "function")
        elif scope_kind == "module":
            self.add(name, scope, "variable", statement)

    def _member_assignment(self, node: tree_sitter.Node, scope: list[str], statement: tree_sitter.Node) -> bool:
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
