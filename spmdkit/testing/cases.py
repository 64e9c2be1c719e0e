"""One case: a rule's claim for one set of input specs, checked on every device.

A case asks the rule for its required inputs and claimed outputs, builds every
device's pieces of the *required* inputs (:mod:`spmdkit.testing.pieces`), runs
the op on them with ``shard_map``, reads the results back as the *claimed*
specs and compares them with the unsharded op (forward) or ``jax.vjp`` (grad).
:func:`check_forward_case` and :func:`check_grad_case` check one case; the
sweep (:mod:`spmdkit.testing.sweep`) prepares many with
:func:`prepare_forward_case` / :func:`prepare_grad_case` and runs them together
with :func:`run_cases`, since compiling, not running, is what a sweep spends
its time on.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.engine.inference import infer_forward, infer_grad
from spmdkit.engine.registry import get_rule, register_rule, unregister_rule
from spmdkit.engine.rule import LocalContext, Rule, without_strategy
from spmdkit.errors import NoRuleError, RegistrationError, SpmdError
from spmdkit.spec import TensorSpec, axis_sizes
from spmdkit.state import cached, register_cache
from spmdkit.testing.pieces import assemble, enumerate_specs, local_pieces, values_close
from spmdkit.util import freeze
from spmdkit.vma import shard_map

__all__ = [
    "Case",
    "CaseFailure",
    "check_forward_case",
    "check_grad_case",
    "find_missing_placement",
    "prepare_forward_case",
    "prepare_grad_case",
    "run_cases",
    "temporarily_registered",
    "unsharded_outputs",
]


@dataclass(frozen=True)
class CaseFailure:
    """A case where the rule's claim is wrong."""

    kind: str
    attrs: Mapping[str, Any]
    given: tuple[TensorSpec, ...]
    required: tuple[TensorSpec, ...]
    claimed: tuple[TensorSpec, ...]
    detail: str

    def __str__(self) -> str:
        g = ", ".join(map(str, self.given))
        r = ", ".join(map(str, self.required))
        c = ", ".join(map(str, self.claimed))
        head = f"{self.kind} {dict(self.attrs)}: given ({g}) required ({r})"
        return f"{head} claimed ({c}): {self.detail}"


def check_forward_case(
    rule: Rule | str,
    specs: Sequence[TensorSpec],
    mesh: Mesh,
    *,
    values: Sequence[np.ndarray],
    attrs: Mapping[str, Any] | None = None,
    rtol: float = 1e-5,
    domain: str = "real",
    seed: int = 0,
) -> tuple[CaseFailure | None, Any]:
    """Check one forward case; returns ``(failure or None, InferenceResult)``."""
    attrs = dict(attrs or {})
    with temporarily_registered(rule) as checked:
        ref = unsharded_outputs(checked, attrs, values)
        case = prepare_forward_case(checked, specs, mesh, values, attrs, ref, domain, seed)
        return _run_alone(case, mesh, rtol), case.res


def check_grad_case(
    rule: Rule | str,
    specs: Sequence[TensorSpec],
    out_grads: Sequence[TensorSpec],
    mesh: Mesh,
    *,
    values: Sequence[np.ndarray],
    cotangents: Sequence[np.ndarray],
    attrs: Mapping[str, Any] | None = None,
    differentiable: Sequence[bool] | None = None,
    rtol: float = 1e-5,
    domain: str = "real",
    seed: int = 0,
) -> tuple[CaseFailure | None, Any]:
    """Check one grad case against ``jax.vjp``; returns ``(failure or None, result)``.

    Each device runs the VJP of the op on its local pieces. The cotangent first
    goes back through the output's pending reduction (sum: as is; avg: divided
    by the group size; max/min: kept only where the local result is the global
    one, which the backward pass knows from the forward output).
    """
    attrs = dict(attrs or {})
    diff = tuple(differentiable or (True,) * len(specs))
    with temporarily_registered(rule) as checked:
        case = prepare_grad_case(
            checked, specs, out_grads, mesh, values, cotangents, attrs, diff, domain, seed
        )
        return _run_alone(case, mesh, rtol), case.res


