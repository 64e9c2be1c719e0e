"""Which values of a step XLA computes once: value numbering as its CSE pass sees them.

XLA's common-subexpression elimination merges two instructions that apply the same
operation, with the same attributes, to the same operands, and XLA's loop
simplifier inlines a loop that runs once into its caller first. So when a step
computes a value twice (a ``custom_vjp`` backward recomputes its forward's scores:
blockwise attention over a single key block is a scan of length 1 in both
passes), the compiled program computes it, and moves it, once. The prediction
must count it once too: :class:`ValueNumbers` maps each value id to the id of the
first identical value (:meth:`ValueNumbers.of`), and the records price reshards by
that id, so a value already moved to a layout is not moved again
(:func:`~spmdkit.propagation.pricing.reshard_once`).

Two values are identical when made by the same primitive, with equal parameters,
from identical operands required in the same layouts, producing the same layouts,
in the same *scope*. A scope is the step's top level, or the body of a loop that
runs more than once (XLA does not merge across a loop's boundary), or a
differentiated remat region with ``prevent_cse`` (JAX lowers its recomputation
behind an optimization barrier, so it is never merged with the forward's). An
equation XLA simplifies away (a ``rev`` of size-1 dims, the identity ``transpose``)
is its operand, in the operand's layout: the backward of a 1x1 convolution reads
the kernel the forward gathered, not a reversed copy gathered again. A scan of length one
is its caller's scope: its body's operands are the caller's values (the ``xs``
sliced at 0) and its results the body's (``ys`` stacked). Small constants are
identical when their values are.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from spmdkit.propagation.graph import Node
from spmdkit.spec import TensorSpec

__all__ = ["ValueNumbers"]

#: Primitives XLA never merges (stateful random number generation, effects).
_NEVER = frozenset({"rng_uniform", "rng_bit_generator", "random_seed", "random_bits_stateful"})

#: Constants up to this many elements are compared by value.
_CONST_ELEMENTS = 64


def _hashable(x: Any) -> Hashable:
    """A hashable stand-in for an equation parameter (TypeError when none)."""
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(y) for y in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    if isinstance(x, np.ndarray):
        raise TypeError("array parameter")
    hash(x)
    return x


def _no_op(node: Node) -> bool:
    """True for an equation XLA's algebraic simplifier removes, its result its
    operand: a ``rev`` of size-1 dims only (a 1x1 convolution's transposed
    kernel in its backward pass) or a ``transpose`` by the identity permutation."""
    params = node.eqn.params
    if node.prim == "rev":
        shape = node.eqn.invars[0].aval.shape
        return all(shape[d] == 1 for d in params["dimensions"])
    if node.prim == "transpose":
        return tuple(params["permutation"]) == tuple(range(len(params["permutation"])))
    return False


class ValueNumbers:
    """Value id → the id of the first value XLA's CSE would merge it with.

    Args:
      values: constant value id → its value (``FlatProgram.values``); small
        constants with equal values are one value.

    Example::

        >>> numbers = ValueNumbers(prog.values)
        >>> numbers.merge(node, required, outputs, scope=None)   # True: seen before
        >>> numbers.of(node.outs[0])                              # the first one's id
    """

    def __init__(self, values: Mapping[int, Any] | None = None) -> None:
        self.values = values or {}
        self.same: dict[int, int] = {}
        self.seen: dict[Hashable, tuple[int, ...]] = {}

    def of(self, vid: int) -> int:
        """The id of the first value identical to ``vid`` (``vid`` itself if none)."""
        hit = self.same.get(vid)
        if hit is not None:
            return hit
        if vid in self.values:
            key = self._const_key(vid)
            if key is not None:
                first = self.seen.setdefault(key, (vid,))[0]
                self.same[vid] = first
                return first
        return vid

    def _const_key(self, vid: int) -> Hashable | None:
        try:
            a = np.asarray(self.values[vid])
        except Exception:  # extended dtypes (PRNG keys) and the like
            return None
        if a.dtype == object or a.size > _CONST_ELEMENTS:
            return None
        return ("const", a.dtype.str, a.shape, a.tobytes())

    def alias(self, vid: int, to: int) -> None:
        """``vid`` is the value ``to`` (a loop-once body's operand or result)."""
        first = self.of(to)
        if first != vid:
            self.same[vid] = first

    def derived(self, vid: int, key: Hashable) -> None:
        """``vid`` is made from other values in a way identified by ``key`` (a
        loop-once scan's ``xs`` slice or stacked ``ys``): merged with the first
        value made so."""
        first = self.seen.setdefault(("derived", key), (vid,))[0]
        if first != vid:
            self.same[vid] = first

    def merge(
        self,
        node: Node,
        required: Sequence[TensorSpec | None],
        outputs: Sequence[TensorSpec | None],
        scope: Hashable,
    ) -> bool:
        """Number ``node``'s results: True when an identical node came before (its
        results are then the earlier node's values), False otherwise."""
        if node.kind != "eqn" or node.prim in _NEVER or getattr(node.eqn, "effects", None):
            return False
        if _no_op(node) and required[:1] == outputs[:1]:
            self.alias(node.outs[0], node.ins[0])
            return True
        try:
            params = _hashable(dict(node.eqn.params))
            key = (
                scope,
                node.prim,
                params,
                tuple(self.of(v) for v in node.ins),
                tuple(required),
                tuple(outputs),
            )
            hit = self.seen.setdefault(key, tuple(node.outs))
        except TypeError:
            return False
        if hit == tuple(node.outs):
            return False
        self.same.update(zip(node.outs, hit, strict=True))
        return True

    def scope(self, node: Node, scope: Hashable) -> Hashable:
        """The scope ``node`` is numbered in: a differentiated remat region that
        prevents CSE (lowered behind an optimization barrier) is one of its own."""
        group = node.group
        params = group.eqn.params if group is not None else {}
        if not (params.get("prevent_cse", True) and params.get("differentiated", False)):
            return scope
        return (scope, id(group))
