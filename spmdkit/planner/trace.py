"""The step trace: a model's train step traced once, abstractly, and what the
cost model reads from it.

:func:`trace_step` traces the loss's value and grad (no FLOPs run, no device
memory) and measures the FLOPs, the optimizer state, the batch dims and the
layer scan's facts (:func:`~spmdkit.pipeline.layer_scan.find_layer_scan`: the
carry, the weight-matmul outputs, ``checkpoint_name`` bytes, attention FLOPs),
memoized on the ``ModelInfo``. :func:`train_step` is the step the planner
propagates, the very function ``sk.train_step`` builds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn

from spmdkit import jaxprs
from spmdkit.engine.region import FORWARD, REGIONS, forward_fn, grad_fn
from spmdkit.introspect.model import ModelInfo, unbound_axis_error
from spmdkit.pipeline.layer_scan import find_layer_scan
from spmdkit.planner.analytic import StepTrace
from spmdkit.planner.experts import MoeCall
from spmdkit.planner.plans import PyTree
from spmdkit.planner.step_terms import PolicyFacts
from spmdkit.state import cached
from spmdkit.step.fp8 import fp8_loss, lm_head_operands, lm_heads
from spmdkit.step.master import opt_init, stored_dtype, stored_params
from spmdkit.step.matmul_roles import with_roles
from spmdkit.step.recipe import PLAIN, Recipe, checkpoint_policy
from spmdkit.util import CONTRACTIONS, contraction_flops, path_str

if TYPE_CHECKING:
    from optax import GradientTransformation

__all__ = [
    "trace_step",
    "train_step",
]


# -- tracing (once per model) -------------------------------------------------------------


def _eqn_flops(eqn: JaxprEqn) -> float:
    name = eqn.primitive.name
    if name not in CONTRACTIONS:
        return 0.0
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    return contraction_flops(name, eqn.params, lhs, rhs, eqn.outvars[0].aval.shape)


def _jaxpr_flops(jaxpr: Jaxpr, *, batched_only: bool = False) -> float:
    """Contraction FLOPs of a jaxpr, scans unrolled (``batched_only``: only dots
    with batch dims, i.e. attention's scores and values, outside the regions of
    :data:`_WEIGHT_REGIONS`)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if not batched_only or (eqn.primitive.name == "dot_general" and _is_batched_dot(eqn)):
            total += _eqn_flops(eqn)
        if batched_only and _weight_region(eqn):
            continue
        mult = jaxprs.scan_length(eqn)
        for sub in _eqn_subs(eqn):
            total += mult * _jaxpr_flops(sub, batched_only=batched_only)
    return total


#: Composite ops whose unsharded computation contracts weights with batched dots
#: (``moe_experts``' reference gathers each assignment's expert weights, a dot
#: batched over the tokens): their FLOPs are the weights' (priced per parameter
#: group, as grouped GEMMs), not attention's.
_WEIGHT_REGIONS = frozenset({"moe_experts"})


