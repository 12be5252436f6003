"""Small semantic source mutations found with `ast` and applied to exact byte spans (bug injection)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Mutation:
    """Replace bytes `start:end` of `path` (UTF-8) by `replacement`; `original` is what was there.

    Invariant: every other byte of the file stays identical, and the mutated file parses."""

    path: str
    start: int
    end: int
    original: str
    replacement: str
    operator: str
    function: str
    line: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Mutation:
        return cls(**data)


def apply_mutation(source: bytes, mutation: Mutation) -> bytes:
    """The mutated file; ValueError when the span no longer holds `original` (a different file)."""
    found = source[mutation.start : mutation.end].decode("utf-8")
    if found != mutation.original:
        raise ValueError(
            f"{mutation.path}: expected {mutation.original!r} at bytes {mutation.start}:{mutation.end}, "
            f"found {found!r}; the snapshot does not match this instance, rebuild the instances file"
        )
    return source[: mutation.start] + mutation.replacement.encode("utf-8") + source[mutation.end :]


# Operator token swaps. Keys are matched as whole tokens in the gap between two operands.
_COMPARE_SWAPS: dict[type, tuple[str, str]] = {
    ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
}
_BINOP_SWAPS: dict[type, tuple[str, str]] = {
    ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "//"), ast.FloorDiv: ("//", "*"),
    ast.Div: ("/", "*"), ast.Mod: ("%", "//"),
}
_BOOLOP_SWAPS: dict[type, tuple[str, str]] = {ast.And: ("and", "or"), ast.Or: ("or", "and")}
# Operands whose source can take a trailing `+ 1` without parentheses.
_ATOMS = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)


class _SourceIndex:
    """Maps ast (line, UTF-8 column) positions to byte offsets in the file."""

    def __init__(self, source: bytes) -> None:
        self.source = source
        self.line_starts = [0]
        for match in re.finditer(rb"\n", source):
            self.line_starts.append(match.end())

    def offset(self, line: int, col: int) -> int:
        return self.line_starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset))

    def text(self, start: int, end: int) -> str:
        return self.source[start:end].decode("utf-8")


def _token_in_gap(index: _SourceIndex, start: int, end: int, token: str) -> tuple[int, int] | None:
    """The single occurrence of `token` between two operands; None when absent or ambiguous
    (e.g. a comment repeating it), because then we cannot be sure which bytes to edit."""
    gap = index.text(start, end)
    if "#" in gap:
        return None
    words = r"\s+".join(re.escape(part) for part in token.split())
    pattern = rf"(?<![\w]){words}(?![\w])" if token[0].isalpha() else rf"(?<![<>=!*/%+\-]){words}(?![<>=*/])"
    matches = list(re.finditer(pattern, gap))
    if len(matches) != 1:
        return None
    prefix = len(gap[: matches[0].start()].encode("utf-8"))
    return start + prefix, start + prefix + len(matches[0].group(0).encode("utf-8"))


class _Finder(ast.NodeVisitor):
    """Collects candidate mutations inside function bodies, naming the innermost function."""

    def __init__(self, path: str, index: _SourceIndex) -> None:
        self.path = path
        self.index = index
        self.scope: list[str] = []
        self.found: list[Mutation] = []

    # Scopes: classes only qualify method names; mutations are collected inside function bodies.
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        for stmt in node.body:
            self.visit(stmt)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # skip the docstring
        for stmt in body:
            self.visit(stmt)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _add(self, start: int, end: int, replacement: str, operator: str, node: ast.AST) -> None:
        if not self.scope or start >= end:
            return
        original = self.index.text(start, end)
        if original == replacement:
            return
        self.found.append(Mutation(self.path, start, end, original, replacement, operator,
                                   ".".join(self.scope), node.lineno))

    def _swap_in_gap(self, left: ast.AST, right: ast.AST, swap: tuple[str, str], operator: str,
                     node: ast.AST) -> None:
        gap_start, gap_end = self.index.span(left)[1], self.index.span(right)[0]
        where = _token_in_gap(self.index, gap_start, gap_end, swap[0])
        if where:
            self._add(*where, swap[1], operator, node)

    def visit_Compare(self, node: ast.Compare) -> None:
        swap = _COMPARE_SWAPS.get(type(node.ops[0]))
        if swap:
            self._swap_in_gap(node.left, node.comparators[0], swap, "compare", node)
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        swap = _BOOLOP_SWAPS[type(node.op)]
        self._swap_in_gap(node.values[0], node.values[1], swap, "boolean", node)
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        swap = _BINOP_SWAPS.get(type(node.op))
        if swap and not _is_text(node.left) and not _is_text(node.right):
            self._swap_in_gap(node.left, node.right, swap, "arithmetic", node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        swap = _BINOP_SWAPS.get(type(node.op))
        if swap and not _is_text(node.value):
            self._swap_in_gap(node.target, node.value, (swap[0] + "=", swap[1] + "="), "arithmetic", node)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            # Drop the `not` keyword and the blanks after it; the operand keeps its own parentheses.
            start, operand_start = self.index.span(node)[0], self.index.span(node.operand)[0]
            between = self.index.text(start, operand_start)
            cut = start + len(between) - len(between[3:].lstrip())
            if between.startswith("not"):
                self._add(start, cut, "", "not_removed", node)
        self.generic_visit(node)

    def visit_If(self, node: ast.If | ast.While | ast.IfExp) -> None:
        start, end = self.index.span(node.test)
        text = self.index.text(start, end)
        if "\n" not in text and not isinstance(node.test, ast.UnaryOp):
            self._add(start, end, f"not ({text})", "condition_negated", node)
        self.generic_visit(node)

    visit_While = visit_If
    visit_IfExp = visit_If

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        # Python < 3.12 reports unreliable positions inside f-strings: leave them alone.
        return

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, int) and not isinstance(value, bool) and value < 10**6:
            start, end = self.index.span(node)
            if _literal(self.index.text(start, end)) != value:
                return
            self._add(start, end, str(value + 1), "off_by_one", node)
            if value > 0:
                self._add(start, end, str(value - 1), "off_by_one", node)

    def visit_Slice(self, node: ast.Slice) -> None:
        for bound in (node.lower, node.upper):
            if bound is not None and not isinstance(bound, ast.Constant):
                start, end = self.index.span(bound)
                text = self.index.text(start, end)
                if "\n" not in text:
                    text = text if isinstance(bound, _ATOMS) else f"({text})"
                    self._add(start, end, f"{text} + 1", "slice_bound", node)
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        value = node.value
        if value is not None:
            start, end = self.index.span(value)
            if isinstance(value, ast.Constant) and isinstance(value.value, bool):
                self._add(start, end, str(not value.value), "return_value", node)
            elif not (isinstance(value, ast.Constant) and value.value is None):
                self._add(start, end, "None", "return_value", node)
        self.generic_visit(node)

    # Nested definitions are scopes of their own.
    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.visit(node.body)


def _literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        return None


def _is_text(node: ast.AST) -> bool:
    """String operands: `+` on them is concatenation, and `%` is formatting, not arithmetic."""
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str | bytes))


def find_mutations(path: str, source: bytes) -> list[Mutation]:
    """Every candidate mutation in the function bodies of one file whose result still parses."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    finder = _Finder(path, _SourceIndex(source))
    finder.visit(tree)
    return [m for m in finder.found if _parses(apply_mutation(source, m))]


def _parses(source: bytes) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def iter_module_mutations(files: dict[str, bytes]) -> Iterator[Mutation]:
    """Candidates of several files (path -> source), in a stable order (path, offset, replacement)."""
    for path in sorted(files):
        yield from sorted(find_mutations(path, files[path]), key=lambda m: (m.start, m.end, m.replacement))
