"""Who gives up a mesh axis that an activation and a weight both shard.

Where an equation's operands disagree on a mesh axis, one of them moves. The
propagator settles it without pricing, by what the axis is for:

- an axis of the **batch** (or any other an activation holds that is not a
  sequence axis): the activation stays put and the weight is all-gathered, as in
  FSDP; moving the batch instead would give up data parallelism for every
  equation after it, which a per-equation price does not see;
- a **sequence axis** (one the batch inputs shard a dim other than their
  leading one over: ``megatron_sp``'s ``seq`` on ``model``) that a
  tensor-parallel weight holds (which operands are is the caller's:
  ``Chooser.tensor_parallel`` names a matmul's column-parallel weight and a
  lookup's vocab-parallel table, not FSDP's weights split over a contracted dim):
  the weight stays put and the activation is all-gathered over the sequence, as
  Megatron-LM's sequence parallelism does before a tensor-parallel matmul. A
  weight gathered instead would be gathered again for every micro-batch (and its
  gradient reduce-scattered per micro-batch), so a step's tensor-parallel bytes
  would grow with the micro-batch count, where the activation's gathers move
  the same tokens per step however they are split.

:func:`contested` names the axes of the second kind for an equation's operands,
:func:`stays` checks an answer against the rule above, and :func:`settled` is
the operands laid out so that it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from spmdkit.propagation.primitives import drop_axes
from spmdkit.spec import TensorSpec

__all__ = ["contested", "sequence_axes", "settled", "stays", "stays_one"]


def sequence_axes(batch_specs: Sequence[TensorSpec]) -> frozenset[str]:
    """The mesh axes the batch inputs shard a dim other than their leading (batch)
    dim over, less any axis some batch input's leading dim uses: the sequence axes."""
    lead: set[str] = set()
    rest: set[str] = set()
    for s in batch_specs:
        if not s.dims:
            continue
        lead.update(s.dims[0])
        for d in s.dims[1:]:
            rest.update(d)
    return frozenset(rest - lead)


def contested(
    specs: Sequence[TensorSpec],
    still: Sequence[bool],
    seq: frozenset[str],
    weight: Sequence[bool] = (),
) -> frozenset[str]:
    """The sequence axes ``seq`` that both an activation (``still``) and a weight
    (``weight``: a value computed from the parameters alone) of ``specs`` shard:
    the weight keeps them. A mask or other constant never does."""
    if not seq:
        return frozenset()
    held_act: set[str] = set()
    held_weight: set[str] = set()
    n = len(specs)
    for s, act, heavy in zip(specs, _padded(still, n), _padded(weight, n), strict=True):
        if act:
            held_act.update(s.sharding_axes)
        elif heavy:
            held_weight.update(s.sharding_axes)
    return frozenset(seq & held_act & held_weight)


def stays_one(
    given: TensorSpec, required: TensorSpec, act: bool, axes: frozenset[str], weight: bool = False
) -> bool:
    """Whether ``required`` keeps what the operand ``given`` must keep: an
    activation its dim shardings off the contested ``axes``, a weight those on them,
    anything else nothing (further sharding, a free slice, is fine)."""
    if act:
        return _kept(drop_axes(given, set(axes)), required)
    if not axes or not weight:
        return True
    return _kept(drop_axes(given, set(given.sharding_axes) - axes), required)


def stays(
    specs: Sequence[TensorSpec],
    still: Sequence[bool],
    axes: frozenset[str],
    required: Sequence[TensorSpec],
    weight: Sequence[bool] = (),
) -> bool:
    """Whether an answer's ``required`` operand layouts keep every activation's
    shardings off the contested ``axes`` and every weight's on them."""
    n = len(specs)
    return all(
        stays_one(s, r, a, axes, w)
        for s, r, a, w in zip(specs, required, _padded(still, n), _padded(weight, n), strict=False)
    )


def settled(
    specs: Sequence[TensorSpec],
    still: Sequence[bool],
    axes: frozenset[str],
    weight: Sequence[bool] = (),
) -> tuple[TensorSpec, ...]:
    """The operands with the contests settled: activations give up the contested
    ``axes`` (gathered over the sequence), weights every other axis an activation
    holds (gathered over the batch), other operands every axis an activation holds."""
    n = len(specs)
    flags, heavy = _padded(still, n), _padded(weight, n)
    held = {a for s, act in zip(specs, flags, strict=True) if act for a in s.sharding_axes}
    return tuple(
        drop_axes(s, set(axes)) if act else drop_axes(s, held - axes if w else held)
        for s, act, w in zip(specs, flags, heavy, strict=True)
    )


def _padded(flags: Sequence[bool], n: int) -> tuple[bool, ...]:
    return tuple(flags) + (False,) * (n - len(flags))


def _kept(given: TensorSpec, required: TensorSpec) -> bool:
    got = required.dims + ((),) * (len(given.dims) - len(required.dims))
    return all(set(d) <= set(r) for d, r in zip(given.dims, got, strict=False))
