"""What a parameter group's names say about how it runs: the GEMM one member runs
on a device and the share of the tokens it sees (an expert's: the step's top-k),
and its tensor-parallel kind as Megatron-LM counts it (which column-parallel
weights share an input, what a row-parallel one is charged, and whether remat's
rerun forward is). The analytic cost model
(:mod:`spmdkit.planner.analytic`) prices groups with these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from spmdkit.planner.plans import Dims

__all__ = ["column_siblings", "gemm_dims", "rerun_charged", "routed_share", "tp_times"]

#: A :class:`spmdkit.planner.analytic.ParamGroup` (not imported: analytic imports
#: this module).
ParamGroup = Any


def tp_times(ctx: Any, g: ParamGroup) -> tuple[float, ...]:
    """How many activation all-reduces one tensor-parallel member of ``g`` is
    charged per step, as Megatron-LM counts them (Narayanan et al. 2021, §3): a
    block of column-parallel weights (``embed`` in, sharded out: q/k/v, gate/up)
    closed by a row-parallel one (sharded in, ``embed`` out: wo, down) all-reduces
    its output once forward and its input's gradient once backward. The
    row-parallel weight is charged the forward one, again when remat reruns the
    layer's forward (``full``, ``names``); the column-parallel weights share the
    backward one (:func:`column_siblings`, ``ctx.siblings``). A weight of neither
    kind (no ``embed`` dim) is charged one. ``ctx``: a
    :class:`~spmdkit.planner.analytic.CostContext`."""
    logical = [n for n in (g.logical or ()) if n not in ("layers", "expert")]
    if "embed" not in logical or len(logical) < 2:
        return (1.0,)
    if logical[-1] == "embed":
        rerun = rerun_charged(g) and ctx.recipe.remat in ("full", "names")
        return (1.0, 1.0 if rerun else 0.0)
    return (1.0 / ctx.siblings.get(g.key, 1),)


def rerun_charged(g: ParamGroup) -> bool:
    """Whether remat's rerun forward can change ``g``'s cost: it is charged to a
    layered row-parallel weight only (:func:`tp_times`)."""
    logical = [n for n in (g.logical or ()) if n not in ("layers", "expert")]
    layered = g.count > 1 or "layers" in (g.logical or ())
    return layered and len(logical) >= 2 and logical[-1] == "embed"


def column_siblings(groups: Sequence[ParamGroup]) -> dict[str, int]:
    """Group key → how many column-parallel groups (``embed`` in first, more
    dims out) share its module and hence its input (q/k/v: 3, gate/up: 2)."""
    parent: dict[str, list[str]] = {}
    for g in groups:
        logical = [n for n in (g.logical or ()) if n not in ("layers", "expert")]
        if len(logical) >= 2 and logical[0] == "embed" and logical[-1] != "embed":
            parent.setdefault(g.key.rsplit("/", 1)[0], []).append(g.key)
    return {k: len(keys) for keys in parent.values() for k in keys}


def routed_share(g: ParamGroup, trace: Any) -> float:
    """The share of the step's tokens one weight of ``g`` sees: 1, or for an expert
    weight (an ``expert`` logical dim of ``e`` experts) the step's top-k over ``e``
    (:meth:`~spmdkit.planner.analytic.StepTrace.routed_share`)."""
    logical = g.logical or ()
    if "expert" not in logical:
        return 1.0
    return trace.routed_share(g.shape[logical.index("expert")])


def gemm_dims(
    g: ParamGroup, dims: Dims, tp: tuple[str, ...], sizes: dict[str, int]
) -> tuple[float, float]:
    """``(k, n)`` of the GEMM one member of ``g`` runs on a device: its local
    weight as ``k`` inputs by ``n`` outputs (the ``embed`` dim is the input unless
    it is last: ``wo``, ``down``; the layers and expert dims are not GEMM dims;
    the rows an expert's GEMM sees are
    :func:`routed_share` of the tokens)."""
    logical = g.logical or (None,) * len(g.shape)
    local = []
    for size, name, d in zip(g.shape, logical, dims, strict=True):
        if name in ("expert", "layers"):
            continue
        local.append((name, size / math.prod(sizes[a] for a in d if a in tp)))
    if len(local) < 2:
        width = math.prod(v for _, v in local) if local else 1.0
        return width, 1.0
    names = [nm for nm, _ in local]
    split = len(local) - 1 if names[-1] == "embed" else 1
    k = math.prod(v for _, v in local[:split])
    n = math.prod(v for _, v in local[split:])
    return k, n
