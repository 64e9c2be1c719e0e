"""Meshes: real ones over devices, abstract ones for planning.

Axis types are chosen on purpose. :func:`make_mesh` and :func:`abstract_mesh`
default to ``Explicit`` axes: shardings are part of the types (``jax.typeof``
shows ``f32[8@data,32]``), jaxprs show layouts without compiling, and an
impossible layout raises instead of silently replicating (Auto axes let
``with_sharding_constraint`` replicate a dim that does not divide, jax#26946).
Pass ``axis_types="auto"`` to hand propagation to Shardy instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

from spmdkit.errors import SpmdError

__all__ = [
    "abstract_mesh",
    "auto_mesh",
    "data_axis",
    "make_mesh",
    "split_axis",
    "use_virtual_cpu_devices",
]

AxisTypes = Literal["explicit", "auto"] | Sequence[Literal["explicit", "auto"]]


def _axis_types(axis_types: AxisTypes, n: int, op: str) -> tuple[AxisType, ...]:
    names = [axis_types] * n if isinstance(axis_types, str) else list(axis_types)
    table = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
    if len(names) != n or any(t not in table for t in names):
        raise SpmdError(
            op=op,
            must=f"axis_types is 'explicit', 'auto', or one of those per axis ({n} axes)",
            given=repr(axis_types),
            fix="pass axis_types='explicit' (default) or axis_types='auto'",
        )
    return tuple(table[t] for t in names)


def _check_axes(axes: dict[str, int], op: str) -> None:
    if not axes:
        raise SpmdError(
            op=op,
            must="at least one mesh axis is named",
            given="no axes",
            fix="call e.g. make_mesh(data=2, model=4)",
        )
    for name, size in axes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise SpmdError(
                op=op,
                must="every axis size is a positive int",
                given=f"{name}={size!r}",
                fix="pass sizes like data=2, model=4",
            )


def use_virtual_cpu_devices(n: int = 8) -> bool:
    """Ask JAX for ``n`` virtual CPU devices if its backends have not started yet.

    Returns True when the setting took effect (or was already in place), False when
    JAX had already started with a different count (set
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before starting Python).
    """
    try:
        jax.config.update("jax_num_cpu_devices", n)
        return True
    except RuntimeError:  # the backends have started: only a count they already have works
        pass
    try:
        return len(jax.devices("cpu")) >= n
    except RuntimeError:
        return False


def make_mesh(
    *,
    axis_types: AxisTypes = "explicit",
    devices: Sequence[jax.Device] | None = None,
    **axes: int,
) -> Mesh:
    """A device mesh with named axes, in the order given.

    With no accelerator and too few CPU devices, asks JAX for virtual CPU devices
    (works only before JAX's backends start; otherwise raises with the fix). Under
    ``jax.distributed`` it uses the global device list as it is.

    Args:
      axis_types: ``"explicit"`` (default; see the module docstring) or ``"auto"``,
        or one per axis.
      devices: devices to use (default: the first ``prod(sizes)`` of ``jax.devices()``).
      **axes: axis name → size, e.g. ``data=2, model=4``.

    Example::

        >>> mesh = make_mesh(data=2, model=4)
        >>> mesh.axis_names
        ('data', 'model')
    """
    _check_axes(axes, "make_mesh")
    need = math.prod(axes.values())
    types = _axis_types(axis_types, len(axes), "make_mesh")
    if devices is None:
        if not jax.distributed.is_initialized():
            # Under jax.distributed each process keeps the device share it was started
            # with; raising its local count would put the whole mesh on one process.
            use_virtual_cpu_devices(max(need, 8))
        devices = jax.devices()
    if len(devices) < need:
        raise SpmdError(
            op="make_mesh",
            must=f"the mesh has at most as many devices as are available ({len(devices)})",
            given=f"{dict(axes)} = {need} devices",
            fix=(
                "shrink the mesh, use sk.abstract_mesh(...) to plan without devices, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX starts"
            ),
        )
    return jax.make_mesh(
        tuple(axes.values()), tuple(axes), axis_types=types, devices=list(devices)[:need]
    )


def abstract_mesh(*, axis_types: AxisTypes = "explicit", **axes: int) -> AbstractMesh:
    """A mesh with no devices, for planning (e.g. 1024 GPUs on a laptop).

    Example::

        >>> abstract_mesh(data=128, model=8).size
        1024
    """
    _check_axes(axes, "abstract_mesh")
    types = _axis_types(axis_types, len(axes), "abstract_mesh")
    return AbstractMesh(tuple(axes.values()), tuple(axes), axis_types=types)


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis ``Auto`` (``mesh`` itself if so).

    Used where XLA must choose layouts between pinned values (``jit`` with
    sharding constraints); other meshes (abstract ones) are returned unchanged.

    Example::

        >>> auto_mesh(make_mesh(data=2, model=4)).axis_types
        (AxisType.Auto, AxisType.Auto)
    """
    if isinstance(mesh, Mesh) and any(t != AxisType.Auto for t in mesh.axis_types):
        return Mesh(
            mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
        )
    return mesh


def data_axis(mesh: Mesh | AbstractMesh) -> str | None:
    """The axis a pipeline or context parallelism is carved out of: ``data`` if the
    mesh has one with more than one device, else its first such axis (None: none).

    Example::

        >>> data_axis(abstract_mesh(model=1, batch=4))
        'batch'
    """
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    if sizes.get("data", 1) > 1:
        return "data"
    return next((a for a, n in sizes.items() if n > 1), None)


def split_axis(
    mesh: Mesh | AbstractMesh, axis: str, new: str, size: int, *, major: bool
) -> Mesh | AbstractMesh:
    """``mesh`` with ``axis`` split in two: ``new`` of ``size`` devices and ``axis``
    of the rest, ``new`` the major (``major=True``: ``new × axis``) or the minor
    (``axis × new``) part. The new axis takes ``axis``'s type, and a ``Mesh``'s
    devices keep their order (its device array is reshaped), so a minor part holds
    neighbouring devices. The caller checks that ``size`` divides ``axis``.

    Example::

        >>> split_axis(abstract_mesh(data=8, model=2), "data", "pipe", 2, major=True).axis_names
        ('pipe', 'data', 'model')
    """
    names: list[str] = []
    shape: list[int] = []
    types: list = []
    kinds = tuple(getattr(mesh, "axis_types", ()) or ()) or (None,) * len(mesh.axis_names)
    for a, n, t in zip(mesh.axis_names, mesh.axis_sizes, kinds, strict=True):
        parts = [(a, n)] if a != axis else [(a, n // size), (new, size)]
        for name, m in parts[::-1] if a == axis and major else parts:
            names.append(name)
            shape.append(m)
            types.append(t)
    kept = tuple(types) if kinds[0] is not None else None
    if isinstance(mesh, Mesh):
        devices = mesh.devices.reshape(shape)
        return Mesh(devices, tuple(names), axis_types=kept)
    return AbstractMesh(tuple(shape), tuple(names), axis_types=kept)
