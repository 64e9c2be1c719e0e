"""The rule registry: op name → rule, and jax primitive → the rule it runs as and
the computation it stands for; the one global registry in spmdkit (the bodies are
stored in :mod:`spmdkit.jaxprs`, which the stages below this one read, and written
only from here). Every other piece of state, caches and context variables, is
listed in :mod:`spmdkit.state`.

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

from spmdkit import jaxprs
from spmdkit.engine.rule import Rule
from spmdkit.errors import NoRuleError, RegistrationError
from spmdkit.state import register_registry

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

#: ``fn(eqn) -> jaxpr``: what an equation of a primitive with no body in its params computes.
BodyFn = Callable[[Any], Any]

_RULES: dict[str, Rule] = {}
_CONVERTERS: dict[str, Converter] = {}
_BUILTIN_LOADED = False
_GENERATION = 0
_LOCK = threading.RLock()
register_registry(
    __name__,
    ("_RULES", "_CONVERTERS", "_BUILTIN_LOADED", "_GENERATION"),
    why="the rule registry: rules by op name, primitive converters, built-ins loaded, "
    "its generation.",
)


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


def register_primitive(
    name: str, to_rule: Converter | None = None, *, body: BodyFn | None = None
) -> None:
    """Register a jax primitive with spmdkit: propagation runs an equation of
    primitive ``name`` as the rule ``to_rule(eqn)`` names, and the readers that look
    inside computations (the pipeline's row check, the layer scan's FLOP count) see
    ``body(eqn)``. One place holds both: a primitive is registered here once.

    Args:
      name: the primitive's name (``eqn.primitive.name``).
      to_rule: ``fn(eqn) -> (op name, attrs)``, or a function returning None to
        treat the equation as having no rule (replicated fallback).
      body: ``fn(eqn) -> jaxpr``: what the equation computes, as a (closed) jaxpr of
        its operands, for a primitive that holds no body in its parameters.

    Raises:
      RegistrationError: ``name`` is not a string, neither ``to_rule`` nor ``body``
        is given or one is not callable, or the primitive is already registered
        (unregister it first).

    Example::

        >>> sk.register_primitive("my_gelu", lambda eqn: ("tanh", {}))
    """
    given = [f for f in (to_rule, body) if f is not None]
    if not isinstance(name, str) or not given or not all(callable(f) for f in given):
        raise RegistrationError(
            op="register_primitive",
            must="name is a primitive name, and to_rule and/or body are callables",
            given=f"{name!r}, to_rule={type(to_rule).__name__}, body={type(body).__name__}",
            fix="register_primitive('prim', lambda eqn: ('op', {...}), body=lambda eqn: jaxpr)",
        )
    with _LOCK:
        if name in _CONVERTERS or jaxprs.primitive_body_fn(name) is not None:
            raise RegistrationError(
                op="register_primitive",
                must="a primitive is registered once",
                given=f"{name!r} is already registered",
                fix=f"sk.unregister_primitive({name!r}) first",
            )
        if to_rule is not None:
            _CONVERTERS[name] = to_rule
        if body is not None:  # stored where the readers below the rule engine see it
            jaxprs.set_primitive_body(name, body)
        _changed()


def unregister_primitive(name: str) -> Converter | None:
    """Remove primitive ``name``'s registration (converter and body); return its
    converter (None when it registered only a body).

    Raises:
      NoRuleError: ``name`` is not registered.
    """
    with _LOCK:
        if name not in _CONVERTERS and jaxprs.primitive_body_fn(name) is None:
            raise NoRuleError(
                op=name,
                must="the primitive is registered",
                given=f"nothing registered for {name!r}",
                fix="see sk.register_primitive",
            )
        conv = _CONVERTERS.pop(name, None)
        jaxprs.set_primitive_body(name, None)
        _changed()
    return conv


def primitive_converter(name: str) -> Converter | None:
    """The converter registered for primitive ``name``, None when there is none."""
    return _CONVERTERS.get(name)