def _weight_region(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is a region of one of :data:`_WEIGHT_REGIONS`."""
    return eqn.primitive.name in REGIONS and eqn.params["op"] in _WEIGHT_REGIONS


def _eqn_subs(eqn: JaxprEqn) -> Iterable[Jaxpr]:
    """The jaxprs inside an equation: its parameters' (scan, call, custom_vjp), or
    for a composite op's region the unsharded computation it stands for (so the
    attention region's dots count as the model's attention FLOPs, its grad region's
    recomputed forward included)."""
    for sub in jaxprs.sub_jaxprs(eqn):
        yield jaxprs.open_jaxpr(sub)[0]
    if eqn.primitive.name in REGIONS:
        avals = tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.invars)
        p = eqn.params
        yield _region_jaxpr(eqn.primitive.name, p["op"], p["attrs"], p.get("diff"), avals)


@cached(maxsize=256, why="a region traced abstractly for the planner's FLOP and residual counts.")
def _region_jaxpr(prim: str, op: str, attrs: Any, diff: Any, avals: tuple) -> Jaxpr:
    fn = forward_fn(op, dict(attrs)) if prim == FORWARD else grad_fn(op, dict(attrs), diff)
    return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(s, d) for s, d in avals)).jaxpr


def _expert_top_k(jaxpr: Jaxpr, tokens: int) -> dict[int, float]:
    """Expert count → experts each token is routed to, read from the traced forward:
    the ``k`` of a ``top_k`` over that many entries (a router choosing its experts),
    else the rows per token a grouped GEMM (``ragged_dot_general``) over that many
    groups multiplies (a dropless MoE sends ``tokens · k`` rows into its experts).
    Scans, calls and op regions are looked into; the largest ``k`` of each count is
    kept."""
    top: dict[int, float] = {}
    rows: dict[int, float] = {}
    stack = [jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            name = eqn.primitive.name
            if name == "top_k":
                shape = eqn.invars[0].aval.shape
                e = int(shape[eqn.params.get("axis", len(shape) - 1)])
                top[e] = max(top.get(e, 0.0), float(eqn.params["k"]))
            elif name == "ragged_dot_general" and tokens > 0:
                dn = eqn.params["ragged_dot_dimension_numbers"]
                if len(dn.rhs_group_dimensions) == 1:  # the forward (or the lhs cotangent)
                    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
                    (contract, _), _ = dn.dot_dimension_numbers
                    g = int(rhs[dn.rhs_group_dimensions[0]])
                    per = math.prod(lhs) / max(math.prod(lhs[d] for d in contract), 1) / tokens
                    rows[g] = max(rows.get(g, 0.0), per)
            stack.extend(_eqn_subs(eqn))
    return {**rows, **top}


def _optimizer(optimizer: GradientTransformation | None) -> GradientTransformation:
    import optax  # loaded on first plan, not on ``import spmdkit``

    return optimizer if optimizer is not None else optax.adam(1e-3)


def _batch_dims(info: ModelInfo) -> tuple[int, int, int]:
    """``(batch size, seq length, tokens)`` from the first batch field's logical names."""
    leaves = jax.tree_util.tree_flatten_with_path(info.batch)[0]
    if not leaves:
        return 1, 1, 1
    kp, leaf = leaves[0]
    names = info.batch_axes.get(path_str(kp)) or ("batch",)
    shape = tuple(leaf.shape)
    batch = seq = 1
    tokens = 1
    for n, s in zip(names, shape, strict=False):
        if n == "batch":
            batch = s
        if n == "seq":
            seq = s
        if n in ("batch", "seq", "height", "width"):
            tokens *= s
    return batch, seq, max(tokens, 1)


def _nbytes(x: jax.ShapeDtypeStruct) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def _opt_bytes(info: ModelInfo, abstract_opt: PyTree) -> tuple[dict[str, int], int]:
    """Optimizer-state bytes per param path (leaves whose path ends with the
    param's and have its shape), and the bytes of the other leaves."""
    paths = [p.path for p in info.params]
    shapes = {p.path: p.shape for p in info.params}
    opt_bytes: dict[str, int] = dict.fromkeys(paths, 0)
    other = 0
    for kp, leaf in jax.tree_util.tree_flatten_with_path(abstract_opt)[0]:
        lp = path_str(kp)
        match = None
        for p in paths:
            hit = (lp == p or lp.endswith("/" + p)) and shapes[p] == tuple(leaf.shape)
            if hit and (match is None or len(p) > len(match)):
                match = p
        if match is None:
            other += _nbytes(leaf)
        else:
            opt_bytes[match] += _nbytes(leaf)
    return opt_bytes, other


class _LayerScan(NamedTuple):
    """What the model's layer scan tells the remat model (global batch)."""

    layers: int
    carry: float
    dots: float
    named: dict[str, float]
    named_flops: dict[str, float]
    fwd_flops: float


class _Body(NamedTuple):
    """One scan body's facts (:func:`_body_facts`)."""

    dots: float
    named: dict[str, float]
    named_flops: dict[str, float]
    attn: float


def _aval_bytes(v: Any) -> float:
    aval = v.aval
    return float(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)


