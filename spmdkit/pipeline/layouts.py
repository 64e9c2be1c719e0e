"""How the pipeline lays out what crosses its ``shard_map``: the micro-batches'
rows, the stage weights and their gradients.

The executor (:mod:`spmdkit.pipeline.execute`) runs the layer stack under a
``shard_map`` manual over the pipe axis and the plan's batch axes
(:class:`ManualAxes`). Across that boundary:

- the stacked and shared weights are split over the batch axes as the plan
  splits the parameter each is, or is a cast of (:func:`weight_splits`,
  :func:`param_sources`); a split weight is gathered once inside
  (:func:`gather_split`) and its gradient reduce-scattered back to its split
  (:meth:`ManualAxes.reduce`);
- the batch is cut into micro-batches (:func:`split_microbatches`: rows
  ``i, i + m, ...``) and a device runs its share of each micro-batch's rows
  (:func:`local_rows`, :func:`per_mb_rows_split`);
- a gradient accumulates in float32 under narrower compute
  (:func:`accumulator_dtype`) and reaches the fp32 parameter a weight is a cast of
  at that precision (:func:`route_wide_gradients`, :func:`gpipe_wide_params`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdkit.batch import stack_rows
from spmdkit.pipeline.schedule import Pipeline, PipelineError
from spmdkit.pipeline.split import SplitLoss

__all__ = [
    "BatchSplit",
    "ManualAxes",
    "UpdatePlan",
    "accumulator_dtype",
    "add_routed_gradients",
    "batch_split",
    "differentiable",
    "expert_splits",
    "local_experts",
    "gather_split",
    "gpipe_wide_params",
    "local_rows",
    "local_tokens",
    "param_sources",
    "per_mb_rows_split",
    "per_mb_seq_split",
    "replicated_splits",
    "route_wide_gradients",
    "split_microbatches",
    "split_to_spec",
    "unowned",
    "update_specs",
    "weight_splits",
    "zero_cotangent",
]

# -- the stage weights over the batch axes -------------------------------------------

#: How a weight is split over the batch axes: per dim of the parameter it is
#: (a cast of), the batch axes that split it, ``((dim, axes), ...)``.
BatchSplit = tuple[tuple[int, tuple[str, ...]], ...]


def weight_splits(
    sp: SplitLoss, specs: list | None, batch: tuple[str, ...], sizes: dict
) -> tuple[tuple[BatchSplit, ...], tuple[BatchSplit, ...]]:
    """Per stacked weight and per shared value of ``sp``: how the parameter it
    is (or is a cast of) is split over the batch axes by ``specs`` (the
    parameters' ``PartitionSpec`` leaves). A value computed otherwise, or
    with no specs or batch axes, is taken replicated (``()``)."""
    if not specs or not batch:
        return (), ()
    xs_src, sh_src = param_sources(sp)

    def split(v: Any, i: int | None, skip: int) -> BatchSplit:
        if i is None:
            return ()
        return batch_split(specs[i], tuple(v.aval.shape), batch, sizes, skip)

    return (
        tuple(split(v, i, 1) for v, i in zip(sp.xs, xs_src, strict=True)),
        tuple(split(v, i, 0) for v, i in zip(sp.shared, sh_src, strict=True)),
    )


def batch_split(
    spec: Any, shape: tuple, batch: tuple[str, ...], sizes: dict, skip: int
) -> BatchSplit:
    """The dims (from ``skip`` on) of a value laid out as ``spec`` that the batch
    axes split major-most, where they divide it (the part of the layout a
    ``shard_map`` manual over those axes can take as given).

    Example::

        >>> batch_split(P("pipe", ("data", "model")), (8, 16), ("data",), sizes, 1)
        ((1, ('data',)),)
    """
    out = []
    for d, entry in enumerate(tuple(spec or ())):
        if d < skip or entry is None or d >= len(shape):
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        k = 0
        while k < len(axes) and axes[k] in batch:
            k += 1
        n = int(np.prod([sizes[a] for a in axes[:k]]))
        if k and shape[d] % n == 0:
            out.append((d, axes[:k]))
    return tuple(out)


#: Primitives a weight may pass through between its parameter and the layer
#: scan keeping the parameter's layout (the compute-dtype cast).
_SAME_LAYOUT = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})


def param_sources(sp: SplitLoss) -> tuple[list[int | None], list[int | None]]:
    """Per stacked weight and per shared value of ``sp``: the parameter leaf it is
    (or is a cast of: ``convert_element_type``, ``copy``), else None."""
    jaxpr = sp.closed.jaxpr
    made = {o: e for e in jaxpr.eqns[: sp.index] for o in e.outvars}
    leaf = {v: i for i, v in enumerate(jaxpr.invars[: sp.n_params])}

    def source(v: Any) -> int | None:
        while v not in leaf and v in made and made[v].primitive.name in _SAME_LAYOUT:
            v = made[v].invars[0]
        return None if isinstance(v, jex.Literal) else leaf.get(v)

    return [source(v) for v in sp.xs], [source(v) for v in sp.shared]


@dataclass(frozen=True)
class ManualAxes:
    """The pipeline ``shard_map``'s manual axes: the pipe axis and the batch axes
    (``batch``, ``shards`` devices in all), which per-micro-batch values are
    split over the latter on their row dim (``rows``), how the stacked weights
    enter split over them (``xs_in``: gathered inside, once per step; GPipe's,
    whose gradients autodiff transposes from that gather), and how
    their gradients and the shared weights' leave (``xs_out``, ``sh_out``:
    reduce-scattered to those splits), as the plan lays them out
    (:func:`weight_splits`); empty: replicated over the batch axes. The shared
    weights enter replicated: XLA gathers them at the input, the same gather as
    the embedding's or the head's outside the pipeline (one all-gather, where
    one inside would be a second that propagation would price apart)."""

    axis: str
    batch: tuple[str, ...] = ()
    shards: int = 1
    rows: tuple[bool, ...] = ()
    xs_in: tuple[BatchSplit, ...] = ()
    xs_out: tuple[BatchSplit, ...] = ()
    sh_out: tuple[BatchSplit, ...] = ()
    #: context parallelism: the axes the micro-batches' sequences are split over,
    #: their device count, and per per-micro-batch value the dim split (or None)
    context: tuple[str, ...] = ()
    context_size: int = 1
    seq: tuple[int | None, ...] = ()
    #: expert parallelism: per stacked weight, the dims split over batch axes that
    #: it enters and leaves split on, never gathered nor summed over
    #: (:func:`expert_splits`)
    xs_ep: tuple[BatchSplit, ...] = ()

    @property
    def all_axes(self) -> tuple[str, ...]:
        return (self.axis, *self.batch, *self.context)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes gradients are summed over: the batch's and the context's."""
        return (*self.batch, *self.context)

    @property
    def parts(self) -> int:
        """The devices one micro-batch is split over (rows × sequence)."""
        return self.shards * self.context_size

    def per_spec(self, row: bool, seq: int | None = None) -> P:
        """A per-micro-batch value's spec, ``[m, ...]``: rows over the batch axes
        (``row``), dim ``seq`` of the value over the context axes."""
        entries: list = [None, self.batch if row and self.batch else None]
        if seq is not None and self.context:
            entries += [None] * max(0, seq + 2 - len(entries))
            entries[seq + 1] = self.context
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def value_spec(self, k: int) -> P:
        """The spec of per-micro-batch value ``k``."""
        return self.per_spec(self.rows[k], self.seq[k] if self.seq else None)

    def value_sum_axes(self, k: int) -> tuple[str, ...]:
        """The axes a per-micro-batch value ``k``'s cotangent is summed over: the
        pipe axis, and the data axes that do not split it."""
        seq = self.seq[k] if self.seq else None
        return (
            self.axis,
            *(() if self.rows[k] else self.batch),
            *(() if seq is not None else self.context),
        )

    def xs_spec(self, split: BatchSplit) -> P:
        """A stacked weight's spec, regrouped ``[p, v, L/(p·v), ...]``."""
        return split_to_spec((self.axis, None, None), split, skip=1)

    def reduce(
        self,
        g: Any,
        split: BatchSplit,
        offset: int,
        extra: tuple[str, ...] = (),
        owned: BatchSplit = (),
    ) -> Any:
        """A gradient summed over the batch axes (and ``extra``): reduce-scattered
        over the axes of ``split`` (its dims shifted by ``offset``), all-reduced
        over the others, except the axes of ``owned`` (an expert-parallel weight's
        gradient is its own device's: :func:`expert_splits`). A narrower float (a
        bf16 parameter's gradient, under
        ``master_weights="optimizer"``) is reduced in :func:`accumulator_dtype`, as
        the planner prices it (and XLA:CPU cannot promote a bf16 all-reduce whose
        reducer it has copied)."""
        dtype = jnp.result_type(g)
        g = g.astype(accumulator_dtype(dtype))
        for d, axes in unowned(split, owned):
            g = jax.lax.psum_scatter(g, axes, scatter_dimension=d + offset, tiled=True)
        done = {a for _, axes in split for a in axes}
        rest = (*extra, *(a for a in self.data_axes if a not in done))
        return (jax.lax.psum(g, rest) if rest else g).astype(dtype)


