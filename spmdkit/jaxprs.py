"""Reading jaxprs on every supported jax: the one module that knows how each release
spells its control-flow and call equations.

spmdkit reads traced programs (jaxprs) to plan, cost, split and rewrite them.
jax changes how some equations carry their structure between releases, so every
other module asks this one instead of indexing ``eqn.params`` of control flow
(``tests/test_jaxprs.py`` fails when one does). What changed, by release:

==================  ===================================  ==================================
equation            jax 0.10                             jax 0.11 and 0.12
==================  ===================================  ==================================
``scan``            ``num_consts``, ``num_carry``;        ``ft_in``: a flat tree of three
                    body a ``ClosedJaxpr``                 groups (consts, carry, xs); body a
                                                           ``Jaxpr`` that carries its consts
``while``           ``cond_nconsts``/``body_nconsts``;    same counts; bodies are ``Jaxpr``
                    bodies ``ClosedJaxpr``
``cond``            ``branches``: ``ClosedJaxpr``s        ``branches``: ``Jaxpr``s
``jit``/``pjit``,   ``jaxpr``/``call_jaxpr``:             ``Jaxpr`` (``jaxpr.jaxpr`` is the
``custom_*``        ``ClosedJaxpr``                       jaxpr itself, ``.consts`` its
                                                          constants)
``shard_map``       ``newly_manual_axes`` (older:        ``newly_manual_axes``
                    ``manual_axes``, ``axis_names``)
``remat``           ``jaxpr``: an open ``Jaxpr``          same
==================  ===================================  ==================================

Everything here works on what the running jax hands out; nothing converts a jaxpr
from one release's form to another's.

A primitive that holds no body in its parameters (spmdkit's op regions, a user's
own primitive) can still say what it computes: ``sk.register_primitive(name,
body=fn)`` registers ``fn(eqn) -> jaxpr`` (the registry in
:mod:`spmdkit.engine.registry` is the only writer; this module stores it so the
readers below the rule engine, the pipeline's row check and FLOP counts, reach it
through :func:`computed_body`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax.extend.core as jex

from spmdkit.state import register_registry

__all__ = [
    "CALL_PRIMITIVES",
    "MARKER_PRIMITIVES",
    "REMAT_PRIMITIVES",
    "Scan",
    "WhileLoop",
    "call_body",
    "call_name",
    "closed",
    "computed_body",
    "cond_branches",
    "manual_axes",
    "open_jaxpr",
    "primitive_body_fn",
    "program_jaxpr",
    "registered_body",
    "scan",
    "scan_length",
    "shard_map_body",
    "shard_map_mesh",
    "shard_map_specs",
    "set_primitive_body",
    "sub_jaxprs",
    "body_params",
    "walk_eqns",
    "while_loop",
    "with_body",
]


#: Recompute (``jax.checkpoint``) primitives: their body is an open jaxpr in ``jaxpr``.
REMAT_PRIMITIVES = frozenset({"remat", "remat2", "checkpoint"})

#: Primitives that carry facts about the program for spmdkit's own readers and no
#: values (no operands, no results; they lower to nothing): the pipeline
#: executor's :data:`~spmdkit.pipeline.facts.FACTS` marker. Graphs and replays skip
#: them; the reader walks the traced program for them.
MARKER_PRIMITIVES = frozenset({"spmdkit_pipeline_facts"})

#: Call-like primitive → the parameter holding its body.
CALL_PRIMITIVES: Mapping[str, str] = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "eval_jaxpr": "call_jaxpr",  # jax 0.12's closed_call
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}


def open_jaxpr(body: Any) -> tuple[Any, list]:
    """(jaxpr, constant values) of a body: ``ClosedJaxpr`` (jax 0.10) and ``Jaxpr``
    with consts (jax 0.11+) give their constants; an open jaxpr gives none."""
    if hasattr(body, "jaxpr") and hasattr(body, "consts"):
        return body.jaxpr, list(body.consts)
    return body, []


def closed(jaxpr: Any, consts: list | tuple = ()) -> Any:
    """The running jax's closed jaxpr of an open ``jaxpr`` and its ``consts`` (what
    a ``scan``/``jit`` equation's body parameter holds)."""
    return jex.ClosedJaxpr(jaxpr, list(consts))


def _has_eqns(value: Any) -> bool:
    return hasattr(open_jaxpr(value)[0], "eqns")


