"""Topology: what a collective over some mesh axes costs on real links.

The cost model is the alpha-beta (latency-bandwidth) model of ring collectives.
A collective over a group of ``n`` devices takes ``steps`` latency hops and pushes
``wire_bytes`` per device through the slowest link of the group::

    time = latency * steps + wire_bytes / bandwidth
    steps = n - 1        for all_gather, reduce_scatter, all_to_all
    steps = 2 (n - 1)    for all_reduce (reduce-scatter then all-gather)
    steps = 0            for local ops (slice, to_partial)

Which link a group uses is decided per mesh axis. An axis named in
``bandwidth=`` / ``latency=`` uses those numbers. Otherwise, when
``gpus_per_node`` is set, the *node heuristic* applies: mesh axes are laid out
major → minor over the device list (as ``jax.make_mesh`` does on one host kind),
so the minor-most axes whose sizes multiply to at most ``gpus_per_node`` stay
inside one node and use ``node_bandwidth`` / ``node_latency``; every more major
axis crosses nodes and uses ``default_bandwidth`` / ``default_latency``. A group
spanning several axes runs at the pace of its slowest axis (minimum bandwidth,
maximum latency) when its axes share one link. A group spanning links of different
speeds runs hierarchically, as NCCL's multi-node collectives and the classic 2-D
all-reduce do: the fastest link first on the whole buffer, each slower link on the
piece the faster levels leave, so an all-reduce over (nodes, GPUs in a node) sends
only 1/8 of the buffer over InfiniBand. All-to-alls stay flat at the slowest link.
This is a heuristic: a device order that interleaves nodes differently needs
explicit per-axis numbers.

Compute and overlap
-------------------
A topology also says how fast a device computes: peak FLOP/s per compute dtype
(``peak_flops``; H100 SXM and A100 SXM datasheet figures, dense, no sparsity),
the fraction of that peak that matmuls and attention reach in a real training
step (``matmul_efficiency``, ``attention_efficiency``), how much of the compute
time XLA's latency-hiding scheduler can hide collectives under (``overlap``:
the next layer's FSDP all-gather and the gradient reduce-scatters and
all-reduces run while the current layer computes; tensor-parallel all-reduces
and expert all-to-alls sit on the critical path and are never hidden), and the
host link that optimizer-state offload uses (``host_bandwidth``).

The matmul efficiency is calibrated, not measured here: with torchtitan's
recipe (FSDP, selective recompute keeping matmul outputs, bf16 compute on fp32
master weights), the step-time model reproduces its published Llama-3 8B
throughput on 8 H100s (5,762 tokens/s/GPU at seq 8192, 2 sequences per GPU)
when weight matmuls run at 43% of the bf16 peak, given attention at 35% (an
assumption: fused attention's forward + backward on H100 at head_dim 128, between
FlashAttention-2's and cuDNN's published rates) and collectives hidden under 90%
of compute. torchtitan's 128-GPU figure (5,605) is the hold-out check.
``benchmarks/planner.py`` refits the constant and prints both estimates beside
the published figures (docs/recipes.md, "Real sizes and the step-time model").
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from spmdkit.errors import SpmdError
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.util import H100_BF16_PEAK_FLOPS

__all__ = [
    "A100_PEAK_FLOPS",
    "COLLECTIVE_KINDS",
    "DEFAULT_TOPOLOGY",
    "H100_PEAK_FLOPS",
    "LOCAL_KINDS",
    "Topology",
]

#: Reshard steps that move no data between devices.
LOCAL_KINDS = frozenset({"slice", "to_partial"})

#: Reshard steps that communicate.
COLLECTIVE_KINDS = frozenset(
    {"all_gather", "all_reduce", "reduce_scatter", "all_to_all", "collective_permute"}
)

# Published link numbers behind Topology.h100 (per GPU, per direction).
_NVLINK4_BANDWIDTH = 450e9  # H100 SXM NVLink 4: 900 GB/s bidirectional
_NVLINK4_LATENCY = 5e-6
_IB_NDR_BANDWIDTH = 50e9  # InfiniBand NDR: 400 Gb/s per GPU
_IB_NDR_LATENCY = 10e-6
_PCIE5_BANDWIDTH = 50e9  # host link, PCIe Gen5 x16 per GPU, per direction (achievable)
_PCIE4_BANDWIDTH = 25e9

#: H100 SXM dense peak FLOP/s per compute dtype (NVIDIA datasheet, no sparsity).
H100_PEAK_FLOPS = {
    "float8": 1978.9e12,
    "bfloat16": H100_BF16_PEAK_FLOPS,
    "float16": H100_BF16_PEAK_FLOPS,
    "tfloat32": 494.7e12,
    "float32": 66.9e12,
}
#: A100 SXM dense peak FLOP/s (no float8 tensor cores).
A100_PEAK_FLOPS = {
    "bfloat16": 312e12,
    "float16": 312e12,
    "tfloat32": 156e12,
    "float32": 19.5e12,
}

# Calibrated on torchtitan's Llama-3 8B / 8 H100 measurement (module docstring).
_MATMUL_EFFICIENCY = 0.43
_ATTENTION_EFFICIENCY = 0.35
_OVERLAP = 0.9


def _table(
    value: Mapping[str, float] | Iterable[tuple[str, float]], name: str
) -> tuple[tuple[str, float], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    out = []
    for axis, raw in items:
        number = float(raw)
        bad = number < 0 if name == "latency" else number <= 0
        if bad:
            raise SpmdError(
                op="Topology",
                must="bandwidths are > 0 bytes/s, peak FLOP/s > 0, latencies >= 0 s",
                given=f"{name}[{axis!r}] = {number}",
                fix="pass bytes per second (e.g. 450e9), FLOP/s (e.g. 989e12) and "
                "seconds (e.g. 5e-6)",
            )
        out.append((str(axis), number))
    return tuple(sorted(out))


@dataclass(frozen=True)
class Topology:
    """Per-mesh-axis link bandwidth (bytes/s) and latency (s).

    Frozen and hashable (the mappings are stored as sorted tuples), so plans that
    depend on it can be cached.

    Args:
      bandwidth: mesh axis → bandwidth override, bytes/s per device per direction.
      latency: mesh axis → latency override, seconds per hop.
      default_bandwidth: bandwidth of axes with no override that cross nodes (all
        such axes when ``gpus_per_node`` is None).
      default_latency: latency of those axes.
      gpus_per_node: devices per node, for the node heuristic (module docstring);
        None turns it off.
      node_bandwidth: bandwidth of intra-node axes under the node heuristic.
      node_latency: latency of intra-node axes under the node heuristic.
      peak_flops: compute dtype (``"bfloat16"``, ``"float8"``, ``"tfloat32"``,
        ``"float32"``, ...) → dense peak FLOP/s per device.
      matmul_efficiency: fraction of the peak weight matmuls reach in a step.
      attention_efficiency: fraction of the peak attention (score and value
        matmuls, batched dots) reaches.
      overlap: fraction of compute time under which overlappable collectives hide.
      host_bandwidth: device↔host bytes/s per device per direction (offload).

    Example::

        >>> topo = Topology(bandwidth={"data": 25e9, "model": 450e9})
        >>> topo.link(("model",), abstract_mesh(data=4, model=8))
        (450000000000.0, 1e-05)
    """

    bandwidth: Mapping[str, float] | tuple[tuple[str, float], ...] = ()
    latency: Mapping[str, float] | tuple[tuple[str, float], ...] = ()
    default_bandwidth: float = _IB_NDR_BANDWIDTH
    default_latency: float = _IB_NDR_LATENCY
    gpus_per_node: int | None = None
    node_bandwidth: float = _NVLINK4_BANDWIDTH
    node_latency: float = _NVLINK4_LATENCY
    peak_flops: Mapping[str, float] | tuple[tuple[str, float], ...] = tuple(H100_PEAK_FLOPS.items())
    matmul_efficiency: float = _MATMUL_EFFICIENCY
    attention_efficiency: float = _ATTENTION_EFFICIENCY
    overlap: float = _OVERLAP
    host_bandwidth: float = _PCIE5_BANDWIDTH

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", _table(self.bandwidth, "bandwidth"))
        object.__setattr__(self, "latency", _table(self.latency, "latency"))
        object.__setattr__(self, "peak_flops", _table(self.peak_flops, "peak_flops"))
        for name in ("matmul_efficiency", "attention_efficiency", "overlap"):
            value = float(getattr(self, name))
            low_ok = value >= 0 if name == "overlap" else value > 0
            if not (low_ok and value <= 1):
                raise SpmdError(
                    op="Topology",
                    must=f"{name} is a fraction in (0, 1]"
                    + (" (0 allowed: no overlap)" if name == "overlap" else ""),
                    given=str(value),
                    fix=f"pass e.g. {name}=0.4",
                )
            object.__setattr__(self, name, value)
        if not float(self.host_bandwidth) > 0:
            raise SpmdError(
                op="Topology",
                must="host_bandwidth is > 0 bytes/s",
                given=str(self.host_bandwidth),
                fix="pass bytes per second, e.g. 50e9 (PCIe Gen5 x16)",
            )
        object.__setattr__(self, "host_bandwidth", float(self.host_bandwidth))
        for name in ("default_bandwidth", "node_bandwidth"):
            value = float(getattr(self, name))
            if not value > 0:
                raise SpmdError(
                    op="Topology",
                    must=f"{name} is > 0 bytes/s",
                    given=str(value),
                    fix="pass bytes per second, e.g. 50e9",
                )
            object.__setattr__(self, name, value)
        for name in ("default_latency", "node_latency"):
            value = float(getattr(self, name))
            if value < 0:
                raise SpmdError(
                    op="Topology",
                    must=f"{name} is >= 0 s",
                    given=str(value),
                    fix="pass seconds, e.g. 5e-6",
                )
            object.__setattr__(self, name, value)
        gpn = self.gpus_per_node
        if gpn is not None and (isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1):
            raise SpmdError(
                op="Topology",
                must="gpus_per_node is a positive int or None",
                given=repr(gpn),
                fix="pass e.g. gpus_per_node=8",
            )

    @classmethod
    def h100(cls, gpus_per_node: int = 8) -> Topology:
        """A cluster of H100 SXM nodes.

        Inside a node NVLink 4 gives ≈ 450 GB/s per direction per GPU with ≈ 5 µs
        per hop; across nodes InfiniBand NDR (400 Gb/s per GPU) gives ≈ 50 GB/s
        with ≈ 10 µs per hop. Intra- vs inter-node follows the node heuristic of
        the module docstring.

        Args:
          gpus_per_node: GPUs per node (8 on a DGX/HGX H100).

        Example::

            >>> Topology.h100().link(("model",), abstract_mesh(data=16, model=8))
            (450000000000.0, 5e-06)
        """
        return cls(
            default_bandwidth=_IB_NDR_BANDWIDTH,
            default_latency=_IB_NDR_LATENCY,
            gpus_per_node=gpus_per_node,
            node_bandwidth=_NVLINK4_BANDWIDTH,
            node_latency=_NVLINK4_LATENCY,
        )

    @classmethod
    def a100(cls, gpus_per_node: int = 8) -> Topology:
        """A cluster of A100 SXM nodes: NVLink 3 (≈ 300 GB/s per direction) inside
        a node, HDR InfiniBand (200 Gb/s, ≈ 25 GB/s per GPU) across, PCIe Gen4
        host links, A100 peaks (no float8)."""
        return cls(
            default_bandwidth=25e9,
            default_latency=_IB_NDR_LATENCY,
            gpus_per_node=gpus_per_node,
            node_bandwidth=300e9,
            node_latency=_NVLINK4_LATENCY,
            peak_flops=A100_PEAK_FLOPS,
            host_bandwidth=_PCIE4_BANDWIDTH,
        )

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s of one device computing in ``dtype``.

        ``dtype`` is a dtype name (``"bfloat16"``, ``"float32"``, ``"float8"``,
        ``"float8_e4m3fn"``, ``"tfloat32"``); float8 variants share ``"float8"``.

        Raises:
          SpmdError: the device has no peak for that dtype (float8 on an A100).

        Example::

            >>> Topology.h100().peak("bfloat16")
            989000000000000.0
        """
        name = "float8" if str(dtype).startswith("float8") else str(dtype)
        table = dict(self.peak_flops)
        if name not in table:
            raise SpmdError(
                op="Topology.peak",
                must=f"the compute dtype is one of {sorted(table)}",
                given=repr(dtype),
                fix="compute in a dtype this device has tensor cores for, or pass "
                "peak_flops={dtype: FLOP/s} to Topology",
            )
        return table[name]

    def compute_time(self, matmul_flops: float, attention_flops: float, dtype: str) -> float:
        """Seconds to run ``matmul_flops`` of weight matmuls and ``attention_flops``
        of attention in ``dtype`` at this device's achievable rates."""
        peak = self.peak(dtype)
        return matmul_flops / (peak * self.matmul_efficiency) + attention_flops / (
            peak * self.attention_efficiency
        )

    def exposed_comm(self, hidden_s: float, exposed_s: float, compute_s: float) -> float:
        """Communication time left on the critical path: ``exposed_s`` (collectives
        that cannot overlap) plus the part of ``hidden_s`` (overlappable ones) that
        ``overlap × compute_s`` cannot cover."""
        return exposed_s + max(0.0, hidden_s - self.overlap * compute_s)

    def intra_node_axes(self, mesh: MeshLike) -> frozenset[str]:
        """Mesh axes the node heuristic places inside one node (empty when off)."""
        if self.gpus_per_node is None:
            return frozenset()
        inside: set[str] = set()
        product = 1
        for name, size in reversed(list(axis_sizes(mesh).items())):
            product *= size
            if product > self.gpus_per_node:
                break
            inside.add(name)
        return frozenset(inside)

    def link(self, axes: tuple[str, ...], mesh: MeshLike) -> tuple[float, float]:
        """``(bandwidth, latency)`` of a device group spanning ``axes`` of ``mesh``.

        Each axis gets its override, else the intra-node link when the node
        heuristic puts it inside a node, else the defaults; the group takes the
        minimum bandwidth and the maximum latency of its axes.

        Raises:
          SpmdError: an axis is not a mesh axis.

        Example::

            >>> mesh = abstract_mesh(data=2, model=8)
            >>> Topology.h100().link(("data", "model"), mesh)
            (50000000000.0, 1e-05)
        """
        return _link(self, tuple(axes), tuple(axis_sizes(mesh).items()))

    def _link_uncached(
        self, axes: tuple[str, ...], sizes_items: tuple[tuple[str, int], ...]
    ) -> tuple[float, float]:
        sizes = dict(sizes_items)
        mesh = _SizesOnly(sizes)
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            raise SpmdError(
                op="Topology.link",
                must=f"every axis is a mesh axis of {tuple(sizes)}",
                given=f"{tuple(axes)}",
                fix="name axes of the mesh the plan runs on",
            )
        bw_over, lat_over = dict(self.bandwidth), dict(self.latency)
        inside = self.intra_node_axes(mesh)
        bandwidth, latency = float("inf"), 0.0
        for a in axes:
            bw = self.node_bandwidth if a in inside else self.default_bandwidth
            lat = self.node_latency if a in inside else self.default_latency
            bandwidth = min(bandwidth, bw_over.get(a, bw))
            latency = max(latency, lat_over.get(a, lat))
        if not axes:
            bandwidth = self.default_bandwidth
        return bandwidth, latency

    def collective_time(
        self,
        kind: str,
        wire_bytes: int,
        group_size: int,
        axes: tuple[str, ...],
        mesh: MeshLike,
    ) -> float:
        """Alpha-beta time (s) of one ring collective.

        ``latency * steps + wire_bytes / bandwidth`` with ``steps = n - 1`` for
        all_gather / reduce_scatter / all_to_all, ``2 (n - 1)`` for all_reduce,
        1 for a collective_permute (each device sends one buffer to one peer),
        and 0 s for local kinds or a group of one device.

        Args:
          kind: ``"all_gather"``, ``"all_reduce"``, ``"reduce_scatter"``,
            ``"all_to_all"``, or a local kind (``"slice"``, ``"to_partial"``).
          wire_bytes: bytes each device sends.
          group_size: devices in the group.
          axes: mesh axes the group spans.
          mesh: the mesh.

        Example::

            >>> Topology.h100().collective_time(
            ...     "all_gather", 3 * 2**20, 4, ("x",), abstract_mesh(x=4))
            2.199...e-05
        """
        if kind in LOCAL_KINDS or group_size <= 1:
            return 0.0
        if kind not in COLLECTIVE_KINDS:
            raise SpmdError(
                op="Topology.collective_time",
                must=f"kind is one of {sorted(COLLECTIVE_KINDS | LOCAL_KINDS)}",
                given=repr(kind),
                fix="use the kind names of spmdkit.resharding.Collective",
            )
        if kind == "collective_permute":
            bandwidth, latency = self.link(axes, mesh)
            return latency + wire_bytes / bandwidth
        levels = self._levels(tuple(axes), mesh)
        if len(levels) <= 1 or kind == "all_to_all":
            bandwidth, latency = self.link(axes, mesh)
            steps = 2 * (group_size - 1) if kind == "all_reduce" else group_size - 1
            return latency * steps + wire_bytes / bandwidth
        # Hierarchical: the fastest level first on the whole buffer, each slower level
        # on the 1/n piece the faster ones leave (reduce-scatter down the levels; an
        # all-reduce climbs back up with the mirror all-gathers, doubling the time).
        rounds = 2 if kind == "all_reduce" else 1
        full = wire_bytes * group_size / (rounds * (group_size - 1))
        time, piece = 0.0, full
        for n, bandwidth, latency in levels:
            time += rounds * ((n - 1) * latency + (n - 1) / n * piece / bandwidth)
            piece /= n
        return time

    def _levels(self, axes: tuple[str, ...], mesh: MeshLike) -> list[tuple[int, float, float]]:
        """The group's axes merged by link, fastest first: ``(devices, bw, latency)``."""
        sizes = axis_sizes(mesh)
        by_link: dict[tuple[float, float], int] = {}
        for a in axes:
            link = self.link((a,), mesh)
            by_link[link] = by_link.get(link, 1) * sizes[a]
        return [(n, bw, lat) for (bw, lat), n in sorted(by_link.items(), key=lambda kv: -kv[0][0])]


#: The topology plans use when none is given: H100 nodes of 8 GPUs.
DEFAULT_TOPOLOGY = Topology.h100()


class _SizesOnly:
    """Just enough of a mesh for :func:`axis_sizes` (names and sizes)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.axis_names = tuple(sizes)
        self.axis_sizes = tuple(sizes.values())


@functools.lru_cache(maxsize=4096)
def _link(
    topology: Topology, axes: tuple[str, ...], sizes_items: tuple[tuple[str, int], ...]
) -> tuple[float, float]:
    return topology._link_uncached(axes, sizes_items)