class UpdatePlan(Protocol):
    """What :func:`update_specs` reads of a pipelined plan
    (:class:`spmdkit.planner.plans.Plan` is one)."""

    @property
    def pipeline(self) -> Pipeline | None: ...
    @property
    def activation(self) -> Mapping[str, tuple[str, ...]]: ...
    @property
    def opt(self) -> Mapping[str, P]: ...
    def grad_specs(self, abstract_params: Any) -> Any: ...
    def opt_specs(self, abstract_opt_state: Any) -> Any: ...


def update_specs(plan: UpdatePlan, params: Any) -> Any:
    """The layouts a pipelined plan's gradients leave the pipeline in when they feed
    the optimizer update (``sk.train_step``): a weight's optimizer state's where the
    plan shards the state over batch axes the weight is not on (ZeRO-1, the
    distributed optimizer) and the weight is split over no axis besides the pipe
    and batch axes, so its sum over the batch axes is a reduce-scatter into the
    shard each device updates, not an all-reduce the update slices; the plan's
    gradient layout otherwise. (A tensor-parallel weight's stays all-reduced: XLA
    partitions a reduce-scatter under the pipeline's automatic tensor axes by
    gathering the weight's tensor-parallel dims first, twice the bytes.)"""
    grads = plan.grad_specs(params)
    if not plan.opt or plan.pipeline is None:
        return grads
    manual = {plan.pipeline.axis, *plan.activation.get("batch", ())}

    def one(grad: P, opt: P) -> P:
        used = {a for e in grad for a in ((e,) if isinstance(e, str) else tuple(e or ()))}
        return opt if used <= manual else grad

    return jax.tree.map(one, grads, plan.opt_specs(params), is_leaf=lambda x: isinstance(x, P))


