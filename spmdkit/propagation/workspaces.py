"""The buffers XLA:CPU takes where it expands an op it has no kernel for.

The liveness estimate (:mod:`spmdkit.propagation.memory`, ``cpu=True``) adds them;
GPUs and TPUs run these ops natively and take none of them.

- **Max pool's gradient** (:func:`select_and_scatter_workspace`): XLA:CPU expands
  ``select_and_scatter`` into a variadic reduce-window over the padded operand and
  one int32 iota per dimension, which finds each window's argmax position, and a
  scatter-add of the source into a zero-filled padded buffer at those positions.
  The reduce-window runs as soon as the operand exists (with the forward pool) and
  the positions stay alive until the gradient; XLA's scheduler makes the
  operand-less iotas and zero-filled buffer at the start of the program.
- **Convolution with batch groups** (the filter gradient of a grouped or depthwise
  convolution, :func:`batch_group_workspace`): one dense convolution ``groups``
  times the result's size, masked to its diagonal groups and reduced: two such
  buffers while it runs (measured on a 7x7 depthwise convolution's gradient, 16
  and 32 channels: XLA's temp is exactly those two).
- **Grouped GEMM** (``ragged_dot_general``, :func:`ragged_dot_workspace`): jax
  lowers it on CPU by expanding each ragged operand to ``[groups, ...]`` (each
  group's copy keeps its own rows, the others zeroed) and contracting that densely.
  With the rows ragged (the forward GEMM ``[m, k] x [g, k, n]`` and the gradient
  of its rows) the expanded rows are copied into the dot's layout (``g`` times
  the rows' bytes) and so is the weight (its bytes), both while the dot runs.
  With the contracting dim ragged (the weights' gradient ``[g, k, n]``) both
  operands are expanded (``g`` times each), each made as soon as its operand
  exists (XLA's scheduler puts the forward's rows' expansion before the forward
  GEMM) and held until the dot.
- **16-bit float dots read transposed** (:func:`float32_dot`, jaxlib 0.11 and
  later, :class:`CpuBackend`): XLA:CPU runs a bfloat16 or float16 dot natively
  (its YNNPACK fusion: 16-bit operands and result) when the left operand contracts
  its last dim, and XLA's dot canonicalization (DotDecomposer) copies every dot
  that is not already ``[batch, m, k] x [batch, k, n]``-shaped into that form. A
  dot that is already canonical but contracts its left operand's first free dim
  (``xT @ dy``, a 2-D weight gradient; ``bhqk,bhqd->bhkd``, attention's value
  gradient) runs as a float32 Eigen dot instead: each 16-bit operand gets a
  float32 copy, made as soon as the operand exists and held until the dot, and
  the result is float32. jaxlib 0.10 ran every 16-bit dot in float32, on float32
  operands that the backend holds as such throughout (``widen``).

``out`` below is the liveness estimate's collector of backend buffers: ``hold(first,
last, nbytes, at=None)`` for bytes live from node ``first`` to node ``last``, and
``at(i, nbytes)`` for bytes live while node ``i`` runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from spmdkit.propagation.graph import Graph
from spmdkit.propagation.primitives import grouped_groups_split, grouped_partial
from spmdkit.spec import MeshLike

__all__ = [
    "CpuBackend",
    "SIXTEEN_BIT_FLOATS",
    "ScatterWorkspace",
    "RaggedWorkspace",
    "batch_group_workspace",
    "cpu_workspaces",
    "float32_dot",
    "ragged_dot_workspace",
    "select_and_scatter_workspace",
]


#: The 16-bit float dtypes XLA:CPU computes with in float32 or natively.
SIXTEEN_BIT_FLOATS = frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})


@dataclass(frozen=True)
class CpuBackend:
    """What the liveness estimate models of one XLA:CPU (``cpu=`` of
    :func:`~spmdkit.propagation.memory.liveness`; ``True`` is the default one).

    Attributes:
      native_16bit_dots: the backend runs 16-bit float dots natively, except those
        :func:`float32_dot` names (jaxlib 0.11 and later): their temporaries keep
        their 16-bit size, where ``False`` (jaxlib 0.10) holds them in float32
        through the estimate's ``widen``.
    """

    native_16bit_dots: bool = False


def float32_dot(lhs_rank: int, rhs_rank: int, dimension_numbers: Any) -> bool:
    """Whether XLA:CPU runs a 16-bit ``dot_general`` of these ranks and dimension
    numbers as a float32 Eigen dot when it runs 16-bit dots natively (module
    docstring): the dot is canonical (batch dims leading and in order on both
    sides, one contracting dim, at most one free dim per operand), so it is not
    copied into the native form, and its left operand contracts the dim before
    its free one.

    Example::

        >>> dims = lambda lc, rc, lb=(), rb=(): ((lc, rc), (lb, rb))
        >>> float32_dot(2, 2, dims((1,), (0,)))  # x @ w: native
        False
        >>> float32_dot(2, 2, dims((0,), (0,)))  # x.T @ dy, a weight gradient
        True
        >>> float32_dot(3, 3, dims((0, 1), (0, 1)))  # bsd,bsf->df: copied, native
        False
        >>> float32_dot(4, 4, dims((2,), (2,), (0, 1), (0, 1)))  # bhqk,bhqd->bhkd
        True
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = tuple(lc), tuple(rc), tuple(lb), tuple(rb)
    batch = tuple(range(len(lb)))
    lfree = [d for d in range(lhs_rank) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs_rank) if d not in rc and d not in rb]
    canonical = lb == batch and rb == batch and len(lc) == 1 and len(lfree) <= 1 and len(rfree) <= 1
    return canonical and bool(lfree) and lc[0] < lfree[0]