# ---------------------------------------------------------------------------
# Preparing and running cases
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One case, its claim inferred and every device's arguments built,
    ready to run (``early``: the claim is already wrong, nothing to run)."""

    res: Any
    fail: Callable[[str], CaseFailure]
    early: CaseFailure | None = None
    key: tuple = ()
    grad: tuple | None = None  # (differentiable, transposes) of a grad case
    args: tuple[jax.Array, ...] = ()
    expect: tuple[np.ndarray, ...] = ()  # unsharded outputs, or grads of the diff inputs


def prepare_forward_case(
    rule: Rule,
    specs: Sequence[TensorSpec],
    mesh: Mesh,
    values: Sequence[np.ndarray],
    attrs: dict[str, Any],
    ref: Sequence[np.ndarray],
    domain: str,
    seed: int,
) -> Case:
    """A forward case ready to run: the rule's claim for ``specs`` and every device's
    pieces of ``values`` under the required specs (drawn from ``seed``); ``ref`` is the
    unsharded op's outputs. A claim that changes a shape or shards a size-1 dim fails
    early."""
    rng = np.random.default_rng(seed)
    res = infer_forward(rule.name, *specs, mesh=mesh, **attrs)
    fail = functools.partial(CaseFailure, "forward", attrs, tuple(specs), res.inputs, res.outputs)
    for s, r in zip(res.inputs, specs, strict=True):
        if s.shape != r.shape:
            return Case(res, fail, fail(f"required spec {s} changes the shape {r.shape}"))
    for o, r in zip(res.outputs, ref, strict=True):
        if o.shape != r.shape:
            return Case(res, fail, fail(f"claimed output shape {o.shape}, op gives {r.shape}"))
        if any(n == 1 and axes for n, axes in zip(o.shape, o.dims, strict=True)):
            return Case(res, fail, fail(f"claimed output {o} shards a size-1 dim"))
    pieces = tuple(
        _put_stacked(local_pieces(v, s, mesh, rng=rng, domain=domain), mesh)
        for v, s in zip(values, res.inputs, strict=True)
    )
    key = _runner_key(rule, attrs, res, mesh=mesh)
    return Case(res, fail, key=key, args=pieces, expect=tuple(ref))


def prepare_grad_case(
    rule: Rule,
    specs: Sequence[TensorSpec],
    out_grads: Sequence[TensorSpec],
    mesh: Mesh,
    values: Sequence[np.ndarray],
    cotangents: Sequence[np.ndarray],
    attrs: dict[str, Any],
    diff: tuple[bool, ...],
    domain: str,
    seed: int,
) -> Case:
    """A grad case ready to run: the grad rule's claim for ``specs`` and ``out_grads``,
    every device's pieces of the values, the cotangents and the forward outputs, and
    ``jax.vjp``'s grads of the inputs ``diff`` marks as the expected result."""
    rng = np.random.default_rng(seed)
    res = infer_grad(rule.name, *specs, out_grads=out_grads, mesh=mesh, **attrs)
    given, required = (*specs, *out_grads), (*res.inputs, *res.out_grads)
    fail = functools.partial(CaseFailure, "grad", attrs, given, required, res.outputs)
    outs_ref, grads_ref = _jitted_unsharded(rule, attrs, diff)(tuple(values), tuple(cotangents))
    sizes = axis_sizes(mesh)
    transposes = tuple(
        (
            float(math.prod(sizes[a] for a, op in fo.partial if op == "avg")),
            any(op in ("max", "min") for _, op in fo.partial),
        )
        for fo in res.forward_outputs
    )
    args = [
        _put_stacked(local_pieces(v, s, mesh, rng=rng, domain=domain), mesh)
        for v, s in zip(values, res.inputs, strict=True)
    ]
    args += [
        _put_stacked(local_pieces(c, s, mesh, rng=rng), mesh)
        for c, s in zip(cotangents, res.out_grads, strict=True)
    ]
    args += [
        _put_stacked(local_pieces(np.asarray(o), fo.without_partial(), mesh, rng=rng), mesh)
        for o, fo in zip(outs_ref, res.forward_outputs, strict=True)
    ]
    return Case(
        res,
        fail,
        key=_runner_key(rule, attrs, res, res.forward_outputs, mesh),
        grad=(diff, transposes),
        args=tuple(args),
        expect=tuple(np.asarray(g) for g in grads_ref),
    )


def run_cases(
    cases: Sequence[Case], mesh: Mesh, rtol: float | Sequence[float]
) -> list[CaseFailure | None]:
    """Every case's failure or None; the cases that run, run together
    (:func:`_run_together`). ``rtol``: one tolerance, or each case's."""
    rtols = [rtol] * len(cases) if isinstance(rtol, (int, float)) else list(rtol)
    if len(rtols) != len(cases):
        raise ValueError(f"run_cases: {len(cases)} cases but {len(rtols)} tolerances")
    live = [c for c in cases if c.early is None]
    jobs = [
        (
            _forward_body(c.key, mesh) if c.grad is None else _grad_body(c.key, mesh, *c.grad),
            c.args,
        )
        for c in live
    ]
    outs = iter(_run_together(jobs, mesh))
    return [
        c.early if c.early is not None else _check_case(c, next(outs), mesh, r)
        for c, r in zip(cases, rtols, strict=True)
    ]


