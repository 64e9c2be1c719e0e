"""A loss split at its layer scan: before (embedding), the layer stack, after (head + loss).

:func:`split_loss` traces ``loss_fn(params, batch, *rest)`` to a jaxpr, inlines
the calls (``jit``, ``closed_call``) that hold a ``scan`` so the scans sit at
the top level, and takes the scan over the stacked layers (the first top-level
scan whose length is the stacked layer count) as the layer stack. The
equations before it are the *pre* part, the scan's body is one layer, the
equations after it are the *post* part. The model is not edited and nothing
is re-traced per micro-batch: the parts are evaluated from the jaxpr.

What crosses between the parts is sorted by whether it depends on the batch:

- ``xs``: the scan's stacked operands (the layers' weights, leading dim ``L``);
  they must not depend on the batch;
- ``shared``: the scan's constants and the values the post part reads that do
  not depend on the batch (the head's weights, a RoPE table);
- ``per_mb``: the values that do (the scan's initial carry: the hidden state
  after the embedding; batch-dependent constants: positions, masks; what the
  post part reads from the batch: labels). A carry that starts as a constant
  (an auxiliary loss summed over the layers from ``0.0``) is one too: every
  micro-batch starts it from that constant and it crosses the stages with the
  micro-batch, so its final value is that micro-batch's (as with ``sk.value_and_grad``'s
  micro-batches, where each micro-batch runs the whole loss).

:meth:`SplitLoss.pre` computes all three for one micro-batch,
:meth:`SplitLoss.stage` runs one chunk of layers (a ``lax.scan`` of the body
over its slice of ``xs``), :meth:`SplitLoss.post` gives the micro-batch's loss
from the last chunk's carry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from spmdkit import jaxprs
from spmdkit.context_parallel import CONTEXT_ATTENTION
from spmdkit.pipeline.layer_scan import find_layer_scan
from spmdkit.pipeline.schedule import PipelineError

__all__ = ["CALLS", "SplitLoss", "call_body", "has_scan", "split_loss"]

#: Call-like primitives whose body may hold the layer scan (inlined to find it);
#: shared with :mod:`spmdkit.step.recipe`'s recompute rewrite.
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "eval_jaxpr"})


def call_body(eqn: Any) -> Any | None:
    """The closed body of a plain call (``jit``, ``closed_call``), else None."""
    return jaxprs.call_body(eqn) if eqn.primitive.name in CALLS else None


def has_scan(jaxpr: Any) -> bool:
    """Does ``jaxpr`` run a ``scan``, directly or inside a call-like equation?"""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            return True
        body = call_body(eqn)
        if body is not None and has_scan(body.jaxpr):
            return True
    return False


def _read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, jex.Literal) else env[v]


def _run(eqns: Sequence[Any], env: dict, *, inline: bool = False) -> None:
    """Evaluate ``eqns`` into ``env`` (``inline``: calls holding a scan are
    evaluated equation by equation, so their scans are traced at this level;
    a pipelined stage's context attention always is)."""
    for eqn in eqns:
        invals = [_read(env, v) for v in eqn.invars]
        body = call_body(eqn)
        # a stage's context attention is a call for the token check to find
        # (spmdkit.pipeline.context_parallel) and runs inline, as it was written: a nested
        # jit of its axis_index under automatic axes needs a context mesh to lower
        if body is not None and (
            (inline and has_scan(body.jaxpr)) or jaxprs.call_name(eqn) == CONTEXT_ATTENTION
        ):
            inner = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
            inner.update(zip(body.jaxpr.invars, invals, strict=True))
            _run(body.jaxpr.eqns, inner, inline=inline)
            outs = [_read(inner, v) for v in body.jaxpr.outvars]
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            # older jax returned (subfuns, params)
            subfuns, params = params if isinstance(params, tuple) else ((), params)
            # not under eqn.ctx: its mesh is the one the loss was traced under, and
            # the layers run again inside the pipeline's shard_map
            outs = eqn.primitive.bind(*subfuns, *invals, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))


def _inlined(closed: jex.ClosedJaxpr) -> Callable:
    def fn(*args: Any) -> list:
        env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(closed.jaxpr.invars, args, strict=True))
        _run(closed.jaxpr.eqns, env, inline=True)
        return [_read(env, v) for v in closed.jaxpr.outvars]

    return fn


def _depends(eqns: Sequence[Any], seeds: set) -> set:
    """Variables computed from ``seeds`` by ``eqns`` (``seeds`` included)."""
    out = set(seeds)
    for eqn in eqns:
        if any(not isinstance(v, jex.Literal) and v in out for v in eqn.invars):
            out.update(eqn.outvars)
    return out


