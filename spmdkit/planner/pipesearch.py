"""What auto searches when asked for pipelines: pipe degrees, meshes, configurations.

``sk.plan(model, mesh, "auto", pipeline="auto")`` costs pipelined candidates
beside the usual ones (:mod:`spmdkit.planner.search`); this module says which:

- **Pipe degrees and meshes** (:func:`pipe_meshes`): a mesh with a ``pipe``
  axis is used as it is (its size is the degree). A mesh without one has its
  data axis (the axis named ``data``, else the first axis with more than one
  device) split into ``pipe × data`` for every degree ``p ≥ 2`` that divides
  both that axis and the layer count: ``data=64, model=8`` gives
  ``pipe=8, data=8, model=8`` among others. The pipe axis goes right before the
  data axis (major to it), so with the topology's node heuristic it spans nodes
  and its sends use the inter-node link. The plan's mesh then has the ``pipe``
  axis: build the devices' mesh the same way, ``sk.make_mesh(pipe=8, data=8,
  model=8)`` (the same devices in the same order as ``data=64, model=8``),
  or take it from ``plan.mesh``'s axis names and sizes.
- **Configurations** (:func:`pipeline_configs`): micro-batch counts ``m`` that
  divide each data-parallel replica's batch (the five largest powers of two); for ``m ≥ p``
  1F1B and, where ``p · v`` divides the layers and ``p`` divides ``m``,
  interleaved 1F1B with ``v ∈ {2, 4}`` virtual stages; for ``m < p``
  (1F1B needs ``m ≥ p``) F-then-B with input release. GPipe is never proposed:
  it has F-then-B's bubble and holds more (:mod:`spmdkit.planner.pipecost`),
  and F-then-B has 1F1B's bubble and holds more where 1F1B runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from jax.sharding import AbstractMesh, Mesh

from spmdkit.pipeline import Pipeline, PipelineError
from spmdkit.spec import MeshLike, axis_sizes

__all__ = [
    "MICROBATCH_COUNTS",
    "PIPE_AXIS",
    "VIRTUAL",
    "data_axis",
    "pipe_meshes",
    "pipeline_configs",
    "reference",
    "split_mesh",
]

#: The mesh axis pipelined plans put their stages on.
PIPE_AXIS = "pipe"

#: Virtual stages per device auto tries with the interleaved schedule.
VIRTUAL = (2, 4)

#: How many micro-batch counts auto tries per pipe degree: the largest powers
#: of two that divide a replica's batch (more micro-batches: a smaller bubble and
#: fewer activations held; fewer: less per-micro-batch communication).
MICROBATCH_COUNTS = 5


def data_axis(mesh: MeshLike) -> str | None:
    """The axis a mesh without a pipe axis gives its stages from: ``data`` if it
    has one, else its first axis with more than one device (None: no such axis)."""
    sizes = axis_sizes(mesh)
    if sizes.get("data", 1) > 1:
        return "data"
    return next((a for a, s in sizes.items() if s > 1), None)


def split_mesh(mesh: MeshLike, stages: int, axis: str = PIPE_AXIS) -> MeshLike:
    """``mesh`` with its data axis (:func:`data_axis`) split into ``axis × data``.

    The devices keep their order (a ``Mesh``'s device array is reshaped), so
    ``split_mesh(make_mesh(data=8, model=2), 2)`` is ``make_mesh(pipe=2, data=4,
    model=2)``.

    Args:
        mesh: a ``Mesh`` or ``AbstractMesh`` without ``axis``.
        stages: the pipe axis's size; it must divide the data axis.
        axis: the new axis's name.

    Raises:
        PipelineError: no data axis, or ``stages`` does not divide it.

    Example::

        >>> split_mesh(abstract_mesh(data=64, model=8), 8).axis_names
        ('pipe', 'data', 'model')
    """
    sizes = axis_sizes(mesh)
    data = data_axis(mesh)
    if data is None or sizes[data] % stages:
        raise PipelineError(
            op="plan",
            must=f"a mesh without a '{axis}' axis has a data axis that {stages} stages divide",
            given=str(sizes),
            fix=f"add a '{axis}' axis to the mesh (sk.make_mesh({axis}={stages}, ...)) "
            "or pick stages that divide the data axis",
        )
    names: list[str] = []
    shape: list[int] = []
    for a, s in sizes.items():
        if a == data:
            names += [axis, a]
            shape += [stages, s // stages]
        else:
            names.append(a)
            shape.append(s)
    types = tuple(getattr(mesh, "axis_types", ()) or ())
    if types:
        i = list(sizes).index(data)
        types = (*types[:i], types[i], *types[i:])
    if isinstance(mesh, Mesh):
        devices = np.asarray(mesh.devices).reshape(shape)
        return Mesh(devices, tuple(names), axis_types=types or None)
    return AbstractMesh(tuple(shape), tuple(names), axis_types=types or None)


def pipe_meshes(mesh: MeshLike, layers: int, stages: int | None = None) -> list[MeshLike]:
    """The meshes auto pipelines over (module docstring), smallest degree first.

    Args:
        mesh: the mesh given to ``plan``.
        layers: the stacked layer count (degrees must divide it).
        stages: a fixed degree (a given :class:`~spmdkit.pipeline.Pipeline`), or
            None for every degree.
    """
    sizes = axis_sizes(mesh)
    if PIPE_AXIS in sizes:
        return [mesh] if sizes[PIPE_AXIS] > 1 else []
    if stages is not None:
        return [split_mesh(mesh, stages)]
    data = data_axis(mesh)
    if data is None or layers < 2:
        return []
    return [
        split_mesh(mesh, p)
        for p in range(2, sizes[data] + 1)
        if sizes[data] % p == 0 and layers % p == 0
    ]


def pipeline_configs(
    stages: int, layers: int, local_batch: int, request: Pipeline | None = None
) -> list[Pipeline]:
    """The configurations auto costs for one degree (module docstring).

    Args:
        stages: the pipe axis's size.
        layers: the stacked layer count.
        local_batch: one data-parallel replica's batch (micro-batches divide it).
        request: a fixed configuration: just it, when it fits these.

    Returns:
        Valid configurations, fewest micro-batches first.
    """
    if request is not None:
        ok = (
            request.stages == stages
            and layers % request.chunks == 0
            and local_batch % request.microbatches == 0
        )
        return [request] if ok else []
    out: list[Pipeline] = []
    counts = [2**k for k in range(int(math.log2(max(local_batch, 1))) + 1)]
    counts = [c for c in counts if local_batch % c == 0][-MICROBATCH_COUNTS:]
    for m in counts:
        if layers % stages:
            break
        if m < stages:
            out.append(Pipeline(stages, m, "fthenb"))
            continue
        out.append(Pipeline(stages, m, "1f1b"))
        for v in VIRTUAL:
            if layers % (stages * v) == 0 and m % stages == 0:
                out.append(Pipeline(stages, m, "interleaved", virtual=v))
    return out


def reference(configs: Sequence[Pipeline]) -> Pipeline:
    """The configuration layouts are searched under: the most micro-batches
    (the smallest bubble and activations), 1F1B where it runs."""
    most = max(c.microbatches for c in configs)
    top = [c for c in configs if c.microbatches == most]
    return next((c for c in top if c.schedule == "1f1b"), top[0])
