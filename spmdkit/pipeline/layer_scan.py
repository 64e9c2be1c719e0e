"""The layer scan: which ``scan`` of a traced loss runs the model's stacked layers.

One finder for every part of spmdkit that needs the layer stack: the planner's
step trace (its per-layer facts), the pipeline cost model (which parameters live
on which stage), the pipeline executor's split and the recompute rewrite. They
all ask :func:`find_layer_scan`, so they cannot pick different scans.

The rule: among the scans at the loss's top level or inside calls (``jit``,
``closed_call``, ``custom_jvp``/``custom_vjp``, ``remat``), not inside another
loop, the one whose iterations run the most contraction FLOPs (an op region
counts its computation's, :func:`spmdkit.jaxprs.registered_body`), with more than
one iteration, or exactly ``layers`` when the layer count is known. A short scan
beside the layers (a few steps of a recurrent head, a loop over two sequences)
loses to the stack; on equal FLOPs the first in program order wins.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from spmdkit import jaxprs
from spmdkit.util import CONTRACTIONS, contraction_flops

__all__ = ["LayerScan", "body_flops", "find_layer_scan", "scans"]


@dataclass(frozen=True, eq=False)
class LayerScan:
    """The scan over a model's stacked layers, found in a traced loss.

    Attributes:
      eqn: the ``scan`` equation (the same object as in the traced jaxpr).
      scan: its parts (body, counts, length).
      calls: the call equations it sits inside, outermost first (empty at the
        top level).
      flops: contraction FLOPs of all its iterations.
    """

    eqn: Any
    scan: jaxprs.Scan
    calls: tuple[Any, ...]
    flops: float

    @property
    def length(self) -> int:
        """The number of layers."""
        return self.scan.length

    @property
    def stacked(self) -> tuple[int, ...]:
        """Operand indices of the stacked per-layer values (the layers' weights)."""
        return tuple(range(self.scan.first_xs, len(self.eqn.invars)))

    @property
    def carried(self) -> tuple[int, ...]:
        """Operand indices of the carry (the hidden state between layers)."""
        return tuple(range(self.scan.num_consts, self.scan.first_xs))


def body_flops(jaxpr: Any) -> float:
    """Contraction FLOPs of one run of ``jaxpr``: nested loops by their trip
    counts, op regions by the computation they stand for."""
    total = 0.0
    for eqn, times in jaxprs.walk_eqns(jaxpr):
        name = eqn.primitive.name
        if name in CONTRACTIONS:
            lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
            out = eqn.outvars[0].aval.shape
            total += times * contraction_flops(name, eqn.params, lhs, rhs, out)
        elif (body := jaxprs.registered_body(eqn)) is not None:
            total += times * body_flops(body)
    return total


def scans(jaxpr: Any, calls: tuple[Any, ...] = ()) -> Iterator[tuple[Any, tuple[Any, ...]]]:
    """Every ``scan`` at ``jaxpr``'s top level or inside its calls (not inside a
    loop), in program order, with the calls it sits inside."""
    for eqn in jaxprs.open_jaxpr(jaxpr)[0].eqns:
        if eqn.primitive.name == "scan":
            yield eqn, calls
            continue
        body = jaxprs.call_body(eqn)
        if body is not None:
            yield from scans(body, (*calls, eqn))


def find_layer_scan(jaxpr: Any, *, layers: int | None = None) -> LayerScan | None:
    """The layer scan of a traced loss (module docstring), None when it has none.

    Args:
      jaxpr: the loss's jaxpr (closed or open).
      layers: the layer count when known: only scans of that length qualify.

    Example::

        >>> closed = jax.make_jaxpr(model_loss)(params, batch)
        >>> find_layer_scan(closed, layers=4).length
        4
    """
    best: LayerScan | None = None
    for eqn, calls in scans(jaxpr):
        sc = jaxprs.scan(eqn)
        fits = sc.length > 1 if layers is None else sc.length == layers
        if not fits:
            continue
        flops = sc.length * body_flops(sc.jaxpr)
        if best is None or flops > best.flops:
            best = LayerScan(eqn, sc, calls, flops)
    return best
