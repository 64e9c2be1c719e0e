"""FP8 compute: weight matmuls with float8 operands and per-tensor current scaling.

``Recipe(compute_dtype="float8")`` runs the step as the FP8 training recipes of
2025-2026 do (torchtitan's Float8 linears, Transformer Engine, MaxText's fp8
quantization): parameters, gradients and optimizer state stay in their (fp32)
dtype, activations and the other computation run in bfloat16, and every weight
matmul runs on float8 operands:

- forward: both operands scaled per tensor by their absolute maximum ("current
  scaling": ``scale = amax / 448``) and cast to ``float8_e4m3fn``; the product is
  accumulated in fp32 and written in the activations' dtype, as a float8 GEMM
  writes it, then scaled back in that dtype (:func:`_scaled`: no cast follows
  the GEMM, so under FSDP its sum-partial weight gradient is reduce-scattered
  to the weight's shards, as bf16's is);
- backward: the output gradient is scaled and cast to ``float8_e5m2`` (more range,
  less precision, as gradients need) and multiplied with the saved e4m3 operands,
  so the two gradient matmuls run on float8 operands too;
- the float8 operands are the residuals the backward keeps (half the bytes of
  bf16); an input several weight matmuls share (q/k/v's, gate/up's) is
  quantized once and kept once, as Transformer Engine's fused GEMMs keep it
  (current scaling; delayed scaling keeps a history, and a copy, per matmul);
  under FSDP the cast happens on each device's shard, before XLA gathers the
  weight for the matmul, so the all-gather moves float8 bytes.

A *weight matmul* is a ``dot_general`` with no batch dimensions (``x @ W``,
``einsum('bsd,dhk->bshk')``): what ``jax.checkpoint_policies.
dots_with_no_batch_dims_saveable`` calls a weight matmul too. Batched matmuls (the
attention scores and their weighted sum) stay in bfloat16, as in the published
recipes.

``exclude=("lm_head",)`` (the recipe's default,
:data:`~spmdkit.step.recipe.LM_HEAD`) also keeps the
*LM head* in bfloat16, as NeMo / Megatron-LM (its output layer is not a
Transformer Engine layer) and torchtitan (torchao's float8 converter skips its
``output`` linear) keep the final projection: the weight matmuls whose results
reach the loss through no other weight matmul (:func:`lm_heads`; the vocabulary
projection of a language model, a classifier's head), outside the layer scan.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax import lax

from spmdkit import jaxprs
from spmdkit.errors import RecipeError, SpmdError
from spmdkit.pipeline import Pipeline
from spmdkit.step.loss import Loss
from spmdkit.step.passes import Step
from spmdkit.step.recipe import LM_HEAD, SCALINGS, check_exclude

__all__ = [
    "E4M3",
    "E5M2",
    "HISTORY",
    "STATE_PREFIX",
    "float8_matmuls",
    "fp8_dot",
    "fp8_dot_delayed",
    "fp8_loss",
    "fp8_state",
    "is_weight_matmul",
    "lm_head_operands",
    "lm_heads",
    "quantize",
]

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


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


def _saturated(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x / scale`` clipped to ``dtype``'s range and cast: a value past the range a
    delayed scale allows saturates at the largest float8 (float8_e4m3fn has no
    infinity: an unclipped cast would make it NaN)."""
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)


def _delayed_scale(history: jax.Array, amax: jax.Array, dtype: Any) -> jax.Array:
    """The scale from an amax history (its maximum over the window); while the
    history is empty (all zero: the first step) the current ``amax``."""
    past = jnp.max(history)
    amax = jnp.where(past > 0, past, amax)
    return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)


def _dims(dn: DimensionNumbers, ndim_l: int, ndim_r: int) -> tuple[list, list, list, list]:
    (cl, cr), _ = dn
    cl, cr = list(cl), list(cr)
    free_l = [d for d in range(ndim_l) if d not in cl]
    free_r = [d for d in range(ndim_r) if d not in cr]
    return cl, cr, free_l, free_r