def _is_batched_dot(eqn: JaxprEqn) -> bool:
    (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    return bool(lhs_batch)


#: What may stand between a projection's matmul and its ``checkpoint_name`` tag
#: (a bias, a cast, a head split): keeping the tagged value saves the matmul.
_TO_TAG = frozenset({"add", "convert_element_type", "reshape", "transpose", "broadcast_in_dim"})


def _tagged_matmul_flops(made: dict[Any, JaxprEqn], v: Any, depth: int = 4) -> float:
    """FLOPs of the weight matmul a tagged value comes from (0: none found
    within ``depth`` equations of :data:`_TO_TAG`)."""
    eqn = made.get(v)
    if eqn is None or depth == 0:
        return 0.0
    if eqn.primitive.name == "dot_general" and not _is_batched_dot(eqn):
        return _eqn_flops(eqn)
    if eqn.primitive.name not in _TO_TAG:
        return 0.0
    return max((_tagged_matmul_flops(made, u, depth - 1) for u in eqn.invars), default=0.0)


def _body_facts(jaxpr: Jaxpr) -> _Body:
    """Weight-matmul output bytes, ``checkpoint_name`` bytes and the FLOPs of the
    matmuls the tags name, and batched-dot FLOPs of one scan body (nested calls
    and scans included)."""
    dots = attn = 0.0
    named: dict[str, float] = {}
    named_flops: dict[str, float] = {}
    made = {o: e for e in jaxpr.eqns for o in e.outvars}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            if _is_batched_dot(eqn):
                attn += _eqn_flops(eqn)
            else:
                dots += _aval_bytes(eqn.outvars[0])
        elif name == "name" and "name" in eqn.params:
            tag = str(eqn.params["name"])
            named[tag] = named.get(tag, 0.0) + _aval_bytes(eqn.outvars[0])
            flops = _tagged_matmul_flops(made, eqn.invars[0])
            named_flops[tag] = named_flops.get(tag, 0.0) + flops
        mult = jaxprs.scan_length(eqn)
        for sub in _eqn_subs(eqn):
            inner = _body_facts(sub)
            dots += mult * inner.dots
            attn += 0.0 if _weight_region(eqn) else mult * inner.attn
            for into, got in ((named, inner.named), (named_flops, inner.named_flops)):
                for k, v in got.items():
                    into[k] = into.get(k, 0.0) + mult * v
    return _Body(dots, named, named_flops, attn)


def _layer_scan(jaxpr: Jaxpr) -> tuple[_LayerScan | None, float]:
    """The facts of the layer scan in a forward jaxpr
    (:func:`~spmdkit.pipeline.layer_scan.find_layer_scan`, the scan the pipeline
    split and the recompute rewrite take) and the batched-dot FLOPs of the forward."""
    layer = find_layer_scan(jaxpr)
    best: _LayerScan | None = None
    attn_total = 0.0
    stack = [jaxpr]
    while stack:
        j = stack.pop()
        for eqn in j.eqns:
            if eqn.primitive.name == "dot_general" and _is_batched_dot(eqn):
                attn_total += _eqn_flops(eqn)
            if eqn.primitive.name != "scan":
                stack.extend(() if _weight_region(eqn) else _eqn_subs(eqn))
                continue
            sc = jaxprs.scan(eqn)
            body, length = sc.jaxpr, sc.length
            flops = length * _jaxpr_flops(body)
            facts = _body_facts(body)
            attn_total += length * facts.attn
            carry = sum(_aval_bytes(v) for v in body.invars[sc.num_consts : sc.first_xs])
            if layer is not None and eqn is layer.eqn:
                best = _LayerScan(length, carry, facts.dots, facts.named, facts.named_flops, flops)
    return best, attn_total


#: Attention implementations that run a fused kernel on a GPU (cuDNN's flash
#: attention; "auto" picks it where cuDNN accepts the inputs).
_FUSED = ("auto", "cudnn", None)


class _Regions(NamedTuple):
    """The traced forward's attention regions (scans unrolled): forward FLOPs (full
    square) of those that run a fused kernel on a GPU and of the causal ones among
    them, the bytes of every region's keys and values, and, of the regions that run
    no fused kernel (plain and blockwise attention), their forward FLOPs and the
    elements of their score matrices (``b·h·Sq·Sk``), which XLA writes to and reads
    from device memory, and of those a region materializes at once (plain attention
    its whole matrix, the blockwise version one key block's ``b·h·Sq·block``)."""

    fused: float = 0.0
    causal: float = 0.0
    kv: float = 0.0
    plain: float = 0.0
    scores: float = 0.0
    live: float = 0.0


def _fused_attention(jaxpr: Jaxpr, mult: float = 1.0) -> _Regions:
    """The attention regions of ``jaxpr`` (:class:`_Regions`), each ``mult`` times."""
    fused = causal = kv = plain = scores = live = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == FORWARD and eqn.params["op"] == "attention":
            attrs = dict(eqn.params["attrs"])
            kv += mult * sum(_aval_bytes(v) for v in eqn.invars[1:3])
            sub = list(_eqn_subs(eqn))[-1]  # the region's unsharded computation
            flops = mult * _jaxpr_flops(sub, batched_only=True)
            if attrs.get("implementation") in _FUSED:
                fused += flops
                causal += flops if attrs.get("causal") else 0.0
            else:
                q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
                plain += flops
                scores += mult * math.prod(q[:-1]) * k[1]
                block = k[1] if attrs.get("implementation") == "xla" else attrs.get("block_size")
                live += mult * math.prod(q[:-1]) * min(k[1], block or k[1])
            continue
        n = jaxprs.scan_length(eqn)
        for sub in jaxprs.sub_jaxprs(eqn):
            r = _fused_attention(jaxprs.open_jaxpr(sub)[0], mult * n)
            fused, causal, kv = fused + r.fused, causal + r.causal, kv + r.kv
            plain, scores, live = plain + r.plain, scores + r.scores, live + r.live
    return _Regions(fused, causal, kv, plain, scores, live)


def _layer_policy(scan: jaxprs.Scan) -> Callable[[Recipe], PolicyFacts]:
    """``recipe -> PolicyFacts`` of one layer (the layer scan's ``body``), memoized:
    the body under ``jax.checkpoint`` with the recipe's policy, differentiated
    abstractly. What its forward hands the backward, less its own inputs, is
    what the policy keeps (an offloaded value is ``f32<host>``); the backward's
    contraction FLOPs beyond the plain layer's are what it recomputes."""
    body = scan.body
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in body.in_avals]
    memo: dict[tuple, PolicyFacts] = {}

    def backward_flops(policy: Any, body: Any = body) -> tuple[float, float]:
        fn = jax.extend.core.jaxpr_as_fun(body)
        if policy is not None:
            fn = jax.checkpoint(fn, policy=policy, prevent_cse=False)

        def step(*args: Any) -> Any:
            out, pull = jax.vjp(fn, *args)
            return pull(jax.tree.map(jax.numpy.zeros_like, out))

        jaxpr = jax.make_jaxpr(step)(*avals).jaxpr
        return _jaxpr_flops(jaxpr), _jaxpr_flops(jaxpr, batched_only=True)

    def kept(policy: Any, body: Any) -> tuple[float, float]:
        fn = jax.checkpoint(jax.extend.core.jaxpr_as_fun(body), policy=policy, prevent_cse=False)
        jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(*avals).jaxpr
        inputs = set(jaxpr.invars)
        device = host = 0.0
        for v in jaxpr.outvars:
            if isinstance(v, jax.extend.core.Literal) or v in inputs:
                continue
            if "host" in str(getattr(v.aval, "memory_space", "")).lower():
                host += _aval_bytes(v)
            else:
                device += _aval_bytes(v)
        return device, host

    def facts(recipe: Recipe) -> PolicyFacts:
        key = (recipe.remat, recipe.saved_names, recipe.remat_offload)  # not dtype, ...
        hit = memo.get(key)
        if hit is None:
            policy = checkpoint_policy(recipe)
            # names on a model that tags nothing: its matmuls tagged by role, as
            # the step runs them (spmdkit.step.remat_scan.remat_loss)
            tagged = with_roles(scan) if recipe.saved_names else body
            plain_mm, plain_attn = memo_plain()
            mm, attn = backward_flops(policy, tagged)
            hit = memo[key] = PolicyFacts(
                *kept(policy, tagged), max(mm - attn - plain_mm, 0.0), max(attn - plain_attn, 0.0)
            )
        return hit

    @functools.cache
    def memo_plain() -> tuple[float, float]:
        mm, attn = backward_flops(None)
        return mm - attn, attn

    return facts


