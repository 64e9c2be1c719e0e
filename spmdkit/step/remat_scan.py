"""The recompute pass: each layer of the loss's layer scan recomputed in the
backward pass under the recipe's policy (:func:`remat_loss`, :func:`recompute_layers`).

The loss is traced and its layer scan's equation replaced, through the plain
calls it sits inside (:func:`rewrite`), by one whose body runs under
``jax.checkpoint(policy)`` (:func:`rematted_scan`); a policy that keeps names on
a model that tags nothing gets the layer's matmuls tagged by role first
(:func:`spmdkit.step.matmul_roles.with_roles`).

``Recipe(remat_every=k)`` recomputes one layer in ``k``. The layer scan becomes
two scans: the first ``L/k`` layers (in the order they run) under
``jax.checkpoint(policy)``, then the others plain, as Megatron's *block*
method does; the memory and recompute are those of every ``k``-th layer. A
scan over groups of ``k`` layers (the first of each checkpointed) puts ``k``
layers in one loop body instead, and XLA keeps their temporaries alive
together: on tiny Llama (4 layers, 256 tokens) ``full`` on one layer in two
compiled to more than no recompute at all; a loop of one trip is inlined with
the same effect (:func:`check_remat_every`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from spmdkit import jaxprs
from spmdkit.errors import RecipeError
from spmdkit.pipeline.layer_scan import LayerScan, find_layer_scan
from spmdkit.pipeline.split import CALLS, call_body
from spmdkit.step.matmul_roles import with_roles
from spmdkit.step.offload import check_offload
from spmdkit.step.passes import Step
from spmdkit.step.recipe import Recipe, checkpoint_policy

__all__ = [
    "check_remat_every",
    "first_layers_checkpointed",
    "recompute_layers",
    "remat_loss",
    "rematted_scan",
    "rewrite",
]


def first_layers_checkpointed(
    scan: jaxprs.Scan, operands: list, body: Any, policy: Any, k: int
) -> Any:
    """A closed jaxpr computing what the layer scan does (its ``operands``: the
    scan equation's invars), as one ``jit`` call of two scans of ``body``: the
    first ``length // k`` layers under ``jax.checkpoint(policy)``, the rest plain.

    Example::

        >>> first_layers_checkpointed(scan, eqn.invars, scan.body, nothing_saveable, 2)
        { lambda ; a:f32[8,16] b:f32[4,16,16]. let c:f32[8,16] = jit[...] a b in (c,) }
    """
    plain = jex.jaxpr_as_fun(body)
    kept = jax.checkpoint(plain, policy=policy, prevent_cse=False)
    nc, ncar, length = scan.num_consts, scan.num_carry, scan.length

    def run(fn: Callable, consts: tuple, carry: tuple, xs: list, n: int) -> tuple:
        def step(c: tuple, x: list) -> tuple:
            out = fn(*consts, *c, *x)
            return tuple(out[:ncar]), out[ncar:]

        return jax.lax.scan(step, carry, xs, length=n, reverse=scan.reverse)

    def split(*ops: Any) -> tuple:
        consts, carry, xs = ops[:nc], tuple(ops[nc : nc + ncar]), ops[nc + ncar :]
        n = length // k  # the layers that run first: recomputed
        cut = length - n if scan.reverse else n
        first = [x[cut:] if scan.reverse else x[:cut] for x in xs]
        rest = [x[:cut] if scan.reverse else x[cut:] for x in xs]
        carry, ys_first = run(kept, consts, carry, first, n)
        carry, ys_rest = run(plain, consts, carry, rest, length - n)
        parts = (ys_rest, ys_first) if scan.reverse else (ys_first, ys_rest)
        return (*carry, *[jnp.concatenate(p) for p in zip(*parts, strict=True)])

    avals = [
        jax.ShapeDtypeStruct(
            v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False)
        )
        for v in operands
    ]
    return jax.make_jaxpr(jax.jit(split))(*avals)


def _checkpointed(body: Any, policy: Any) -> Any:
    """A scan body that runs under ``jax.checkpoint(policy)`` (same signature)."""
    fn = jax.checkpoint(jex.jaxpr_as_fun(body), policy=policy, prevent_cse=False)
    avals = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
        for a in body.in_avals
    ]
    return jax.make_jaxpr(fn)(*avals)


def check_remat_every(every: int, layers: int, *, op: str) -> None:
    """Raise unless one layer in ``every`` recomputed fits a stack of ``layers``.

    Raises:
      RecipeError: ``every`` > 1 does not divide ``layers`` or leaves fewer than two
        recomputed layers (XLA inlines a loop of one trip, and the compiled step
        then keeps the inlined layers' temporaries alive together).
    """
    if every > 1 and (layers % every or layers // every < 2):
        raise RecipeError(
            op=op,
            must="remat_every divides the number of layers and leaves two or more "
            "recomputed layers",
            given=f"{layers} layers, remat_every={every}",
            fix=f"pass a remat_every that divides {layers} and is at most {layers // 2}, "
            "or remat_every=1",
        )


def _every_kth(layer: LayerScan, body: Any, policy: Any, k: int) -> Any:
    """The layer scan as a ``jit`` equation of two scans, the first ``1/k`` of the
    layers checkpointed (:func:`first_layers_checkpointed`)."""
    check_remat_every(k, layer.scan.length, op="sk.value_and_grad")
    traced = first_layers_checkpointed(layer.scan, layer.eqn.invars, body, policy, k)
    (call,) = traced.jaxpr.eqns
    if traced.jaxpr.constvars or len(call.invars) != len(layer.eqn.invars):
        raise RecipeError(
            op="sk.value_and_grad",
            must="remat_every finds a layer scan whose body closes over no constants",
            given=f"a body with {len(traced.jaxpr.constvars)} constants",
            fix="pass the constants to the scan as operands, or use remat_every=1",
        )
    return call.replace(invars=list(layer.eqn.invars), outvars=list(layer.eqn.outvars))


def rewrite(jaxpr: Any, layer: LayerScan, new: Any) -> Any:
    """``jaxpr`` with the layer scan's equation replaced by ``new`` (through the
    plain calls it sits inside).

    Example::

        >>> jaxpr = rewrite(closed.jaxpr, layer, rematted_scan(layer, policy, 1, ()))
    """
    eqns = []
    for old in jaxpr.eqns:
        eqn = old
        if old is layer.eqn:
            eqn = new
        elif any(old is c for c in layer.calls):
            inner = call_body(old)
            body = rewrite(inner.jaxpr, layer, new)
            eqn = jaxprs.with_body(old, jaxprs.closed(body, inner.consts))
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns)


def rematted_scan(layer: LayerScan, policy: Any, every: int, names: tuple[str, ...]) -> Any:
    """The layer scan's equation under ``policy``: its body checkpointed (one layer
    in ``every`` only: :func:`first_layers_checkpointed`), the layer's weight
    matmuls tagged by role first when the policy keeps ``names`` and the model tags
    nothing (:func:`spmdkit.step.matmul_roles.with_roles`).

    Raises:
      RecipeError: ``every`` does not fit the layer count (:func:`check_remat_every`),
        or the layer body closes over constants (with ``every`` > 1).

    Example::

        >>> eqn = rematted_scan(layer, jax.checkpoint_policies.nothing_saveable, 2, ())
    """
    body = with_roles(layer.scan) if names else layer.scan.body
    if every > 1:
        return _every_kth(layer, body, policy, every)
    return jaxprs.with_body(layer.eqn, _checkpointed(body, policy))


# -- the pass -----------------------------------------------------------------------


def remat_loss(loss_fn: Callable, recipe: Recipe) -> Callable:
    """``loss_fn`` with each scanned layer recomputed per the recipe's policy.

    The loss is traced (for the arguments of each call), the layer scan's body
    (:func:`~spmdkit.pipeline.layer_scan.find_layer_scan`, the scan the planner
    and the pipeline split take too) is wrapped in ``jax.checkpoint(policy=...)``,
    and the rewritten jaxpr is evaluated; the model is not edited. ``remat="none"``
    returns ``loss_fn`` itself.

    Raises:
      RecipeError: the loss has no layer scan (its layers are a python loop), or
        runs it inside a ``jax.checkpoint``/``custom_vjp``: there is no layer
        boundary to recompute at; ``remat_offload`` on a backend without a
        ``pinned_host`` memory kind; ``remat_every`` that does not divide the
        layer count or leaves fewer than two recomputed layers.

    Example::

        >>> loss = remat_loss(model_loss, Recipe(remat="full"))
        >>> jax.grad(loss)(params, batch)  # each layer recomputed in the backward
    """
    if recipe.remat == "none":
        return loss_fn

    @functools.wraps(loss_fn)
    def rematted(*args: Any) -> Any:
        check_offload(recipe)

        def afresh(*a: Any) -> Any:
            # a new function per call: jax caches a function's traces, and a trace
            # must run the model's ops each time, for what they note while traced
            # (a pipelined stage's expert and context exchanges:
            # spmdkit.expert_shard, spmdkit.context_parallel)
            return loss_fn(*a)

        closed, shape = jax.make_jaxpr(afresh, return_shape=True)(*args)
        layer = find_layer_scan(closed.jaxpr)
        if layer is None or any(c.primitive.name not in CALLS for c in layer.calls):
            raise RecipeError(
                op="sk.value_and_grad",
                must=f"remat={recipe.remat!r} finds the layers as a scan in the loss",
                given="a loss with no scan (layers run as a python loop: unrolled)",
                fix="scan the layers (scan_layers=True in the reference models, nnx.scan / "
                "jax.lax.scan over stacked layer params, not wrapped in jax.checkpoint), or "
                "use remat='none'",
            )
        new = rematted_scan(
            layer, checkpoint_policy(recipe), recipe.remat_every, recipe.saved_names
        )
        jaxpr = rewrite(closed.jaxpr, layer, new)
        flat = jex.jaxpr_as_fun(jaxprs.closed(jaxpr, closed.consts))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    return rematted


def recompute_layers(step: Step) -> Step:
    """The recompute pass: the loss with each scanned layer recomputed in the
    backward pass under the recipe's policy (:func:`remat_loss`; ``remat="none"``
    leaves it as it is)."""
    if step.recipe.remat == "none":
        return step
    return replace(step, fn=remat_loss(step.fn, step.recipe))
