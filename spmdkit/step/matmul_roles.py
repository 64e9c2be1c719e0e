"""The roles of a layer's weight matmuls, for models that tag nothing.

MaxText's recompute policies (:data:`spmdkit.step.recipe.NAMED_POLICIES`) keep
values by their ``jax.ad_checkpoint.checkpoint_name`` tags (``query_proj``,
``out_proj``, ``mlpwo``, ...); the reference models tag them. A layer that tags
nothing gets the same names from what its traced body computes, so
``save_qkv_proj`` keeps the same values on it as on a tagged copy:

- a *weight matmul* is a ``dot_general`` of floating operands with no batch
  dimensions (a projection: :func:`spmdkit.step.fp8.is_weight_matmul`);
- *attention* is an equation whose body holds a batched ``dot_general`` (a
  ``custom_vjp`` kernel, an spmdkit attention region, a call); without one, the
  batched dots of two activations (values computed from the layer's carry). A
  batched dot with a weight operand (a mixture of experts' expert matmuls) keeps
  no tag, nor do the batched dots beside an attention kernel (token routing);
- the *Q/K/V projections* are the weight matmuls whose results reach attention's
  operands through anything but another matmul (a bias, a reshape, rotary
  embedding): ``query_proj``, ``key_proj`` and ``value_proj`` by the operand they
  reach (a kernel's first three operands; of two batched dots, the scores' two
  and the other one's), ``qkv_proj`` for one matmul that reaches several (a fused
  projection);
- the *out projection* (``out_proj``) is a weight matmul attention's result
  reaches the same way;
- the others are the MLP, by position: one whose result reaches another of them
  is an input projection (``mlpwi``; ``mlpwi_0``, ``mlpwi_1``, ... in program
  order when there are several, as a gated MLP's), the rest output projections
  (``mlpwo``).

Only the layer body's own equations are read (a matmul inside a nested call keeps
no tag), and a body that tags anything is left as it is.

A *matmul role* is what a weight matmul does in its layer; spmdkit's two other
"roles" are an argument's part in a step (``params``, ``batch``...:
:data:`spmdkit.compile.ROLES`, what ``sk.jit`` lays out by) and a mesh axis's part
in a preset (``data``, ``fsdp``, ``model``, ``expert``: :mod:`spmdkit.planner.logical`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.extend.core as jex
from jax.ad_checkpoint import checkpoint_name

from spmdkit import jaxprs
from spmdkit.step.fp8 import is_weight_matmul

__all__ = ["matmul_roles", "with_roles"]

_QKV = ("query_proj", "key_proj", "value_proj")


def _is_batched_dot(eqn: Any) -> bool:
    if eqn.primitive.name != "dot_general":
        return False
    (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    return bool(lhs_batch)


def _attends(eqn: Any) -> bool:
    return _is_batched_dot(eqn) or eqn.params.get("op") == "attention"


def _is_attention(eqn: Any, active: set) -> bool:
    """A batched dot of two activations (``active``: the values computed from the
    carry), an spmdkit attention region, or a call whose body holds either."""
    if _is_batched_dot(eqn):
        return all(v in active for v in eqn.invars)
    return _attends(eqn) or any(
        _attends(e) for sub in jaxprs.sub_jaxprs(eqn) for e, _ in jaxprs.walk_eqns(sub)
    )


def _activations(jaxpr: Any, carry: range) -> set:
    """The values of ``jaxpr`` computed from its invars at ``carry``."""
    active = {jaxpr.invars[i] for i in carry}
    for eqn in jaxpr.eqns:
        if any(v in active for v in eqn.invars if not isinstance(v, jex.Literal)):
            active.update(eqn.outvars)
    return active


def _tags_anything(jaxpr: Any) -> bool:
    return any(e.primitive.name == "name" for e, _ in jaxprs.walk_eqns(jaxpr))


class _Flow:
    """Where each value of a jaxpr flows: the first matmuls and attention
    equations it reaches through the others."""

    def __init__(self, jaxpr: Any, stops: set[int]) -> None:
        self.eqns = jaxpr.eqns
        self.stops = stops
        self.users: dict[Any, list[tuple[int, int]]] = {}
        for i, eqn in enumerate(self.eqns):
            for pos, v in enumerate(eqn.invars):
                if not isinstance(v, jex.Literal):
                    self.users.setdefault(v, []).append((i, pos))

    def reach(self, i: int) -> set[tuple[int, int]]:
        """``(equation, operand)`` pairs of the stops equation ``i``'s results reach."""
        hits: set[tuple[int, int]] = set()
        seen: set[int] = {i}
        frontier = list(self.eqns[i].outvars)
        while frontier:
            for j, pos in self.users.get(frontier.pop(), ()):
                if j in self.stops:
                    hits.add((j, pos))
                elif j not in seen:
                    seen.add(j)
                    frontier.extend(self.eqns[j].outvars)
        return hits