def _activation_residuals(fn: Callable, scan: jaxprs.Scan) -> float:
    """Bytes of what the layer ``fn`` (a scan body, ``scan``'s operand layout)
    hands its backward pass (``jax.vjp``) that are computed from its input, the
    scan carry: its activations, not its weights nor their float8 copies (those
    are priced as the compute-dtype copy of the parameters)."""
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in scan.body.in_avals]
    jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(*avals).jaxpr
    live = set(jaxpr.invars[scan.num_consts : scan.first_xs])
    for eqn in jaxpr.eqns:
        if any(_is_var(v) and v in live for v in eqn.invars):
            live.update(eqn.outvars)
    outs = dict.fromkeys(v for v in jaxpr.outvars if _is_var(v))
    return sum(_aval_bytes(v) for v in outs if v in live and v not in jaxpr.invars)


def _is_var(v: Any) -> bool:
    return not isinstance(v, jax.extend.core.Literal)


def _bf16(x: Any) -> Any:
    floating = jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
    return x.astype(jax.numpy.bfloat16) if floating else x


def _float8_share(info: ModelInfo) -> Callable[[], float]:
    """``() -> share`` (memoized): the bytes one layer keeps for its backward pass
    with no recompute under ``Recipe(compute_dtype="float8")``, over those it keeps
    in bfloat16. Measured on the layer scan's body of the loss traced on bfloat16
    parameters (as the step casts them), as it runs and as ``spmdkit.step.fp8``
    rewrites it: each weight matmul keeps its float8 (e4m3) input, 1 byte an
    element, for the backward's two GEMMs, so a bfloat16 value only matmuls read
    is not kept (a norm's output, attention's output, the MLP's gated product);
    values other backward ops read stay (Llama 3 70B: 0.83 of the bfloat16
    bytes; q/k/v's and gate/up's shared inputs are quantized and kept once).
    Under a remat policy the float8 step keeps what bfloat16's does (the policy
    saves the GEMMs' bfloat16 outputs or the named values, and the float8 inputs
    are recomputed): the share prices a layer's full residual set only
    (:func:`spmdkit.planner.float8.layer_residuals`)."""

    @functools.cache
    def share() -> float:
        args = info.trace_args()
        cast = jax.make_jaxpr(lambda p, *r: info.scalar_loss(jax.tree.map(_bf16, p), *r))
        layer = find_layer_scan(cast(*args).jaxpr)
        if layer is None:
            return 1.0
        body = jax.extend.core.jaxpr_as_fun(layer.scan.body)
        bf16 = _activation_residuals(body, layer.scan)
        fp8 = _activation_residuals(fp8_loss(body), layer.scan)
        return fp8 / bf16 if bf16 > 0 else 1.0

    return share


