"""``shard_map`` as every spmdkit region builds it, on every supported jax.

Inside a ``shard_map`` that checks types (``check_vma=True``, the default), every
value is typed with the manual axes it varies over, and most primitives refuse
operands whose types disagree. jax's own wrappers (``lax.add``, ``lax.mul``...)
first cast an operand the same on every device of an axis to varying over it.
jax 0.12's ``lax.polynomial`` does not: its coefficients, constants that vary over
nothing, reach ``polynomial_p`` next to an ``x`` that varies, and tracing fails
with ``Primitive polynomial requires varying manual axes to match``. jax 0.12
reaches it from the derivative of ``erf`` (so from ``jax.grad`` of an exact
``jax.nn.gelu``, of ``erfc`` and of ``erfcx``), from ``jnp.sinc`` and from
``jnp.polyval``: any rule, region or model body that uses them inside a checked
``shard_map``.

:func:`shard_map` is the one way spmdkit builds a ``shard_map`` (rule programs,
composite-op regions, the rule-testing sweeps, the pipeline, the enforced replay,
resharding). It first makes ``polynomial_p`` cast its operands as the other
n-ary primitives do (:func:`vary_polynomial_operands`), once per process, on the
jax versions that have the primitive: every operand is made varying over the
manual axes some operand varies over (``jax.lax.pcast(..., to="varying")``, a
no-op where the types already agree and outside ``shard_map``). The values are
the same; only the types, and so the transposes, change as for ``lax.mul``.

Example::

    >>> f = shard_map(jax.grad(lambda x: jax.scipy.special.erf(x).sum()),
    ...               mesh=mesh, in_specs=P("x"), out_specs=P("x"))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = ["shard_map", "vary_polynomial_operands", "varying_axes"]


def varying_axes(x: Any) -> frozenset[Any]:
    """The manual axes ``x`` is typed varying over inside a checked ``shard_map``
    (empty outside one, or where jax does not type it)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    found = getattr(mat, "varying", None)
    if found is None:
        found = getattr(aval, "vma", None) or ()  # an older spelling
    return frozenset(found)


def _vary_alike(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args``, each cast varying over every manual axis some of them vary over."""
    each = [varying_axes(a) for a in args]
    every = frozenset().union(*each)
    if all(v == every for v in each):
        return args
    return tuple(
        jax.lax.pcast(a, tuple(sorted(every - v, key=str)), to="varying") if every - v else a
        for a, v in zip(args, each, strict=True)
    )


def vary_polynomial_operands() -> bool:
    """Make ``jax.lax.polynomial_p`` cast its operands to one varying type before it
    binds (module docstring); idempotent.

    Returns:
      Whether this jax has the primitive (jax 0.12+); without it there is nothing
      to cast.
    """
    prim = getattr(jax.lax, "polynomial_p", None)
    if prim is None:
        return False
    if getattr(prim.bind, "_spmdkit_vary", False):
        return True
    bind = prim.bind

    def bind_varying(*args: Any, **params: Any) -> Any:
        return bind(*_vary_alike(args), **params)

    bind_varying._spmdkit_vary = True  # type: ignore[attr-defined]
    prim.bind = bind_varying
    return True


def shard_map(
    f: Callable[..., Any],
    *,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = True,
    **kwargs: Any,
) -> Callable[..., Any]:
    """``jax.shard_map(f, ...)`` with ``polynomial_p``'s operands cast alike first
    (:func:`vary_polynomial_operands`), so that a body differentiating ``erf``
    traces on jax 0.12 as on earlier releases.

    Args:
      f: the per-device function.
      mesh: the mesh (``Mesh`` or ``AbstractMesh``).
      in_specs: ``PartitionSpec`` per argument (a pytree prefix).
      out_specs: ``PartitionSpec`` per result.
      check_vma: type values by the manual axes they vary over (jax's default).
      **kwargs: passed on (``axis_names=``: the axes made manual).

    Returns:
      The function ``jax.shard_map`` returns.
    """
    vary_polynomial_operands()
    return jax.shard_map(
        f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, **kwargs
    )
