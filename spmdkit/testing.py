"""Rule-validation toolkit: check any rule against the unsharded op on a virtual mesh.

Two checks, usable on your own rules:

* :func:`check_rule` — the numeric sweep, in the style of PyTorch DTensor's
  strategy validation. For each example of the rule it enumerates input specs
  (replicated, sharded on each dim, partial with every reduce op) over the
  mesh, asks the rule for required input and output specs, builds every
  device's local pieces of the *required* inputs (partial values split
  *asymmetrically*, so coincidences fail), runs the op on each device's pieces
  with ``shard_map``, rebuilds the global result from the *claimed* output spec
  and compares with the unsharded op. A replicated claim is checked too: every
  copy must agree. Where the rule asked for a reshard, the op is also run on the
  pieces as given, and any output spec that would have been right is reported
  as a *missing* placement (the rule is conservative there). Grad rules are
  checked the same way against ``jax.vjp``.
* :func:`check_jit` — compiles the op with the rule's required input shardings
  and the claimed output (partials resolved) and checks that the collectives in
  the compiled HLO are exactly those the reshard planner predicts (count, kind
  and bytes). Under ``jit`` a wrong rule still gives right numbers, because XLA
  inserts whatever it needs; the collectives are what betray it.

Both run on a mesh of virtual CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``).

Example::

    >>> report = check_rule("matmul", mesh=sk.make_mesh(a=2, b=4))
    >>> report.ok, len(report.wrong), len(report.missing)
    (True, 0, 3)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.errors import NoRuleError, RegistrationError, SpmdError
from spmdkit.inference import infer_forward, infer_grad
from spmdkit.mesh import auto_mesh
from spmdkit.registry import get_rule, register_rule, unregister_rule
from spmdkit.rule import Example, LocalContext, Rule, RuleContext, without_strategy
from spmdkit.spec import REDUCE_OPS, MeshLike, TensorSpec, axis_sizes
from spmdkit.util import freeze

__all__ = [
    "CaseFailure",
    "MissingPlacement",
    "RuleReport",
    "JitReport",
    "assemble",
    "check_rule",
    "check_jit",
    "check_forward_case",
    "check_grad_case",
    "enumerate_specs",
    "local_pieces",
    "random_value",
    "undeclared_replications",
]


# ---------------------------------------------------------------------------
# Values, local pieces, reassembly
# ---------------------------------------------------------------------------


def random_value(
    shape: tuple[int, ...],
    dtype: str = "float32",
    *,
    domain: str = "real",
    rng: np.random.Generator,
) -> np.ndarray:
    """A random global value of ``shape`` in the op's ``domain``."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dt, np.integer):
        return rng.integers(-4, 5, size=shape).astype(dt)
    if domain == "positive":
        return rng.uniform(0.5, 2.0, size=shape).astype(dt)
    if domain == "near_one":
        return rng.uniform(0.8, 1.25, size=shape).astype(dt)
    if domain == "unit":
        return rng.uniform(-0.9, 0.9, size=shape).astype(dt)
    return rng.standard_normal(shape).astype(dt)


def _coords(sizes: Mapping[str, int]) -> Iterable[tuple[int, ...]]:
    return itertools.product(*(range(n) for n in sizes.values()))


