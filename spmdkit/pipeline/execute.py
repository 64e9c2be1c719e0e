"""Running a schedule: the loss's layer stack pipelined over the pipe axis.

:func:`pipelined_value_and_grad` is ``jax.value_and_grad`` of a loss whose
stacked layers run as a pipeline (what ``sk.value_and_grad(loss, plan)`` runs
when ``plan.pipeline`` is set):

1. The loss is cut at its layer scan (:func:`spmdkit.pipeline.split.split_loss`).
   The batch's leaves are split on their leading dim into ``m`` micro-batches
   (micro-batch ``i`` takes rows ``i, i + m, ...``, so a batch sharded on that
   dim stays put); the *pre* part (embedding) runs for every micro-batch
   outside the pipeline (unrolled), differentiated with ``jax.vjp``.
2. The layer stack runs under ``jax.shard_map`` manual over the pipe axis and
   the batch's axes (``batch_axes``: a device computes its own rows of each
   micro-batch, with its stages' weights gathered over those axes once, at the
   shard_map's input; other axes, e.g. a tensor-parallel one, stay automatic,
   laid out as the plan says). Every gradient is accumulated locally over the
   micro-batches and summed over the batch axes once, at the end of the step
   (the embedding's, from the rows' cotangents, in a second shard_map over the
   batch axes: :func:`_pre_grad_on_rows`): reduce-scattered to the plan's gradient
   layout where it splits the weight over batch axes (FSDP, ZeRO-2:
   :func:`~spmdkit.pipeline.layouts.weight_splits`), all-reduced where it replicates it. Each device
   holds its chunks' stacked weights (``L / (p·v)`` layers per chunk, chunk
   ``c`` on device ``c mod p``; with ``v > 1`` the layer dim is regrouped into
   that order inside the step; under an uneven ``pipe.layout`` each chunk's
   layers are moved to its device by ``ppermute`` and padded to the largest
   chunk's count, the padded layers skipped: :func:`regroup_layers`). A
   ``lax.scan`` over the schedule's ticks runs, per tick and device, the action of the tick table
   (:mod:`spmdkit.pipeline.tables`) under ``lax.switch``; activations move to
   the next device and cotangents to the previous one with ``ppermute``.
   Ticks are scanned in runs with the same sends, so each run's body has only
   the permutes it needs (a forward-only run has no backward permute): the
   compiled program runs ``sum(run length × permutes per tick)`` collective
   permutes, :func:`~spmdkit.pipeline.facts.permute_count`.
3. The *post* part (head and loss) runs on the last chunk's device right
   after that chunk's forward of each micro-batch, so 1F1B starts backwards
   early; the loss is the mean of the micro-batch losses (the full batch's, for
   a mean loss).

Schedules:

- ``"gpipe"``: the forward ticks run as one differentiated scan, and
  ``jax.vjp`` of it gives the gradients: every tick's residuals (bubble ticks
  included) and every sent activation stay alive until the backward pass.
- ``"fthenb"``, ``"1f1b"``, ``"interleaved"``: the full tick table runs
  explicitly. A forward takes ``jax.vjp`` of its chunk and stashes the
  residuals (minus the chunk's weights, which the backward reads again) in a
  slot; the backward pulls them back, applies the cotangent and frees the slot.
  A device holds as many residual sets as the schedule's ``peak_in_flight``.

This module is the entry and what runs around the layer stack (the pre part,
the ``shard_map``, the embedding's gradient); the rest is in the modules beside
it: :mod:`~spmdkit.pipeline.layouts` (what crosses the ``shard_map`` and how it is
split over the batch axes), :mod:`~spmdkit.pipeline.ticks` (the tick loops inside
it), :mod:`~spmdkit.pipeline.chunk` (one chunk's forward and its stash) and
:mod:`~spmdkit.pipeline.facts` (what the planner and ``plan.verify`` read).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdkit.context_parallel import PIPELINED_STRATEGIES, ContextShard
from spmdkit.expert_shard import ExpertShard, expert_shard
from spmdkit.pipeline.context_parallel import (
    rows_loss_combined,
    rows_loss_error,
    tokens_combined,
    tokens_error,
)
from spmdkit.pipeline.facts import (
    record_traced,
    rows_error,
    split_on_tokens,
    split_rows_combined,
)
from spmdkit.pipeline.layouts import (
    ManualAxes,
    add_routed_gradients,
    batch_split,
    differentiable,
    expert_splits,
    gpipe_wide_params,
    local_experts,
    local_rows,
    param_sources,
    per_mb_rows_split,
    per_mb_seq_split,
    replicated_splits,
    route_wide_gradients,
    split_microbatches,
    split_to_spec,
    weight_splits,
    zero_cotangent,
)
from spmdkit.pipeline.schedule import Pipeline, PipelineError, build_schedule
from spmdkit.pipeline.split import SplitLoss, split_loss
from spmdkit.pipeline.stored import stack_dim
from spmdkit.pipeline.tables import build_tables, forward_ticks
from spmdkit.pipeline.ticks import explicit_tick_loop, gpipe_forward_loop
from spmdkit.vma import shard_map

__all__ = ["pipelined_value_and_grad", "regroup_layers", "ungroup_layers"]


def pipelined_value_and_grad(
    loss_fn: Callable[..., Any],
    pipe: Pipeline,
    mesh: Any,
    batch_axes: tuple[str, ...] = (),
    layouts: Callable[[Any], tuple[Any, Any]] | None = None,
    *,
    context: ContextShard | None = None,
    seq_dims: Mapping[str, int] | None = None,
    experts: Callable[[Any], Any] | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad(loss_fn)`` with the layer stack pipelined (module docstring).

    Args:
      loss_fn: ``loss_fn(params, batch, *rest)`` → the scalar mean loss over the
        batch's examples; its layers a scan over stacked parameters.
      pipe: the pipeline.
      mesh: the mesh with ``pipe.axis`` (the context mesh, under ``jax.set_mesh``,
        wins when it has that axis).
      batch_axes: the mesh axes the batch's rows are split over (a plan's
        ``activation["batch"]``). They are manual inside the pipeline too: a
        device runs its stages on its own rows of each micro-batch with the
        stage's weights gathered over them once per step (at the ``shard_map``'s
        input), accumulates its weight gradients locally over the micro-batches
        and sums them over these axes once, at the end of the step. The loss must
        be a mean over rows (:func:`~spmdkit.pipeline.context_parallel.rows_loss_combined`
        checks it), and a layer that combines rows needs
        ``pipe.local_statistics``. Other axes stay automatic (a
        tensor-parallel ``model`` axis, an expert axis: XLA partitions the
        stage over it).
      layouts: ``layouts(params) -> (param specs, grad specs)``, trees like the
        params of ``PartitionSpec`` (a plan's ``param_specs`` and ``grad_specs``).
        A weight the specs split over batch axes (FSDP, ZeRO-2) is gathered
        over them once per step, and its gradient leaves reduce-scattered to
        its grad spec (rather than all-reduced and sliced: half the bytes).
        ``None``: their gradients are all-reduced over the batch axes.
      context: context parallelism (a plan's ``context``): the micro-batches'
        sequences split over ``context.axes``, manual inside the pipeline like
        the batch axes. The layers are traced on a device's tokens
        (:func:`spmdkit.context_parallel.context_shard`: RoPE at their natural
        positions, attention as ``context.attention``'s per-device computation,
        its K/V permuted or gathered over those axes) and every gradient is
        summed over them once, with the batch axes'. The loss must be a mean
        over tokens, as over rows.
      seq_dims: with ``context``, per batch leaf (its path, as
        :func:`spmdkit.util.path_str` writes it) the dim holding the sequence;
        leaves not named keep theirs whole.
      experts: ``experts(params)``, a tree like the params of, per leaf, its
        routed experts' dim (the ``expert`` logical dim of a ``moe_experts``
        weight) or None. Where ``layouts`` splits that dim over batch axes (expert
        parallelism), the weight enters split on it and stays so, the layers are
        traced on a device's experts too (:func:`spmdkit.expert_shard.expert_shard`:
        the tokens exchanged with the experts' devices by all-to-all over those
        axes) and its gradient, its devices' own, is summed over the other batch
        axes only.

    The loss is the mean of the micro-batches' losses, each micro-batch running
    the whole loss, as ``sk.value_and_grad``'s micro-batches do: a value the
    layer scan carries from a constant (an auxiliary loss summed over the
    layers) starts from it for every micro-batch and crosses the stages with it.

    Returns:
      ``f(params, batch, *rest) -> (loss, grads)``; ``rest`` is passed to every
      micro-batch and not differentiated. With ``pipe.return_output``:
      ``((loss, outputs), grads)``, ``outputs`` a list with the layer stack's
      final value of each carried value (the scan's carry: the hidden state, and
      any other value the layers carry) for every example, ``[batch, ...]`` in
      the batch's row order, as the last stage computed it.

    Raises:
      PipelineError: the loss has no layer scan of ``stages · virtual``-divisible
        length, the batch does not divide into the micro-batches, a value the
        scan carries is not floating, or (with batch axes) a layer combines a
        micro-batch's rows and ``pipe.local_statistics`` is off, or the loss is
        not a mean over the rows; with context axes, what
        :func:`~spmdkit.pipeline.context_parallel.tokens_combined` finds; routed experts
        split over different batch axes, or over batch axes with context axes.

    Example::

        >>> f = pipelined_value_and_grad(loss, Pipeline(stages=2, microbatches=4), mesh)
        >>> loss_value, grads = jax.jit(f)(params, batch)
    """

    def grad_fn(params: Any, batch: Any, *rest: Any) -> tuple[Any, Any]:
        micro = split_microbatches(batch, pipe.microbatches)
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micro)
        sp = split_loss(loss_fn, params, one, rest)
        pipe.check_layers(sp.layers, op="pipeline")
        run_mesh = _run_mesh(mesh, pipe.axis)
        axes, shards = _batch_axes(run_mesh, pipe, batch_axes)
        shard = _context_on(run_mesh, pipe, context, axes)
        cp = (shard.axes, shard.shards) if shard is not None else ((), 1)
        data = (*axes, *cp[0])
        p_specs, g_specs = layouts(params) if layouts and data else (None, None)
        stored = _stored_specs(sp, pipe, layouts(params)[0] if layouts and pipe.uneven else None)
        on = dict(run_mesh.shape)
        ep, owner = _experts_on(experts, params, p_specs, axes, on)
        local, rows, seq, exch, ep_exch = _local_split(
            loss_fn, sp, (params, one, rest), shards, shard, seq_dims, (ep, owner)
        )
        xs_in, xs_out, sh_out, xs_ep = _weight_layouts(sp, pipe, (p_specs, g_specs), data, on, ep)
        lay = ManualAxes(
            pipe.axis, axes, shards, rows, xs_in, xs_out, sh_out, *cp, seq, xs_ep=xs_ep
        )
        _check_rows_and_tokens(sp, local, lay, pipe)
        p_leaves, p_tree = jax.tree.flatten(params)
        r_leaves = jax.tree.leaves(rest)
        pre_all = _pre_for_microbatches(sp, micro, r_leaves)
        record_traced(
            loss_fn, pipe, sp, lay.data_axes, (params, batch, *rest), exch, ep_exch, (ep, owner)
        )
        sources = param_sources(sp)
        if not _every_value_on_rows(sp, lay):
            ((xs, shared), per), pre_vjp = jax.vjp(pre_all, p_leaves)
            wide = gpipe_wide_params(pipe, (xs, shared), sources, p_leaves)
            loss, (ct_xs, ct_sh, ct_per), outs = _run_layer_stack(
                local, pipe, run_mesh, lay, (xs, shared, per), wide, stored
            )
            (ct_xs, ct_sh), direct = route_wide_gradients((ct_xs, ct_sh), (xs, shared), sources)
            (g,) = pre_vjp(((ct_xs, ct_sh), ct_per))
            grads = add_routed_gradients(g, direct)
            return _loss_and_outputs(loss, outs), jax.tree.unflatten(p_tree, grads)
        # the embedding's gradient from the rows' cotangents: on each device's rows,
        # summed over the micro-batches, then over the batch axes once
        (_, per) = pre_all(p_leaves)
        (xs, shared), pre_vjp = jax.vjp(lambda pl: pre_all(pl)[0], p_leaves)
        wide = gpipe_wide_params(pipe, (xs, shared), sources, p_leaves)
        loss, (ct_xs, ct_sh, ct_per), outs = _run_layer_stack(
            local, pipe, run_mesh, lay, (xs, shared, per), wide, stored
        )
        (ct_xs, ct_sh), direct = route_wide_gradients((ct_xs, ct_sh), (xs, shared), sources)
        g = add_routed_gradients(pre_vjp((ct_xs, ct_sh))[0], direct)
        g_out = (
            [
                batch_split(s, np.shape(x), axes, on, 0)
                for s, x in zip(jax.tree.leaves(g_specs, _is_spec), p_leaves, strict=True)
            ]
            if g_specs
            else replicated_splits(p_leaves)
        )
        g_rows = _pre_grad_on_rows(local, lay, run_mesh, (p_leaves, micro, r_leaves), ct_per, g_out)
        g = [a + b if differentiable(a) else a for a, b in zip(g, g_rows, strict=True)]
        return _loss_and_outputs(loss, outs), jax.tree.unflatten(p_tree, g)

    return grad_fn