def find_missing_placement(
    rule: Rule,
    specs: Sequence[TensorSpec],
    mesh: Mesh,
    values: Sequence[np.ndarray],
    attrs: Mapping[str, Any],
    ref: Sequence[np.ndarray],
    rtol: float,
    domain: str,
    rng: np.random.Generator,
) -> TensorSpec | None:
    """An output spec the op's single output is right under when run on the pieces of
    ``values`` laid out as ``specs``, as given (no reshard); None when there is none,
    the op cannot run on them, or the rule computes locally in its own way."""
    if rule.has_custom_local_fn:
        return None  # its local computation is defined for the specs it requires only
    try:
        pieces = [
            _put_stacked(local_pieces(v, s, mesh, rng=rng, domain=domain), mesh)
            for v, s in zip(values, specs, strict=True)
        ]
        outs = _forward_runner(_runner_key(rule, attrs, None), mesh)(*pieces)
    except (TypeError, ValueError, SpmdError):
        return None  # the op cannot even run on these pieces
    if len(outs) != 1:
        return None
    stacked = np.asarray(outs[0])
    mesh_rank = len(mesh.axis_names)
    for cand in enumerate_specs(ref[0].shape, mesh, dtype=None):
        if cand.local_shape(mesh) != stacked.shape[mesh_rank:]:
            continue
        got, why = assemble(stacked, cand, mesh, rtol=rtol)
        if why is None and values_close(got, ref[0], rtol):
            return cand
    return None


@contextlib.contextmanager
def temporarily_registered(rule: Rule | str):
    """The rule, registered for the duration (a rule under test need not be yet)."""
    if isinstance(rule, str):
        yield get_rule(rule)
        return
    try:
        current = get_rule(rule.name)
    except NoRuleError:
        current = None
    if current is rule:
        yield rule
        return
    if current is not None:
        raise RegistrationError(
            op=rule.name,
            must="the rule under test is the one registered under its name, or its name is free",
            given=f"another rule is registered as {rule.name!r}",
            fix="give the rule under test another name",
        )
    register_rule(rule)
    try:
        yield rule
    finally:
        unregister_rule(rule.name)


def unsharded_outputs(
    rule: Rule, attrs: Mapping[str, Any], values: Sequence[Any]
) -> list[np.ndarray]:
    """The unsharded op's outputs on ``values`` (the reference every case compares with)."""
    return [np.asarray(o) for o in _jitted_unsharded(rule, attrs)(*values)]


def _run_alone(case: Case, mesh: Mesh, rtol: float) -> CaseFailure | None:
    """Run one case with its own (cached) runner and check it."""
    if case.early is not None:
        return case.early
    if case.grad is None:
        runner = _forward_runner(case.key, mesh)
    else:
        runner = _grad_runner(case.key, mesh, *case.grad)
    return _check_case(case, runner(*case.args), mesh, rtol)


def _check_case(case: Case, outs: Sequence[Any], mesh: Mesh, rtol: float) -> CaseFailure | None:
    """Compare a case's per-device results, read as the claimed specs, with the
    unsharded op (forward) or ``jax.vjp`` (grad)."""
    if case.grad is None:
        for o, claimed, r in zip(outs, case.res.outputs, case.expect, strict=True):
            got, why = assemble(np.asarray(o), claimed, mesh, rtol=rtol)
            if why:
                return case.fail(why)
            if not values_close(got, r, rtol):
                err = float(np.max(np.abs(got.astype(np.float64) - r.astype(np.float64))))
                return case.fail(f"values differ from the unsharded op (max abs err {err:.3g})")
        return None
    idx = [i for i, d in enumerate(case.grad[0]) if d]
    for i, lg, rg in zip(idx, outs, case.expect, strict=True):
        got, why = assemble(np.asarray(lg), case.res.outputs[i], mesh, rtol=rtol)
        if why:
            return case.fail(f"grad of input {i}: {why}")
        if not values_close(got, rg, rtol):
            err = float(np.max(np.abs(got.astype(np.float64) - rg.astype(np.float64))))
            return case.fail(f"grad of input {i} differs from jax.vjp (max abs err {err:.3g})")
    return None