def cpu_workspaces(graph: Graph, layout: Any, mesh: MeshLike, out: Any) -> None:
    """Add XLA:CPU's workspaces of ``graph``'s equations to ``out`` (module
    docstring); ``layout(v)`` is value ``v``'s :class:`~spmdkit.spec.TensorSpec`."""
    _scatter_workspaces(graph, layout, mesh, out)
    _batch_group_workspaces(graph, layout, mesh, out)
    _ragged_dot_workspaces(graph, layout, mesh, out)


@dataclass(frozen=True)
class ScatterWorkspace:
    """Bytes XLA:CPU's expansion of one ``select_and_scatter`` takes besides the
    operand, the source and the gradient (module docstring).

    Attributes:
      iotas: one int32 per padded element and operand dimension (each element's
        position): XLA:CPU's scheduler makes these operand-less buffers at the
        start of the program; they live until the positions are computed.
      zeros: the zero-filled padded buffer the source is scattered into: made at
        the start too, alive until it becomes the gradient (a padded one is
        sliced as its consumer reads it).
      indices: each window's argmax position, one int32 per window and operand
        dimension: from the forward pool (when the operand exists) to the gradient.
      forward: the padded operand (when there is padding) and each window's
        maximum: while the positions are computed.
    """

    iotas: int
    zeros: int
    indices: int
    forward: int


