"""Where a layer stack the pipe axis cannot split evenly is stored.

A pipelined plan splits a stacked parameter's ``layers`` dim over the pipe axis:
each device stores ``L / p`` layers, and inside the step the executor moves each
chunk's layers to the device that runs it
(:func:`~spmdkit.pipeline.execute.regroup_layers`). Under an uneven
:attr:`~spmdkit.pipeline.Pipeline.layout` the layer count need not divide by the
stages (DeepSeek-V3's 58 MoE layers over 8), and jax places no array, as a
``jit`` input or output, on a sharding that does not divide its dim.

Such a stack is stored split over the pipe axis on another dim instead
(:func:`stored_stack_specs`): the largest one the pipe axis divides together with
the axes already on it, the pipe axis minor-most (so a device's slice, joined
with the other stages' over the pipe axis, is its block of the axes before it).
Every device then stores ``1 / p`` of the stack's bytes, as the plan prices; the
parameter, its gradient and its optimizer state keep the model's shapes; and the
executor moves each chunk's layers to its device by one all-to-all over the pipe
axis (each device sends every other device its slice of that device's layers),
whose transpose brings the gradients back. A stack with no such dim (a per-layer
scalar) keeps its spec, and ``sk.jit`` refuses it with a
:class:`~spmdkit.pipeline.PipelineError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec as P

__all__ = ["stack_dim", "stored_stack_specs"]


def _axes(entry: object) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)  # type: ignore[arg-type]


def _entry(axes: tuple[str, ...]) -> object:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def stored_stack_specs(
    specs: Sequence[P | None], shape: Sequence[int], axis: str, sizes: Mapping[str, int]
) -> tuple[P | None, ...]:
    """The specs (a stacked parameter's, its optimizer state's, its gradient's:
    ``None`` entries kept) it is stored with when ``axis`` splits its leading
    ``layers`` dim but does not divide it (module docstring): ``axis`` moved,
    major-most, to the largest other dim it divides with the axes each spec
    already puts there; unchanged when ``axis`` divides the layers or no dim takes it.

    Args:
      specs: the plan's specs of one parameter (``None``: none given).
      shape: the parameter's shape, ``layers`` first.
      axis: the pipe axis.
      sizes: the mesh's axis sizes.

    Example::

        >>> stored_stack_specs([P("pipe", None, "model")], (7, 16, 8), "pipe",
        ...                    {"pipe": 2, "model": 4})
        (PartitionSpec(None, 'pipe', 'model'),)
    """
    given = [s for s in specs if s is not None]
    if not given or not shape:
        return tuple(specs)
    p = sizes.get(axis, 1)
    first = [_axes(s[0] if len(s) else None) for s in given]
    if p == 1 or not any(axis in a for a in first):
        return tuple(specs)
    if all(shape[0] % math.prod(sizes[a] for a in f) == 0 for f in first):
        return tuple(specs)

    def entry(s: P, d: int) -> tuple[str, ...]:
        return tuple(a for a in _axes(tuple(s)[d] if d < len(s) else None) if a != axis)

    def takes(d: int) -> bool:
        return all(shape[d] % (p * math.prod(sizes[a] for a in entry(s, d))) == 0 for s in given)

    dims = sorted((d for d in range(1, len(shape)) if takes(d)), key=lambda d: -shape[d])
    if not dims:
        return tuple(specs)
    k = dims[0]

    def moved(s: P | None) -> P | None:
        if s is None:
            return None
        out = [_entry(entry(s, d)) for d in range(max(len(s), k + 1))]
        out[k] = _entry((*entry(s, k), axis))
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    return tuple(moved(s) for s in specs)


def stack_dim(spec: P | None, axis: str) -> int | None:
    """The dim (not the leading ``layers`` one) a stored stack's ``spec`` splits
    over ``axis`` minor-most (:func:`stored_stack_specs`), else None.

    Example::

        >>> stack_dim(P(None, ("data", "pipe")), "pipe")
        1
    """
    for d, e in enumerate(tuple(spec or ())):
        a = _axes(e)
        if d and a and a[-1] == axis:
            return d
    return None
