"""Parameter groups as a recipe's step stores them (``Recipe.master_weights``).

Under ``master_weights="optimizer"`` (:mod:`spmdkit.step.master`) the analytic model
prices each floating group stored in bf16: its parameters, gradients and their
collectives at 2 bytes per element, no compute-dtype copy (the parameters are
already in it), and its fp32 master (4 bytes per element) added to its
optimizer state, so it is sharded as the moments are (``+zero1``, ``fsdp``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from spmdkit.step.master import master_bytes, stored_dtype

__all__ = ["stored_group"]

#: A :class:`spmdkit.planner.analytic.ParamGroup` (not imported: analytic imports
#: this module).
ParamGroup = Any


def stored_group(recipe: Any, g: ParamGroup) -> ParamGroup:
    """``g`` as the recipe's step stores it: under ``master_weights="optimizer"``
    a floating group in :func:`~spmdkit.step.master.stored_dtype` with its fp32 master
    in :attr:`opt_bytes <spmdkit.planner.analytic.ParamGroup>` (and in ``master``);
    else ``g``. Idempotent (a stored group has ``master`` set)."""
    dtype = stored_dtype(recipe)
    if dtype is None or g.master or not np.issubdtype(np.dtype(g.dtype), np.floating):
        return g
    extra = master_bytes(g.shape, g.dtype)
    return replace(g, dtype=dtype, opt_bytes=g.opt_bytes + extra, master=extra)