def _lhs_grad(
    g: jax.Array, rhs: jax.Array, dn: DimensionNumbers, ndim_l: int, dtype: Any
) -> jax.Array:
    """d(lhs) of ``dot_general(lhs, rhs, dn)`` (no batch dims) for output gradient ``g``,
    on ``g``'s and ``rhs``'s dtypes, accumulated in fp32 and written in ``dtype``."""
    cl, cr, free_l, free_r = _dims(dn, ndim_l, rhs.ndim)
    g_r = [len(free_l) + j for j in range(len(free_r))]
    out = lax.dot_general(g, rhs, ((g_r, free_r), ((), ())), preferred_element_type=dtype)
    # out's dims: lhs's free dims in order, then rhs's contracting dims in rhs order
    src = free_l + [cl[cr.index(r)] for r in sorted(cr)]
    return jnp.transpose(out, [src.index(d) for d in range(ndim_l)])


def _rhs_grad(
    lhs: jax.Array, g: jax.Array, dn: DimensionNumbers, ndim_r: int, dtype: Any
) -> jax.Array:
    """d(rhs) of ``dot_general(lhs, rhs, dn)`` (no batch dims) for output gradient ``g``,
    written in ``dtype``."""
    cl, cr, free_l, free_r = _dims(dn, lhs.ndim, ndim_r)
    g_l = list(range(len(free_l)))
    out = lax.dot_general(lhs, g, ((free_l, g_l), ((), ())), preferred_element_type=dtype)
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


def _check_unbatched(dn: DimensionNumbers) -> None:
    if dn[1][0] or dn[1][1]:
        raise SpmdError(
            op="fp8_dot",
            must="the dot_general has no batch dimensions (a weight matmul)",
            given=f"dimension numbers {dn}",
            fix="run batched matmuls (attention) with lax.dot_general in bf16; fp8_loss "
            "leaves them alone",
        )


def _product(ql: jax.Array, qr: jax.Array, dn: DimensionNumbers, scale: Any, dtype: Any) -> Any:
    """The float8 operands' product scaled back, in ``dtype`` (:func:`_scaled`)."""
    return _scaled(lax.dot_general(ql, qr, dn, preferred_element_type=dtype), scale)


def _scaled(out: jax.Array, scale: jax.Array) -> jax.Array:
    """A float8 GEMM's result ``out`` (accumulated in fp32, written in the
    result's dtype, as a float8 GEMM writes the activations' dtype) times its
    per-tensor ``scale``, in ``out``'s dtype: no narrowing cast follows the
    GEMM, so a result left sum-partial by a sharded contraction (the weight
    gradient's, over the batch under FSDP) is reduced as a bfloat16 GEMM's
    would be, reduce-scattered to the weight's shards, not all-reduced at a
    cast (a cast to a narrower dtype rounds each partial piece, so a pending
    sum is resolved before it). Under bfloat16 the scale rounds to 8 bits
    (at most 2^-9 relative, far below e4m3's 2^-4 step); a ``dtype`` of
    float32 or wider keeps it exact. A remat policy saving matmul outputs
    (``dots``) keeps the result at ``dtype``'s size."""
    return out * scale.astype(out.dtype)


def _forward(lhs: jax.Array, rhs: jax.Array, dn: DimensionNumbers, out_dtype: Any) -> tuple:
    _check_unbatched(dn)
    ql, sl = quantize(lhs, E4M3)
    qr, sr = quantize(rhs, E4M3)
    out = _product(ql, qr, dn, sl * sr, out_dtype or lhs.dtype)
    res = (ql, sl, qr, sr, jnp.zeros((), lhs.dtype), jnp.zeros((), rhs.dtype))
    return out, res


def _backward(dn: DimensionNumbers, out_dtype: Any, res: tuple, g: jax.Array) -> tuple:
    ql, sl, qr, sr, lhs_like, rhs_like = res
    qg, sg = quantize(g, E5M2)
    d_lhs = _scaled(_lhs_grad(qg, qr, dn, ql.ndim, lhs_like.dtype), sg * sr)
    d_rhs = _scaled(_rhs_grad(ql, qg, dn, qr.ndim, rhs_like.dtype), sg * sl)
    return d_lhs, d_rhs