def _weight_layouts(
    sp: SplitLoss, pipe: Pipeline, specs: tuple, data: tuple[str, ...], on: dict, ep: tuple
) -> tuple[tuple, tuple, tuple, tuple]:
    """How the stacked weights enter the pipeline's ``shard_map`` and how theirs and
    the shared weights' gradients leave it (:class:`ManualAxes`' ``xs_in``,
    ``xs_out``, ``sh_out``), and the stacked weights' expert-parallel splits
    (``xs_ep``), from the plan's ``specs`` (params', grads') and the parameters'
    expert splits ``ep``."""
    p_specs, g_specs = specs
    leaves = jax.tree.leaves
    # GPipe's gradients are autodiff's transpose of its shard_map: its stacked
    # weights enter split and are gathered inside, so theirs are reduce-
    # scattered. The explicit schedules reduce-scatter their accumulators
    # themselves and take the weights gathered at the input (gathered
    # inside, XLA keeps a second copy for the tick loops: +W on the peak),
    # but for expert-parallel ones, which enter split on their experts
    split_in = p_specs if pipe.schedule == "gpipe" else None
    xs_in, _ = weight_splits(sp, split_in and leaves(split_in, _is_spec), data, on)
    xs_out, sh_out = weight_splits(sp, g_specs and leaves(g_specs, _is_spec), data, on)
    xs_ep = _stacked(sp, ep)
    if pipe.schedule != "gpipe" and any(xs_ep):
        xs_in = xs_ep
    return xs_in, xs_out, sh_out, xs_ep