def _dim_slices(
    spec: TensorSpec, coord: Mapping[str, int], sizes: Mapping[str, int]
) -> tuple[slice, ...]:
    out = []
    for n, axes in zip(spec.shape, spec.dims, strict=True):
        idx, count = 0, 1
        for a in axes:
            idx = idx * sizes[a] + coord[a]
            count *= sizes[a]
        step = -(-n // count)  # ceil: the last blocks may be short (padded on devices)
        out.append(slice(min(idx * step, n), min((idx + 1) * step, n)))
    return tuple(out)


def _crop(sl: tuple[slice, ...]) -> tuple[slice, ...]:
    """The part of a (padded) local block that holds real elements."""
    return tuple(slice(0, s.stop - s.start) for s in sl)


def _is_float(dtype: np.dtype) -> bool:
    """Floating point, including the ml_dtypes floats (bfloat16, float8) numpy does not know."""
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _fill_value(dtype: np.dtype) -> Any:
    """Padding of uneven blocks: NaN for floats (so a leak into a real output is caught)."""
    if _is_float(dtype) or np.issubdtype(dtype, np.complexfloating):
        return np.nan
    return False if dtype == np.bool_ else 0


def _split(
    base: np.ndarray, n: int, op: str, rng: np.random.Generator, domain: str
) -> list[np.ndarray]:
    """Split ``base`` into ``n`` asymmetric parts whose ``op``-reduction is ``base``.

    NaN padding (uneven blocks) stays NaN in every part. Sum/avg parts of a
    float are drawn on each element's own scale (half its magnitude, plus a
    floor) and the last one is computed in float64: parts much larger than the
    element would round its low bits away (a bfloat16 part near 8 is a multiple
    of 1/16; a float32 reduction of 64 such parts to a scalar near 0 misses by
    1e-5), so their sum would miss ``base`` by more than the example's tolerance
    for reasons of the check, not of the rule."""
    pad = np.isnan(base) if _is_float(base.dtype) else None
    if pad is not None and pad.any():
        parts = _split(np.where(pad, 0, base).astype(base.dtype), n, op, rng, domain)
        return [np.where(pad, np.nan, p).astype(base.dtype) for p in parts]
    scale = float(np.abs(base).mean()) + 1.0 if base.size else 1.0
    if op in ("sum", "avg") and _is_float(base.dtype):
        wide = base.astype(np.float64)
        target = wide * n if op == "avg" else wide
        mean = float(np.abs(wide).mean()) if base.size else 0.0
        local = 0.5 * np.abs(wide) + 0.125 * mean + 2**-8
        parts = [(rng.standard_normal(base.shape) * local).astype(base.dtype) for _ in range(n - 1)]
        rest = target - sum((p.astype(np.float64) for p in parts), np.zeros_like(wide))
        parts.append(rest.astype(base.dtype))
        order = rng.permutation(n)
        return [parts[i] for i in order]
    if op in ("sum", "avg"):
        target = base * n if op == "avg" else base
        parts = [rng.standard_normal(base.shape).astype(base.dtype) * scale for _ in range(n - 1)]
        parts.append((target - sum(parts, np.zeros_like(base))).astype(base.dtype))
        order = rng.permutation(n)
        return [parts[i] for i in order]
    owner = rng.integers(0, n, size=base.shape)
    parts = []
    for j in range(n):
        if domain in ("positive", "near_one"):
            u = rng.uniform(0.3, 0.9, size=base.shape).astype(base.dtype)
            other = base * u if op == "max" else base / u
        else:
            d = (np.abs(rng.standard_normal(base.shape)) + 0.25).astype(base.dtype)
            other = base - d if op == "max" else base + d
        parts.append(np.where(owner == j, base, other).astype(base.dtype))
    return parts


def local_pieces(
    value: np.ndarray,
    spec: TensorSpec,
    mesh: Any,
    *,
    rng: np.random.Generator,
    domain: str = "real",
) -> np.ndarray:
    """Every device's local piece of ``value`` laid out as ``spec``.

    Returns an array of shape ``(*mesh axis sizes, *local shape)``. Partial axes
    get asymmetric splits: random parts (sum, avg) or one owner per element
    holding the value with smaller/larger values elsewhere (max, min). A dim
    that does not divide is split in ``ceil(n / shards)`` blocks; the padding
    of the short blocks is NaN (floats), 0 (ints) or False, so a rule that lets
    padding reach a real output element fails.
    """
    sizes = axis_sizes(mesh)
    local = spec.local_shape(mesh)
    out = np.full((*sizes.values(), *local), _fill_value(value.dtype), dtype=value.dtype)
    names = list(sizes)
    for c in _coords(sizes):
        coord = dict(zip(names, c, strict=True))
        sl = _dim_slices(spec, coord, sizes)
        out[(*c, *_crop(sl))] = value[sl]
    # The value is the reduction over the partial axes in listed order, so the
    # split runs in reverse: the last-reduced axis is split first.
    for p, op in reversed(spec.partial):
        k = names.index(p)
        others = [a for a in names if a != p]
        # Devices that differ only along replicated axes must hold equal pieces:
        # draw one split per distinct coordinate along the axes the spec uses.
        splits: dict[tuple[int, ...], list[np.ndarray]] = {}
        for c in _coords({a: sizes[a] for a in others}):
            at = [*c[:k], 0, *c[k:]]
            key = tuple(i for a, i in zip(others, c, strict=True) if a in spec.used_axes)
            if key not in splits:
                splits[key] = _split(out[tuple(at)].copy(), sizes[p], op, rng, domain)
            for j, part in enumerate(splits[key]):
                at[k] = j
                out[tuple(at)] = part
    return out


def _close(a: np.ndarray, b: np.ndarray, rtol: float) -> bool:
    if a.shape != b.shape:
        return False
    if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
        return bool(np.array_equal(a, b))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = np.abs(b64[np.isfinite(b64)])
    scale = max(1.0, float(np.max(finite, initial=0.0)))
    return bool(np.allclose(a64, b64, rtol=rtol, atol=rtol * scale, equal_nan=True))


def assemble(
    stacked: np.ndarray, spec: TensorSpec, mesh: Any, *, rtol: float = 1e-5
) -> tuple[np.ndarray | None, str | None]:
    """Rebuild the global value from every device's local piece, read as ``spec``.

    Partial axes are reduced with their op; over every axis the spec claims is
    replicated, all copies must agree. Returns ``(value, None)`` or
    ``(None, why)`` when the pieces contradict the claim.
    """
    sizes = axis_sizes(mesh)
    names = list(sizes)
    arr = np.asarray(stacked)
    reducers = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}
    for p, op in spec.partial:
        arr = reducers[op](arr, axis=names.index(p), keepdims=True).astype(arr.dtype)
    for a in names:
        if a in spec.used_axes:
            continue
        k = names.index(a)
        first = np.take(arr, [0], axis=k)
        for j in range(1, sizes[a]):
            if not _close(np.take(arr, [j], axis=k), first, rtol):
                return None, f"claimed replicated over {a!r} but device copies differ"
        arr = first
    out = np.empty(spec.shape, dtype=arr.dtype)
    for c in _coords(sizes):
        coord = dict(zip(names, c, strict=True))
        src = tuple(coord[a] if a in spec.sharding_axes else 0 for a in names)
        sl = _dim_slices(spec, coord, sizes)
        out[sl] = arr[(*src, *_crop(sl))]
    return out, None