fp8_dot.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fp8_dot_shared(
    lhs: jax.Array,
    ql: jax.Array,
    sl: jax.Array,
    rhs: jax.Array,
    dn: DimensionNumbers,
    out_dtype: Any,
) -> Any:
    """:func:`fp8_dot` of an ``lhs`` already quantized, ``(ql, sl) = quantize(lhs)``
    (an input several weight matmuls share: quantized once, kept once for their
    backward passes); the gradient reaches ``lhs``, none ``ql`` or ``sl``."""
    return _shared_forward(lhs, ql, sl, rhs, dn, out_dtype)[0]


def _shared_forward(
    lhs: jax.Array,
    ql: jax.Array,
    sl: jax.Array,
    rhs: jax.Array,
    dn: DimensionNumbers,
    out_dtype: Any,
) -> tuple:
    _check_unbatched(dn)
    qr, sr = quantize(rhs, E4M3)
    out = _product(ql, qr, dn, sl * sr, out_dtype or lhs.dtype)
    return out, (ql, sl, qr, sr, jnp.zeros((), lhs.dtype), jnp.zeros((), rhs.dtype))


def _shared_backward(dn: DimensionNumbers, out_dtype: Any, res: tuple, g: jax.Array) -> tuple:
    d_lhs, d_rhs = _backward(dn, out_dtype, res, g)
    return d_lhs, jnp.zeros_like(res[0]), jnp.zeros_like(res[1]), d_rhs


_fp8_dot_shared.defvjp(_shared_forward, _shared_backward)

#: The keys of delayed scaling's state start with this (:func:`fp8_state`).
STATE_PREFIX = "fp8_amax_"

#: Steps of amax history delayed scaling keeps per operand (the window its scale
#: is the maximum over).
HISTORY = 16


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp8_dot_delayed(
    lhs: jax.Array, rhs: jax.Array, history: jax.Array, dn: DimensionNumbers, out_dtype: Any = None
) -> Any:
    """:func:`fp8_dot` with *delayed* scaling: each operand (and, backward, the
    output gradient) is scaled by the maximum of its amax ``history``
    (``float32[3, H]``: rows lhs, rhs, output gradient; newest first) instead of
    its own amax, and clipped (saturated) to the float8 range; while a row is all
    zero (the first step) the current amax is used, so the first step is
    :func:`fp8_dot`'s.

    The gradient with respect to ``history`` is not a derivative: it is the
    updated history (this step's three amaxes pushed in front, the oldest
    dropped), which the backward pass alone can produce (the output gradient's
    amax is known only there); :func:`fp8_loss` hands it back as the new state
    (Transformer Engine's and flax's fp8 ops keep the same state)."""
    return _delayed_forward(lhs, rhs, history, dn, out_dtype)[0]


def _delayed_forward(
    lhs: jax.Array, rhs: jax.Array, history: jax.Array, dn: DimensionNumbers, out_dtype: Any
) -> tuple:
    _check_unbatched(dn)
    al, ar = _amax(lhs), _amax(rhs)
    sl, sr = _delayed_scale(history[0], al, E4M3), _delayed_scale(history[1], ar, E4M3)
    ql, qr = _saturated(lhs, sl, E4M3), _saturated(rhs, sr, E4M3)
    out = _product(ql, qr, dn, sl * sr, out_dtype or lhs.dtype)
    res = (ql, sl, qr, sr, jnp.stack([al, ar]), history)
    likes = (jnp.zeros((), lhs.dtype), jnp.zeros((), rhs.dtype))
    return out, (res, *likes)