def select_and_scatter_workspace(
    shape: Sequence[int],
    operand_itemsize: int,
    source_itemsize: int,
    window_dimensions: Sequence[int],
    window_strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
) -> ScatterWorkspace:
    """The workspace of XLA:CPU's ``select_and_scatter`` on an operand of ``shape``
    (per device), from the equation's window (see :class:`ScatterWorkspace`).

    Example::

        >>> # a 3x3/2 SAME max pool's gradient on f32[8,16,16,32]
        >>> w = select_and_scatter_workspace(
        ...     (8, 16, 16, 32), 4, 4, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (0, 1), (0, 1), (0, 0)))
        >>> w.iotas, w.zeros, w.indices, w.forward  # padded: 8*17*17*32; windows: 8*8*8*32
        (1183744, 295936, 262144, 361472)
    """
    rank = len(shape)
    padded = [n + lo + hi for n, (lo, hi) in zip(shape, padding, strict=True)]
    windows = [
        max(0, (p - w) // s + 1)
        for p, w, s in zip(padded, window_dimensions, window_strides, strict=True)
    ]
    n_padded, n_windows = int(np.prod(padded)), int(np.prod(windows))
    pad_copy = n_padded * operand_itemsize if any(lo or hi for lo, hi in padding) else 0
    return ScatterWorkspace(
        iotas=rank * n_padded * 4,
        zeros=n_padded * source_itemsize,
        indices=rank * n_windows * 4,
        forward=pad_copy + n_windows * operand_itemsize,
    )


def _scatter_workspaces(graph: Graph, layout: Any, mesh: MeshLike, out: Any) -> None:
    """The workspaces of the ``select_and_scatter_add`` equations (XLA:CPU): the
    positions are computed at the operand's first reader (the forward pool, or
    the equation itself); iotas and zeros are made at the start."""
    first: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        for v in node.ins:
            first.setdefault(v, i)
    for i, node in enumerate(graph.nodes):
        if node.prim != "select_and_scatter_add" or node.eqn is None:
            continue
        source, operand = layout(node.ins[0]), layout(node.ins[1])
        p = node.eqn.params
        ws = select_and_scatter_workspace(
            operand.local_shape(mesh),
            operand.itemsize,
            source.itemsize,
            p["window_dimensions"],
            p["window_strides"],
            p["padding"],
        )
        k = first[node.ins[1]]
        out.hold(0, k, ws.iotas)
        out.at(k, ws.forward)
        out.hold(k, i, ws.indices, at=k)
        if i > 0:
            out.hold(0, i - 1, ws.zeros)


def batch_group_workspace(local_bytes: int, groups: int, operand_bytes: int = 0) -> int:
    """XLA:CPU's workspace for a convolution with ``batch_group_count`` ``groups``
    (per device), a result of ``local_bytes`` and operands of ``operand_bytes``:
    its group converter runs it as one dense convolution whose result is
    ``groups`` times as large (alive with the operands), then masks that to the
    diagonal groups (a second buffer of the same size, alive with the first once
    the operands are freed) and reduces it to the result. This is the filter
    gradient of a grouped (depthwise) convolution.

    Example::

        >>> batch_group_workspace(7 * 7 * 16 * 4, 16)  # a 7x7 depthwise kernel, 16 channels
        100352
    """
    if groups <= 1:
        return 0
    dense = groups * local_bytes
    return dense + max(0, dense - operand_bytes)


def _batch_group_workspaces(graph: Graph, layout: Any, mesh: MeshLike, out: Any) -> None:
    """The workspaces of convolutions with batch groups (XLA:CPU), while each runs."""
    for i, node in enumerate(graph.nodes):
        if node.prim != "conv_general_dilated" or node.eqn is None:
            continue
        p = node.eqn.params
        if p.get("batch_group_count", 1) <= 1:
            continue
        spec = layout(node.outs[0])
        feature = p["dimension_numbers"].out_spec[1]
        shape = spec.local_shape(mesh)
        groups = p["batch_group_count"] * shape[feature] // spec.shape[feature]
        operands = sum(layout(v).local_bytes(mesh) for v in node.ins)
        out.at(i, batch_group_workspace(spec.local_bytes(mesh), max(1, groups), operands))


class RaggedWorkspace(NamedTuple):
    """XLA:CPU's buffers for one ``ragged_dot_general`` (module docstring).

    Attributes:
      early: bytes made as soon as their operand exists and held until the dot, per
        operand (``lhs``, ``rhs``): the expanded operands of a ragged contraction.
      during: bytes live while the dot runs: the expanded rows and the weight's
        copy of a ragged-rows GEMM.
    """

    early: tuple[int, int]
    during: int


def ragged_dot_workspace(
    lhs_bytes: int, rhs_bytes: int, groups: int, *, ragged_contracting: bool
) -> RaggedWorkspace:
    """The workspace of XLA:CPU's ``ragged_dot_general`` with per-device operands of
    ``lhs_bytes`` and ``rhs_bytes`` and ``groups`` groups (module docstring).

    Example::

        >>> # [256, 64] rows, 4 experts of [64, 48]: the forward grouped GEMM
        >>> ragged_dot_workspace(256 * 64 * 4, 4 * 64 * 48 * 4, 4, ragged_contracting=False)
        RaggedWorkspace(early=(0, 0), during=311296)
    """
    if ragged_contracting:
        return RaggedWorkspace((groups * lhs_bytes, groups * rhs_bytes), 0)
    return RaggedWorkspace((0, 0), groups * lhs_bytes + rhs_bytes)


def _ragged_dot_workspaces(graph: Graph, layout: Any, mesh: MeshLike, out: Any) -> None:
    """The workspaces of the ``ragged_dot_general`` equations (XLA:CPU): the number
    of groups is the local extent of the weight's group dim (ragged rows) or of the
    result's leading dim (a ragged contraction makes ``[groups, ...]``), two more
    (empty ones before and after the device's own) where the enforced replay runs
    the rule's local computation (a result partial over the groups' axes, or a
    ragged contraction's split over them:
    :func:`~spmdkit.propagation.primitives.grouped_partial`,
    :func:`~spmdkit.propagation.primitives.grouped_groups_split`)."""
    producer = {o: i for i, node in enumerate(graph.nodes) for o in node.outs}
    for i, node in enumerate(graph.nodes):
        if node.prim != "ragged_dot_general" or node.eqn is None:
            continue
        dims = node.eqn.params["ragged_dot_dimension_numbers"]
        (contracting, _), _ = dims.dot_dimension_numbers
        ragged = tuple(dims.lhs_ragged_dimensions)
        lhs, rhs = layout(node.ins[0]), layout(node.ins[1])
        contract = bool(ragged) and ragged[0] in tuple(contracting)
        if contract:
            groups = layout(node.outs[0]).local_shape(mesh)[0]
        else:
            (g_dim,) = tuple(dims.rhs_group_dimensions)[:1] or (0,)
            groups = rhs.local_shape(mesh)[g_dim]
        rhs_bytes = rhs.local_bytes(mesh)
        out_layout = layout(node.outs[0])
        if grouped_partial(node.eqn, rhs, out_layout) or grouped_groups_split(node.eqn, out_layout):
            # run per device by the rule's local computation: two empty groups more
            rhs_bytes = rhs_bytes * (groups + 2) // max(groups, 1)
            groups += 2
        ws = ragged_dot_workspace(
            lhs.local_bytes(mesh), rhs_bytes, groups, ragged_contracting=contract
        )
        for v, nbytes in zip(node.ins[:2], ws.early, strict=True):
            if nbytes:
                out.hold(min(producer[v] + 1, i) if v in producer else 0, i, nbytes, at=i)
        if ws.during:
            out.at(i, ws.during)
