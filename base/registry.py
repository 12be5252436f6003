"""One registry per component kind (task set, tool, sandbox, policy, learner, advantage, loss): built-in
implementations by name, your own by `python:MODULE:CLASS`, each with its own pydantic config.

A config section names its implementation with `type`. The implementation's config class (a subclass
of the section's base config, which holds the fields every implementation has) is registered with a
built-in (`Registry.add(name, target, config)`: `SWEBenchTasksConfig` for `tasks.type: swebench`) or is a
plugin's `config_class` attribute; the section is validated against that class (a discriminated union
resolved through the registry), so a plugin's own options are checked like built-in ones and a key the
chosen type lacks fails naming the key and the type. A plugin without `config_class` gets the config
of the built-in it subclasses, else the section's base config."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError, model_validator

from rollway.base.config import StrictModel
from rollway.base.plugins import is_plugin, load_plugin


def import_target(target: str) -> Any:
    """The object `module:attr` names."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


class SectionConfig(StrictModel):
    """Base of a config section chosen by `type` (tasks, policy, sandbox). A built-in's own config class
    names its implementation in `implementation`: the class then fills `type` when it is left out
    and refuses another `type`, so `SWEBenchTasksConfig(path=...)` is a swebench section."""

    implementation: ClassVar[str | None] = None
    """The `type` this class configures (built-ins); None: any (the section's base, plugins)."""
    registry: ClassVar[str | None] = None
    """`module:NAME` of the section's Registry (set on the section's base class)."""

    def __new__(cls, *args: Any, **data: Any) -> Any:
        """`SandboxConfig(type="docker", image=...)` builds the docker sandbox's own config class (the
        built-in's config class the registry names; `type` left out: the default type's), so the base
        class constructs any built-in type as a discriminated union would. A call without fields (also
        how pydantic copies a model) builds the class itself."""
        if not (data and cls.registry and cls.implementation is None and "type" in cls.model_fields):
            return super().__new__(cls)
        type_name = data.get("type", cls.model_fields["type"].default)
        if isinstance(type_name, str) and not is_plugin(type_name):
            registry = import_target(cls.registry)
            if type_name in registry:
                chosen = registry.config_class(type_name, cls)
                if chosen is not cls and issubclass(chosen, cls):
                    return super().__new__(chosen)
        return super().__new__(cls)

    @model_validator(mode="before")
    @classmethod
    def _type_of_this_class(cls, data: Any) -> Any:
        if cls.implementation is not None and isinstance(data, dict) and "type" not in data:
            return {**data, "type": cls.implementation}
        return data

    @model_validator(mode="after")
    def _type_matches_class(self) -> SectionConfig:
        type_name = getattr(self, "type", None)
        if self.implementation is not None and type_name != self.implementation and not is_plugin(type_name):
            raise ValueError(f"{type(self).__name__} configures type {self.implementation!r}, not "
                             f"{getattr(self, 'type', None)!r}; build the config of that type (or load_config)")
        return self


class Registry:
    """Implementations of one component kind. Built-ins are named by `module:Class` strings, imported
    on first use, so validating a config does not load torch or docker."""

    def __init__(self, kind: str, section: str, base: str) -> None:
        self.kind = kind
        """What the implementations are, for messages ("task set")."""
        self.section = section
        """The config key that selects one (`tasks.type`)."""
        self._base = base
        self._builtins: dict[str, str | type] = {}
        self._configs: dict[str, str] = {}

    @property
    def base(self) -> type:
        """The class every implementation subclasses."""
        return import_target(self._base)

    def add(self, name: str, target: str | type, config: str | None = None) -> None:
        """Register a built-in (or an in-process plugin) under `name`; `config`: its config class as
        `module:Class` when it has its own."""
        self._builtins[name] = target
        if config is not None:
            self._configs[name] = config

    def names(self) -> list[str]:
        return sorted(self._builtins)

    def registered(self, name: str) -> str | type | None:
        """What `name` was registered as (`module:Class` or the class itself); None when not registered."""
        return self._builtins.get(name)

    def __contains__(self, name: str) -> bool:
        return is_plugin(name) or name in self._builtins

    def load(self, type_name: str) -> type:
        """The implementation class `type_name` names (a registered name or `python:MODULE:CLASS`)."""
        if is_plugin(type_name):
            return load_plugin(type_name, self.base)
        target = self._builtins.get(type_name)
        if target is None:
            raise ValueError(f"{self.section}={type_name!r} is not a {self.kind}; built-in: {', '.join(self.names())}; "
                             "or your own class as python:MODULE:CLASS (or python:FILE.py:CLASS)")
        return import_target(target) if isinstance(target, str) else target

    def config_class(self, type_name: str, default: type[BaseModel]) -> type[BaseModel]:
        """The config class of `type_name`: its `config_class`, else that of the built-in it subclasses
        (a plugin deriving from the toy task set takes `tasks.count`), else `default` (the section's base)."""
        if not is_plugin(type_name):
            return import_target(self._configs[type_name]) if type_name in self._configs else default
        implementation = self.load(type_name)
        cls = getattr(implementation, "config_class", None) or self._inherited_config(implementation) or default
        if not (isinstance(cls, type) and issubclass(cls, default)):
            raise TypeError(f"{type_name}: config_class {cls!r} must subclass {default.__module__}.{default.__name__} "
                            "(the fields the framework reads)")
        return cls

    def _inherited_config(self, implementation: type) -> type[BaseModel] | None:
        """The config class of the nearest built-in among `implementation`'s bases."""
        for klass in implementation.__mro__:
            for name, target in self._builtins.items():
                if name in self._configs and (target is klass or target == f"{klass.__module__}:{klass.__qualname__}"):
                    return import_target(self._configs[name])
        return None


def validate_section(data: Any, default: type[BaseModel], registry: Registry) -> Any:
    """Pydantic `before` validator of a section chosen by `type`: validates a mapping against the
    chosen implementation's config class. Anything else (a model instance) passes through."""
    if not isinstance(data, dict):
        return data
    type_name = data.get("type", default.model_fields["type"].default)
    if not isinstance(type_name, str) or type_name not in registry:
        return data  # the base config's `type` field reports it
    try:
        cls = registry.config_class(type_name, default)
    except (ImportError, TypeError, AttributeError) as err:
        raise ValueError(str(err)) from None
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ValueError("; ".join(_section_error(e, registry.section, type_name, cls) for e in err.errors())) from None


def _section_error(error: Any, section: str, type_name: str, cls: type[BaseModel]) -> str:
    """One validation error as `tasks.KEY: message`; a key the chosen type does not have says so and
    lists the keys it has."""
    prefix = section.rpartition(".")[0]
    key = f"{prefix}.{'.'.join(map(str, error['loc']))}"
    message = error["msg"].removeprefix("Value error, ")
    if message.startswith(f"{prefix}."):
        return message  # a nested section's own message (learner.loss.KEY: ...)
    if error["type"] != "extra_forbidden" or len(error["loc"]) != 1:
        return f"{key}: {message}"
    return (f"{key}: Extra inputs are not permitted: not a field of {section}={type_name} "
            f"(its fields: {', '.join(sorted(cls.model_fields))}); if it came with a config file written for "
            f"another type, override the whole section: '{prefix}={{\"type\": ..., ...}}'")