# ---------------------------------------------------------------------------
# Enumeration of specs
# ---------------------------------------------------------------------------


def enumerate_specs(
    shape: tuple[int, ...],
    mesh: Any,
    *,
    dtype: Any = None,
    partial_ops: Sequence[str] = REDUCE_OPS,
    even_only: bool = True,
) -> list[TensorSpec]:
    """Every spec of ``shape`` on ``mesh``: each axis unused, sharding one dim
    (several axes on one dim in mesh order), or partial with each op.

    Size-1 dims are never sharded; with ``even_only`` neither are dims the
    axes do not divide.
    """
    sizes = axis_sizes(mesh)
    choices: list[list[tuple[str, Any]]] = []
    for _ in sizes:
        opts: list[tuple[str, Any]] = [("none", None)]
        opts += [("dim", d) for d, n in enumerate(shape) if n > 1]
        opts += [("partial", op) for op in partial_ops]
        choices.append(opts)
    out: list[TensorSpec] = []
    for combo in itertools.product(*choices):
        dims: list[list[str]] = [[] for _ in shape]
        partial: dict[str, str] = {}
        for a, (kind, v) in zip(sizes, combo, strict=True):
            if kind == "dim":
                dims[v].append(a)
            elif kind == "partial":
                partial[a] = v
        spec = TensorSpec(shape, [tuple(d) for d in dims], partial=partial, dtype=dtype)
        if even_only and not spec.is_even(mesh):
            continue
        out.append(spec)
    return out


# ---------------------------------------------------------------------------
# Local execution with shard_map
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


def _vjp(fn: Callable[..., Any], xs: Sequence[Any], diff: Sequence[bool]) -> tuple[Any, Any]:
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
_REFERENCES: dict[tuple, Callable[..., Any]] = {}


def _reference(
    rule: Rule, attrs: Mapping[str, Any], diff: tuple[bool, ...] | None = None
) -> Callable[..., Any]:
    """The unsharded op, jitted: one compiled program per shape instead of one per
    primitive that eager dispatch compiles, kept so every case and sweep of the op
    reuses it. ``diff=None``: ``(*values) -> outputs``; else ``(values, cotangents) ->
    (outputs, grads)``, the grads by :func:`_vjp` for the inputs ``diff`` marks."""
    attrs = without_strategy(attrs)
    fn = functools.partial(rule.impl, **attrs)

    def outputs(*values):
        return _as_tuple(fn(*values))

    def outputs_and_grads(values, cotangents):
        outs, vjp = _vjp(fn, list(values), diff)
        return outs, vjp(tuple(cotangents))

    try:
        key = (rule, freeze(attrs), diff)
    except TypeError:  # an unhashable attribute: compiled for this call only
        key = None
    if key is None or key not in _REFERENCES:
        if len(_REFERENCES) >= 512:
            _REFERENCES.clear()
        compiled = jax.jit(outputs if diff is None else outputs_and_grads)
        if key is None:
            return compiled
        _REFERENCES[key] = compiled
    return _REFERENCES[key]


def _unsharded(rule: Rule, attrs: Mapping[str, Any], values: Sequence[Any]) -> list[np.ndarray]:
    """The unsharded op's outputs on ``values`` (the reference every case compares with)."""
    return [np.asarray(o) for o in _reference(rule, attrs)(*values)]


def _local_key(
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


def _local_fn(key: tuple, mesh: Mesh) -> Callable[..., Any]:
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
        fn = _local_fn(key, mesh)
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
        fn = _local_fn(key, mesh)
        xs = [a[lead] for a in args[:n_in]]
        n_out = len(transposes)
        gs = [a[lead] for a in args[n_in : n_in + n_out]]
        outs_global = [a[lead] for a in args[n_in + n_out :]]
        outs, vjp = _vjp(fn, xs, diff)
        cts = []
        for o, g, og, (scale, mask) in zip(outs, gs, outs_global, transposes, strict=True):
            ct = g / scale
            if mask:
                ct = jnp.where(o == og, ct, jnp.zeros_like(ct))
            cts.append(ct.astype(o.dtype))
        grads = vjp(tuple(cts))
        return tuple(d[(None,) * len(names)] for d in grads)

    return local


def _spmd(local: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    names = mesh.axis_names
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(*names), out_specs=P(*names)))


@functools.lru_cache(maxsize=512)
def _forward_runner(key: tuple, mesh: Mesh) -> Callable[..., Any]:
    return _spmd(_forward_body(key, mesh), mesh)


