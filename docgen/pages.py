"""Generated pages: the configuration reference (docs/configuration.md) from the pydantic config models, by
`rollway docs config`; the pipeline block of README.md and docs/concepts.md, by `rollway docs topology`."""

from __future__ import annotations

import ast
import inspect
import json
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

COMMAND = "rollway docs config"
"""What regenerates the page (named in the page and in the staleness test's message)."""
TOPOLOGY_FILES = ("README.md", "docs/concepts.md")

HEADER = f"""# Configuration reference

<!-- Generated from the pydantic config models by `{COMMAND}`: do not edit by hand. -->

A run's configuration is one YAML file (`rollway up CONFIG`) plus dotted overrides on the command line
(`agent.max_turns=8 'tasks={{"type": "toy", "count": 2}}'`). Every key below is optional: a key left out
takes its default. An unknown key, or a key of another `type`, is an error naming the key and the fields
it allows. Sections chosen by `type` (tasks, policy, sandbox, learner, learner.loss, learner.advantage)
list the fields every type has, then what each built-in type adds; a plugin (`python:MODULE:CLASS`)
brings its own fields as its `config_class` ([Extending rollway](extending.md)).

Regenerate this page with `{COMMAND}` after changing a config model; a test fails while it is stale.
"""


@dataclass(frozen=True)
class Polymorphic:
    """A section whose fields depend on its `type`: the base class and the registry of its types."""

    base: str
    registry: str


POLYMORPHIC = {
    "tasks": Polymorphic("rollway.envs.config:TasksConfig", "rollway.envs.factory:TASK_SETS"),
    "policy": Polymorphic("rollway.policies.config:PolicyConfig", "rollway.policies.factory:POLICIES"),
    "sandbox": Polymorphic("rollway.sandboxes.config:SandboxConfig", "rollway.sandboxes.factory:SANDBOXES"),
    "learner": Polymorphic("rollway.learning.config:LearnerConfig", "rollway.learning.registries:LEARNERS"),
    "learner.loss": Polymorphic("rollway.learning.config:LossConfig", "rollway.learning.registries:LOSSES"),
    "learner.advantage": Polymorphic("rollway.learning.config:AdvantageConfig",
                                     "rollway.learning.registries:ADVANTAGES"),
}
"""Sections chosen by `type` (their validators in config/run.py and learning/config.py)."""


def _target(spec: str) -> Any:
    from rollway.base.registry import import_target

    return import_target(spec)


# -- docstrings ------------------------------------------------------------------------------------------
@cache
def _own_field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under the fields a class declares itself (the string after `name: type = ...`)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def field_doc(cls: type[BaseModel], name: str) -> str:
    """The docstring of field `name`, from the nearest class in the MRO that documents it."""
    for klass in cls.__mro__:
        if isinstance(klass, type) and issubclass(klass, BaseModel) and name in _own_field_docs(klass):
            return _own_field_docs(klass)[name]
    info = cls.model_fields[name]
    return info.description or ""


def class_doc(cls: type) -> str:
    doc = cls.__dict__.get("__doc__")
    return inspect.cleandoc(doc) if doc else ""