# ---------------------------------------------------------------------------
# Running on every device with shard_map
# ---------------------------------------------------------------------------


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _invariant_axes(y: Any) -> tuple[tuple[str, ...], int]:
    """Mesh axes (of the enclosing shard_map) over which ``y`` is typed invariant, e.g.
    after a ``psum``, and their total size; ``((), 1)`` outside shard_map."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.axis_names:
        return (), 1
    aval = jax.typeof(y)
    varying = getattr(aval, "vma", None)  # some jax versions expose it as .vma
    if varying is None:
        varying = aval.manual_axis_type.varying
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    axes = tuple(a for a in mesh.axis_names if a not in varying)
    return axes, math.prod(sizes[a] for a in axes)


def _vjp_wrt(fn: Callable[..., Any], xs: Sequence[Any], diff: Sequence[bool]) -> tuple[Any, Any]:
    """``jax.vjp`` of ``fn`` with respect to the inputs marked differentiable only
    (ints and bools get no cotangent).

    Inside the sweep's shard_map every cotangent piece is typed varying over all
    axes, while an output that went through a collective (a statistic ``psum``) is
    invariant over its axes. Such an output is cast to varying and its cotangent,
    equal on every device along those axes, is divided by their size, so the cast's
    transpose (a psum) gives back exactly the cotangent.
    """
    idx = [i for i, d in enumerate(diff) if d]
    scales: list[int] = []

    def f(*dxs):
        full = list(xs)
        for i, v in zip(idx, dxs, strict=True):
            full[i] = v
        scales.clear()
        outs = []
        for y in _as_tuple(fn(*full)):
            axes, size = _invariant_axes(y)
            scales.append(size)
            outs.append(jax.lax.pcast(y, axes, to="varying") if axes else y)
        return tuple(outs)

    outs, vjp = jax.vjp(f, *(xs[i] for i in idx))

    def scaled(cts: Sequence[Any]) -> Any:
        return vjp(tuple(c if s == 1 else c / s for c, s in zip(cts, scales, strict=True)))

    return outs, scaled


#: Jitted unsharded ops, by (rule, frozen attributes without strategy, differentiable).
_JITTED_UNSHARDED: dict[tuple, Callable[..., Any]] = register_cache(
    {},
    module=__name__,
    name="_JITTED_UNSHARDED",
    why="jitted unsharded ops a rule is checked against.",
)


def _jitted_unsharded(
    rule: Rule, attrs: Mapping[str, Any], diff: tuple[bool, ...] | None = None
) -> Callable[..., Any]:
    """The unsharded op, jitted: one compiled program per shape instead of one per
    primitive that eager dispatch compiles, kept so every case and sweep of the op
    reuses it. ``diff=None``: ``(*values) -> outputs``; else ``(values, cotangents) ->
    (outputs, grads)``, the grads by :func:`_vjp_wrt` for the inputs ``diff`` marks."""
    attrs = without_strategy(attrs)
    fn = functools.partial(rule.impl, **attrs)

    def outputs(*values):
        return _as_tuple(fn(*values))

    def outputs_and_grads(values, cotangents):
        outs, vjp = _vjp_wrt(fn, list(values), diff)
        return outs, vjp(tuple(cotangents))

    try:
        key = (rule, freeze(attrs), diff)
    except TypeError:  # an unhashable attribute: compiled for this call only
        key = None
    if key is None or key not in _JITTED_UNSHARDED:
        if len(_JITTED_UNSHARDED) >= 512:
            _JITTED_UNSHARDED.clear()
        compiled = jax.jit(outputs if diff is None else outputs_and_grads)
        if key is None:
            return compiled
        _JITTED_UNSHARDED[key] = compiled
    return _JITTED_UNSHARDED[key]


def _runner_key(
    rule: Rule,
    attrs: Mapping[str, Any],
    res: Any,
    outputs: Sequence[TensorSpec] | None = None,
    mesh: Mesh | None = None,
) -> tuple:
    """Cache key of a runner: a rule whose local computation depends on the case's
    specs (its own, or the padding of uneven blocks) gets one runner per case, the
    others one per attribute set."""
    outs = tuple(res.outputs if outputs is None else outputs) if res is not None else ()
    padded = (
        res is not None
        and mesh is not None
        and not rule.has_custom_local_fn
        and not all(s.is_even(mesh) for s in (*res.inputs, *outs))
        and rule.padding_fills(
            LocalContext(rule.name, dict(attrs), tuple(res.inputs), outs, axis_sizes(mesh))
        )
        is not None
    )
    if not rule.has_custom_local_fn and not padded:
        return (rule, freeze(without_strategy(attrs)), None, None)
    return (rule, freeze(dict(attrs)), tuple(res.inputs), outs)


def _per_device_fn(key: tuple, mesh: Mesh) -> Callable[..., Any]:
    """Build the per-device function of a runner key (inside the shard_map trace)."""
    rule, attrs, inputs, outputs = key
    lctx = LocalContext(
        op=rule.name,
        attrs=dict(attrs),
        inputs=inputs or (),
        outputs=outputs or (),
        axis_sizes=axis_sizes(mesh),
    )
    return rule.local_fn(lctx)


def _forward_body(key: tuple, mesh: Mesh) -> Callable[..., tuple[Any, ...]]:
    """The forward of a runner key on every device's stacked pieces (inside shard_map)."""
    names = mesh.axis_names
    lead = (0,) * len(names)

    def local(*xs):
        fn = _per_device_fn(key, mesh)
        ys = _as_tuple(fn(*(x[lead] for x in xs)))
        return tuple(y[(None,) * len(names)] for y in ys)

    return local