def matmul_roles(jaxpr: Any, carry: range) -> dict[int, str]:
    """``{equation index: tag}`` for the weight matmuls of a layer body (module
    docstring; ``carry``: the invars that carry the activations); empty when the
    body tags anything or has no weight matmul.

    Example::

        >>> matmul_roles(scan.jaxpr, range(scan.num_consts, scan.first_xs))  # untagged Llama
        {1: 'query_proj', 2: 'key_proj', 3: 'value_proj', 9: 'out_proj', 12: 'mlpwi_0', ...}
    """
    jaxpr = jaxprs.open_jaxpr(jaxpr)[0]
    if _tags_anything(jaxpr):
        return {}
    eqns = jaxpr.eqns
    mm = [i for i, e in enumerate(eqns) if is_weight_matmul(e)]
    active = _activations(jaxpr, carry)
    attn = [i for i, e in enumerate(eqns) if not is_weight_matmul(e) and _is_attention(e, active)]
    kernels = [i for i in attn if not _is_batched_dot(eqns[i])]
    attn = kernels or attn  # a kernel is the attention; other batched dots route (MoE)
    flow = _Flow(jaxpr, set(mm) | set(attn))
    dots = [i for i in attn if _is_batched_dot(eqns[i])]

    def operand(j: int, pos: int) -> str | None:
        if j in dots:  # the first batched dot is the scores' (q, k), a later one takes v
            return _QKV[pos] if j == dots[0] else "value_proj"
        return _QKV[pos] if pos < 3 else None

    roles: dict[int, str] = {}
    for i in mm:
        got = {operand(j, pos) for j, pos in flow.reach(i) if j in attn} - {None}
        if got:
            roles[i] = got.pop() if len(got) == 1 else "qkv_proj"
    for a in attn:
        for j, _ in flow.reach(a):
            if j in mm and j not in roles:
                roles[j] = "out_proj"
    rest = [i for i in mm if i not in roles]
    wi = [i for i in rest if any(j in rest for j, _ in flow.reach(i))]
    for n, i in enumerate(wi):
        roles[i] = "mlpwi" if len(wi) == 1 else f"mlpwi_{n}"
    roles.update({i: "mlpwo" for i in rest if i not in wi})
    return roles


def with_roles(scan: jaxprs.Scan) -> Any:
    """The body of a layer scan (closed jaxpr) computing what its body does with
    each weight matmul's result tagged with its role (:func:`matmul_roles`), or
    its body itself when it tags anything or has no weight matmul.

    Example::

        >>> body = with_roles(jaxprs.scan(layer_eqn))  # save_qkv_proj keeps its Q/K/V
    """
    jaxpr, consts = scan.jaxpr, list(scan.consts)
    roles = matmul_roles(jaxpr, range(scan.num_consts, scan.first_xs))
    if not roles:
        return scan.body

    def run(*args: Any) -> list:
        env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jex.Literal) else env[v]

        for i, eqn in enumerate(jaxpr.eqns):
            params = eqn.primitive.get_bind_params(eqn.params)
            # older jax returned (subfuns, params)
            subfuns, params = params if isinstance(params, tuple) else ((), params)
            ctx = getattr(eqn, "ctx", None)
            with ctx.manager if ctx is not None else contextlib.nullcontext():
                outs = eqn.primitive.bind(*subfuns, *[read(v) for v in eqn.invars], **params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
            if i in roles:
                outs = [checkpoint_name(outs[0], roles[i])]
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    avals = [
        jax.ShapeDtypeStruct(
            v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False)
        )
        for v in jaxpr.invars
    ]
    return jax.make_jaxpr(run)(*avals)
