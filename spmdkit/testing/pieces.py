"""Values and their pieces: what a check feeds a rule and reads back.

A random global value in an op's domain (:func:`random_value`); every device's
local piece of it under a spec (:func:`local_pieces`: partial values split
asymmetrically, uneven blocks padded so a leak is caught); the global value
rebuilt from pieces read as a claimed spec (:func:`assemble`: replicated copies
must agree); and the specs a sweep tries (:func:`enumerate_specs`, with the
combinations of an example's input specs sampled deterministically).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from spmdkit.engine.rule import Example
from spmdkit.spec import REDUCE_OPS, TensorSpec, axis_sizes

__all__ = [
    "assemble",
    "enumerate_specs",
    "every_combination",
    "example_input_specs",
    "local_pieces",
    "random_value",
    "sample_combinations",
    "spec_combinations",
    "values_close",
]


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
    if np.issubdtype(dt, np.complexfloating):
        parts = rng.standard_normal((2, *shape))
        return (parts[0] + 1j * parts[1]).astype(dt)
    if domain == "positive":
        return rng.uniform(0.5, 2.0, size=shape).astype(dt)
    if domain == "near_one":
        return rng.uniform(0.8, 1.25, size=shape).astype(dt)
    if domain == "unit":
        return rng.uniform(-0.9, 0.9, size=shape).astype(dt)
    if domain == "above_one":
        return rng.uniform(1.25, 3.0, size=shape).astype(dt)
    return rng.standard_normal(shape).astype(dt)


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
    out = np.full((*sizes.values(), *local), _padding_value(value.dtype), dtype=value.dtype)
    names = list(sizes)
    for c in _device_coords(sizes):
        coord = dict(zip(names, c, strict=True))
        sl = _block_slices(spec, coord, sizes)
        out[(*c, *_unpadded(sl))] = value[sl]
    # The value is the reduction over the partial axes in listed order, so the
    # split runs in reverse: the last-reduced axis is split first.
    for p, op in reversed(spec.partial):
        k = names.index(p)
        others = [a for a in names if a != p]
        # Devices that differ only along replicated axes must hold equal pieces:
        # draw one split per distinct coordinate along the axes the spec uses.
        splits: dict[tuple[int, ...], list[np.ndarray]] = {}
        for c in _device_coords({a: sizes[a] for a in others}):
            at = [*c[:k], 0, *c[k:]]
            key = tuple(i for a, i in zip(others, c, strict=True) if a in spec.used_axes)
            if key not in splits:
                splits[key] = _asymmetric_parts(out[tuple(at)].copy(), sizes[p], op, rng, domain)
            for j, part in enumerate(splits[key]):
                at[k] = j
                out[tuple(at)] = part
    return out


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
            if not values_close(np.take(arr, [j], axis=k), first, rtol):
                return None, f"claimed replicated over {a!r} but device copies differ"
        arr = first
    out = np.empty(spec.shape, dtype=arr.dtype)
    for c in _device_coords(sizes):
        coord = dict(zip(names, c, strict=True))
        src = tuple(coord[a] if a in spec.sharding_axes else 0 for a in names)
        sl = _block_slices(spec, coord, sizes)
        out[sl] = arr[(*src, *_unpadded(sl))]
    return out, None


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
# Comparing values, sampling spec combinations (shared with the checks)
# ---------------------------------------------------------------------------


def values_close(a: np.ndarray, b: np.ndarray, rtol: float) -> bool:
    """Whether a checked value ``a`` matches the reference ``b``: exactly for ints and
    bools, else within ``rtol`` relative to ``b``'s largest finite magnitude (NaNs
    match NaNs: the padding of uneven blocks); complex values part by part."""
    if a.shape != b.shape:
        return False
    if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
        return bool(np.array_equal(a, b))
    if np.iscomplexobj(a) or np.iscomplexobj(b):
        return values_close(np.real(a), np.real(b), rtol) and values_close(
            np.imag(a), np.imag(b), rtol
        )
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = np.abs(b64[np.isfinite(b64)])
    scale = max(1.0, float(np.max(finite, initial=0.0)))
    return bool(np.allclose(a64, b64, rtol=rtol, atol=rtol * scale, equal_nan=True))


def example_input_specs(ex: Example, mesh: Mesh) -> list[list[TensorSpec]]:
    """Each input's candidate specs for ``ex``: partial ones for floats only, uneven
    ones when the example allows them."""
    dtypes = ex.dtypes or ("float32",) * len(ex.shapes)
    out = []
    for shape, dt in zip(ex.shapes, dtypes, strict=True):
        floating = jnp.issubdtype(np.dtype(dt), jnp.floating)
        ops = REDUCE_OPS if floating else ()
        out.append(enumerate_specs(shape, mesh, dtype=dt, partial_ops=ops, even_only=not ex.uneven))
    return out


def sample_combinations(
    combos: list[tuple[TensorSpec, ...]], limit: int | None, rng: np.random.Generator
) -> list[tuple[TensorSpec, ...]]:
    """``limit`` of ``combos`` drawn at random, always including the first (all
    replicated), in their listed order; all of them when fewer or ``limit`` is None."""
    if limit is None or len(combos) <= limit:
        return combos
    keep = {0}  # all replicated
    keep |= {int(i) for i in rng.choice(len(combos), size=limit - 1, replace=False)}
    return [combos[i] for i in sorted(keep)]


#: Above this many combinations the sweep samples them by index instead of listing them.
_LAZY_ABOVE = 200_000


def spec_combinations(
    lists: Sequence[Sequence[TensorSpec]], limit: int | None, rng: np.random.Generator
) -> list[tuple[TensorSpec, ...]]:
    """A deterministic sample of ``limit`` input-spec combinations (all of them when
    fewer), without materialising the product when it is huge (many operands)."""
    total = math.prod(len(x) for x in lists)
    if total <= _LAZY_ABOVE or limit is None:
        return sample_combinations(list(itertools.product(*lists)), limit, rng)
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


def every_combination(
    lists: Sequence[Sequence[TensorSpec]], rng: np.random.Generator, *, cap: int = 4096
) -> list[tuple[TensorSpec, ...]]:
    """Every input-spec combination in order, or, when the product is too large to
    list, a deterministic sample of ``cap`` of them."""
    if math.prod(len(x) for x in lists) > _LAZY_ABOVE:
        return spec_combinations(lists, cap, rng)
    return list(itertools.product(*lists))


# ---------------------------------------------------------------------------
# Blocks, padding and asymmetric splits
# ---------------------------------------------------------------------------


def _device_coords(sizes: Mapping[str, int]) -> Iterable[tuple[int, ...]]:
    """Every device's coordinates on a mesh of axis ``sizes``, in mesh order."""
    return itertools.product(*(range(n) for n in sizes.values()))