def _delayed_backward(dn: DimensionNumbers, out_dtype: Any, saved: tuple, g: jax.Array) -> tuple:
    (ql, sl, qr, sr, amaxes, history), lhs_like, rhs_like = saved
    ag = _amax(g)
    sg = _delayed_scale(history[2], ag, E5M2)
    qg = _saturated(g, sg, E5M2)
    d_lhs = _scaled(_lhs_grad(qg, qr, dn, ql.ndim, lhs_like.dtype), sg * sr)
    d_rhs = _scaled(_rhs_grad(ql, qg, dn, qr.ndim, rhs_like.dtype), sg * sl)
    newest = jnp.concatenate([amaxes, ag[None]])[:, None].astype(history.dtype)
    updated = jnp.concatenate([newest, history[:, :-1]], axis=1)
    return d_lhs, d_rhs, updated


fp8_dot_delayed.defvjp(_delayed_forward, _delayed_backward)


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


#: Where a weight matmul sits in a jaxpr: its equation's index, preceded by the
#: indices of the call equations (``jit``, ``jax.checkpoint``) it is nested in.
Site = tuple[int, ...]


def _is_var(v: Any) -> bool:
    return not isinstance(v, jex.Literal)


def _holds_matmul(eqn: Any) -> bool:
    return any(
        is_weight_matmul(e) for sub in jaxprs.sub_jaxprs(eqn) for e, _ in jaxprs.walk_eqns(sub)
    )


def _final(jaxpr: Any, live_out: Sequence[bool]) -> tuple[set[Site], list[bool]]:
    """The weight matmuls of ``jaxpr`` whose results reach an outvar marked in
    ``live_out`` through no other weight matmul, and which invars reach one so.
    Calls are followed (their sites count unless the call is a custom_vjp/jvp,
    whose body :func:`fp8_loss` leaves alone); a scan, loop or other body holding
    a weight matmul stops the flow (the layer stack: the head is after it)."""
    live = {v for v, on in zip(jaxpr.outvars, live_out, strict=True) if on and _is_var(v)}
    sites: set[Site] = set()
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        outs = [v in live for v in eqn.outvars]
        if not any(outs):
            continue
        if is_weight_matmul(eqn):
            sites.add((i,))
            continue
        body = jaxprs.call_body(eqn)
        if body is not None:
            inner, ins = _final(jaxprs.open_jaxpr(body)[0], outs)
            if not eqn.primitive.name.startswith("custom_"):
                sites.update((i, *s) for s in inner)
        elif _holds_matmul(eqn):
            continue
        else:
            ins = [True] * len(eqn.invars)
        live.update(v for v, on in zip(eqn.invars, ins, strict=True) if on and _is_var(v))
    return sites, [v in live for v in jaxpr.invars]


def lm_heads(jaxpr: Any) -> frozenset[Site]:
    """The LM head(s) of a loss's (forward) jaxpr: its weight matmuls whose results
    reach the loss through no other weight matmul (outside the layer scan: a body
    holding weight matmuls is a stop), each as a :data:`Site`. A language model's
    vocabulary projection (tied to the embedding or not), a classifier's head.

    Example::

        >>> lm_heads(jax.make_jaxpr(loss)(params, batch).jaxpr)
        frozenset({(41,)})
    """
    jaxpr = jaxprs.open_jaxpr(jaxpr)[0]
    return frozenset(_final(jaxpr, [True] * len(jaxpr.outvars))[0])


#: Primitives that move a weight without computing on it (followed back to it).
_RELAYOUTS = frozenset({"convert_element_type", "transpose", "reshape", "copy", "copy_p"})


def lm_head_operands(jaxpr: Any, sites: frozenset[Site]) -> set[int]:
    """Indices of ``jaxpr``'s invars that are operands of the matmuls at ``sites``
    (:func:`lm_heads`), through casts, transposes and reshapes and into calls:
    the parameters an LM head reads.

    Example::

        >>> lm_head_operands(jaxpr, lm_heads(jaxpr))  # the flattened params' index
        {3}
    """
    jaxpr = jaxprs.open_jaxpr(jaxpr)[0]
    origin = {v: i for i, v in enumerate(jaxpr.invars)}
    return _operands(jaxpr, sites, origin)


