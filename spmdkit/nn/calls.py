"""How the drop-ins call an op: as is, or — on plain arrays with no mesh anywhere,
as flax modules are often called — inside ``jit``, where the op is a region that
computes its unsharded reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from spmdkit.errors import SpecError
from spmdkit.ops.base import find_mesh

__all__ = ["call_op"]


def call_op(fn: Callable[..., Any], *arrays: Any, **kwargs: Any) -> Any:
    """``fn(*arrays, **kwargs)``; under ``jit`` when no argument is traced and no mesh
    can be found (the op then runs its unsharded computation).

    Example::

        >>> y = call_op(sk.ops.rms_norm, x, scale, epsilon=1e-6)
    """
    present = [a for a in arrays if a is not None]
    if not any(isinstance(a, jax.core.Tracer) for a in present):
        try:
            find_mesh("spmdkit.nn", present, None)
        except SpecError:
            return jax.jit(lambda *xs: fn(*xs, **kwargs))(*arrays)
    return fn(*arrays, **kwargs)