# -- types and defaults ----------------------------------------------------------------------------------
def type_text(annotation: Any) -> str:
    """A short, stable rendering of a field's type: `int | None`, `"a" | "b"`, `list[str]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        if getattr(args[0], "__name__", "") == "str" and any("python:" in str(m) for m in args[1:]):
            return "python:MODULE:CLASS"
        return type_text(args[0])
    if origin is Literal:
        return " | ".join(json.dumps(a.value if isinstance(a, Enum) else a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]" if args else name
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, Enum):
        value = value.value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def _cell(text: str) -> str:
    """One Markdown table cell: a single line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`".replace("|", "\\|")


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    """Config classes a field holds (directly or in a list/dict): each gets its own table."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _submodels(a)]


# -- the page ---------------------------------------------------------------------------------------------
def fields_table(cls: type[BaseModel], names: list[str]) -> list[str]:
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name in names:
        info = cls.model_fields[name]
        rows.append(f"| `{name}` | {_code(type_text(info.annotation))} | {_code(default_text(info))} | "
                    f"{_cell(field_doc(cls, name))} |")
    return rows


def section(path: str, cls: type[BaseModel], level: int, intro: str = "") -> list[str]:
    """The heading, docstrings and fields of one section, then its nested sections."""
    names = list(cls.model_fields)
    out = [f"{'#' * level} `{path}`", ""]
    for doc in (intro, class_doc(cls)):
        if doc:
            out += [doc, ""]
    if names:
        out += fields_table(cls, names) + [""]
    for name in names:
        sub_path = f"{path}.{name}"
        if sub_path in POLYMORPHIC:
            out += polymorphic_section(sub_path, level + 1, field_doc(cls, name))
            continue
        for sub in _submodels(cls.model_fields[name].annotation):
            label = sub_path if sub is cls.model_fields[name].annotation else f"{sub_path} ({sub.__name__})"
            out += section(label, sub, level + 1, field_doc(cls, name))
    return out


def polymorphic_section(path: str, level: int, intro: str = "") -> list[str]:
    """The fields every type has, then per built-in type the fields its config class adds or re-defaults."""
    poly = POLYMORPHIC[path]
    base, registry = _target(poly.base), _target(poly.registry)
    out = section(path, base, level, intro)
    for name in registry.names():
        cls = registry.config_class(name, base)
        extra = [f for f in cls.model_fields if f not in base.model_fields
                 or default_text(cls.model_fields[f]) != default_text(base.model_fields[f])]
        extra = [f for f in extra if f != "type"]
        out += [f"{'#' * (level + 1)} `{path}.type: {name}`", ""]
        if cls is base:
            out += ["The fields above, nothing more.", ""]
            continue
        out += [f"Config class `{cls.__module__}.{cls.__qualname__}`.", ""]
        if extra:
            out += fields_table(cls, extra) + [""]
            for field_name in extra:
                for sub in _submodels(cls.model_fields[field_name].annotation):
                    out += section(f"{path}.{field_name} ({sub.__name__})", sub, level + 2)
        else:
            out += ["No fields beyond those above.", ""]
    return out


def config_reference() -> str:
    """The whole page, as `rollway docs config` writes it."""
    from rollway.config.run import RunConfig

    out = [HEADER]
    for name, info in RunConfig.model_fields.items():
        intro = field_doc(RunConfig, name)
        if name in POLYMORPHIC:
            out += polymorphic_section(name, 2, intro)
        else:
            out += section(name, info.annotation, 2, intro)
    return "\n".join(out).rstrip() + "\n"


def write_config_reference(out: Path, check: bool, named_out: bool) -> int:
    """Write the page to `out`; with `check`, write nothing and return 1 when `out` is stale."""
    text = config_reference()
    if check:
        current = out.read_text() if out.exists() else None
        if current != text:
            print(f"rollway docs: {out} is stale (the config models changed); run `{COMMAND}`"
                  + (f" --out {out}" if named_out else ""), file=sys.stderr)
            return 1
        print(f"{out} is current")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(out)
    return 0


def write_topology(check: bool) -> int:
    """Rewrite (or check) the generated topology block of each file in TOPOLOGY_FILES."""
    from rollway.topics.topology import with_diagram

    stale = []
    for name in TOPOLOGY_FILES:
        path = Path(name)
        current = path.read_text()
        wanted = with_diagram(current)
        if wanted != current:
            stale.append(name)
            if not check:
                path.write_text(wanted)
    if check and stale:
        print(f"rollway docs: the topology block of {', '.join(stale)} is stale (topics/topology.py changed); "
              "run `rollway docs topology`", file=sys.stderr)
        return 1
    print("topology block current in " + ", ".join(TOPOLOGY_FILES) if check else "\n".join(TOPOLOGY_FILES))
    return 0