def _run_mesh(plan_mesh: Any, axis: str) -> Any:
    """The mesh the pipeline runs on: the context mesh where it has the pipe axis."""
    ctx = jax.sharding.get_abstract_mesh()
    if not ctx.empty and axis in ctx.axis_names:
        return ctx
    return plan_mesh


def _check_rows_and_tokens(
    sp: SplitLoss, local: SplitLoss, lay: ManualAxes, pipe: Pipeline
) -> None:
    """Refuse a step whose stages would not compute the micro-batches' loss: a layer
    combining the rows the batch axes split (unless ``local_statistics``), a layer
    mixing the tokens the context axes split or a loss not a mean over them, a
    loss not a mean over the rows."""
    mixed = split_rows_combined(sp, lay)
    if mixed and not pipe.local_statistics:
        raise rows_error(mixed, lay.batch, "pipeline")
    problem = tokens_combined(sp, local, lay)
    if problem:
        raise tokens_error(problem, lay.context, "pipeline")
    problem = "" if lay.context else rows_loss_combined(sp, local, lay)
    if problem:
        raise rows_loss_error(problem, lay.batch, "pipeline")


def _context_on(
    mesh: Any, pipe: Pipeline, context: ContextShard | None, batch: tuple[str, ...]
) -> ContextShard | None:
    """``context`` on the mesh the pipeline runs on: its axes there with more than
    one device (not the pipe or a batch axis), or None when none is left."""
    if context is None:
        return None
    sizes = dict(mesh.shape)
    axes = tuple(
        a for a in context.axes if a != pipe.axis and a not in batch and sizes.get(a, 1) > 1
    )
    if not axes:
        return None
    if context.attention not in PIPELINED_STRATEGIES:
        raise PipelineError(
            op="pipeline",
            must=f"a pipelined stage's context-parallel attention is one of "
            f"{PIPELINED_STRATEGIES} (the ring's permutes would run inside the "
            "schedule's per-device branches, where XLA:CPU pairs them with other "
            "devices' permutes)",
            given=f"attention {context.attention!r} over {axes}",
            fix="plan it again (the planner gives pipelined plans 'gather_kv'), or "
            "dataclasses.replace(plan.context, attention='gather_kv')",
        )
    return ContextShard(axes, tuple(sizes[a] for a in axes), context.balanced, context.attention)