def _block_slices(
    spec: TensorSpec, coord: Mapping[str, int], sizes: Mapping[str, int]
) -> tuple[slice, ...]:
    """The slices of the global value that the device at ``coord`` holds under ``spec``."""
    out = []
    for n, axes in zip(spec.shape, spec.dims, strict=True):
        idx, count = 0, 1
        for a in axes:
            idx = idx * sizes[a] + coord[a]
            count *= sizes[a]
        step = -(-n // count)  # ceil: the last blocks may be short (padded on devices)
        out.append(slice(min(idx * step, n), min((idx + 1) * step, n)))
    return tuple(out)


def _unpadded(sl: tuple[slice, ...]) -> tuple[slice, ...]:
    """The part of a (padded) local block that holds real elements."""
    return tuple(slice(0, s.stop - s.start) for s in sl)


def _is_float(dtype: np.dtype) -> bool:
    """Floating point, including the ml_dtypes floats (bfloat16, float8) numpy does not know."""
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _padding_value(dtype: np.dtype) -> Any:
    """Padding of uneven blocks: NaN for floats (so a leak into a real output is caught)."""
    if _is_float(dtype) or np.issubdtype(dtype, np.complexfloating):
        return np.nan
    return False if dtype == np.bool_ else 0


def _asymmetric_parts(
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
        parts = _asymmetric_parts(np.where(pad, 0, base).astype(base.dtype), n, op, rng, domain)
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