@functools.lru_cache(maxsize=512)
def _grad_runner(
    key: tuple,
    mesh: Mesh,
    diff: tuple[bool, ...],
    transposes: tuple[tuple[float, bool], ...],
) -> Callable[..., Any]:
    return _spmd(_grad_body(key, mesh, diff, transposes), mesh)


#: Cases compiled into one program by :func:`_run_together`.
_BATCH = 32


def _run_together(
    jobs: Sequence[tuple[Callable[..., tuple[Any, ...]], Sequence[jax.Array]]], mesh: Mesh
) -> list[tuple[Any, ...]]:
    """Run many cases, each ``(body, stacked arguments)``, side by side in one compiled
    program per :data:`_BATCH` of them: a sweep's cases differ in their local shapes,
    so run apart each would compile its own program, and compiling (not running)
    is what a sweep spends its time on. Returns each case's outputs, in order."""
    results: list[tuple[Any, ...]] = []
    for start in range(0, len(jobs), _BATCH):
        chunk = jobs[start : start + _BATCH]
        counts = [len(args) for _, args in chunk]

        def local(*flat, chunk=chunk, counts=counts):
            outs, at = [], 0
            for (body, _), n in zip(chunk, counts, strict=True):
                outs.append(tuple(body(*flat[at : at + n])))
                at += n
            return tuple(outs)

        flat = [a for _, args in chunk for a in args]
        results += list(_spmd(local, mesh)(*flat))
    return results


def _put(stacked: np.ndarray, mesh: Mesh) -> jax.Array:
    return jax.device_put(stacked, NamedSharding(mesh, P(*mesh.axis_names)))


# ---------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------


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


@dataclass(frozen=True)
class MissingPlacement:
    """Inputs the rule resharded although the op could run on them as given."""

    attrs: Mapping[str, Any]
    given: tuple[TensorSpec, ...]
    valid_output: TensorSpec

    def __str__(self) -> str:
        g = ", ".join(map(str, self.given))
        return f"{dict(self.attrs)}: ({g}) could give {self.valid_output} without a reshard"