def _local_split(
    loss_fn: Callable,
    sp: SplitLoss,
    args: tuple,
    shards: int,
    shard: Any,
    seq_dims: Any,
    experts: tuple[tuple, ExpertShard | None] = ((), None),
) -> tuple[SplitLoss, tuple, tuple, tuple, tuple]:
    """The loss split on a device's rows (and, with ``shard``, tokens; with an
    :class:`~spmdkit.expert_shard.ExpertShard`, experts: ``experts`` is the
    parameters' expert splits and it) of one micro-batch, per per-micro-batch
    value whether its rows are split and which dim the context axes split, and
    the collectives one layer traced over the context axes
    (:attr:`~spmdkit.pipeline.facts.PipelineFacts.context_bytes`) or the experts'
    (:attr:`~spmdkit.pipeline.facts.PipelineFacts.expert_bytes`)."""
    splits, owner = experts
    if shard is not None and owner is not None:
        raise PipelineError(
            op="pipeline",
            must="a pipelined stage splits the sequence (context axes) or the routed "
            "experts over batch axes, not both",
            given=f"context axes {shard.axes} and experts over {owner.experts}",
            fix="plan the experts off the batch axes, or without context parallelism",
        )
    if shard is not None:
        local, exchanges = split_on_tokens(loss_fn, args, shards, shard, seq_dims)
        return local, *per_mb_seq_split(sp, local, shards, shard.shards), exchanges, ()
    params, one, rest = args
    if owner is None:
        local = sp if shards == 1 else split_loss(loss_fn, params, local_rows(one, shards), rest)
        return local, per_mb_rows_split(sp, local, shards), (), (), ()
    leaves, tree = jax.tree.flatten(params)
    mine = jax.tree.unflatten(tree, local_experts(leaves, splits, dict(owner.sizes)))
    with expert_shard(owner) as exchanges:
        local = split_loss(loss_fn, mine, local_rows(one, shards), rest, axis_env=list(owner.sizes))
    rows = per_mb_rows_split(sp, local, shards, _stacked(sp, splits))
    return local, rows, (), (), tuple(exchanges)


def _experts_on(
    experts: Callable[[Any], Any] | None,
    params: Any,
    specs: Any,
    batch: tuple[str, ...],
    sizes: dict,
) -> tuple[tuple, ExpertShard | None]:
    """Per parameter leaf its expert-parallel split over the batch axes
    (:func:`~spmdkit.pipeline.layouts.expert_splits`), and the
    :class:`~spmdkit.expert_shard.ExpertShard` the layers are traced on (None
    without expert parallelism).

    Raises:
      PipelineError: the experts are split over different batch axes."""
    leaves = jax.tree.leaves(params)
    if experts is None or specs is None or not batch:
        return ((),) * len(leaves), None
    dims = jax.tree.leaves(experts(params), is_leaf=lambda x: x is None)
    splits = expert_splits(dims, jax.tree.leaves(specs, _is_spec), batch, sizes)
    axes = {tuple(a for _, part in split for a in part) for split in splits if split}
    if not axes:
        return splits, None
    if len(axes) > 1:
        raise PipelineError(
            op="pipeline",
            must="the routed experts of the layer stack are split over one set of batch axes",
            given=f"experts split over {sorted(axes)}",
            fix="plan every expert weight's `expert` dim on the same mesh axes",
        )
    (ep,) = axes
    return splits, ExpertShard(batch, ep, tuple((a, sizes[a]) for a in batch))


