"""The rule registry: op name → rule, and jax primitive → the rule it runs as; the
only global state in spmdkit.

Built-in rules live in ``spmdkit.rules`` (the repository's ``rules/`` folder),
one module per op family, each exposing a ``RULES`` tuple. They are registered
the first time the registry is used, not as a side effect of importing the
modules.

Every change (register, unregister) bumps :func:`generation`; whoever caches
rule answers (:mod:`spmdkit.engine.inference`) keys them on it, so the registry never
has to know who caches.
"""

from __future__ import annotations

import difflib
import importlib
import threading
from collections.abc import Callable
from typing import Any

from spmdkit.engine.rule import Rule
from spmdkit.errors import NoRuleError, RegistrationError

__all__ = [
    "generation",
    "get_rule",
    "primitive_converter",
    "register_primitive",
    "register_rule",
    "registered_ops",
    "unregister_primitive",
    "unregister_rule",
]

#: ``fn(eqn) -> (op name, attrs)``, or None: the equation has no rule.
Converter = Callable[[Any], "tuple[str, dict] | None"]

_RULES: dict[str, Rule] = {}
_CONVERTERS: dict[str, Converter] = {}
_BUILTIN_LOADED = False
_GENERATION = 0
_LOCK = threading.RLock()


def _load_builtin() -> None:
    global _BUILTIN_LOADED  # noqa: PLW0603 - the registry is the one global by design
    if _BUILTIN_LOADED:
        return
    with _LOCK:
        if _BUILTIN_LOADED:
            return
        _BUILTIN_LOADED = True
        families = importlib.import_module("spmdkit.rules").FAMILIES
        for family in families:
            module = importlib.import_module(f"spmdkit.rules.{family}")
            for rule in module.RULES:
                _add(rule, family=family)


def _add(rule: Rule, *, family: str) -> None:
    if not isinstance(rule, Rule):
        raise RegistrationError(
            op=getattr(rule, "name", repr(rule)),
            must="a rule is a spmdkit Rule (FactorRule or a Rule subclass)",
            given=type(rule).__name__,
            fix="build it with sk.FactorRule(...) or subclass sk.Rule",
        )
    if rule.name in _RULES:
        raise RegistrationError(
            op=rule.name,
            must="an op is registered once",
            given=f"a second rule for {rule.name!r} (from {family})",
            fix="pick another op name, or unregister_rule() the old one first",
        )
    rule.family = family
    _RULES[rule.name] = rule
    _changed()


def _changed() -> None:
    global _GENERATION  # noqa: PLW0603 - the registry is the one global by design
    _GENERATION += 1


def generation() -> int:
    """A number that grows on every change of the registry (built-ins loaded).

    Caches of rule answers put it in their keys: an answer cached before a rule
    was registered or unregistered is never returned after.

    Example::

        >>> g = generation()
        >>> sk.unregister_rule(sk.register_rule(my_rule).name)
        >>> generation() == g + 2
        True
    """
    _load_builtin()
    return _GENERATION


def register_rule(rule: Rule) -> Rule:
    """Register ``rule`` under ``rule.name``; returns it (usable as a decorator
    on a Rule instance factory's result).

    Raises:
      RegistrationError: the name is taken, or ``rule`` is not a Rule.

    Example::

        >>> sk.register_rule(sk.FactorRule("my_scale", "... d, d -> ... d",
        ...                  impl=lambda x, s: x * s, partial="MULTIPLICATIVE"))
    """
    _load_builtin()
    with _LOCK:
        _add(rule, family="user")
    return rule


def unregister_rule(name: str) -> Rule:
    """Remove and return the rule registered as ``name`` (for tests and notebooks)."""
    rule = get_rule(name)
    with _LOCK:
        del _RULES[name]
        _changed()
    return rule


def get_rule(name: str) -> Rule:
    """The rule registered as ``name``.

    Raises:
      NoRuleError: nothing is registered under ``name``; names near matches.
    """
    _load_builtin()
    try:
        return _RULES[name]
    except KeyError:
        near = difflib.get_close_matches(name, list(_RULES), n=3, cutoff=0.6)
        raise NoRuleError(
            op=name,
            must="the op has a registered rule",
            given=f"no rule named {name!r}",
            fix=(f"did you mean {', '.join(map(repr, near))}? " if near else "")
            + "see sk.registered_ops(), or register one with sk.register_rule(...)",
        ) from None


def registered_ops() -> tuple[str, ...]:
    """Names of all registered ops, sorted."""
    _load_builtin()
    return tuple(sorted(_RULES))


# -- primitives ------------------------------------------------------------------


def register_primitive(name: str, to_rule: Converter) -> None:
    """Map a jax primitive to a registered rule: propagation runs an equation of
    primitive ``name`` as the rule ``to_rule(eqn)`` names.

    Args:
      name: the primitive's name (``eqn.primitive.name``).
      to_rule: ``fn(eqn) -> (op name, attrs)``, or None to treat the equation as
        having no rule (replicated fallback).

    Raises:
      RegistrationError: ``name`` is not a string, ``to_rule`` not callable, or the
        primitive already has a converter (unregister it first).

    Example::

        >>> sk.register_primitive("my_gelu", lambda eqn: ("tanh", {}))
    """
    if not isinstance(name, str) or not callable(to_rule):
        raise RegistrationError(
            op="register_primitive",
            must="name is a primitive name and to_rule a callable",
            given=f"{name!r}, {type(to_rule).__name__}",
            fix="register_primitive('prim', lambda eqn: ('op', {...}))",
        )
    with _LOCK:
        if name in _CONVERTERS:
            raise RegistrationError(
                op="register_primitive",
                must="a primitive is registered once",
                given=f"{name!r} already has a converter",
                fix=f"sk.unregister_primitive({name!r}) first",
            )
        _CONVERTERS[name] = to_rule
        _changed()


def unregister_primitive(name: str) -> Converter:
    """Remove and return the converter registered for primitive ``name``.

    Raises:
      NoRuleError: no converter is registered for ``name``.
    """
    with _LOCK:
        if name not in _CONVERTERS:
            raise NoRuleError(
                op=name,
                must="the primitive has a registered converter",
                given=f"none for {name!r}",
                fix="see sk.register_primitive",
            )
        conv = _CONVERTERS.pop(name)
        _changed()
    return conv


def primitive_converter(name: str) -> Converter | None:
    """The converter registered for primitive ``name``, None when there is none."""
    return _CONVERTERS.get(name)