def _free(eqns: Sequence[Any], outvars: Sequence[Any]) -> list:
    """Variables ``eqns`` and ``outvars`` read but do not define, in first-use order."""
    defined: set = set()
    seen: dict = {}
    for eqn in eqns:
        for v in eqn.invars:
            if not isinstance(v, jex.Literal) and v not in defined:
                seen.setdefault(v, None)
        defined.update(eqn.outvars)
    for v in outvars:
        if not isinstance(v, jex.Literal) and v not in defined:
            seen.setdefault(v, None)
    return list(seen)


@dataclass(frozen=True)
class SplitLoss:
    """A loss cut at its layer scan (module docstring).

    Attributes:
      layers: the layer count ``L`` (the scan's length).
      n_params, n_batch: how many leaves of the params and the batch the loss takes
        (the rest are the ``rest`` arguments' leaves).
      xs, shared, per_mb: the jaxpr variables of each kind.
      consts, carry: the scan's constants and initial carry (variables; a carry
        that starts as a constant is a new variable, its value in ``starts``).
      starts: the constant-started carries' variables → their values.
    """

    closed: jex.ClosedJaxpr
    index: int
    layers: int
    n_params: int
    n_batch: int
    xs: tuple
    shared: tuple
    per_mb: tuple
    consts: tuple
    carry: tuple
    starts: tuple = ()

    @property
    def scan(self) -> Any:
        """The layer scan's equation."""
        return self.closed.jaxpr.eqns[self.index]

    def pre(self, leaves: Sequence[Any]) -> tuple[list, list, list]:
        """``(xs, shared, per_mb)`` values from the loss's input leaves
        (params, one micro-batch, rest)."""
        jaxpr = self.closed.jaxpr
        env = dict(zip(jaxpr.constvars, self.closed.consts, strict=True))
        env.update(zip(jaxpr.invars, leaves, strict=True))
        env.update(self.starts)
        _run(jaxpr.eqns[: self.index], env)
        return tuple(
            [_read(env, v) for v in group] for group in (self.xs, self.shared, self.per_mb)
        )

    def stage(
        self, xs: Sequence[Any], values: dict, carry: Sequence[Any], count: Any = None
    ) -> list:
        """The carry after the layers whose stacked weights are ``xs`` (a chunk:
        leading dim ``L / chunks``); ``values`` maps the scan's constants
        (variables) to their values. ``count`` (an int scalar, traced or not):
        only the first ``count`` layers of ``xs`` run, the others (an uneven
        layout's padding) pass the carry through under a ``lax.cond`` (no
        compute, a zero gradient for their weights); None: every layer runs."""
        sc = jaxprs.scan(self.scan)

        def body(*args: Any) -> list:
            env = dict(zip(sc.jaxpr.constvars, sc.consts, strict=True))
            env.update(zip(sc.jaxpr.invars, args, strict=True))
            _run(sc.jaxpr.eqns, env)
            return [_read(env, v) for v in sc.jaxpr.outvars]

        consts = [
            _read(values, v) if not isinstance(v, jex.Literal) else v.val for v in self.consts
        ]

        def step(c: list, x: list) -> tuple[list, None]:
            out = body(*consts, *c, *x)
            return list(out[: len(c)]), None

        if count is None:
            out, _ = jax.lax.scan(step, list(carry), list(xs))
            return out

        # under a checkpoint that saves everything (no recompute): its partial
        # evaluation hands the cond's staged (backward) half the cond's operands
        # as they are, so the layer's weights are read from the stack rather than
        # kept as residuals of their own (a plain cond's linearization copies them)
        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.everything_saveable)
        def step_or_skip(c: list, kx: tuple) -> tuple[list, None]:
            k, x = kx
            run = lambda c_, x_: step(c_, x_)[0]  # noqa: E731
            return jax.lax.cond(k < count, run, lambda c_, x_: list(c_), c, x), None

        n = int(np.shape(xs[0])[0]) if xs else 0
        ks = jnp.arange(n, dtype=jnp.int32)
        out, _ = jax.lax.scan(step_or_skip, list(carry), (ks, list(xs)))
        return out

    def post(self, values: dict, carry_out: Sequence[Any]) -> Any:
        """The loss from the last chunk's carry; ``values`` maps the shared and
        per-micro-batch variables to their values."""
        jaxpr = self.closed.jaxpr
        eqn = self.scan
        env = dict(values)
        env.update(zip(eqn.outvars[: len(carry_out)], carry_out, strict=True))
        _run(jaxpr.eqns[self.index + 1 :], env)
        return _read(env, jaxpr.outvars[0])


def _find_scan(jaxpr: Any, layers: int | None) -> int:
    """The index of the layer scan (:func:`find_layer_scan`) among the equations of
    ``jaxpr``, whose plain calls are inlined."""
    found = find_layer_scan(jaxpr, layers=layers)
    if found is not None and found.calls:
        raise PipelineError(
            op="pipeline",
            must="the layer scan runs at the loss's top level or inside jit",
            given=f"the layer scan inside {found.calls[-1].primitive.name} (a "
            "jax.checkpoint or custom_vjp around the whole stack)",
            fix="checkpoint each layer inside the scan body (or use a Recipe's remat) "
            "instead of wrapping the stack",
        )
    if found is None:
        raise PipelineError(
            op="pipeline",
            must="the loss runs its stacked layers as a scan (the layer stack the "
            "pipeline splits into stages)" + ("" if layers is None else f" of length {layers}"),
            given="a loss with no such scan (layers run as a python loop, or not stacked)",
            fix="stack and scan the layers (scan_layers=True in the reference models, "
            "nnx.scan / jax.lax.scan over stacked layer params)",
        )
    return next(i for i, e in enumerate(jaxpr.eqns) if e is found.eqn)