def _stacked(sp: SplitLoss, splits: tuple) -> tuple:
    """Per stacked weight of ``sp``, the expert-parallel split of the parameter it
    is (or is a cast of); ``()`` when none is."""
    if not any(splits):
        return ()
    xs_src, _ = param_sources(sp)
    return tuple(() if i is None else splits[i] for i in xs_src)


def _batch_axes(mesh: Any, pipe: Pipeline, batch_axes: tuple[str, ...]) -> tuple[tuple, int]:
    """The batch axes of ``mesh`` (size > 1, not the pipe axis) and their device count."""
    sizes = dict(mesh.shape)
    axes = tuple(a for a in batch_axes if a != pipe.axis and sizes.get(a, 1) > 1)
    return axes, int(np.prod([sizes[a] for a in axes]))


def _pre_for_microbatches(sp: SplitLoss, micro: Any, r_leaves: list) -> Callable:
    """``params → ((xs, shared), per)``: the pre part for every micro-batch."""
    m = jax.tree.leaves(micro)[0].shape[0]

    def pre_one(pl: list, mb: Any) -> tuple:
        xs, shared, per = sp.pre([*pl, *jax.tree.leaves(mb), *r_leaves])
        return (xs, shared), per

    def pre_all(pl: list) -> tuple:
        # once per micro-batch, unrolled rather than vmapped: an spmdkit op (the
        # embedding) stays the planned region instead of a batched plain gather
        # (which XLA partitions with a permute of a vocab-sharded table), and a
        # weight's reshard is shared by the copies, as XLA shares it
        outs = [pre_one(pl, jax.tree.map(lambda x, i=i: x[i], micro)) for i in range(m)]
        per = [jnp.stack(vals) for vals in zip(*(o[1] for o in outs), strict=True)]
        return outs[0][0], per

    return pre_all


def _every_value_on_rows(sp: SplitLoss, lay: ManualAxes) -> bool:
    """Does the pre part's gradient run on each device's rows (:func:`_pre_grad_on_rows`)?
    With batch axes, when every floating per-micro-batch value is split over them."""
    return (
        bool(lay.batch)
        and not lay.context
        and all(r for v, r in zip(sp.per_mb, lay.rows, strict=True) if differentiable(v.aval.dtype))
    )


def _run_layer_stack(
    sp: SplitLoss,
    pipe: Pipeline,
    mesh: Any,
    lay: ManualAxes,
    vals: tuple[list, list, list],
    wide: tuple[Sequence[Any], Sequence[Any]] = ((), ()),
    stored: Sequence[P | None] = (),
) -> tuple:
    """``(loss, (ct xs, ct shared, ct per), outputs)`` of the pipelined layer stack
    and head (``sp``: the loss split on a device's rows of a micro-batch;
    ``outputs``: the last stage's, ``[m, rows, ...]`` per carry value, with
    ``pipe.return_output``, else None). ``wide``: per stacked weight and per
    shared value, the wider value it is a cast of (its fp32 parameter) or None;
    GPipe runs with those and returns their gradients at that dtype. ``stored``:
    per stacked weight, its parameter's spec where its stack is stored split over
    the pipe axis on another dim than its layers (:mod:`spmdkit.pipeline.stored`),
    else None."""
    dims = list(stored) or [None] * len(vals[0])
    carry_specs = [
        lay.value_spec(next(k for k, u in enumerate(sp.per_mb) if u is v))
        for v in (sp.carry if pipe.return_output else ())
    ]
    xs, shared, per = vals
    sched = build_schedule(pipe)
    xs_g = [regroup_layers(x, pipe, mesh, k) for x, k in zip(xs, dims, strict=True)]
    n = (len(xs), len(shared), len(per))
    if pipe.schedule == "gpipe":
        tables = build_tables(sched, ticks=forward_ticks(sched))
        specs = (P(), carry_specs) if pipe.return_output else P()
        dtypes = ([jnp.result_type(x) for x in xs], [jnp.result_type(x) for x in shared])
        w_xs, w_sh = (list(w) or [None] * len(v) for w, v in zip(wide, (xs, shared), strict=True))
        xs_g = [
            x if w is None else regroup_layers(w, pipe, mesh, k)
            for x, w, k in zip(xs_g, w_xs, dims, strict=True)
        ]
        sh_g = [x if w is None else w for x, w in zip(shared, w_sh, strict=True)]
        fn = _pipeline_shard_map(
            gpipe_forward_loop(sp, pipe, tables, lay, dtypes), lay, mesh, specs, n
        )
        res, vjp = jax.vjp(fn, xs_g, sh_g, per)
        loss, outputs = res if pipe.return_output else (res, None)
        ones = jnp.ones_like(loss)
        ct = ones if outputs is None else (ones, jax.tree.map(jnp.zeros_like, outputs))
        ct_xs, ct_sh, ct_per = vjp(ct)
        return (
            loss,
            (
                [
                    ungroup_layers(g, pipe, mesh, k) if differentiable(g) else zero_cotangent(x)
                    for g, x, k in zip(ct_xs, xs, dims, strict=True)
                ],
                ct_sh,
                ct_per,
            ),
            outputs,
        )
    tables = build_tables(sched)
    xs_floating = [differentiable(x) for x in xs]
    mb_specs = [lay.value_spec(k) for k, x in enumerate(per) if differentiable(x)]
    xs_out = [
        lay.xs_spec(s)
        for s, f in zip(lay.xs_out or replicated_splits(xs), xs_floating, strict=True)
        if f
    ]
    sh_split = lay.sh_out or replicated_splits(shared)
    sh_out = [
        split_to_spec((), s) for s, x in zip(sh_split, shared, strict=True) if differentiable(x)
    ]
    out_specs = (P(), xs_out, sh_out, mb_specs, carry_specs)
    read_slot = all(size == 1 for name, size in mesh.shape.items() if name not in lay.all_axes)
    body = explicit_tick_loop(sp, pipe, tables, lay, read_slot=read_slot)
    loss, g_xs, g_sh, g_mb, outputs = _pipeline_shard_map(body, lay, mesh, out_specs, n)(
        xs_g, shared, per
    )
    it_xs, it_sh, it_mb = iter(g_xs), iter(g_sh), iter(g_mb)
    ct_xs = [
        ungroup_layers(next(it_xs), pipe, mesh, k) if f else zero_cotangent(x)
        for x, f, k in zip(xs, xs_floating, dims, strict=True)
    ]
    ct_sh = [next(it_sh) if differentiable(x) else zero_cotangent(x) for x in shared]
    ct_per = [next(it_mb) if differentiable(x) else zero_cotangent(x) for x in per]
    return loss, (ct_xs, ct_sh, ct_per), (outputs if pipe.return_output else None)