@dataclass
class RuleReport:
    """Result of :func:`check_rule`.

    Attributes:
      op: the op checked.
      mesh: the mesh, as ``{axis: size}``.
      forward_cases / grad_cases: how many cases ran.
      wrong: cases where the rule's claim is numerically wrong.
      replicated: cases where the rule replicated an uneven dim it does not declare
        in :attr:`~spmdkit.rule.Rule.must_divide` (see :func:`undeclared_replications`).
      missing: valid placements the rule did not claim (it resharded instead).
      skipped: cases that could not run (and why).
    """

    op: str
    mesh: dict[str, int]
    forward_cases: int = 0
    grad_cases: int = 0
    wrong: list[CaseFailure] = field(default_factory=list)
    replicated: list[CaseFailure] = field(default_factory=list)
    missing: list[MissingPlacement] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no case is wrong or replicated and at least one case ran."""
        return not self.wrong and not self.replicated and self.forward_cases > 0

    def __str__(self) -> str:
        lines = [
            f"{self.op} on {self.mesh}: {self.forward_cases} forward, "
            f"{self.grad_cases} grad cases, {len(self.wrong)} wrong, "
            f"{len(self.replicated)} replicated, {len(self.missing)} missing, "
            f"{len(self.skipped)} skipped"
        ]
        lines += [f"  WRONG {w}" for w in self.wrong[:10]]
        lines += [f"  REPLICATED {w}" for w in self.replicated[:10]]
        lines += [f"  missing {m}" for m in self.missing[:5]]
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Single cases
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _registered(rule: Rule | str):
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


def _values(rule: Rule, ex: Example, rng: np.random.Generator) -> list[np.ndarray]:
    if ex.values is not None:
        return [np.asarray(v) for v in ex.values(rng)]
    dtypes = ex.dtypes or ("float32",) * len(ex.shapes)
    return [
        random_value(s, d, domain=ex.domain, rng=rng)
        for s, d in zip(ex.shapes, dtypes, strict=True)
    ]


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
    with _registered(rule) as checked:
        ref = _unsharded(checked, attrs, values)
        case = _prepare_forward(checked, specs, mesh, values, attrs, ref, domain, seed)
        return _run_one(case, mesh, rtol), case.res


@dataclass(frozen=True)
class _Case:
    """One case of a sweep, its claim inferred and every device's arguments built,
    ready to run (``early``: the claim is already wrong, nothing to run)."""

    res: Any
    fail: Callable[[str], CaseFailure]
    early: CaseFailure | None = None
    key: tuple = ()
    grad: tuple | None = None  # (differentiable, transposes) of a grad case
    args: tuple[jax.Array, ...] = ()
    expect: tuple[np.ndarray, ...] = ()  # unsharded outputs, or grads of the diff inputs


def _prepare_forward(
    rule: Rule,
    specs: Sequence[TensorSpec],
    mesh: Mesh,
    values: Sequence[np.ndarray],
    attrs: dict[str, Any],
    ref: Sequence[np.ndarray],
    domain: str,
    seed: int,
) -> _Case:
    rng = np.random.default_rng(seed)
    res = infer_forward(rule.name, *specs, mesh=mesh, **attrs)
    fail = functools.partial(CaseFailure, "forward", attrs, tuple(specs), res.inputs, res.outputs)
    for s, r in zip(res.inputs, specs, strict=True):
        if s.shape != r.shape:
            return _Case(res, fail, fail(f"required spec {s} changes the shape {r.shape}"))
    for o, r in zip(res.outputs, ref, strict=True):
        if o.shape != r.shape:
            return _Case(res, fail, fail(f"claimed output shape {o.shape}, op gives {r.shape}"))
        if any(n == 1 and axes for n, axes in zip(o.shape, o.dims, strict=True)):
            return _Case(res, fail, fail(f"claimed output {o} shards a size-1 dim"))
    pieces = tuple(
        _put(local_pieces(v, s, mesh, rng=rng, domain=domain), mesh)
        for v, s in zip(values, res.inputs, strict=True)
    )
    key = _local_key(rule, attrs, res, mesh=mesh)
    return _Case(res, fail, key=key, args=pieces, expect=tuple(ref))


def _check_case(case: _Case, outs: Sequence[Any], mesh: Mesh, rtol: float) -> CaseFailure | None:
    """Compare a case's per-device results, read as the claimed specs, with the
    unsharded op (forward) or ``jax.vjp`` (grad)."""
    if case.grad is None:
        for o, claimed, r in zip(outs, case.res.outputs, case.expect, strict=True):
            got, why = assemble(np.asarray(o), claimed, mesh, rtol=rtol)
            if why:
                return case.fail(why)
            if not _close(got, r, rtol):
                err = float(np.max(np.abs(got.astype(np.float64) - r.astype(np.float64))))
                return case.fail(f"values differ from the unsharded op (max abs err {err:.3g})")
        return None
    idx = [i for i, d in enumerate(case.grad[0]) if d]
    for i, lg, rg in zip(idx, outs, case.expect, strict=True):
        got, why = assemble(np.asarray(lg), case.res.outputs[i], mesh, rtol=rtol)
        if why:
            return case.fail(f"grad of input {i}: {why}")
        if not _close(got, rg, rtol):
            err = float(np.max(np.abs(got.astype(np.float64) - rg.astype(np.float64))))
            return case.fail(f"grad of input {i} differs from jax.vjp (max abs err {err:.3g})")
    return None


def _run_one(case: _Case, mesh: Mesh, rtol: float) -> CaseFailure | None:
    """Run one case with its own (cached) runner and check it."""
    if case.early is not None:
        return case.early
    if case.grad is None:
        runner = _forward_runner(case.key, mesh)
    else:
        runner = _grad_runner(case.key, mesh, *case.grad)
    return _check_case(case, runner(*case.args), mesh, rtol)


def _run_cases(cases: Sequence[_Case], mesh: Mesh, rtol: float) -> list[CaseFailure | None]:
    """Every case's failure or None; the cases that run, run in one program
    (:func:`_run_together`)."""
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
        c.early if c.early is not None else _check_case(c, next(outs), mesh, rtol) for c in cases
    ]


def _find_missing(
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
    if rule.has_custom_local_fn:
        return None  # its local computation is defined for the specs it requires only
    try:
        pieces = [
            _put(local_pieces(v, s, mesh, rng=rng, domain=domain), mesh)
            for v, s in zip(values, specs, strict=True)
        ]
        outs = _forward_runner(_local_key(rule, attrs, None), mesh)(*pieces)
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
        if why is None and _close(got, ref[0], rtol):
            return cand
    return None


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
    with _registered(rule) as checked:
        case = _prepare_grad(
            checked, specs, out_grads, mesh, values, cotangents, attrs, diff, domain, seed
        )
        return _run_one(case, mesh, rtol), case.res


def _prepare_grad(
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
) -> _Case:
    rng = np.random.default_rng(seed)
    res = infer_grad(rule.name, *specs, out_grads=out_grads, mesh=mesh, **attrs)
    given, required = (*specs, *out_grads), (*res.inputs, *res.out_grads)
    fail = functools.partial(CaseFailure, "grad", attrs, given, required, res.outputs)
    outs_ref, grads_ref = _reference(rule, attrs, diff)(tuple(values), tuple(cotangents))
    sizes = axis_sizes(mesh)
    transposes = tuple(
        (
            float(math.prod(sizes[a] for a, op in fo.partial if op == "avg")),
            any(op in ("max", "min") for _, op in fo.partial),
        )
        for fo in res.forward_outputs
    )
    args = [
        _put(local_pieces(v, s, mesh, rng=rng, domain=domain), mesh)
        for v, s in zip(values, res.inputs, strict=True)
    ]
    args += [
        _put(local_pieces(c, s, mesh, rng=rng), mesh)
        for c, s in zip(cotangents, res.out_grads, strict=True)
    ]
    args += [
        _put(local_pieces(np.asarray(o), fo.without_partial(), mesh, rng=rng), mesh)
        for o, fo in zip(outs_ref, res.forward_outputs, strict=True)
    ]
    return _Case(
        res,
        fail,
        key=_local_key(rule, attrs, res, res.forward_outputs, mesh),
        grad=(diff, transposes),
        args=tuple(args),
        expect=tuple(np.asarray(g) for g in grads_ref),
    )


# ---------------------------------------------------------------------------
# Uneven dims the rule replicates
# ---------------------------------------------------------------------------


def undeclared_replications(
    rule: Rule | str,
    specs: Sequence[TensorSpec],
    mesh: MeshLike,
    *,
    attrs: Mapping[str, Any] | None = None,
    out_grads: Sequence[TensorSpec] | None = None,
) -> list[str]:
    """Sharded dims the rule replicates because their axes do not divide them, where
    it does not declare (:attr:`~spmdkit.rule.Rule.must_divide`) that they must.

    The rule is asked twice: on ``mesh``, and on its *even twin*, the same axes of
    size 1, which divide every dim. A layout decision that depends on the axis
    sizes is a divisibility decision, so an axis the twin keeps on an operand dim
    and the real mesh drops is the rule replicating an uneven dim. Each such dim
    must be one :meth:`~spmdkit.rule.Rule.divisible_dims` names for the call.
    Checks the forward inference, or the grad inference when ``out_grads`` is given
    (its required inputs and cotangents).

    Returns:
      One line per undeclared replicated dim (empty when every given spec is even).

    Example::

        >>> undeclared_replications("matmul", (T((32, 64), P(None, "c")),
        ...                                    T((64, 32))), sk.abstract_mesh(c=3))
        []
    """
    checked = get_rule(rule) if isinstance(rule, str) else rule
    attrs = dict(attrs or {})
    sizes = axis_sizes(mesh)
    specs, grads = tuple(specs), tuple(out_grads or ())
    given = (*specs, *grads)
    if all(s.is_even(mesh) for s in given):
        return []
    ctx = RuleContext(op=checked.name, axis_sizes=sizes, attrs=attrs)
    twin = RuleContext(op=checked.name, axis_sizes={a: 1 for a in sizes}, attrs=attrs)

    def required(c: RuleContext) -> tuple[TensorSpec, ...]:
        if out_grads is None:
            return checked.forward(c, specs).inputs
        res = checked.grad(c, specs, grads)
        return (*res.inputs, *res.out_grads)

    real, even = required(ctx), required(twin)
    declared = checked.divisible_dims(ctx, specs, grads)
    out = []
    for i, (r, e, g, ok) in enumerate(zip(real, even, given, declared, strict=True)):
        what = f"input {i}" if i < len(specs) else f"out_grad {i - len(specs)}"
        for d, n in enumerate(g.shape):
            lost = [a for a in e.dims[d] if a not in r.dims[d]]
            if lost and n > 1 and d not in ok:  # a size-1 dim is never sharded
                out.append(f"{what} dim {d} (size {n}) loses {lost}: not declared must_divide")
    return out


def _replications(
    report: RuleReport,
    rule: Rule,
    case: _Case,
    specs: Sequence[TensorSpec],
    mesh: Mesh,
    attrs: Mapping[str, Any],
    out_grads: Sequence[TensorSpec] | None = None,
) -> None:
    """Record a case's undeclared replications of uneven dims in ``report``."""
    why = undeclared_replications(rule, specs, mesh, attrs=attrs, out_grads=out_grads)
    if why:
        report.replicated.append(case.fail("; ".join(why)))