# -- scan, while, cond ---------------------------------------------------------------


@dataclass(frozen=True)
class Scan:
    """A ``scan`` equation read: its operands are ``consts``, then the initial
    ``carry``, then the scanned ``xs``; its results the final carry, then ``ys``.

    Attributes:
      body: the body as the equation holds it (closed).
      jaxpr: the body's open jaxpr (invars: consts, carry, one slice of each xs).
      consts: the body's own constant values (``jaxpr.constvars``).
      length: trip count.
      reverse: whether it runs from the last slice to the first.
      num_consts: how many operands are loop-invariant.
      num_carry: how many are carried.
      unroll: how many iterations XLA runs per loop trip.
    """

    body: Any
    jaxpr: Any
    consts: tuple
    length: int
    reverse: bool
    num_consts: int
    num_carry: int
    unroll: int | bool = 1

    @property
    def num_xs(self) -> int:
        """How many operands are scanned over (leading dim ``length``)."""
        return len(self.jaxpr.invars) - self.num_consts - self.num_carry

    @property
    def first_xs(self) -> int:
        """The operand index of the first scanned operand."""
        return self.num_consts + self.num_carry


def _scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    groups = params["ft_in"].unpack()  # jax 0.11+: (consts, carry, xs)
    return len(groups[0]), len(groups[1])


def scan(eqn: Any) -> Scan:
    """The parts of a ``scan`` equation."""
    p = eqn.params
    nc, nk = _scan_counts(p)
    jaxpr, consts = open_jaxpr(p["jaxpr"])
    return Scan(
        body=p["jaxpr"],
        jaxpr=jaxpr,
        consts=tuple(consts),
        length=int(p["length"]),
        reverse=bool(p["reverse"]),
        num_consts=nc,
        num_carry=nk,
        unroll=p.get("unroll", 1),
    )


@dataclass(frozen=True)
class WhileLoop:
    """A ``while`` equation read: operands are the condition's consts, the body's
    consts, then the carry.

    Attributes:
      cond: the condition (closed).
      body: the body (closed).
      cond_nconsts: how many operands only the condition reads.
      body_nconsts: how many operands only the body reads.
    """

    cond: Any
    body: Any
    cond_nconsts: int
    body_nconsts: int


def while_loop(eqn: Any) -> WhileLoop:
    """The parts of a ``while`` equation."""
    p = eqn.params
    return WhileLoop(
        p["cond_jaxpr"], p["body_jaxpr"], int(p["cond_nconsts"]), int(p["body_nconsts"])
    )


def cond_branches(eqn: Any) -> list:
    """The branches (closed) of a ``cond`` equation; its first operand picks one."""
    return list(eqn.params["branches"])


# -- calls, shard_map ----------------------------------------------------------------


def call_body(eqn: Any) -> Any | None:
    """The body of a call-like equation (``jit``, ``closed_call``, ``custom_jvp_call``,
    ``custom_vjp_call``, ``remat``), as the equation holds it; None for others.
    Its invars line up with the equation's operands."""
    key = CALL_PRIMITIVES.get(eqn.primitive.name)
    body = eqn.params.get(key) if key else None
    return body if body is not None and _has_eqns(body) else None


def call_name(eqn: Any) -> str | None:
    """The name a ``jit`` call was made under (its function's ``__name__``), None
    for other equations."""
    if eqn.primitive.name not in ("pjit", "jit"):
        return None
    name = eqn.params.get("name")
    return None if name is None else str(name)


def remat_options(eqn: Any) -> dict:
    """``jax.checkpoint``'s keyword arguments a remat equation was made with
    (``policy``, ``prevent_cse``), to make the same region again."""
    return {"policy": eqn.params.get("policy"), "prevent_cse": eqn.params.get("prevent_cse", True)}


#: primitive name → ``fn(eqn) -> jaxpr``: what a primitive with no body in its params
#: computes (written by the registry only: :func:`set_primitive_body`).
_PRIMITIVE_BODIES: dict[str, Callable[[Any], Any]] = {}
register_registry(
    __name__, ("_PRIMITIVE_BODIES",), why="the rule registry's bodies of registered primitives."
)


