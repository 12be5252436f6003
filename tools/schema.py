"""A small JSON-schema validator (the subset tool parameters use) and example-call rendering."""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

_TYPE_NAMES = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true or false",
    "object": "an object",
    "array": "an array",
    "null": "null",
}


MAX_ARGUMENT_DEPTH = 32
"""Deepest nesting of arrays and objects in a call's arguments (no tool needs more; Python's own
recursion limit is about 1,000, and validation, encoding and logging all recurse)."""
MAX_STRING_CHARS = 1_000_000
"""Longest string argument (a whole file's text for `editor create` fits)."""
MAX_ITEMS = 10_000
"""Most items in one array, or keys in one object, of a call's arguments."""
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
"""Integers outside signed 64 bits cannot travel in a message (MessagePack) or index anything."""


def is_valid_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON lets `"\\udc80"` through; no UTF-8 can carry it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def argument_bounds(value: Any, where: str = "arguments") -> list[str]:
    """Violations of the bounds every tool call obeys whatever its schema states (depth, string
    length, item counts, 64-bit integers). Iterative, so a value nested beyond Python's recursion
    limit is reported, not raised on; check it before `validate`, which recurses."""
    problems: list[str] = []
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack and len(problems) < 5:
        item, at, depth = stack.pop()
        if depth > MAX_ARGUMENT_DEPTH:
            return [f"{where}: nested deeper than {MAX_ARGUMENT_DEPTH} levels of arrays and objects"]
        if isinstance(item, int) and not isinstance(item, bool) and not INT_MIN <= item <= INT_MAX:
            problems.append(f"{at}: must be an integer between -2**63 and 2**63-1")
        elif isinstance(item, str) and len(item) > MAX_STRING_CHARS:
            problems.append(f"{at}: longer than {MAX_STRING_CHARS} characters ({len(item)})")
        elif isinstance(item, str) and not is_valid_unicode(item):
            problems.append(f"{at}: not valid Unicode (a lone surrogate escape such as \\udc80); send the text itself")
        elif isinstance(item, (list, dict)) and len(item) > MAX_ITEMS:
            problems.append(f"{at}: more than {MAX_ITEMS} items ({len(item)})")
        elif isinstance(item, list):
            stack.extend((sub, f"{at}[{i}]", depth + 1) for i, sub in enumerate(item))
        elif isinstance(item, dict):
            stack.extend((key, f"{at} key", depth + 1) for key in item)
            stack.extend((sub, f"{at}.{key}"[:200], depth + 1) for key, sub in item.items())
    return problems