def _check_scan(eqn: Any, post_eqns: Sequence[Any], outvars: Sequence[Any]) -> None:
    sc = jaxprs.scan(eqn)
    used = set(_free(post_eqns, outvars))
    if sc.reverse or any(v in used for v in eqn.outvars[sc.num_carry :]):
        raise PipelineError(
            op="pipeline",
            must="the layer scan runs forward and the loss reads only its final carry",
            given="a reversed scan, or per-layer outputs (ys) read after it",
            fix="return what the layers make through the carry",
        )


def split_loss(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    rest: tuple = (),
    *,
    layers: int | None = None,
    axis_env: Sequence[tuple[str, int]] = (),
) -> SplitLoss:
    """Trace ``loss_fn(params, batch, *rest)`` (one micro-batch's shapes) and cut it
    at its layer scan (module docstring).

    Args:
      loss_fn: the loss; its first output is the scalar loss.
      params, batch, rest: arguments (concrete or abstract) with one micro-batch's shapes.
      layers: the stacked layer count (picks the scan of that length).
      axis_env: mesh axes (name, size) the loss may name in collectives (it is
        traced for a ``shard_map`` manual over them: a context-parallel stage's
        attention permutes K/V over its context axes).

    Raises:
      PipelineError: no scan over the layers; a reversed scan; per-layer outputs
        read after it; stacked operands that depend on the batch.
    """
    n_params = len(jax.tree.leaves(params))
    n_batch = len(jax.tree.leaves(batch))
    leaves = jax.tree.leaves((params, batch, rest))
    tree = jax.tree.structure((params, batch, rest))

    def flat(*a: Any) -> Any:
        p, b, r = jax.tree.unflatten(tree, a)
        return loss_fn(p, b, *r)

    # traced on plain shapes with no context mesh: the parts run again under other
    # meshes (the layers inside the pipeline's shard_map, where the pipe axis is manual)
    plain = [
        jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", None) or jnp.result_type(x))
        for x in leaves
    ]
    with jax.sharding.use_abstract_mesh(AbstractMesh((), ())):
        env = list(axis_env)
        closed = jax.make_jaxpr(_inlined(jax.make_jaxpr(flat, axis_env=env)(*plain)), axis_env=env)(
            *plain
        )
    jaxpr = closed.jaxpr
    index = _find_scan(jaxpr, layers)
    eqn = jaxpr.eqns[index]
    post_eqns = jaxpr.eqns[index + 1 :]
    _check_scan(eqn, post_eqns, jaxpr.outvars[:1])
    sc = jaxprs.scan(eqn)
    nc, ncarry = sc.num_consts, sc.num_carry
    batch_vars = set(jaxpr.invars[n_params : n_params + n_batch])
    dep = _depends(jaxpr.eqns[:index], batch_vars)
    xs = tuple(eqn.invars[nc + ncarry :])
    if any(not isinstance(v, jex.Literal) and v in dep for v in xs):
        raise PipelineError(
            op="pipeline",
            must="the layer scan's stacked operands (the layers' weights) do not depend on "
            "the batch",
            given="a scanned-over operand computed from the batch",
            fix="scan over the stacked parameters only; pass batch values through the carry",
        )
    consts = tuple(eqn.invars[:nc])
    # a carry that starts as a constant gets a variable of its own (per micro-batch)
    carry, starts = [], {}
    for v in eqn.invars[nc : nc + ncarry]:
        start = jex.Var(v.aval) if isinstance(v, jex.Literal) else v
        if start is not v:
            starts[start] = np.full(v.aval.shape, v.val, v.aval.dtype)
        carry.append(start)
    defined_after = set(eqn.outvars)
    post_in = [v for v in _free(post_eqns, jaxpr.outvars[:1]) if v not in defined_after]
    need = [v for v in (*consts, *post_in) if not isinstance(v, jex.Literal)]
    need = list(dict.fromkeys(need))
    shared = tuple(v for v in need if v not in dep)
    per_mb = tuple(dict.fromkeys([*carry, *(v for v in need if v in dep)]))
    return SplitLoss(
        closed=closed,
        index=index,
        layers=sc.length,
        n_params=n_params,
        n_batch=n_batch,
        xs=xs,
        shared=shared,
        per_mb=per_mb,
        consts=consts,
        carry=tuple(carry),
        starts=tuple(starts.items()),
    )