# ---------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------


def _input_specs(ex: Example, mesh: Mesh) -> list[list[TensorSpec]]:
    dtypes = ex.dtypes or ("float32",) * len(ex.shapes)
    out = []
    for shape, dt in zip(ex.shapes, dtypes, strict=True):
        floating = jnp.issubdtype(np.dtype(dt), jnp.floating)
        ops = REDUCE_OPS if floating else ()
        out.append(enumerate_specs(shape, mesh, dtype=dt, partial_ops=ops, even_only=not ex.uneven))
    return out


def _sample(
    combos: list[tuple[TensorSpec, ...]], limit: int | None, rng: np.random.Generator
) -> list[tuple[TensorSpec, ...]]:
    if limit is None or len(combos) <= limit:
        return combos
    keep = {0}  # all replicated
    keep |= {int(i) for i in rng.choice(len(combos), size=limit - 1, replace=False)}
    return [combos[i] for i in sorted(keep)]


#: Above this many combinations the sweep samples them by index instead of listing them.
_LAZY_ABOVE = 200_000


def _combos(
    lists: Sequence[Sequence[TensorSpec]], limit: int | None, rng: np.random.Generator
) -> list[tuple[TensorSpec, ...]]:
    """A deterministic sample of ``limit`` input-spec combinations (all of them when
    fewer), without materialising the product when it is huge (many operands)."""
    total = math.prod(len(x) for x in lists)
    if total <= _LAZY_ABOVE or limit is None:
        return _sample(list(itertools.product(*lists)), limit, rng)
    picks = {0}
    while len(picks) < min(limit, total):
        picks.add(int(rng.integers(total)))
    out = []
    for pick in sorted(picks):
        combo, rest = [], pick
        for x in reversed(lists):
            rest, j = divmod(rest, len(x))
            combo.append(x[j])
        out.append(tuple(reversed(combo)))
    return out