def _json_type(value: Any) -> str:
    """The JSON type name of a decoded value (bool is checked before int: bool subclasses int)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _type_matches(value: Any, expected: str) -> bool:
    actual = _json_type(value)
    if expected == "number":
        return actual in ("integer", "number")
    if expected == "integer":
        # JSON has one number type: 3.0 is an integer by JSON-schema rules.
        return actual == "integer" or (actual == "number" and float(value).is_integer())
    return actual == expected


def _show(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=repr)
    except (ValueError, RecursionError):  # an integer of thousands of digits, deep nesting
        return f"a {_json_type(value)}"
    return text if len(text) <= 60 else text[:57] + "..."


def validate(value: Any, schema: dict[str, Any], where: str = "arguments") -> list[str]:
    """All violations of `schema` by `value`, each naming the place (`arguments.view_range[1]`).

    Supports: type (name or list), enum, const, anyOf/oneOf/allOf, properties, required,
    additionalProperties (bool or a schema), items, minItems/maxItems, minimum/maximum,
    exclusiveMinimum/exclusiveMaximum, minLength/maxLength, pattern. Other keywords (format,
    description, title, $schema, default, examples) are accepted and not checked.
    """
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            results = [validate(value, sub, where) for sub in schema[key]]
            if not any(not r for r in results):
                return min(results, key=len)
    for sub in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        if errors := validate(value, sub, where):
            return errors
    if "const" in schema and value != schema["const"]:
        return [f"{where}: must be {_show(schema['const'])}, got {_show(value)}"]
    expected = schema.get("type")
    if expected is not None:
        names = expected if isinstance(expected, list) else [expected]
        if not any(_type_matches(value, name) for name in names):
            wanted = " or ".join(_TYPE_NAMES.get(name, name) for name in names)
            return [f"{where}: expected {wanted}, got {_json_type(value)} {_show(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        options = ", ".join(_show(option) for option in schema["enum"])
        return [f"{where}: {_show(value)} is not one of {options}"]
    if isinstance(value, dict):
        return _validate_object(value, schema, where)
    if isinstance(value, list):
        return _validate_array(value, schema, where)
    return _validate_scalar(value, schema, where)


def _validate_object(value: dict[str, Any], schema: dict[str, Any], where: str) -> list[str]:
    errors: list[str] = []
    properties: dict[str, Any] = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in value:
            errors.append(f"{where}: missing required key {key!r}")
    for key, item in value.items():
        if key in properties:
            errors.extend(validate(item, properties[key], f"{where}.{key}"))
        elif isinstance(schema.get("additionalProperties"), dict):
            errors.extend(validate(item, schema["additionalProperties"], f"{where}.{key}"))
        elif schema.get("additionalProperties", True) is False:
            close = difflib.get_close_matches(key, list(properties), n=1)
            suggestion = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"{where}: unknown key {key!r}{suggestion}; allowed keys: {', '.join(properties)}")
    return errors


def _validate_array(value: list[Any], schema: dict[str, Any], where: str) -> list[str]:
    errors: list[str] = []
    if "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(f"{where}: needs at least {schema['minItems']} items, got {len(value)}")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{where}: takes at most {schema['maxItems']} items, got {len(value)}")
    if isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            errors.extend(validate(item, schema["items"], f"{where}[{index}]"))
    return errors


def _validate_scalar(value: Any, schema: dict[str, Any], where: str) -> list[str]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return [f"{where}: must be >= {schema['minimum']}, got {value}"]
        if "maximum" in schema and value > schema["maximum"]:
            return [f"{where}: must be <= {schema['maximum']}, got {value}"]
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            return [f"{where}: must be > {schema['exclusiveMinimum']}, got {value}"]
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            return [f"{where}: must be < {schema['exclusiveMaximum']}, got {value}"]
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return [f"{where}: must have at least {schema['minLength']} characters"]
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return [f"{where}: must have at most {schema['maxLength']} characters"]
        if "pattern" in schema and not re.search(schema["pattern"], value):
            return [f"{where}: {_show(value)} does not match the pattern {schema['pattern']!r}"]
    return []


def example_value(schema: dict[str, Any]) -> Any:
    """A placeholder value of the right shape, used to show the model a well-formed call."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "object":
        return {
            key: example_value(sub)
            for key, sub in schema.get("properties", {}).items()
            if key in schema.get("required", [])
        }
    if kind == "array":
        item = example_value(schema.get("items", {}))
        return [item] * max(1, schema.get("minItems", 1))
    return {"integer": 1, "number": 1.0, "boolean": True, "null": None}.get(
        kind or "", f"<{kind or 'value'}>"
    )


def describe_parameters(schema: dict[str, Any]) -> str:
    """One line per parameter: name, type, required/optional, allowed values, description."""
    required = set(schema.get("required", []))
    lines = []
    for key, sub in schema.get("properties", {}).items():
        kind = sub.get("type", "any")
        kind = " | ".join(kind) if isinstance(kind, list) else kind
        if kind == "array" and isinstance(sub.get("items"), dict):
            kind = f"array of {sub['items'].get('type', 'any')}"
        parts = [f"- {key} ({kind}, {'required' if key in required else 'optional'})"]
        if "enum" in sub:
            parts.append("one of " + ", ".join(_show(option) for option in sub["enum"]))
        if sub.get("description"):
            parts.append(sub["description"].strip().splitlines()[0])
        lines.append(": ".join(parts[:1]) + (": " + "; ".join(parts[1:]) if len(parts) > 1 else ""))
    return "\n".join(lines) if lines else "(no parameters)"
