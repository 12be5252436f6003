"""Extension hooks have one signature each; a class that defines one with another is refused when it is
loaded, with the hook's name and the signature rollway calls it with (not later, mid-episode)."""

from __future__ import annotations

import inspect
from typing import Any


class HookSignatureError(TypeError):
    """A hook is defined with a signature rollway does not call; the message says which one it does."""


def check_hook(obj: Any, hook: str, params: tuple[str, ...], signature: str) -> None:
    """Refuse `obj.<hook>` unless it takes exactly the positional parameters `params` (names free; a
    `*args` also takes them). `signature` is how the error message writes the expected definition."""
    method = getattr(obj, hook)
    owner = obj if isinstance(obj, type) else type(obj)
    try:
        found = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    if isinstance(obj, type) and found and found[0].name == "self":
        found = found[1:]  # the function on the class, not bound
    positional = [p for p in found if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in found if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                                       p.KEYWORD_ONLY)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in found)
    if (len(positional) >= len(params) or varargs) and len(required) <= len(params):
        return
    written = ", ".join(p.name for p in found)
    raise HookSignatureError(
        f"{owner.__module__}.{owner.__qualname__}.{hook}({written}) has the wrong signature: rollway calls "
        f"`{signature}` ({len(params)} arguments: {', '.join(params)}). Define it with that signature "
        "(an argument you do not need is still declared; docs/extending.md)")