def _moe_calls(jaxpr: Jaxpr) -> dict[int, MoeCall]:
    """Expert count → its ``moe_experts`` call (:class:`~spmdkit.planner.experts.MoeCall`),
    read from the traced forward's regions (scans' trip counts multiply the calls)."""
    out: dict[int, MoeCall] = {}
    stack = [(jaxpr, 1.0)]
    while stack:
        sub, mult = stack.pop()
        for eqn in sub.eqns:
            if eqn.primitive.name == FORWARD and eqn.params["op"] == "moe_experts":
                x, idx, _, wg = (v.aval for v in eqn.invars[:4])
                e, d, f = (int(n) for n in wg.shape)
                seen = out.get(e)
                attrs = dict(eqn.params["attrs"])
                groups = attrs.get("expert_groups")
                out[e] = MoeCall(
                    e,
                    int(x.shape[0]),
                    int(idx.shape[1]),
                    d,
                    f,
                    np.dtype(x.dtype).itemsize,
                    mult + (seen.calls if seen else 0.0),
                    attrs.get("strategy"),
                    tuple(groups) if groups is not None else None,
                )
                continue
            stack.extend((j, mult * jaxprs.scan_length(eqn)) for j in _eqn_subs(eqn))
    return out


def _trace_step(info: ModelInfo, optimizer: GradientTransformation | None) -> StepTrace:
    args = info.trace_args()
    try:
        closed = jax.make_jaxpr(jax.value_and_grad(info.scalar_loss))(*args)
    except NameError as e:
        raise (unbound_axis_error(e, "plan") or e) from e
    forward = jax.make_jaxpr(info.scalar_loss)(*args)

    def residuals(p: PyTree, b: PyTree, *state: PyTree) -> Callable:
        return jax.vjp(lambda p, b: info.scalar_loss(p, b, *state), p, b)[1]

    resid = jax.eval_shape(residuals, *args)
    resid_bytes = sum(_nbytes(x) for x in jax.tree.leaves(resid))
    param_bytes = sum(p.nbytes for p in info.params)
    batch_bytes = sum(_nbytes(x) for x in jax.tree.leaves(info.batch))
    abstract_opt = jax.eval_shape(_optimizer(optimizer).init, info.abstract_params)
    opt_bytes, other = _opt_bytes(info, abstract_opt)
    batch, seq, tokens = _batch_dims(info)
    dtypes = [np.dtype(p.dtype).itemsize for p in info.params if len(p.shape) >= 2]
    scan, attn_fwd = _layer_scan(forward.jaxpr)
    layer_resid = peak = 0.0
    if scan is not None:
        # Residuals stacked by the layer scan lead with its length; the stacked
        # parameters are among them (counted as parameters, not activations).
        stacked = sum(
            _nbytes(x) for x in jax.tree.leaves(resid) if x.ndim >= 2 and x.shape[0] == scan.layers
        )
        stacked_params = sum(p.nbytes for p in info.params if p.shape and p.shape[0] == scan.layers)
        layer_resid = max(stacked - stacked_params, 0) / scan.layers
        # The largest residual outside the layers (the logits) is live twice in
        # the backward pass: itself and its gradient.
        peak = max(
            (
                _nbytes(x)
                for x in jax.tree.leaves(resid)
                if not (x.ndim >= 2 and x.shape[0] == scan.layers)
            ),
            default=0,
        )
    attn_train = _jaxpr_flops(closed.jaxpr, batched_only=True)
    regions = _fused_attention(forward.jaxpr)
    kv = regions.kv
    if not kv and seq > 1:
        # attention written as plain batched dots: its forward is two of them,
        # 4·b·s²·h·d FLOPs, over keys and values of 2·b·s·h·d elements
        kv = attn_fwd / (2.0 * seq) * (min(dtypes) if dtypes else 4)
    return StepTrace(
        flops=_jaxpr_flops(closed.jaxpr),
        resid_bytes=int(max(resid_bytes - param_bytes - batch_bytes, 0)),
        opt_bytes=opt_bytes,
        opt_other_bytes=other,
        tokens=tokens,
        batch_size=batch,
        seq_len=seq,
        act_itemsize=min(dtypes) if dtypes else 4,
        abstract_opt=abstract_opt,
        attn_flops=attn_train,
        layers=scan.layers if scan else 0,
        layer_resid=layer_resid,
        layer_carry=scan.carry if scan else 0.0,
        layer_dots=scan.dots if scan else 0.0,
        layer_named=scan.named if scan else {},
        layer_named_flops=scan.named_flops if scan else {},
        layer_fwd_flops=scan.fwd_flops if scan else 0.0,
        layer_policy=_layer_policy(find_layer_scan(forward.jaxpr).scan) if scan else None,
        layer_float8=_float8_share(info) if scan else None,
        attn_fwd_flops=attn_fwd,
        attn_fused_fwd_flops=regions.fused,
        attn_causal_fwd_flops=regions.causal,
        attn_plain_fwd_flops=regions.plain,
        attn_plain_scores=regions.scores,
        attn_plain_live=regions.live,
        attn_kv_bytes=kv,
        resid_peak=float(peak),
        state_bytes=sum(p.nbytes for p in info.state),
        lm_head_params=_lm_head_params(forward.jaxpr, args[0]),
        expert_top_k=_expert_top_k(forward.jaxpr, tokens),
        moe_calls=_moe_calls(forward.jaxpr),
        param_uses=_param_uses(forward.jaxpr, args[0]),
    )