def _pipeline_shard_map(
    body: Callable, lay: ManualAxes, mesh: Any, out_specs: Any, n: tuple
) -> Callable:
    """``body`` under the pipeline's ``shard_map``, manual over ``lay.all_axes``: it
    takes the ``n = (stacked, shared, per-micro-batch)`` values, the stacked
    weights regrouped on the pipe axis (and split as ``lay.xs_in``), the shared
    ones replicated, the per-micro-batch ones split on their rows where
    ``lay.rows`` says."""
    in_specs = (
        [lay.xs_spec(s) for s in lay.xs_in or ((),) * n[0]],
        [P()] * n[1],
        [lay.value_spec(k) for k in range(len(lay.rows))],
    )
    return shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(lay.all_axes),
        check_vma=False,
    )


def regroup_layers(x: Any, pipe: Pipeline, mesh: Any = None, stored: P | None = None) -> Any:
    """``[L, ...]`` → ``[p, v, L/(p·v), ...]``: device ``d``'s chunks ``d, d+p, ...``.
    Under an uneven :attr:`~spmdkit.pipeline.Pipeline.layout`, ``[p, v, n, ...]``
    with ``n`` the largest chunk's layers: each chunk's slice of the stack padded
    with zeros to ``n`` (the padded layers are skipped, :meth:`SplitLoss.stage`).
    With ``mesh`` (its pipe axis dividing ``L``), the layers move from the stack's
    even split over the pipe axis to their chunks' devices by ``ppermute``
    (:func:`_moved_layers`: only the layers that change device, once each);
    with ``stored`` too (the parameter's spec, the pipe axis on another dim:
    :mod:`spmdkit.pipeline.stored`, ``L`` need not divide), the chunks gather their
    layers by one all-to-all (:func:`_exchanged_layers`).

    Example::

        >>> pipe = Pipeline(stages=2, microbatches=2, layout=(1, 2))
        >>> regroup_layers(jnp.arange(1.0, 4.0), pipe).tolist()
        [[[1.0, 0.0]], [[2.0, 3.0]]]
    """
    p, v = pipe.stages, pipe.virtual
    if pipe.uneven and mesh is not None and stored is not None:
        return _exchanged_layers(x, pipe, mesh, stored)
    if pipe.uneven and mesh is not None and x.shape[0] % p == 0:
        return _moved_layers(x, pipe, mesh)
    if pipe.uneven:
        assert pipe.layout is not None
        big, start, pieces = max(pipe.layout), 0, []
        for n in pipe.layout:
            pad = jnp.zeros((big - n, *x.shape[1:]), x.dtype)
            pieces.append(jnp.concatenate([x[start : start + n], pad]))
            start += n
        y = jnp.reshape(jnp.stack(pieces), (v, p, big, *x.shape[1:]))
    else:
        y = jnp.reshape(x, (v, p, x.shape[0] // (p * v), *x.shape[1:]))
    return jnp.swapaxes(y, 0, 1)


def ungroup_layers(g: Any, pipe: Pipeline, mesh: Any = None, stored: P | None = None) -> Any:
    """``[p, v, L/(p·v), ...]`` → ``[L, ...]``: :func:`regroup_layers` undone (an
    uneven layout's padded layers dropped; with ``mesh``, its transpose: the
    layers' gradients permuted back to the stack's even split, or with ``stored``
    exchanged back to it)."""
    if pipe.uneven and mesh is not None and stored is not None:
        x = jax.ShapeDtypeStruct((sum(pipe.layout or ()), *g.shape[3:]), g.dtype)
        (out,) = jax.linear_transpose(lambda a: _exchanged_layers(a, pipe, mesh, stored), x)(g)
        return out
    if pipe.uneven and mesh is not None and (sum(pipe.layout or ()) % pipe.stages == 0):
        n_layers = sum(pipe.layout or ())
        x = jax.ShapeDtypeStruct((n_layers, *g.shape[3:]), g.dtype)
        (out,) = jax.linear_transpose(lambda a: _moved_layers(a, pipe, mesh), x)(g)
        return out
    y = jnp.swapaxes(g, 0, 1)
    if pipe.uneven:
        assert pipe.layout is not None
        chunks = jnp.reshape(y, (y.shape[0] * y.shape[1], *y.shape[2:]))
        return jnp.concatenate([chunks[c, :n] for c, n in enumerate(pipe.layout)])
    return jnp.reshape(y, (y.shape[0] * y.shape[1] * y.shape[2], *y.shape[3:]))


def _move_tables(pipe: Pipeline, n_layers: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per shift ``s`` (device ``q`` sends to ``q + s``), ``(s, src, dst)``: ``src[q]``
    the offsets in ``q``'s block of the stack (``L / p`` layers) it sends, ``dst[r]``
    the padded slots (``j · n + k``) of ``r``'s chunks they fill, padded alike to the
    shift's most (``dst`` past the end: dropped); shifts that move nothing left out."""
    p, v = pipe.stages, pipe.virtual
    assert pipe.layout is not None
    block, big = n_layers // p, max(pipe.layout)
    pairs: dict[int, list[list[tuple[int, int]]]] = {s: [[] for _ in range(p)] for s in range(p)}
    start = 0
    for c, n in enumerate(pipe.layout):
        r, j = c % p, c // p
        for k in range(n):
            layer = start + k
            q = layer // block
            pairs[(r - q) % p][q].append((layer % block, j * big + k))
        start += n
    out = []
    for s in range(p):
        most = max(len(x) for x in pairs[s])
        if not most:
            continue
        src = np.zeros((p, most), np.int32)
        dst = np.full((p, most), v * big, np.int32)
        for q, items in enumerate(pairs[s]):
            for i, (a, _) in enumerate(items):
                src[q, i] = a
            for i, (_, b) in enumerate(items):
                dst[(q + s) % p, i] = b
        out.append((s, src, dst))
    return out


def _moved_layers(x: Any, pipe: Pipeline, mesh: Any) -> Any:
    r""":func:`regroup_layers` of an uneven layout as a ``shard_map`` manual over the
    pipe axis: each device gathers from its block of the stack the layers another
    device's chunks run, ``ppermute``\ s them there (one permute per shift that
    moves any) and scatters what it receives into its zero-padded chunks. Linear
    in ``x``: its transpose moves the gradients back."""
    p, v, axis = pipe.stages, pipe.virtual, pipe.axis
    assert pipe.layout is not None
    big = max(pipe.layout)
    tables = _move_tables(pipe, x.shape[0])

    # each device's rows of the tables enter split over the pipe axis (an
    # axis_index here, manual over the pipe axis alone, is a partition id XLA's
    # partitioner refuses to place)
    def body(local: Any, idx: list) -> Any:
        out = jnp.zeros((v * big, *local.shape[1:]), local.dtype)
        for (s, _, _), (src, dst) in zip(tables, idx, strict=True):
            vals = local[src[0]]
            if s:
                vals = jax.lax.ppermute(vals, axis, [(q, (q + s) % p) for q in range(p)])
            out = out.at[dst[0]].add(vals, mode="drop")
        return jnp.reshape(out, (1, v, big, *local.shape[1:]))

    idx = [(jnp.asarray(src), jnp.asarray(dst)) for _, src, dst in tables]
    return shard_map(
        body,
        mesh=mesh,
        in_specs=(P(axis), [(P(axis), P(axis))] * len(idx)),
        out_specs=P(axis),
        axis_names=frozenset({axis}),
        check_vma=False,
    )(x, idx)


def _exchanged_layers(x: Any, pipe: Pipeline, mesh: Any, spec: P) -> Any:
    r""":func:`regroup_layers` of a stack stored as ``spec``, split over the pipe axis
    on another dim than its layers (:mod:`spmdkit.pipeline.stored`: every device
    holds a slice of every layer), as a ``shard_map`` manual over ``spec``'s axes:
    each device gathers, per device, its slices of that device's chunks' layers
    into their zero-padded slots, one ``all_to_all`` sends each device its own,
    and the slices it receives are joined on that dim (the pipe axis is its
    minor-most: the joined slices are the device's block of the axes before it,
    which stay split). Linear in ``x``: its transpose sends the gradients' slices back."""
    p, v, axis = pipe.stages, pipe.virtual, pipe.axis
    assert pipe.layout is not None
    dim = stack_dim(spec, axis)
    assert dim is not None
    big, n_layers = max(pipe.layout), x.shape[0]
    # slot j·big + k of device r: layer k of chunk j·p + r, or past the end (zeros)
    idx = np.full((p, v * big), n_layers, np.int32)
    start = 0
    for c, n in enumerate(pipe.layout):
        idx[c % p, (c // p) * big : (c // p) * big + n] = np.arange(start, start + n)
        start += n

    def body(local: Any) -> Any:
        send = jnp.take(local, jnp.asarray(idx), axis=0, mode="fill", fill_value=0)
        got = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # [p (from), slots, ...]
        got = jnp.moveaxis(got, 0, dim)  # the senders' slices beside theirs on dim
        shape = (*local.shape[1:dim], p * local.shape[dim], *local.shape[dim + 1 :])
        return jnp.reshape(got, (1, v, big, *shape))

    entries = list(tuple(spec))
    kept = [
        tuple(a for a in ((e,) if isinstance(e, str) else tuple(e or ())) if a != axis)
        for e in entries[1:]
    ]
    out = P(axis, None, None, *[None if not k else k[0] if len(k) == 1 else k for k in kept])
    manual = {axis, *(a for k in kept for a in k)}
    return shard_map(
        body,
        mesh=mesh,
        in_specs=(spec,),
        out_specs=out,
        axis_names=frozenset(manual),
        check_vma=False,
    )(x)


def _stored_specs(sp: SplitLoss, pipe: Pipeline, specs: Any) -> list[P | None]:
    """Per stacked weight of ``sp``, the plan's spec (``specs``) of the parameter
    it is (a cast of) when that stack is stored split over the pipe axis on
    another dim than its layers (:func:`~spmdkit.pipeline.stored.stack_dim`), else None."""
    if specs is None:
        return [None] * len(sp.xs)
    leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    src, _ = param_sources(sp)
    return [
        None if i is None or stack_dim(leaves[i], pipe.axis) is None else leaves[i] for i in src
    ]


def _pre_grad_on_rows(
    local: SplitLoss, lay: ManualAxes, mesh: Any, args: tuple, ct_per: list, g_out: Sequence
) -> list:
    """The parameters' gradient through the per-micro-batch values (the
    embedding's), under a ``shard_map`` manual over the batch axes: each device
    differentiates the pre part on its rows of every micro-batch (``local``: the
    loss split on those rows), summed over the micro-batches, then over the
    batch axes once (``g_out``: per parameter, the split over the batch axes
    its gradient is reduce-scattered to). Non-floating parameters get zeros."""
    p_leaves, micro, r_leaves = args
    dper = [i for i, x in enumerate(ct_per) if differentiable(x)]
    b_leaves = jax.tree.leaves(micro)
    read = _params_read_by(local, dper, (p_leaves, [x[0] for x in b_leaves], r_leaves))
    dp = [i for i in read if differentiable(p_leaves[i])]

    def body(pl: list, bl: list, rl: list, cts: list) -> list:
        # the parameters the rows' values are not computed from are not passed
        # (a shard_map input is gathered over the manual axes even when unread)
        given = dict(zip(read, pl, strict=True))

        def pre_rows(dpl: list) -> list:
            full = [given.get(i, jnp.zeros(x.shape, x.dtype)) for i, x in enumerate(p_leaves)]
            for i, x in zip(dp, dpl, strict=True):
                full[i] = x

            def one(mb: list) -> list:
                per = local.pre([*full, *mb, *rl])[2]
                return [per[i] for i in dper]

            return jax.vmap(one)(bl)

        _, vjp = jax.vjp(pre_rows, [given[i] for i in dp])
        (g,) = vjp(cts)
        return [lay.reduce(x, g_out[i], 0) for i, x in zip(dp, g, strict=True)]

    rows = P(None, lay.batch)
    fn = shard_map(
        body,
        mesh=mesh,
        in_specs=(
            [P()] * len(read),
            [rows] * len(b_leaves),
            [P()] * len(r_leaves),
            [rows] * len(dper),
        ),
        out_specs=[split_to_spec((), g_out[i]) for i in dp],
        axis_names=frozenset(lay.batch),
        check_vma=False,
    )
    g = fn([p_leaves[i] for i in read], b_leaves, r_leaves, [ct_per[i] for i in dper])
    out = [zero_cotangent(x) for x in p_leaves]
    for i, x in zip(dp, g, strict=True):
        out[i] = x
    return out


def _params_read_by(sp: SplitLoss, outs: list, args: tuple) -> list[int]:
    """The parameter leaves that ``sp``'s per-micro-batch values ``outs``
    (indices) are computed from (the others' gradient through them is zero, and
    a ``psum`` of it would be priced though XLA drops it)."""
    p_leaves, mb, rl = args
    closed = jax.make_jaxpr(lambda *a: [sp.pre(list(a))[2][i] for i in outs])(*p_leaves, *mb, *rl)
    need = {v for v in closed.jaxpr.outvars if not isinstance(v, jex.Literal)}
    for eqn in reversed(closed.jaxpr.eqns):
        if any(o in need for o in eqn.outvars):
            need.update(v for v in eqn.invars if not isinstance(v, jex.Literal))
    invars = closed.jaxpr.invars[: len(p_leaves)]
    return [i for i, v in enumerate(invars) if v in need]


def _loss_and_outputs(loss: Any, outs: list | None) -> Any:
    """The loss, or ``(loss, outputs)`` with the last stage's outputs in the
    batch's row order (the inverse of :func:`~spmdkit.pipeline.layouts.split_microbatches`)."""
    if outs is None:
        return loss

    def rows(o: Any) -> Any:
        y = jnp.swapaxes(o, 0, 1)
        return jnp.reshape(y, (y.shape[0] * y.shape[1], *y.shape[2:]))

    return loss, [rows(o) for o in outs]


def _is_spec(x: Any) -> bool:
    """A spec tree's leaf (a ``PartitionSpec``, or None for a replicated value)."""
    return isinstance(x, P) or x is None
