"""FP8 compute: weight matmuls with float8 operands and per-tensor current scaling.

``Recipe(compute_dtype="float8")`` runs the step as the FP8 training recipes of
2025-2026 do (torchtitan's Float8 linears, Transformer Engine, MaxText's fp8
quantization): parameters, gradients and optimizer state stay in their (fp32)
dtype, activations and the other computation run in bfloat16, and every weight
matmul runs on float8 operands:

- forward: both operands scaled per tensor by their absolute maximum ("current
  scaling": ``scale = amax / 448``) and cast to ``float8_e4m3fn``; the product is
  accumulated in fp32 (``preferred_element_type``) and scaled back;
- backward: the output gradient is scaled and cast to ``float8_e5m2`` (more range,
  less precision, as gradients need) and multiplied with the saved e4m3 operands,
  so the two gradient matmuls run on float8 operands too;
- the float8 operands are the residuals the backward keeps (half the bytes of
  bf16), and under FSDP the cast happens on each device's shard, before XLA
  gathers the weight for the matmul, so the all-gather moves float8 bytes.

A *weight matmul* is a ``dot_general`` with no batch dimensions (``x @ W``,
``einsum('bsd,dhk->bshk')``): what ``jax.checkpoint_policies.
dots_with_no_batch_dims_saveable`` calls a weight matmul too. Batched matmuls (the
attention scores and their weighted sum) stay in bfloat16, as in the published
recipes.

:func:`fp8_loss` applies this to any loss without editing the model: the loss is
traced to a jaxpr, and re-run equation by equation with every weight matmul
replaced by :func:`fp8_dot`, inside the layer scan, ``jit`` calls and
``jax.checkpoint`` regions too (not inside a ``custom_vjp`` the model defines:
its backward is its own).

Example::

    >>> y = fp8_dot(x, w, (((1,), (0,)), ((), ())))  # x @ w on e4m3 operands
    >>> loss8 = fp8_loss(loss)                         # every weight matmul in fp8
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax import lax

from spmdkit import jaxprs
from spmdkit.errors import SpmdError

__all__ = ["E4M3", "E5M2", "fp8_dot", "fp8_loss", "is_weight_matmul", "quantize"]

#: The forward operands' float8 type (3 mantissa bits, max 448).
E4M3 = jnp.float8_e4m3fn
#: The gradients' float8 type (2 mantissa bits, max 57344).
E5M2 = jnp.float8_e5m2

#: A ``dot_general``'s dimension numbers: ((lhs contracting, rhs contracting), (lhs
#: batch, rhs batch)).
DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``x`` scaled by its absolute maximum into ``dtype``'s range and cast:
    ``(q, scale)`` with ``q.astype(f32) * scale ≈ x`` (per-tensor current scaling;
    an all-zero tensor gets scale 1)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32))
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    return (x32 / scale).astype(dtype), scale


def _dims(dn: DimensionNumbers, ndim_l: int, ndim_r: int) -> tuple[list, list, list, list]:
    (cl, cr), _ = dn
    cl, cr = list(cl), list(cr)
    free_l = [d for d in range(ndim_l) if d not in cl]
    free_r = [d for d in range(ndim_r) if d not in cr]
    return cl, cr, free_l, free_r


def _lhs_grad(g: jax.Array, rhs: jax.Array, dn: DimensionNumbers, ndim_l: int) -> jax.Array:
    """d(lhs) of ``dot_general(lhs, rhs, dn)`` (no batch dims) for output gradient ``g``,
    on ``g``'s and ``rhs``'s dtypes, accumulated in fp32."""
    cl, cr, free_l, free_r = _dims(dn, ndim_l, rhs.ndim)
    g_r = [len(free_l) + j for j in range(len(free_r))]
    out = lax.dot_general(g, rhs, ((g_r, free_r), ((), ())), preferred_element_type=jnp.float32)
    # out's dims: lhs's free dims in order, then rhs's contracting dims in rhs order
    src = free_l + [cl[cr.index(r)] for r in sorted(cr)]
    return jnp.transpose(out, [src.index(d) for d in range(ndim_l)])


def _rhs_grad(lhs: jax.Array, g: jax.Array, dn: DimensionNumbers, ndim_r: int) -> jax.Array:
    """d(rhs) of ``dot_general(lhs, rhs, dn)`` (no batch dims) for output gradient ``g``."""
    cl, cr, free_l, free_r = _dims(dn, lhs.ndim, ndim_r)
    g_l = list(range(len(free_l)))
    out = lax.dot_general(lhs, g, ((free_l, g_l), ((), ())), preferred_element_type=jnp.float32)
    # out's dims: lhs's contracting dims in lhs order (→ rhs dims), then rhs's free dims
    src = [cr[cl.index(d)] for d in sorted(cl)] + free_r
    return jnp.transpose(out, [src.index(d) for d in range(ndim_r)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fp8_dot(lhs: jax.Array, rhs: jax.Array, dn: DimensionNumbers, out_dtype: Any = None) -> Any:
    """``lax.dot_general(lhs, rhs, dn)`` (no batch dimensions) on float8 operands:
    e4m3 forward, e5m2 output gradients backward, each scaled per tensor, fp32
    accumulation; the result in ``out_dtype`` (default ``lhs``'s dtype), the
    gradients in the operands' dtypes (module docstring)."""
    return _forward(lhs, rhs, dn, out_dtype)[0]


def _forward(lhs: jax.Array, rhs: jax.Array, dn: DimensionNumbers, out_dtype: Any) -> tuple:
    if dn[1][0] or dn[1][1]:
        raise SpmdError(
            op="fp8_dot",
            must="the dot_general has no batch dimensions (a weight matmul)",
            given=f"dimension numbers {dn}",
            fix="run batched matmuls (attention) with lax.dot_general in bf16; fp8_loss "
            "leaves them alone",
        )
    ql, sl = quantize(lhs, E4M3)
    qr, sr = quantize(rhs, E4M3)
    out = lax.dot_general(ql, qr, dn, preferred_element_type=jnp.float32) * (sl * sr)
    res = (ql, sl, qr, sr, jnp.zeros((), lhs.dtype), jnp.zeros((), rhs.dtype))
    return out.astype(out_dtype or lhs.dtype), res


def _backward(dn: DimensionNumbers, out_dtype: Any, res: tuple, g: jax.Array) -> tuple:
    ql, sl, qr, sr, lhs_like, rhs_like = res
    qg, sg = quantize(g, E5M2)
    d_lhs = _lhs_grad(qg, qr, dn, ql.ndim) * (sg * sr)
    d_rhs = _rhs_grad(ql, qg, dn, qr.ndim) * (sg * sl)
    return d_lhs.astype(lhs_like.dtype), d_rhs.astype(rhs_like.dtype)


fp8_dot.defvjp(_forward, _backward)


def is_weight_matmul(eqn: Any) -> bool:
    """Whether an equation is a weight matmul :func:`fp8_loss` runs in float8: a
    ``dot_general`` of floating operands with no batch dimensions."""
    if eqn.primitive.name != "dot_general":
        return False
    (_, (bl, br)) = eqn.params["dimension_numbers"]
    floating = all(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars)
    return floating and not bl and not br


def _avals(avals: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    return [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
        for a in avals
    ]


def _rewritten(closed: Any) -> Any:
    """A closed jaxpr computing what ``closed`` does with its weight matmuls in fp8."""
    jaxpr, consts = jaxprs.open_jaxpr(closed)
    fn = functools.partial(_run, jaxpr, list(consts))
    return jax.make_jaxpr(fn)(*_avals([v.aval for v in jaxpr.invars]))


def _with_fp8_body(eqn: Any) -> Any:
    """``eqn`` with the body it runs rewritten (a scan's, a plain call's, a
    ``jax.checkpoint`` region's), or ``eqn`` itself (no body, or a custom_vjp/jvp)."""
    name = eqn.primitive.name
    if name == "scan":
        return jaxprs.with_body(eqn, _rewritten(jaxprs.scan(eqn).body))
    body = jaxprs.call_body(eqn)
    if body is None or name.startswith("custom_"):
        return eqn
    if name in jaxprs.REMAT_PRIMITIVES:  # an open jaxpr: it cannot take new constants
        new = _rewritten(jaxprs.closed(body))
        return eqn if new.consts else jaxprs.with_body(eqn, new.jaxpr)
    return jaxprs.with_body(eqn, _rewritten(body))


def _run(jaxpr: Any, consts: list, *args: Any) -> list:
    """Evaluate ``jaxpr`` on ``args`` with every weight matmul run by :func:`fp8_dot`."""
    env: dict = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if is_weight_matmul(eqn):
            outs = [fp8_dot(*ins, eqn.params["dimension_numbers"], eqn.outvars[0].aval.dtype)]
        else:
            new = _with_fp8_body(eqn)
            ctx = getattr(eqn, "ctx", None)
            with ctx.manager if ctx is not None else contextlib.nullcontext():
                outs = new.primitive.bind(*ins, **new.primitive.get_bind_params(new.params))
            outs = outs if new.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def fp8_loss(loss_fn: Callable) -> Callable:
    """``loss_fn`` with every weight matmul run by :func:`fp8_dot` (module docstring):
    traced for the arguments of each call and re-run equation by equation; the
    model is not edited.

    Example::

        >>> jax.grad(fp8_loss(loss))(params, batch)  # float8 matmuls, grads in params' dtype
    """

    @functools.wraps(loss_fn)
    def wrapped(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(loss_fn, return_shape=True)(*args)
        flat = _run(closed.jaxpr, list(closed.consts), *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    return wrapped