def _operands(jaxpr: Any, sites: frozenset[Site], origin: dict) -> set[int]:
    found: set[int] = set()
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [origin.get(v) if _is_var(v) else None for v in eqn.invars]
        if (i,) in sites:
            found.update(o for o in ins if o is not None)
        elif eqn.primitive.name in _RELAYOUTS and ins[0] is not None:
            origin[eqn.outvars[0]] = ins[0]
        elif _below(sites, i) and jaxprs.call_body(eqn) is not None:
            body = jaxprs.open_jaxpr(jaxprs.call_body(eqn))[0]
            inner = {b: o for b, o in zip(body.invars, ins, strict=True) if o is not None}
            found |= _operands(body, _below(sites, i), inner)
    return found


def _below(sites: frozenset[Site], i: int) -> frozenset[Site]:
    """The sites nested in equation ``i``'s body, relative to it."""
    return frozenset(s[1:] for s in sites if s[0] == i and len(s) > 1)


def _kept(jaxpr: Any, exclude: Sequence[str]) -> frozenset[Site]:
    """The sites of ``jaxpr`` that ``exclude`` keeps out of float8."""
    return lm_heads(jaxpr) if LM_HEAD in exclude else frozenset()


def _rewritten(closed: Any, keep: frozenset[Site] = frozenset()) -> Any:
    """A closed jaxpr computing what ``closed`` does with its weight matmuls in fp8
    (but those at ``keep``)."""
    jaxpr, consts = jaxprs.open_jaxpr(closed)
    fn = functools.partial(_run, jaxpr, list(consts), keep=keep)
    return jax.make_jaxpr(fn)(*_avals([v.aval for v in jaxpr.invars]))


def _with_fp8_body(eqn: Any, keep: frozenset[Site]) -> Any:
    """``eqn`` with the body it runs rewritten (a scan's, a plain call's, a
    ``jax.checkpoint`` region's; ``keep``: sites in it left alone), or ``eqn``
    itself (no body, or a custom_vjp/jvp)."""
    name = eqn.primitive.name
    if name == "scan":
        return jaxprs.with_body(eqn, _rewritten(jaxprs.scan(eqn).body, keep))
    body = jaxprs.call_body(eqn)
    if body is None or name.startswith("custom_"):
        return eqn
    if name in jaxprs.REMAT_PRIMITIVES:  # an open jaxpr: it cannot take new constants
        new = _rewritten(jaxprs.closed(body), keep)
        return eqn if new.consts else jaxprs.with_body(eqn, new.jaxpr)
    return jaxprs.with_body(eqn, _rewritten(body, keep))


def _sites(eqn: Any, keep: frozenset[Site] = frozenset()) -> list[tuple[int, ...]]:
    """The weight matmuls delayed scaling keeps a history for, in the order
    :func:`_run` meets them, each as the scan lengths it runs under (``()``: once
    per step; ``(L,)``: in an ``L``-step layer scan, one history per layer): the
    equation itself, or those in the body of a scan or a call (not a custom_vjp/jvp:
    the model's own backward), but those at ``keep`` (relative to ``eqn``'s body;
    ``()``: the equation itself)."""
    if is_weight_matmul(eqn):
        return [] if () in keep else [()]
    name = eqn.primitive.name
    if name == "scan":
        sc = jaxprs.scan(eqn)
        return [(sc.length, *s) for s in _jaxpr_sites(sc.jaxpr, keep)]
    body = jaxprs.call_body(eqn)
    if body is None or name.startswith("custom_"):
        return []
    return _jaxpr_sites(jaxprs.open_jaxpr(body)[0], keep)


def _jaxpr_sites(jaxpr: Any, keep: frozenset[Site] = frozenset()) -> list[tuple[int, ...]]:
    return [s for i, eqn in enumerate(jaxpr.eqns) for s in _sites(eqn, _at(keep, i))]