def set_primitive_body(name: str, fn: Callable[[Any], Any] | None) -> None:
    """Store (``None``: remove) the body function of primitive ``name``. Called by
    :func:`spmdkit.engine.registry.register_primitive` and ``unregister_primitive``
    alone: register bodies there (``sk.register_primitive(name, body=fn)``)."""
    if fn is None:
        _PRIMITIVE_BODIES.pop(name, None)
    else:
        _PRIMITIVE_BODIES[name] = fn


def primitive_body_fn(name: str) -> Callable[[Any], Any] | None:
    """The body function registered for primitive ``name``, None when there is none."""
    return _PRIMITIVE_BODIES.get(name)


def computed_body(eqn: Any) -> Any | None:
    """The computation an equation runs, as a jaxpr whose invars line up with its
    operands: a call's body (:func:`call_body`), a ``shard_map``'s per-device body, or
    the body registered for its primitive (``sk.register_primitive(name, body=fn)``);
    None for a primitive with none of these."""
    body = call_body(eqn)
    if body is not None:
        return body
    if eqn.primitive.name == "shard_map":
        return shard_map_body(eqn)
    return registered_body(eqn)


def registered_body(eqn: Any) -> Any | None:
    """The body registered for the equation's primitive
    (``sk.register_primitive(name, body=fn)``), None when there is none."""
    fn = primitive_body_fn(eqn.primitive.name)
    return None if fn is None else fn(eqn)


def program_jaxpr(eqn: Any) -> Any:
    """The closed jaxpr a program equation holds in ``jaxpr`` (the enforced replay's
    region programs, bound once per distinct program)."""
    return eqn.params["jaxpr"]


def shard_map_body(eqn: Any) -> Any:
    """The per-device body of a ``shard_map`` equation."""
    return eqn.params["jaxpr"]


def shard_map_specs(eqn: Any) -> tuple[tuple, tuple]:
    """(in_specs, out_specs) of a ``shard_map`` equation."""
    return tuple(eqn.params["in_specs"]), tuple(eqn.params["out_specs"])


def manual_axes(eqn_or_params: Any) -> frozenset:
    """The mesh axes a ``shard_map`` equation (or its ``params``) makes manual, empty
    when it names none (jax 0.10 calls the parameter ``manual_axes`` or
    ``newly_manual_axes``, later ones ``newly_manual_axes``; ``axis_names`` before)."""
    params = getattr(eqn_or_params, "params", eqn_or_params)
    for key in ("newly_manual_axes", "manual_axes", "axis_names"):
        if params.get(key) is not None:
            return frozenset(params[key])
    return frozenset()


def shard_map_mesh(eqn: Any) -> Any:
    """The mesh a ``shard_map`` equation runs over."""
    return eqn.params.get("mesh")


# -- walking -------------------------------------------------------------------------


def sub_jaxprs(eqn: Any) -> list:
    """Every jaxpr nested in an equation's parameters (a scan's body, a while's
    condition and body, a cond's branches, a call's body, a shard_map's body), as
    the equation holds them, in parameter order. Thunks (a custom_vjp's backward)
    are not jaxprs yet and are left out."""
    out = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if _has_eqns(v):
                out.append(v)
    return out


def walk_eqns(jaxpr: Any, times: int = 1) -> Iterator[tuple[Any, int]]:
    """Every equation of ``jaxpr`` and of the jaxprs nested in it, depth first, with
    how many times it runs per run of ``jaxpr`` (scan trip counts multiplied)."""
    for eqn in open_jaxpr(jaxpr)[0].eqns:
        yield eqn, times
        for sub in sub_jaxprs(eqn):
            yield from walk_eqns(sub, times * scan_length(eqn))


def body_params(eqn: Any, body: Any) -> dict:
    """``eqn``'s parameters with its body replaced (a scan's, a call's or a
    shard_map's): what ``eqn.replace(params=...)`` or a ``bind`` takes."""
    name = eqn.primitive.name
    key = "jaxpr" if name in ("scan", "shard_map") else CALL_PRIMITIVES[name]
    return {**eqn.params, key: body}


def with_body(eqn: Any, body: Any) -> Any:
    """``eqn`` with its body replaced (a scan's, a call's or a shard_map's)."""
    return eqn.replace(params=body_params(eqn, body))


def scan_length(eqn: Any) -> int:
    """The trip count of a ``scan`` equation (1 for any other equation)."""
    return int(eqn.params["length"]) if eqn.primitive.name == "scan" else 1