#: Primitives that move a weight without computing on it (followed to its matmuls).
_MOVES = frozenset({"convert_element_type", "transpose", "reshape", "copy", "copy_p"})


def _lookup(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` reads rows of its first operand by index: a ``gather`` or
    an embedding traced as a region (:mod:`spmdkit.engine.region`)."""
    name = eqn.primitive.name
    return name == "gather" or (name == FORWARD and eqn.params.get("op") == "embedding")


def _param_uses(jaxpr: Jaxpr, params: PyTree) -> dict[str, int]:
    """Paths of the params two or more weight matmuls read outside the layer
    scans (through casts, transposes and reshapes, and into calls), with how many,
    and of those only gathered from there (an embedding table's lookup: rows
    read, no weight matmul), with 0 (:class:`~spmdkit.planner.analytic.StepTrace`'s
    ``param_uses``); the params lead the jaxpr's invars. A scan's body is not
    entered: a stacked weight is one use a layer."""
    paths = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    counts: dict[int, int] = {}
    gathered: set[int] = set()
    other: set[int] = set()

    def walk(jx: Jaxpr, origin: dict) -> None:
        for eqn in jx.eqns:
            ins = [origin.get(v) if _is_var(v) else None for v in eqn.invars]
            name = eqn.primitive.name
            if name in CONTRACTIONS:
                for o in {o for o in ins if o is not None}:
                    counts[o] = counts.get(o, 0) + 1
            elif name in _MOVES and ins and ins[0] is not None:
                origin[eqn.outvars[0]] = ins[0]
            elif (body := jaxprs.call_body(eqn)) is not None:
                inner = jaxprs.open_jaxpr(body)[0]
                walk(
                    inner, {b: o for b, o in zip(inner.invars, ins, strict=False) if o is not None}
                )
            else:
                if _lookup(eqn) and ins and ins[0] is not None:
                    gathered.add(ins[0])
                    ins = ins[1:]
                other.update(o for o in ins if o is not None)

    jaxpr = jaxprs.open_jaxpr(jaxpr)[0]
    walk(jaxpr, {v: i for i, v in enumerate(jaxpr.invars) if i < len(paths)})
    uses = {paths[i]: n for i, n in counts.items() if n >= 2}
    lookups = gathered - other - set(counts)
    return uses | {paths[i]: 0 for i in sorted(lookups)}


def _lm_head_params(jaxpr: Jaxpr, params: PyTree) -> frozenset[str]:
    """Paths of the params the loss's LM head reads (``spmdkit.step.fp8.lm_heads``:
    what a float8 recipe keeps in bf16 by default); the params lead the
    jaxpr's invars."""
    paths = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    found = lm_head_operands(jaxpr, lm_heads(jaxpr))
    return frozenset(paths[i] for i in found if i < len(paths))


def trace_step(info: ModelInfo, optimizer: GradientTransformation | None) -> StepTrace:
    """The model's train step traced abstractly (no FLOPs run, no device memory):
    FLOPs, residual bytes, optimizer state. Once per model and optimizer
    (``ModelInfo.memo``)."""
    return info.memo(("planner.trace", id(optimizer)), lambda: _trace_step(info, optimizer))


def step_arguments(
    info: ModelInfo, optimizer: GradientTransformation | None, recipe: Recipe
) -> tuple[PyTree, PyTree]:
    """The abstract ``(params, opt_state)`` the recipe's step takes: the model's,
    or under ``master_weights="optimizer"`` the params in bf16 and the optimizer
    state with their fp32 master in it (:func:`spmdkit.step.master.opt_init`)."""
    if stored_dtype(recipe) is None:
        return info.abstract_params, trace_step(info, optimizer).abstract_opt

    def make() -> tuple[PyTree, PyTree]:
        params = stored_params(info.abstract_params, recipe)
        return params, jax.eval_shape(opt_init(_optimizer(optimizer), recipe), params)

    return info.memo(("planner.stored", id(optimizer), stored_dtype(recipe)), make)


def train_step(
    info: ModelInfo,
    optimizer: GradientTransformation | None,
    recipe: Recipe = PLAIN,
    grad_specs: PyTree = None,
) -> Callable:
    """``train_step(params, opt_state, batch[, key]) -> (params, opt_state, value)``
    with the optimizer (default ``optax.adam``) and the recipe applied: the very
    function ``sk.train_step(info, ...)`` builds and ``sk.jit``/``train`` run
    (:func:`spmdkit.step.grad.train_step` of the model's ``train_loss``: its key an
    input when the model draws random numbers, its aux kept), so what is planned is
    what runs. A model with mutable state gets ``train_step(params, opt_state,
    state, batch[, key]) -> (params, opt_state, state, value)``.
    ``grad_specs``: the gradients' shardings when the plan shards them (ZeRO-2).
    One function per model, optimizer and recipe (``ModelInfo.memo``), so
    propagations of it share jax's trace cache. A ModelInfo built by hand (no loss
    to run) steps its ``loss_fn``."""
    from spmdkit.step.grad import train_step as recipe_step

    def make() -> Callable:
        if info.run is not None:
            return recipe_step(info, _optimizer(optimizer), recipe, grad_specs=grad_specs)
        return recipe_step(
            info.state_loss_fn if info.has_state else info.loss_fn,
            _optimizer(optimizer),
            recipe,
            grad_specs=grad_specs,
            has_state=info.has_state,
        )

    if grad_specs is not None:
        return make()
    return info.memo(("planner.step", id(optimizer), recipe), make)