def _at(keep: frozenset[Site], i: int) -> frozenset[Site]:
    """``keep`` relative to equation ``i``: ``()`` when it is the equation itself."""
    return frozenset(s[1:] for s in keep if s[0] == i)


def _delayed_eqn(eqn: Any, ins: list, histories: Iterator, keep: frozenset[Site]) -> list | None:
    """``eqn`` run with delayed scaling on the next of ``histories`` for each of
    its weight matmuls (but those at ``keep``, :func:`_sites`); None when it has
    none (run it as it is)."""
    if is_weight_matmul(eqn) and () not in keep:
        dn = eqn.params["dimension_numbers"]
        return [fp8_dot_delayed(*ins, next(histories), dn, eqn.outvars[0].aval.dtype)]
    hs = [next(histories) for _ in _sites(eqn, keep)]
    if not hs:
        return None
    if eqn.primitive.name == "scan":
        return _delayed_scan(jaxprs.scan(eqn), ins, hs, keep)
    jaxpr, consts = jaxprs.open_jaxpr(jaxprs.call_body(eqn))

    def body(hs: list, *args: Any) -> list:
        return _run(jaxpr, consts, *args, histories=iter(hs), keep=keep)

    if eqn.primitive.name in jaxprs.REMAT_PRIMITIVES:
        return jax.checkpoint(body, **jaxprs.remat_options(eqn))(hs, *ins)
    return body(hs, *ins)  # a jit / closed call: inlined


def _delayed_scan(sc: Any, ins: list, hs: list, keep: frozenset[Site]) -> list:
    """A scan with delayed scaling: each layer's histories ride as extra scanned
    inputs (one slice per step)."""
    consts, init = ins[: sc.num_consts], ins[sc.num_consts : sc.num_consts + sc.num_carry]
    xs = ins[sc.num_consts + sc.num_carry :]

    def step(carry: list, x: tuple) -> tuple[list, list]:
        args = (*consts, *carry, *x[0])
        outs = _run(sc.jaxpr, list(sc.consts), *args, histories=iter(x[1]), keep=keep)
        return outs[: sc.num_carry], outs[sc.num_carry :]

    carry, ys = lax.scan(
        step, init, (xs, hs), length=sc.length, reverse=sc.reverse, unroll=sc.unroll
    )
    return [*carry, *ys]


def _current_eqn(eqn: Any, ins: list, rewrite: bool, keep: frozenset[Site]) -> list:
    """``eqn`` run with its weight matmuls (its own, its body's; but those at
    ``keep``) by :func:`fp8_dot`; with ``rewrite`` False (delayed scaling found
    none in it) as it is."""
    if rewrite and is_weight_matmul(eqn) and () not in keep:
        return [fp8_dot(*ins, eqn.params["dimension_numbers"], eqn.outvars[0].aval.dtype)]
    new = _with_fp8_body(eqn, keep) if rewrite else eqn
    ctx = getattr(eqn, "ctx", None)
    with ctx.manager if ctx is not None else contextlib.nullcontext():
        outs = new.primitive.bind(*ins, **new.primitive.get_bind_params(new.params))
    return outs if new.primitive.multiple_results else [outs]


def _shared_inputs(jaxpr: Any, keep: frozenset[Site]) -> set:
    """The vars of ``jaxpr`` that two or more of its float8 weight matmuls (not
    those at ``keep``) take as their input (``lhs``): q/k/v's, gate/up's."""
    seen: set = set()
    shared: set = set()
    for i, eqn in enumerate(jaxpr.eqns):
        if is_weight_matmul(eqn) and (i,) not in keep and _is_var(eqn.invars[0]):
            (shared if eqn.invars[0] in seen else seen).add(eqn.invars[0])
    return shared


def _shared_dot(eqn: Any, ins: list, quantized: dict) -> jax.Array:
    """A weight matmul whose input others share, on that input quantized once
    (``quantized``: var → ``(q, scale)``, filled on first use)."""
    v = eqn.invars[0]
    if v not in quantized:
        quantized[v] = tuple(lax.stop_gradient(q) for q in quantize(ins[0], E4M3))
    ql, sl = quantized[v]
    dn, dtype = eqn.params["dimension_numbers"], eqn.outvars[0].aval.dtype
    return _fp8_dot_shared(ins[0], ql, sl, ins[1], dn, dtype)