def split_to_spec(lead: tuple, split: BatchSplit, skip: int = 0) -> P:
    """``lead``, then per dim of the value from ``skip`` on, the axes splitting it."""
    if not split:
        return P(*lead)
    entries: list = [None] * (max(d for d, _ in split) + 1)
    for d, axes in split:
        entries[d] = axes
    return P(*lead, *entries[skip:])


def unowned(split: BatchSplit, owned: BatchSplit) -> BatchSplit:
    """``split`` without the dims of ``owned`` (an expert-parallel weight's)."""
    return tuple(entry for entry in split if entry not in owned)


def expert_splits(
    dims: list[int | None], specs: list | None, batch: tuple[str, ...], sizes: dict
) -> tuple[BatchSplit, ...]:
    """Per parameter leaf, its expert-parallel split: the batch axes its ``specs``
    split its routed experts' dim over (``dims``: per leaf that dim, or None), where
    they divide it; ``()`` for the others.

    Example::

        >>> expert_splits([None, 1], [P("pipe"), P("pipe", "data")], ("data",), sizes)
        ((), ((1, ('data',)),))
    """
    if not specs or not batch:
        return ((),) * len(dims)
    out = []
    for (
        d,
        spec,
    ) in zip(dims, specs, strict=True):
        split = () if d is None else batch_split(spec, (0,) * (d + 1), batch, sizes, 0)
        out.append(tuple(entry for entry in split if entry[0] == d))
    return tuple(out)


def local_experts(leaves: list, splits: tuple[BatchSplit, ...], sizes: dict) -> list:
    """The parameter leaves as a device holds its experts: each expert-parallel dim
    (``splits``: :func:`expert_splits`) divided by its axes' size."""
    out = []
    for x, split in zip(leaves, splits, strict=True):
        shape = list(np.shape(x))
        for d, axes in split:
            shape[d] //= int(np.prod([sizes[a] for a in axes]))
        out.append(jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x)) if split else x)
    return out


def gather_split(x: Any, split: BatchSplit, offset: int) -> Any:
    """A device's split of a weight gathered whole (dims shifted by ``offset``)."""
    for d, axes in split:
        x = jax.lax.all_gather(x, axes, axis=d + offset, tiled=True)
    return x


def replicated_splits(values: Any) -> tuple:
    """A :data:`BatchSplit` per value that leaves it whole (replicated over the batch axes)."""
    return ((),) * len(values)


# -- the micro-batches and a device's rows of them -----------------------------------


def split_microbatches(batch: Any, m: int) -> Any:
    """Each array leaf ``[B, ...]`` → ``[m, B/m, ...]`` (micro-batch ``i``: rows
    ``i, i+m, ...``; :func:`spmdkit.batch.split_rows`, the one split every
    accumulation uses).

    Raises:
      PipelineError: a leaf's leading dim does not divide into ``m``.
    """
    return stack_rows(batch, m, op="pipeline", error=PipelineError)