def check_rule(
    rule: Rule | str,
    *,
    mesh: Mesh,
    examples: Sequence[Example] | None = None,
    max_cases: int | None = 48,
    max_grad_cases: int | None = 16,
    grads: bool = True,
    missing: bool = True,
    seed: int = 0,
) -> RuleReport:
    """Run the numeric sweep (forward and grad) of ``rule`` on ``mesh``.

    Args:
      rule: a Rule or a registered op name.
      mesh: a real mesh (virtual CPU devices are fine).
      examples: inputs to sweep (default: the rule's own ``examples``).
      max_cases: forward cases per example; beyond it a deterministic sample
        (always including all-replicated) is taken. ``None``: every combination.
      max_grad_cases: grad cases per example (each with a random cotangent spec).
      grads: also check the grad rule.
      missing: also look for valid placements the rule did not claim.
      seed: seed of the values, splits and sampling.

    Returns:
      A :class:`RuleReport`; ``report.ok`` is False when any claim is wrong.
    """
    with _registered(rule) as checked:
        return _sweep(checked, mesh, examples, max_cases, max_grad_cases, grads, missing, seed)


def _sweep(
    rule: Rule,
    mesh: Mesh,
    examples: Sequence[Example] | None,
    max_cases: int | None,
    max_grad_cases: int | None,
    grads: bool,
    missing: bool,
    seed: int,
) -> RuleReport:
    report = RuleReport(rule.name, dict(axis_sizes(mesh)))
    rng = np.random.default_rng(seed)
    for ex in examples or rule.examples:
        values = _values(rule, ex, rng)
        ref = _unsharded(rule, ex.attrs, values)
        _sweep_forward(report, rule, ex, mesh, values, ref, max_cases, missing, rng)
        if not grads:
            continue
        diff = ex.differentiable or (True,) * len(ex.shapes)
        if not any(diff) or not all(jnp.issubdtype(r.dtype, jnp.floating) for r in ref):
            continue
        _sweep_grads(report, rule, ex, mesh, values, ref, tuple(diff), max_grad_cases, rng)
    return report


def _sweep_forward(
    report: RuleReport,
    rule: Rule,
    ex: Example,
    mesh: Mesh,
    values: Sequence[np.ndarray],
    ref: Sequence[np.ndarray],
    max_cases: int | None,
    missing: bool,
    rng: np.random.Generator,
) -> None:
    """The forward cases of one example, run together; then, for the cases the rule
    resharded, a search for placements it missed (one at a time, drawing from the
    case's own seed: the cases a sweep runs do not depend on ``missing``)."""
    attrs = dict(ex.attrs)
    combos = _combos(_input_specs(ex, mesh), max_cases, rng)
    seeds = [int(rng.integers(1 << 30)) for _ in combos]
    cases = [
        _prepare_forward(rule, specs, mesh, values, attrs, ref, ex.domain, seed)
        for specs, seed in zip(combos, seeds, strict=True)
    ]
    failures = _run_cases(cases, mesh, ex.rtol)
    for specs, case, failure, seed in zip(combos, cases, failures, seeds, strict=True):
        report.forward_cases += 1
        _replications(report, rule, case, specs, mesh, attrs)
        if failure:
            report.wrong.append(failure)
            continue
        if missing and tuple(case.res.inputs) != tuple(specs) and len(ref) == 1:
            own = np.random.default_rng([seed, 1])
            cand = _find_missing(rule, specs, mesh, values, attrs, ref, ex.rtol, ex.domain, own)
            if cand is not None:
                report.missing.append(MissingPlacement(attrs, tuple(specs), cand))


def _sweep_grads(
    report: RuleReport,
    rule: Rule,
    ex: Example,
    mesh: Mesh,
    values: Sequence[np.ndarray],
    ref: Sequence[np.ndarray],
    diff: tuple[bool, ...],
    max_grad_cases: int | None,
    rng: np.random.Generator,
) -> None:
    """The grad cases of one example (each with a random cotangent spec), run together."""
    attrs = dict(ex.attrs)
    out_cands = [
        enumerate_specs(r.shape, mesh, dtype=r.dtype, partial_ops=("sum",), even_only=not ex.uneven)
        for r in ref
    ]
    cases, given = [], []
    for specs in _combos(_input_specs(ex, mesh), max_grad_cases, rng):
        plain = tuple(s.without_partial() for s in specs)
        gs = tuple(c[int(rng.integers(len(c)))] for c in out_cands)
        cots = [random_value(r.shape, r.dtype.name, rng=rng) for r in ref]
        seed = int(rng.integers(1 << 30))
        cases.append(
            _prepare_grad(rule, plain, gs, mesh, values, cots, attrs, diff, ex.domain, seed)
        )
        given.append((plain, gs))
    failures = _run_cases(cases, mesh, max(ex.rtol, 1e-5))
    for case, (plain, gs), failure in zip(cases, given, failures, strict=True):
        report.grad_cases += 1
        _replications(report, rule, case, plain, mesh, attrs, gs)
        if failure:
            report.wrong.append(failure)


