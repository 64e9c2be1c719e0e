"""The propagator's hand-off: one decided equation (:class:`Step`) and a loop's body
(:class:`LoopBody`).

The propagator appends one :class:`Step` per equation it propagates; choosing,
pricing, the records and what the replay pins read them by field name.
"""

from __future__ import annotations

from typing import NamedTuple

from spmdkit.engine.inference import ArgReshard
from spmdkit.propagation.graph import Node
from spmdkit.spec import TensorSpec

__all__ = ["LoopBody", "Step"]


class LoopBody(NamedTuple):
    """The body of a ``scan``, ``while`` or ``cond`` node as propagated.

    Attributes:
      steps: the body's steps (a ``while``: its condition's, then its body's; a
        ``cond``: the dearest branch's).
      back: reshards of the body's results back to the loop's carry (or the
        branches' agreed output) layouts, and of a scan's sum-partial ``ys``
        to the layouts they leave the loop in, per iteration.
      trips: how many times the body runs per run of the node (a scan's length;
        1 for ``while``, whose trip count is unknown, and ``cond``).
    """

    steps: list[Step]
    back: list[ArgReshard]
    trips: int


class Step(NamedTuple):
    """What the propagator decided for one node.

    Attributes:
      node: the node.
      op: the registered rule used, or a structural op
        (:data:`spmdkit.propagation.propagator.STRUCTURAL_OPS`);
        None when the node had none (replicated).
      attrs: the attributes the rule got.
      given: the operands' specs as they arrived.
      required: the specs the rule needs its operands in (the difference from
        ``given`` is a reshard).
      outputs: the results' specs.
      loop: the body of a loop or branch node, else None.
      hinted: the results' layouts are the ones later equations asked for (a
        backward hint, :meth:`~spmdkit.propagation.choose.Chooser.take_hint`),
        not the rule's forward answer.
    """

    node: Node
    op: str | None
    attrs: dict
    given: tuple[TensorSpec, ...]
    required: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    loop: LoopBody | None = None
    hinted: bool = False