def local_rows(one: Any, shards: int) -> Any:
    """One micro-batch's leaves with a device's share of its rows."""

    def cut(x: Any) -> jax.ShapeDtypeStruct:
        if x.shape[0] % shards:
            raise PipelineError(
                op="pipeline",
                must="a micro-batch's rows split evenly over the batch axes' devices",
                given=f"a micro-batch leaf of shape {tuple(x.shape)} over {shards} devices",
                fix=f"use a batch size that is a multiple of microbatches × {shards}",
            )
        return jax.ShapeDtypeStruct((x.shape[0] // shards, *x.shape[1:]), x.dtype)

    return jax.tree.map(cut, one)


def local_tokens(one: Any, seq_dims: Any, parts: int) -> Any:
    """One micro-batch's leaves with a device's share of their sequence dims
    (``seq_dims``: per leaf, the dim split over the context axes, or None)."""

    def cut(x: Any, d: int | None) -> jax.ShapeDtypeStruct:
        if d is None:
            return x
        if x.shape[d] % parts:
            raise PipelineError(
                op="pipeline",
                must="a micro-batch's sequences split evenly over the context axes' devices",
                given=f"a micro-batch leaf of shape {tuple(x.shape)}, dim {d} over {parts} devices",
                fix=f"use a sequence length that is a multiple of {parts}",
            )
        shape = list(x.shape)
        shape[d] //= parts
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

    return jax.tree.map(cut, one, seq_dims, is_leaf=lambda x: x is None)


def per_mb_seq_split(
    sp: SplitLoss, local: SplitLoss, shards: int, parts: int
) -> tuple[tuple[bool, ...], tuple[int | None, ...]]:
    """Per value of ``sp.per_mb``: is it split over the batch rows (dim 0), and
    which of its dims is split over the context axes (the first that shrinks
    ``parts`` times), or None. ``local`` is the loss split on a device's rows and
    tokens.

    Raises:
      PipelineError: the layer stack's weights or shared values change with the
        tokens (a position table computed before the layers), or a value changes
        otherwise."""
    same = all(
        [v.aval for v in getattr(sp, k)] == [v.aval for v in getattr(local, k)]
        for k in ("xs", "shared")
    )
    rows, seq = [], []
    for g, lo in zip(sp.per_mb, local.per_mb, strict=False):
        gs, ls = list(g.aval.shape), list(lo.aval.shape)
        row = bool(ls) and len(gs) == len(ls) and gs[0] == ls[0] * shards and shards > 1
        if row:
            ls[0] = gs[0]
        dim = next(
            (
                d
                for d in range(len(ls))
                if len(gs) == len(ls)
                and gs[d] == ls[d] * parts
                and gs[:d] + gs[d + 1 :] == ls[:d] + ls[d + 1 :]
            ),
            None,
        )
        same = same and (gs == ls or dim is not None) and g.aval.dtype == lo.aval.dtype
        rows.append(row)
        seq.append(dim)
    if not same or len(sp.per_mb) != len(local.per_mb):
        raise PipelineError(
            op="pipeline",
            must="the loss traced on a device's rows and tokens of a micro-batch has the "
            "same structure, its per-micro-batch values split on their row and sequence "
            "dims, the layer stack's weights and shared values unchanged",
            given="a loss whose values change otherwise with the tokens (a position or "
            "mask table computed before the layer stack, a reshape that mixes the "
            "sequence with other dims)",
            fix="compute position-dependent values inside the layers (from "
            "spmdkit.context_parallel.current_order), or plan without a context axis",
        )
    return tuple(rows), tuple(seq)


def per_mb_rows_split(
    sp: SplitLoss, local: SplitLoss, shards: int, xs_ep: tuple[BatchSplit, ...] = ()
) -> tuple[bool, ...]:
    """Per value of ``sp.per_mb``: is it split over the batch rows (its leading dim
    scales with them)? ``local`` is the loss split on a device's rows (and its
    experts: per stacked weight ``xs_ep``, the dims it holds a part of)."""
    ep = [{d for d, _ in split} for split in xs_ep] or [set()] * len(sp.xs)
    same = len(sp.xs) == len(local.xs) and all(
        g.aval.dtype == lo.aval.dtype
        and len(g.aval.shape) == len(lo.aval.shape)
        and all(
            a == b or (d in owned and b and a % b == 0)
            for d, (a, b) in enumerate(zip(g.aval.shape, lo.aval.shape, strict=True))
        )
        for g, lo, owned in zip(sp.xs, local.xs, ep, strict=False)
    )
    same = same and [v.aval for v in sp.shared] == [v.aval for v in local.shared]
    rows = []
    for g, lo in zip(sp.per_mb, local.per_mb, strict=False):
        gs, ls = tuple(g.aval.shape), tuple(lo.aval.shape)
        split = bool(ls) and gs == (ls[0] * shards, *ls[1:])
        same = same and (gs == ls or split) and g.aval.dtype == lo.aval.dtype
        rows.append(split)
    if not same or len(sp.per_mb) != len(local.per_mb):
        raise PipelineError(
            op="pipeline",
            must="the loss traced on a device's rows of a micro-batch has the same "
            "structure, its per-micro-batch values split on their leading dim",
            given="a loss whose values change otherwise with the rows (a batch statistic, "
            "a reshape that mixes rows with other dims before the layer stack)",
            fix="keep the layer stack's inputs row-wise, or plan without a batch axis",
        )
    return tuple(rows)


# -- the gradients' dtypes -----------------------------------------------------------


def differentiable(x: Any) -> bool:
    """Does ``x`` (a value or a dtype) get a gradient: is it floating (or complex)?"""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def zero_cotangent(x: Any) -> Any:
    """A zero gradient for ``x``: zeros of its dtype, ``float0`` for a value that
    gets none (:func:`differentiable`)."""
    if differentiable(x):
        return jnp.zeros(np.shape(x), jnp.result_type(x))
    return np.zeros(np.shape(x), jax.dtypes.float0)


def accumulator_dtype(dtype: Any) -> np.dtype:
    """The dtype a gradient of ``dtype`` accumulates in over the micro-batches
    and is reduced in: float32 for narrower floats (bf16 compute: as Megatron-LM
    accumulates and reduces fp32 main gradients), else ``dtype``."""
    d = np.dtype(dtype)
    narrow = jnp.issubdtype(d, jnp.floating) and d.itemsize < 4
    return np.dtype(np.float32) if narrow else d


def gpipe_wide_params(pipe: Pipeline, vals: tuple, sources: tuple, p_leaves: list) -> tuple:
    """GPipe's stacked weights and shared values (``vals``, their parameter
    ``sources``) as it runs them: per value that is a narrower cast of a parameter
    (bf16 compute on fp32 master weights), that parameter, else None (the explicit
    schedules accumulate in float32 themselves: :func:`accumulator_dtype`)."""
    if pipe.schedule != "gpipe":
        return ((), ())

    def one(x: Any, src: int | None) -> Any:
        dtype = jnp.result_type(x)
        wider = accumulator_dtype(dtype)
        keep = src is not None and differentiable(x) and wider != dtype
        return p_leaves[src] if keep and jnp.result_type(p_leaves[src]) == wider else None

    return tuple(
        [one(x, i) for x, i in zip(v, srcs, strict=True)]
        for v, srcs in zip(vals, sources, strict=True)
    )


def route_wide_gradients(cts: tuple, vals: tuple, sources: tuple) -> tuple[tuple, dict[int, Any]]:
    """:func:`_wide_gradients_to_params` over the stacked weights' and the shared
    values' gradients."""
    (xs, d_xs), (sh, d_sh) = (
        _wide_gradients_to_params(*a) for a in zip(cts, vals, sources, strict=True)
    )
    for i, g in d_sh.items():
        d_xs[i] = d_xs[i] + g if i in d_xs else g
    return (xs, sh), d_xs


def _wide_gradients_to_params(cts: list, vals: list, sources: list) -> tuple[list, dict[int, Any]]:
    """Gradients accumulated wider than their values (:func:`accumulator_dtype`):
    those of a (cast) parameter go to it directly, at that precision, and the
    pre part's vjp gets zeros for them; the others are cast back for it."""
    out, direct = [], {}
    for ct, x, src in zip(cts, vals, sources, strict=True):
        dtype = jnp.result_type(x)
        if not differentiable(x) or jnp.result_type(ct) == dtype:
            out.append(ct)
        elif src is None:
            out.append(ct.astype(dtype))
        else:
            out.append(jnp.zeros(np.shape(x), dtype))
            direct[src] = direct[src] + ct if src in direct else ct
    return out, direct


def add_routed_gradients(g: list, direct: dict[int, Any]) -> list:
    """The pre part's parameter gradients plus those routed past it."""
    g = list(g)
    for i, x in direct.items():
        g[i] = (g[i] + x).astype(g[i].dtype)
    return g