# ---------------------------------------------------------------------------
# Jit check
# ---------------------------------------------------------------------------


@dataclass
class JitReport:
    """Result of :func:`check_jit`: predicted vs compiled collectives per case."""

    op: str
    mesh: dict[str, int]
    cases: int = 0
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every compiled case matched the prediction."""
        return not self.mismatches and self.cases > 0

    def __str__(self) -> str:
        head = (
            f"{self.op} jit on {self.mesh}: {self.cases} cases, {len(self.mismatches)} mismatches"
        )
        return "\n".join([head, *(f"  {m}" for m in self.mismatches[:10])])


def check_jit(
    rule: Rule | str,
    *,
    mesh: Mesh,
    examples: Sequence[Example] | None = None,
    max_cases: int | None = 8,
    seed: int = 0,
) -> JitReport:
    """Compile the op with the rule's shardings; compare HLO collectives with the prediction.

    For each sampled case without partial inputs: ``jax.jit(op,
    in_shardings=required inputs, out_shardings=claimed outputs with partials
    resolved)`` on an Auto-axes copy of ``mesh``. The predicted collectives are
    the reshard plan from the claimed output to that target (an all-reduce per
    pending reduction, nothing else). The compiled HLO must show the same count
    of collectives per kind and the same payload bytes per device.
    """

    with _registered(rule) as checked:
        return _jit_sweep(checked, mesh, examples, max_cases, seed)


def _jit_sweep(
    rule: Rule, mesh: Mesh, examples: Sequence[Example] | None, max_cases: int | None, seed: int
) -> JitReport:
    from spmdkit.local import shard_program
    from spmdkit.resharding import plan_reshard
    from spmdkit.verification.hlo import compiled_collectives

    report = JitReport(rule.name, dict(axis_sizes(mesh)))
    rng = np.random.default_rng(seed)
    amesh = auto_mesh(mesh)
    for ex in examples or rule.examples:
        attrs = dict(ex.attrs)
        fn = functools.partial(rule.impl, **without_strategy(attrs))
        lists = _input_specs(ex, mesh)
        big = math.prod(len(x) for x in lists) > _LAZY_ABOVE
        combos = _combos(lists, 4096, rng) if big else list(itertools.product(*lists))
        combos = [  # jit arguments hold no padded shards: even, whole values only
            c for c in combos if not any(s.partial for s in c) and all(s.is_even(mesh) for s in c)
        ]
        for specs in _sample(combos, max_cases, rng):
            res = infer_forward(rule.name, *specs, mesh=mesh, **attrs)
            if any(s.partial for s in res.inputs) or not all(
                s.is_even(mesh) for s in (*res.inputs, *res.outputs)
            ):
                continue
            targets = [o.without_partial() for o in res.outputs]
            predicted = [
                c
                for o, t in zip(res.outputs, targets, strict=True)
                for c in plan_reshard(o, t, mesh).collectives
            ]
            dtypes = ex.dtypes or ("float32",) * len(ex.shapes)
            args = [
                jax.ShapeDtypeStruct(s.shape, np.dtype(d), sharding=s.to_named_sharding(amesh))
                for s, d in zip(res.inputs, dtypes, strict=True)
            ]
            if rule.has_custom_local_fn:
                # The rule runs its own local computation: compile exactly that program.
                if not all(s.is_even(mesh) for s in (*res.inputs, *res.outputs)):
                    continue
                predicted = [*res.collectives, *predicted]
                program = shard_program(rule, res, attrs, amesh)
                compiled = compiled_collectives(program, *args)
            else:
                out_sh = tuple(t.to_named_sharding(amesh) for t in targets)
                compiled = compiled_collectives(
                    lambda *a, fn=fn: fn(*a),
                    *args,
                    out_shardings=out_sh if len(out_sh) > 1 else out_sh[0],
                )
            report.cases += 1
            why = _compare(predicted, compiled)
            if why:
                ins = ", ".join(map(str, res.inputs))
                outs = ", ".join(map(str, res.outputs))
                report.mismatches.append(f"{dict(attrs)} ({ins}) -> ({outs}): {why}")
    return report


def _compare(predicted: Sequence[Any], compiled: Sequence[Any]) -> str | None:
    """Differences between predicted and compiled collectives (None when they agree).

    A pending reduction over several axes may compile as one all-reduce over all
    of them or one per axis (see :func:`spmdkit.verification.hlo.check_plan`); both are accepted.
    """
    from spmdkit.verification.hlo import check_plan

    diffs = check_plan(list(predicted), compiled, all_reduce_per_axis=True)
    return "; ".join(diffs) if diffs else None