def _grad_body(
    key: tuple, mesh: Mesh, diff: tuple[bool, ...], transposes: tuple[tuple[float, bool], ...]
) -> Callable[..., tuple[Any, ...]]:
    """The VJP of a runner key on stacked inputs, cotangents and forward outputs: each
    cotangent goes back through its output's pending reduction (``transposes``)."""
    names = mesh.axis_names
    lead = (0,) * len(names)
    n_in = len(diff)

    def local(*args):
        fn = _per_device_fn(key, mesh)
        xs = [a[lead] for a in args[:n_in]]
        n_out = len(transposes)
        gs = [a[lead] for a in args[n_in : n_in + n_out]]
        outs_global = [a[lead] for a in args[n_in + n_out :]]
        outs, vjp = _vjp_wrt(fn, xs, diff)
        cts = []
        for o, g, og, (scale, mask) in zip(outs, gs, outs_global, transposes, strict=True):
            ct = g / scale
            if mask:
                ct = jnp.where(o == og, ct, jnp.zeros_like(ct))
            cts.append(ct.astype(o.dtype))
        grads = vjp(tuple(cts))
        return tuple(d[(None,) * len(names)] for d in grads)

    return local


def _on_every_device(local: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """``local`` jitted under ``shard_map``: each argument and result is stacked, one
    leading dim per mesh axis, each device holding its own entry."""
    names = mesh.axis_names
    return jax.jit(shard_map(local, mesh=mesh, in_specs=P(*names), out_specs=P(*names)))


@cached(maxsize=512, why="the compiled program that checks many forward cases of a rule at once.")
def _forward_runner(key: tuple, mesh: Mesh) -> Callable[..., Any]:
    return _on_every_device(_forward_body(key, mesh), mesh)


@cached(maxsize=512, why="the compiled program that checks many grad cases of a rule at once.")
def _grad_runner(
    key: tuple,
    mesh: Mesh,
    diff: tuple[bool, ...],
    transposes: tuple[tuple[float, bool], ...],
) -> Callable[..., Any]:
    return _on_every_device(_grad_body(key, mesh, diff, transposes), mesh)


#: Cases compiled into one program by :func:`_run_together`.
_CASES_PER_PROGRAM = 32


def _run_together(
    jobs: Sequence[tuple[Callable[..., tuple[Any, ...]], Sequence[jax.Array]]], mesh: Mesh
) -> list[tuple[Any, ...]]:
    """Run many cases, each ``(body, stacked arguments)``, side by side in one
    compiled program per :data:`_CASES_PER_PROGRAM` of them: a sweep's cases differ
    in their local shapes, so run apart each would compile its own program, and
    compiling (not running) is what a sweep spends its time on. Returns each case's
    outputs, in order."""
    results: list[tuple[Any, ...]] = []
    for start in range(0, len(jobs), _CASES_PER_PROGRAM):
        chunk = jobs[start : start + _CASES_PER_PROGRAM]
        counts = [len(args) for _, args in chunk]

        def local(*flat, chunk=chunk, counts=counts):
            outs, at = [], 0
            for (body, _), n in zip(chunk, counts, strict=True):
                outs.append(tuple(body(*flat[at : at + n])))
                at += n
            return tuple(outs)

        flat = [a for _, args in chunk for a in args]
        results += list(_on_every_device(local, mesh)(*flat))
    return results


def _put_stacked(stacked: np.ndarray, mesh: Mesh) -> jax.Array:
    """Every device's piece (``local_pieces``' layout) placed on that device."""
    return jax.device_put(stacked, NamedSharding(mesh, P(*mesh.axis_names)))
