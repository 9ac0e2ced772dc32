"""Checks of the component contract: how factories are called and what they must build.

Every factory is called with one positional argument, the validated config; one that
declares a ``ctx`` parameter (or accepts ``**kwargs``) also gets ``ctx=<RunContext>``.
:func:`inspect_factory` checks that shape when a component is registered, so a factory that
cannot be called that way is reported up front instead of failing mid-run.
:func:`missing_members` compares a built object with its kind's Protocol; the required
members are read from the Protocol class itself, so they follow the Protocol as it grows.

Nothing here imports :mod:`reasonctl.core.protocols`: the Protocol classes are handed in.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol

SPECIAL_METHODS = ("__call__", "__len__", "__getitem__")
"""Dunder methods a Protocol can require (all other ``_``-prefixed names are ignored)."""

CONTEXT_PARAMETER = "ctx"

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


@dataclass(frozen=True)
class FactoryShape:
    """How a factory is called: whether it takes ``ctx``, or why it cannot be called."""

    takes_ctx: bool = False
    problem: str = ""


def inspect_factory(factory: Any) -> FactoryShape:
    """Check that ``factory(config)`` / ``factory(config, ctx=...)`` is a valid call."""
    if not callable(factory):
        return FactoryShape(problem=f"its factory {factory!r} is not callable")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins hide their signature: trust the config call
        return FactoryShape()
    params = list(signature.parameters.values())
    shown = f"{_factory_name(factory)}{signature}"
    config_slot = next((p for p in params if p.kind in _POSITIONAL), None)
    takes_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    if config_slot is None and not takes_varargs:
        return FactoryShape(
            problem=f"its factory {shown} has no positional parameter to receive the config; "
            "define it as `def factory(config)` (add `ctx` to get the run context)"
        )
    if config_slot is not None and config_slot.name == CONTEXT_PARAMETER:
        return FactoryShape(
            problem=f"the first parameter of its factory {shown} is named 'ctx' but receives "
            "the config; define it as `def factory(config, ctx)`"
        )
    ctx_param = next(
        (p for p in params
         if p.name == CONTEXT_PARAMETER and p is not config_slot and p.kind in _BY_KEYWORD),
        None,
    )
    unfilled = [
        p.name for p in params
        if p is not config_slot and p is not ctx_param and p.kind not in _VARIADIC
        and p.default is inspect.Parameter.empty
    ]
    if unfilled:
        names = ", ".join(repr(n) for n in unfilled)
        return FactoryShape(
            problem=f"its factory {shown} requires {names}, which reasonctl never passes: a "
            "factory gets the config as its only positional argument, plus ctx=<RunContext> "
            "when it declares `ctx`; give the others defaults or move them into the config "
            "model"
        )
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return FactoryShape(takes_ctx=ctx_param is not None or takes_kwargs)


def _factory_name(factory: Callable[..., Any]) -> str:
    return getattr(factory, "__qualname__", None) or type(factory).__qualname__


@functools.cache
def required_members(protocol: type) -> tuple[str, ...]:
    """Members an object needs to satisfy ``protocol``, in declaration order.

    Public methods and properties defined on the Protocol (and on Protocols it extends),
    the special methods in :data:`SPECIAL_METHODS`, and annotated public attributes.
    """
    names: dict[str, None] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object, Protocol, Generic) or not getattr(klass, "_is_protocol", False):
            continue
        for name in vars(klass).get("__annotations__", {}):
            if not name.startswith("_"):
                names[name] = None
        for name, value in vars(klass).items():
            member = inspect.isfunction(value) or isinstance(
                value, (property, classmethod, staticmethod, functools.cached_property)
            )
            if name in SPECIAL_METHODS or (member and not name.startswith("_")):
                names[name] = None
    return tuple(names)


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks (empty when it satisfies it)."""
    return [name for name in required_members(protocol) if not _has_member(obj, name)]


def _has_member(obj: Any, name: str) -> bool:
    if name == "__call__":
        return callable(obj)
    if name in SPECIAL_METHODS:  # looked up on the type, as the interpreter does
        return hasattr(type(obj), name)
    missing = object()
    if inspect.getattr_static(obj, name, missing) is not missing:
        return True
    try:  # attributes served by __getattr__ (proxies, wrappers)
        return hasattr(obj, name)
    except Exception:
        return False


def product_problem(factory: Any, protocol: type | tuple[type, ...]) -> str:
    """Why what ``factory`` builds cannot satisfy ``protocol``, known at registration
    ("" when it can, or when that cannot be told before the factory runs).

    Known are a class registered as its own factory and a function whose return
    annotation names a class; the methods (and properties) the Protocol requires must be
    defined on that class. Data attributes are left to the check of the built object, as
    ``__init__`` may set them, and so is a class with ``__getattr__`` (a proxy).
    """
    product = factory if inspect.isclass(factory) else _returned_class(factory)
    if product is None or getattr(product, "_is_protocol", False) or any(
            "__getattr__" in vars(k) for k in product.__mro__ if k is not object):
        return ""
    alternatives = protocol if isinstance(protocol, tuple) else (protocol,)
    missing = [_missing_methods(product, p) for p in alternatives]
    if not all(missing):
        return ""
    others = "".join(f" or {p.__name__}'s {', '.join(m)}"
                     for p, m in zip(alternatives[1:], missing[1:], strict=True))
    return (f"its class {product.__qualname__} lacks {', '.join(missing[0])} required by the "
            f"{alternatives[0].__name__} protocol{others} (see reasonctl."
            f"{alternatives[0].__qualname__})")


def _returned_class(factory: Any) -> type | None:
    """The class a function's return annotation names, if it resolves to one."""
    annotation = getattr(factory, "__annotations__", {}).get("return")
    if isinstance(annotation, str):
        try:
            annotation = eval(annotation, getattr(factory, "__globals__", {}))
        except Exception:  # a name imported only for type checkers: nothing to tell
            return None
    if not inspect.isclass(annotation) or annotation in (Any, object):
        return None
    return annotation


def _missing_methods(cls: type, protocol: type) -> list[str]:
    """The methods and properties of ``protocol`` that class ``cls`` does not define."""
    declared = {name for klass in protocol.__mro__ if getattr(klass, "_is_protocol", False)
                for name, value in vars(klass).items()
                if inspect.isfunction(value) or isinstance(value, property)}
    return [name for name in required_members(protocol)
            if name in declared and not any(name in vars(k) for k in cls.__mro__
                                            if k is not object)]


def contract_problem(obj: Any, protocol: type | tuple[type, ...]) -> str:
    """Why ``obj`` does not satisfy ``protocol`` ("" when it does); given several Protocols,
    ``obj`` must satisfy one of them (the first is the one named when it satisfies none)."""
    alternatives = protocol if isinstance(protocol, tuple) else (protocol,)
    protocol = alternatives[0]
    if obj is None:
        return f"its factory returned None instead of a {protocol.__name__} (a missing return?)"
    if any(not missing_members(obj, p) for p in alternatives):
        return ""
    missing = missing_members(obj, protocol)
    what = obj.__qualname__ if inspect.isfunction(obj) else type(obj).__qualname__
    others = "".join(f" or {p.__name__}'s {', '.join(missing_members(obj, p))}"
                     for p in alternatives[1:])
    return (
        f"{what} lacks {', '.join(missing)} required by the {protocol.__name__} protocol"
        f"{others} (see {protocol.__module__}.{protocol.__qualname__})"
    )
