"""One chunk of the layer stack as a device runs it for one micro-batch.

:class:`BoundLoss` is the split loss (:func:`spmdkit.pipeline.split.split_loss`)
bound to one trace's values: the shared ones and every micro-batch's, and which
of them get gradients; it runs a chunk's layers (``stage``) and the head and loss
(``post``) of micro-batch ``i``. :class:`VjpStash` is what a chunk's ``jax.vjp``
keeps: the residuals a forward stashes, less the chunk's weights and shared
constants, which the backward reads again. The tick loops
(:mod:`spmdkit.pipeline.ticks`) run both, and the residual facts
(:func:`spmdkit.pipeline.facts.residual_probe`) size the same stash.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.pipeline.layouts import differentiable
from spmdkit.pipeline.schedule import Pipeline, PipelineError
from spmdkit.pipeline.split import SplitLoss

__all__ = ["BoundLoss", "VjpStash", "chunk_count_table"]


class BoundLoss:
    """The split loss bound to one trace of the pipeline's values: the shared values
    (``sv``), per micro-batch values stacked ``[m, ...]`` (``per``), the layer
    scan's carry and which values get gradients (``dconsts``: the scan's
    constants, ``dpost``: the head's inputs besides the carry, ``dshared``,
    ``dper``)."""

    def __init__(
        self, sp: SplitLoss, pipe: Pipeline, shared: list, per: list, shards: int = 1
    ) -> None:
        self.sp, self.pipe = sp, pipe
        # the loss of a device's rows of a micro-batch, as a share of the step's
        self.scale = 1.0 / (pipe.microbatches * shards)
        self.sv = dict(zip(sp.shared, shared, strict=True))
        self.per = dict(zip(sp.per_mb, per, strict=True))
        self.carry = [v for v in sp.carry]
        for v in self.carry:
            if v not in self.per or not differentiable(v.aval.dtype):
                raise PipelineError(
                    op="pipeline",
                    must="the layer scan's carry is floating (the hidden state; an "
                    "accumulator such as an auxiliary loss)",
                    given=f"a carry of {v.aval}",
                    fix="carry the hidden state; pass other values as scan constants",
                )
        self.consts = [v for v in sp.consts if not hasattr(v, "val")]
        self.dconsts = [v for v in self.consts if differentiable(v.aval.dtype)]
        self.post_vars = [v for v in (*sp.shared, *sp.per_mb) if v not in self.carry]
        self.dpost = [
            v for v in self.post_vars if differentiable(v.aval.dtype) and v not in sp.consts
        ]
        self.dshared = [v for v in sp.shared if differentiable(v.aval.dtype)]
        self.dper = [v for v in sp.per_mb if differentiable(v.aval.dtype)]

    def microbatch(self, i: Any) -> dict:
        """Micro-batch ``i``'s values."""
        return {v: x[i] for v, x in self.per.items()}

    def stage(self, w: list, cd: list, carry: list, i: Any, count: Any = None) -> list:
        """The carry after micro-batch ``i`` runs the chunk whose weights are ``w``
        (``count``: its layers, the rest padding; None: all of ``w``'s)."""
        vals = {**self.sv, **self.microbatch(i), **dict(zip(self.dconsts, cd, strict=True))}
        return self.sp.stage(w, vals, carry, count)

    def chunk_count(self, d: Any, j: Any) -> Any:
        """How many of its padded layers device ``d``'s local chunk ``j`` runs (an
        int32 scalar) under an uneven :attr:`~spmdkit.pipeline.Pipeline.layout`;
        None when the chunks are equal (every layer of the slice runs)."""
        table = chunk_count_table(self.pipe)
        return None if table is None else jnp.asarray(table)[d, j]

    def post(self, i: Any, out: list) -> tuple:
        """``(loss_i · scale, ct of carry, {var: ct})`` of micro-batch ``i``'s head and
        loss (``scale``: ``1 / (m · batch shards)``, the device's rows' share)."""
        base = {**self.sv, **self.microbatch(i)}
        diff = [base[v] for v in self.dpost]

        def f(c: list, dv: list) -> Any:
            return self.sp.post({**base, **dict(zip(self.dpost, dv, strict=True))}, c)

        loss, vjp = jax.vjp(f, out, diff)
        ct_c, ct_v = vjp(jnp.asarray(self.scale, loss.dtype))
        return loss * self.scale, ct_c, ct_v


def chunk_count_table(pipe: Pipeline) -> np.ndarray | None:
    """``int32[p, v]``: the layers device ``d``'s local chunk ``j`` (global chunk
    ``j · p + d``) runs under an uneven layout; None for equal chunks."""
    if not pipe.uneven:
        return None
    assert pipe.layout is not None
    return np.asarray(pipe.layout, np.int32).reshape(pipe.virtual, pipe.stages).T.copy()


class VjpStash:
    """What a chunk's ``jax.vjp`` keeps (found once per trace): the residuals'
    tree, and per leaf whether it is one of the chunk's weights or shared
    constants (read again in the backward, never stashed) or stashed."""

    def __init__(self) -> None:
        self.tree: Any = None
        self.source: list[tuple[str, Any]] = []

    def record(self, leaves: list, w: list, cd: list, shared: list) -> list:
        """The leaves to stash; the first call records where each leaf comes from."""
        source: list[tuple[str, Any]] = []
        keep = []
        for leaf in leaves:
            hit = next((("w", k) for k, x in enumerate(w) if leaf is x), None)
            hit = hit or next((("c", k) for k, x in enumerate(cd) if leaf is x and shared[k]), None)
            if hit is None:
                hit = ("s", len(keep))
                keep.append(leaf)
            source.append(hit)
        if self.source and [s[0] for s in source] != [s[0] for s in self.source]:
            raise PipelineError(  # pragma: no cover (jax's vjp is deterministic)
                op="pipeline",
                must="a chunk's residuals have one structure",
                given="two traces of the chunk that keep different residuals",
                fix="report this with the model",
            )
        self.source = source
        return keep

    def rebuild(self, stash: list, w: list, cd: list) -> Callable:
        """The chunk's vjp from the stashed leaves and the re-read weights/constants."""
        leaves = []
        for kind, key in self.source:
            leaves.append(w[key] if kind == "w" else cd[key] if kind == "c" else stash[key])
        return jax.tree.unflatten(self.tree, leaves)