def _run(
    jaxpr: Any,
    consts: list,
    *args: Any,
    histories: Iterator | None = None,
    keep: frozenset[Site] = frozenset(),
) -> list:
    """Evaluate ``jaxpr`` on ``args`` with every weight matmul but those at ``keep``
    run by :func:`fp8_dot` (with ``histories``, the amax histories in :func:`_sites`
    order: by :func:`fp8_dot_delayed`)."""
    env: dict = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    shared = _shared_inputs(jaxpr, keep) if histories is None else set()
    quantized: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [read(v) for v in eqn.invars]
        at = _at(keep, i)
        outs = _delayed_eqn(eqn, ins, histories, at) if histories is not None else None
        if outs is None and is_weight_matmul(eqn) and eqn.invars[0] in shared and () not in at:
            outs = [_shared_dot(eqn, ins, quantized)]
        if outs is None:
            outs = _current_eqn(eqn, ins, rewrite=histories is None, keep=at)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def fp8_loss(loss_fn: Callable, scaling: str = "current", exclude: Sequence[str] = ()) -> Callable:
    """``loss_fn`` with every weight matmul run in float8 (module docstring): traced
    for the arguments of each call and re-run equation by equation; the model is
    not edited.

    Args:
      loss_fn: ``loss_fn(*args)``.
      scaling: ``"current"``: by :func:`fp8_dot` (each operand by its own amax);
        the result takes ``loss_fn``'s arguments. ``"delayed"``: by
        :func:`fp8_dot_delayed`; the result takes the amax histories first,
        ``f(state, *args)`` with ``state`` from :func:`fp8_state`, and the
        gradient of ``f`` with respect to ``state`` is the next step's state.
      exclude: weight matmuls left in the loss's own dtype, by name
        (:data:`~spmdkit.step.recipe.EXCLUDABLE`): ``("lm_head",)`` keeps :func:`lm_heads` out of
        float8 (what ``Recipe(compute_dtype="float8")`` passes by default).

    Raises:
      SpmdError: ``scaling`` is neither; a name in ``exclude`` that is not
        excludable; a delayed ``state`` that is not :func:`fp8_state`'s for these
        arguments (and ``exclude``).

    Example::

        >>> jax.grad(fp8_loss(loss))(params, batch)  # float8 matmuls, grads in params' dtype
        >>> f = fp8_loss(loss, "delayed"); state = fp8_state(loss, params, batch)
        >>> grads, state = jax.grad(f, argnums=(1, 0))(state, params, batch)
    """
    if scaling not in SCALINGS:
        raise SpmdError(
            op="fp8_loss",
            must=f"scaling is one of {SCALINGS}",
            given=repr(scaling),
            fix="pass scaling='current' or 'delayed'",
        )
    exclude = check_exclude(exclude, "fp8_loss")

    @functools.wraps(loss_fn)
    def wrapped(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(loss_fn, return_shape=True)(*args)
        keep = _kept(closed.jaxpr, exclude)
        flat = _run(closed.jaxpr, list(closed.consts), *jax.tree.leaves(args), keep=keep)
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    @functools.wraps(loss_fn)
    def delayed(state: Any, *args: Any) -> Any:
        closed, shape = jax.make_jaxpr(loss_fn, return_shape=True)(*args)
        keep = _kept(closed.jaxpr, exclude)
        want = _state_shapes(closed.jaxpr, _history_length(state), keep)
        got = {k: tuple(jnp.shape(v)) for k, v in dict(state).items()}
        if got != want:
            raise SpmdError(
                op="fp8_loss(scaling='delayed')",
                must="the state holds one amax history per weight matmul of the loss "
                "(fp8_state's for these arguments)",
                given=f"{len(got)} histories for {len(want)} weight matmuls",
                fix="make the state with spmdkit.step.fp8.fp8_state(loss_fn, *args, "
                "exclude=...) with the exclude of the loss",
            )
        hs = iter([state[k] for k in sorted(want)])
        leaves = jax.tree.leaves(args)
        flat = _run(closed.jaxpr, list(closed.consts), *leaves, histories=hs, keep=keep)
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    return delayed if scaling == "delayed" else wrapped


def _history_length(state: Any) -> int:
    shapes = [jnp.shape(v) for v in dict(state).values()]
    return shapes[0][-1] if shapes else HISTORY


def _state_shapes(
    jaxpr: Any, history: int, keep: frozenset[Site] = frozenset()
) -> dict[str, tuple[int, ...]]:
    sites = _jaxpr_sites(jaxpr, keep)
    return {f"{STATE_PREFIX}{i:04d}": (*s, 3, history) for i, s in enumerate(sites)}


def _unsharded(x: Any) -> Any:
    """An array leaf as a shape struct with no sharding (the matmuls a loss runs do
    not depend on layouts; tracing sharded arrays could trip explicit axes)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def fp8_state(
    loss_fn: Callable, *args: Any, history: int = HISTORY, exclude: Sequence[str] = ()
) -> dict[str, jax.Array]:
    """The initial state of ``fp8_loss(loss_fn, "delayed", exclude)`` for ``args``
    (arrays or ``jax.ShapeDtypeStruct``): per float8 weight matmul (those
    ``exclude`` leaves out have none), in the order the loss runs them, a
    ``float32[..., 3, history]`` amax history of zeros (rows lhs, rhs, output
    gradient; a leading dim per layer scan it runs in), keyed ``"fp8_amax_0000"``,
    ``"fp8_amax_0001"``, ... (:data:`STATE_PREFIX`). A float32 array per history:
    it is replicated under every layout (a few KiB) and checkpoints as any other
    state.

    Example::

        >>> state = fp8_state(loss, params, batch)  # {"fp8_amax_0000": zeros((L, 3, 16)), ...}
    """
    exclude = check_exclude(exclude, "fp8_state")
    jaxpr = jax.make_jaxpr(loss_fn)(*jax.tree.map(_unsharded, args)).jaxpr
    shapes = _state_shapes(jaxpr, history, _kept(jaxpr, exclude))
    return {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}


# -- the pass -----------------------------------------------------------------------


def float8_matmuls(step: Step) -> Step:
    """The float8 pass: under ``Recipe(compute_dtype="float8")`` the loss with its
    weight matmuls on float8 operands (:func:`fp8_loss`); with delayed scaling the
    loss takes the amax histories after the batch, as state (``fn(params, batch,
    histories, *rest)``). Other recipes leave the loss as it is.

    Raises:
      RecipeError: delayed scaling with a loss that carries state of its own, or
        with a pipelined plan.
    """
    recipe = step.recipe
    if recipe.fp8_scaling == "delayed":
        f8 = fp8_loss(step.fn, recipe.fp8_scaling, recipe.fp8_exclude)
        _check_delayed(step.loss, step.pipeline)
        return replace(step, fn=lambda p, b, state, *r: f8(state, p, b, *r))
    if recipe.compute_dtype == "float8":
        return replace(step, fn=fp8_loss(step.fn, recipe.fp8_scaling, recipe.fp8_exclude))
    return step


def _check_delayed(loss: Loss, pipe: Pipeline | None) -> None:
    """Delayed float8 scaling's state is the step's only state, and the step is
    not pipelined."""
    if loss.has_state or pipe is not None:
        what = "mutable model state" if loss.has_state else f"a pipeline ({pipe!r})"
        raise RecipeError(
            op="sk.value_and_grad",
            must="with fp8_scaling='delayed' the loss carries no mutable model state of "
            "its own and the plan has no pipeline (the amax histories are the step's state)",
            given=f"{loss!r} with {what}",
            fix="use Recipe(compute_dtype='float8') (current scaling), which needs no state",
        )
