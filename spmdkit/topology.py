"""Topology: what a collective over some mesh axes costs on real links.

The cost model is the alpha-beta (latency-bandwidth) model of ring collectives.
A collective over a group of ``n`` devices takes ``steps`` latency hops and pushes
``wire_bytes`` per device through the slowest link of the group::

    time = latency * steps + wire_bytes / bandwidth
    steps = n - 1        for all_gather, reduce_scatter, all_to_all
    steps = 2 (n - 1)    for all_reduce (reduce-scatter then all-gather)
    steps = 0            for local ops (slice, to_partial)

With ``tree_all_reduce`` (H100, A100) an all-reduce pays the lower of the ring's
latency and NCCL's tree's, ``2 ((m - 1) + ceil(log2 nodes))`` hops for ``m`` devices
a node (NCCL's tuner picks per call, ``src/graph/tuning.cc``), bytes as the ring.

Which link a group uses is decided per mesh axis. An axis named in ``bandwidth=`` /
``latency=`` uses those numbers. Otherwise, when ``gpus_per_node`` is set, the *node
heuristic* applies: mesh axes are laid out major → minor over the device list (as
``jax.make_mesh`` does on one host kind), so the minor-most axes whose sizes multiply to at
most ``gpus_per_node`` stay inside one node and use ``node_bandwidth`` / ``node_latency``;
every more major axis crosses nodes and uses ``default_bandwidth`` / ``default_latency``. A
group spanning several axes runs at the pace of its slowest axis (minimum bandwidth, maximum
latency) when its axes share one link. A group spanning links of different speeds runs
hierarchically, as NCCL's multi-node collectives and the classic 2-D all-reduce do: the
fastest link first on the whole buffer, each slower link on the piece the faster levels
leave, so an all-reduce over (nodes, GPUs in a node) sends only 1/8 of the buffer over
InfiniBand. An all-to-all over such a group sends each peer its piece directly: the pieces
for peers one fast level away go over that level's link while those for farther peers cross
the slower ones, all at once, so it takes as long as its slowest level's share (over (2
nodes, 8 GPUs) 8 of 15 pieces cross InfiniBand, not all of them). This is a heuristic: a
device order that interleaves nodes differently needs explicit per-axis numbers.

Compute and overlap
-------------------
A topology also says how fast a device computes, each constant with its source
(``docs/recipes.md``, "Step-time model and calibration"):

- ``peak_flops``: dense peak FLOP/s per compute dtype (H100 SXM and A100 SXM datasheets, no
  sparsity).
- Weight matmuls (:meth:`Topology.matmul_time`) run as GEMMs of a shape: an ``m × k``
  activation times a ``k × n`` weight. Their rate is a roofline: the tensor cores at
  ``matmul_efficiency`` of the peak (what a large, well-tiled GEMM reaches in a training step,
  fitted) times the tile and wave quantization of the output over ``gemm_tile`` tiles and
  ``sm_count`` multiprocessors (a GEMM of fewer tiles than multiprocessors splits ``k`` over
  them; few rows take a tile of 64), times ``k / (k + k_ramp)`` (the main loop's prologue and
  epilogue: small-k GEMMs lose more), unless the GEMM's operands take longer to stream through
  HBM (``hbm_bandwidth``) than its FLOPs take: small ``m`` (few tokens per device) makes a
  GEMM memory bound.
- Memory-bound work (elementwise chains as XLA fuses them, norms, softmax, casts, the
  optimizer update) is priced by the bytes crossing fusion boundaries over ``hbm_bandwidth``
  (:meth:`Topology.memory_time`); ``fusion_traffic`` scales them for a stack that fuses less
  (1 for XLA).
- Attention in a fused kernel (cuDNN's flash attention, what the models' ``"auto"`` attention
  runs on a GPU) runs at ``attention_efficiency`` of the peak and, causal, skips the key
  blocks above the diagonal (``attention_block`` keys a block); the blockwise fallback and
  plain XLA attention compute every block.
- ``overlap``: how much of the compute time XLA's latency-hiding scheduler can hide
  collectives under (the next layer's FSDP all-gather and the gradient reduce-scatters and
  all-reduces run while the current layer computes; tensor-parallel all-reduces and expert
  all-to-alls sit on the critical path and are never hidden).
- ``host_bandwidth``: the host link optimizer-state offload uses.

The free constants (``matmul_efficiency``, ``attention_efficiency``) are
fitted on published JAX/XLA runs (MaxText's Llama 2 70B on 64 H100s);
``Topology.h100(stack="pytorch")`` holds the ones fitted on torchtitan's
PyTorch runs (eager PyTorch, FlashAttention-2, unfused elementwise ops), the
cross-check, and ``stack="pytorch_compile"`` those of its ``torch.compile`` runs
(elementwise chains fused). ``benchmarks/calibration.py`` refits each and prints every
published row beside its prediction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from spmdkit.errors import SpmdError
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.state import cached
from spmdkit.util import H100_BF16_PEAK_FLOPS

__all__ = [
    "A100_PEAK_FLOPS",
    "CPU_CONSTANTS",
    "STACKS",
    "COLLECTIVE_KINDS",
    "DEFAULT_TOPOLOGY",
    "EXPERT_EXCHANGES",
    "H100_PEAK_FLOPS",
    "LOCAL_KINDS",
    "RAGGED_BACKENDS",
    "Topology",
    "host_cores",
    "mesh_platform",
    "topology_for",
]

#: Reshard steps that move no data between devices.
LOCAL_KINDS = frozenset({"slice", "to_partial"})

#: Backends whose XLA has a ragged all-to-all (``jax.lax.ragged_all_to_all``): a
#: routed experts' exchange there sends each peer only the rows routed to it, not
#: the padded buffer (:mod:`spmdkit.planner.experts`).
RAGGED_BACKENDS = frozenset({"gpu", "cuda", "rocm", "tpu"})

#: Reshard steps that communicate.
COLLECTIVE_KINDS = frozenset(
    {"all_gather", "all_reduce", "reduce_scatter", "all_to_all", "collective_permute"}
)

#: How routed experts' token exchange is priced (:attr:`Topology.expert_exchange`):
#: ``"all_to_all"`` (spmdkit's ``moe_experts`` op: every (token, expert) copy sent
#: from a buffer padded for the worst case); priced only, buffers sized to the rows
#: routed: ``"routed"`` (Megatron-LM's alltoall dispatcher) or ``"node_dedup"``
#: (a token over the network once per node holding its experts: DeepEP's).
EXPERT_EXCHANGES = ("all_to_all", "routed", "node_dedup")

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

# HBM bandwidth (datasheets): H100 SXM5 80 GB HBM3 3.35 TB/s; A100 SXM4 80 GB HBM2e 2.0 TB/s.
_H100_HBM = 3.35e12
_A100_HBM = 2.0e12
# Streaming multiprocessors: H100 SXM5 132, A100 108 (NVIDIA architecture whitepapers).
_H100_SMS = 132
_A100_SMS = 108
# Output tile of the bf16 GEMM kernels cuBLAS/XLA pick for large training GEMMs:
# 128 x 256 on Hopper (wgmma), 128 x 128 on Ampere (CUTLASS defaults).
_H100_TILE = (128, 256)
_A100_TILE = (128, 128)
# Main-loop ramp in elements of k: about four 64-wide k-tiles of prologue and
# epilogue per output tile (the software pipeline's depth).
_K_RAMP = 256
# Key block of the fused causal attention kernels (cuDNN, FlashAttention): 128.
_ATTENTION_BLOCK = 128

# Fitted on JAX/XLA's published runs (benchmarks/calibration.py, docs/recipes.md).
_MATMUL_EFFICIENCY = 0.66
_ATTENTION_EFFICIENCY = 0.50
_OVERLAP = 0.9

#: The constants of each software stack the model is calibrated for: ``"xla"``
#: (JAX/XLA: fused elementwise chains, cuDNN flash attention; fitted on
#: MaxText's Llama 2 70B), ``"pytorch"`` (torchtitan's eager PyTorch:
#: FlashAttention-2, every elementwise op its own kernel; fitted on its Llama 3.1
#: 8B / 8 H100 run, the cross-check) and ``"pytorch_compile"`` (torchtitan under
#: ``torch.compile``: the same FlashAttention-2 kernel, elementwise chains fused
#: by Inductor as XLA fuses them; fitted on the compiled Llama 3.1 8B / 8 H100
#: run).
STACKS: dict[str, dict[str, float]] = {
    "xla": {
        "matmul_efficiency": _MATMUL_EFFICIENCY,
        "attention_efficiency": _ATTENTION_EFFICIENCY,
        "fusion_traffic": 1.0,
    },
    "pytorch": {
        "matmul_efficiency": 0.38,
        "attention_efficiency": 0.32,
        "fusion_traffic": 3.0,
    },
    "pytorch_compile": {
        "matmul_efficiency": 0.43,
        "attention_efficiency": 0.32,
        "fusion_traffic": 1.0,
    },
}


#: Per-core constants of :meth:`Topology.cpu`, measured on a 2-core x86 host (AMD
#: EPYC) with 8 virtual devices all running at once (``benchmarks/overhead.py``,
#: ``measure_cpu_constants``; the figures are saved in
#: ``benchmarks/results/overhead.json``, ``auto_vs_presets.cpu_constants``): a
#: batched 256^3 matmul per device (f32 and bf16 ran at the same rate), an
#: elementwise pass and a 1 MiB all-reduce.
#: ``bf16_rate``: a bf16 or f16 step's rate against f32's, calibrated on the
#: step: the same layout (gpt tiny, tp_fsdp, data=2 x model=4) ran about 1.5x
#: slower with bf16 compute (XLA:CPU widens bf16 elementwise work to f32 and
#: back around each fusion), though a lone bf16 matmul ran at the f32 rate.
#: ``float8_rate``: a float8 step's rate against f32's. XLA:CPU has no float8
#: matmul: it widens each float8 operand to f32 and runs the f32 dot, after the
#: recipe's scale-and-cast of each operand, so a float8 step (gpt tiny, tp_fsdp
#: and fsdp on data=2 x model=4) ran slower than the f32 one, as a bf16 step does.
#: These rates are over the wall clock of a loaded, shared host (below the same
#: work's rates per CPU second, as ``measure_cpu_constants`` now measures them).
#: ``latency_per_hop_s``: per ring hop, the rendezvous of device threads that each
#: arrive after their compute on a time slice of the cores; it grows with the compute
#: between collectives (``measure_cpu_constants``' ``rendezvous_per_hop_s``), so a
#: chain of bare collectives measured it low (5 us): priced so, FSDP's many all-device
#: collectives looked cheaper than tensor parallelism's over groups of 2 or 4, the
#: opposite of the small reference models' measured steps (the auto-vs-presets table).
#: ``fresh_page_cpu_s``: the kernel's CPU seconds per 4 KiB page of a device's
#: temporaries that are fresh pages each step (faulted in and zero-filled; measured
#: by ``measure_fresh_pages`` on a program with 48 MiB of temporaries a device, one
#: fault a page) and ``fresh_pages_from``: the temporaries' bytes a device from which
#: they are (glibc's largest mmap threshold on 64-bit, 32 MiB: a program with 16 MiB
#: of temporaries a device reused its pages).
CPU_CONSTANTS: dict[str, float] = {
    "flops_per_core": 35e9,
    "bf16_rate": 0.5,
    "float8_rate": 0.5,
    "memory_bytes_per_core": 4e9,
    "latency_per_hop_s": 30e-6,
    "link_bytes_per_core": 2e9,
    "fresh_page_cpu_s": 2.2e-6,
    "fresh_pages_from": float(32 << 20),
}


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


def mesh_platform(mesh: MeshLike) -> str | None:
    """The platform of ``mesh``'s devices (``"cpu"``, ``"gpu"``...), None for an
    abstract mesh (no devices)."""
    try:
        return str(mesh.devices.flat[0].platform)
    except (AttributeError, IndexError, ValueError):  # AbstractMesh: ValueError
        return None


def _default_backend() -> str:
    import jax

    return jax.default_backend()


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
      matmul_efficiency: fraction of the peak a large, well-tiled GEMM reaches
        in a step (the roofline's ceiling, :meth:`matmul_time`).
      attention_efficiency: fraction of the peak attention (score and value
        matmuls, batched dots) reaches.
      overlap: fraction of compute time under which overlappable collectives hide.
      host_bandwidth: device↔host bytes/s per device per direction (offload).
      hbm_bandwidth: device memory bytes/s (memory-bound work, the roofline).
      sm_count: streaming multiprocessors (GEMM wave quantization).
      gemm_tile: ``(rows, cols)`` of a GEMM's output tile (tile quantization).
      k_ramp: elements of ``k`` a GEMM's main loop loses to its prologue and
        epilogue (small-k loss).
      attention_block: keys per block of the fused causal attention kernel.
      fusion_traffic: factor on the bytes at fusion boundaries (1: XLA's fusion;
        more for a stack that runs elementwise ops one kernel each).
      fresh_page_s: seconds a device's step spends per 4 KiB page of temporaries
        that come back as fresh pages each step (0: the allocator reuses its
        memory, as a GPU's does).
      fresh_pages_from: a device's temporaries in bytes from which they are fresh
        pages each step (XLA:CPU's temporaries are one allocation a device, which
        glibc maps afresh above its largest mmap threshold); None: never.
      tree_all_reduce: an all-reduce's latency the lower of the ring's and NCCL's
        tree's (module docstring); off: the ring's (plain alpha-beta; XLA:CPU).
      combines_all_reduces: whether the step's propagated all-reduces of one
        group of axes and one pass (forward, backward) pay one collective's
        latency, not one each (XLA:CPU's all-reduce combiner merges them; the
        GPU calibration prices each).
      expert_exchange: one of :data:`EXPERT_EXCHANGES`: how routed experts' token
        exchanges and their buffers are priced. ``"routed"`` and ``"node_dedup"``
        price forms spmdkit's executor does not run (a ``priced_only`` note;
        :mod:`spmdkit.planner.experts`, docs/moe.md).
      expert_overlap: price the experts' token exchanges as overlappable with
        compute in a step of two or more micro-batches (another micro-batch's
        compute hides them, as Megatron-LM's 1F1B all-to-all overlap runs them).
        Priced only: spmdkit's executor runs each micro-batch's exchanges on its
        own critical path (the ``priced_only`` note says so).
      exchange_sms: streaming multiprocessors an overlapped token exchange's
        kernels hold while they run (DeepEP's normal kernels run on SMs of
        their own: Megatron-LM's ``moe_deepep_num_sms``, 20 by default); the
        compute they overlap runs on the others, so each second of overlapped
        exchange costs ``exchange_sms / sm_count`` seconds of compute. 0: the
        exchange takes no SMs from the compute (a copy-engine transfer).
      moe_call_s: seconds one MoE layer's call adds per micro-batch (forward and backward)
        beyond its kernels' price: an eager framework's fixed cost per layer launch; priced
        only (0 for spmdkit's compiled step; the calibration's Megatron-LM rows fit it).
      platform: the XLA backend the devices run (``"gpu"``, ``"cpu"``, ...): which
        compiler passes the prediction follows on an abstract mesh
        (:meth:`target`); None: jax's default backend.
      name: what the plan table says its step was priced on (``"h100"``,
        ``"cpu: 8 devices on 2 cores"``, ``"custom"``).

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
    hbm_bandwidth: float = _H100_HBM
    sm_count: int = _H100_SMS
    gemm_tile: tuple[int, int] = _H100_TILE
    k_ramp: int = _K_RAMP
    attention_block: int = _ATTENTION_BLOCK
    fusion_traffic: float = 1.0
    fresh_page_s: float = 0.0
    fresh_pages_from: float | None = None
    tree_all_reduce: bool = False
    combines_all_reduces: bool = False
    expert_exchange: str = "all_to_all"
    expert_overlap: bool = False
    exchange_sms: int = 0
    moe_call_s: float = 0.0
    platform: str | None = "gpu"
    name: str = "custom"

    def __post_init__(self) -> None:
        self._check_device_constants()
        if not isinstance(self.name, str) or not self.name:
            raise SpmdError(
                op="Topology",
                must="name is a non-empty str",
                given=repr(self.name),
                fix='pass e.g. name="my cluster"',
            )
        if self.platform is not None and not (isinstance(self.platform, str) and self.platform):
            raise SpmdError(
                op="Topology",
                must="platform is a backend name (a non-empty str) or None",
                given=repr(self.platform),
                fix='pass e.g. platform="gpu" (or None: jax\'s default backend)',
            )
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
        links = ("default_bandwidth", "node_bandwidth", "default_latency", "node_latency")
        for name in (*links, "moe_call_s"):
            value, link = float(getattr(self, name)), name.endswith("bandwidth")
            if not (value > 0 if link else value >= 0):
                raise SpmdError(
                    op="Topology",
                    must=f"{name} is > 0 bytes/s" if link else f"{name} is >= 0 s",
                    given=str(value),
                    fix="pass bytes per second, e.g. 50e9" if link else "pass seconds, e.g. 5e-6",
                )
            object.__setattr__(self, name, value)
        self._check_expert_exchange()
        gpn = self.gpus_per_node
        if gpn is not None and (isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1):
            raise SpmdError(
                op="Topology",
                must="gpus_per_node is a positive int or None",
                given=repr(gpn),
                fix="pass e.g. gpus_per_node=8",
            )

    def _check_expert_exchange(self) -> None:
        if self.expert_exchange not in EXPERT_EXCHANGES:
            raise SpmdError(
                op="Topology",
                must=f"expert_exchange is one of {EXPERT_EXCHANGES}",
                given=repr(self.expert_exchange),
                fix="pass 'all_to_all' (what spmdkit runs), or, priced only, 'routed' "
                "(buffers of the rows routed) or 'node_dedup' (DeepEP's node dedup)",
            )
        if not isinstance(self.expert_overlap, bool):
            raise SpmdError(
                op="Topology",
                must="expert_overlap is a bool",
                given=repr(self.expert_overlap),
                fix="pass expert_overlap=True (priced only) or False",
            )
        sms = self.exchange_sms
        if isinstance(sms, bool) or not isinstance(sms, int) or not 0 <= sms < self.sm_count:
            raise SpmdError(
                op="Topology",
                must=f"exchange_sms is an int in [0, sm_count) = [0, {self.sm_count})",
                given=repr(sms),
                fix="pass the SMs the exchange kernels hold, e.g. exchange_sms=20 "
                "(DeepEP's normal kernels under Megatron-LM's default), or 0",
            )

    def _check_device_constants(self) -> None:
        page, start = float(self.fresh_page_s), self.fresh_pages_from
        if page < 0 or (start is not None and not float(start) >= 0):
            raise SpmdError(
                op="Topology",
                must="fresh_page_s is >= 0 s and fresh_pages_from >= 0 bytes (or None)",
                given=f"fresh_page_s = {self.fresh_page_s!r}, "
                f"fresh_pages_from = {self.fresh_pages_from!r}",
                fix="pass e.g. fresh_page_s=2e-6, fresh_pages_from=32 * 2**20",
            )
        object.__setattr__(self, "fresh_page_s", page)
        object.__setattr__(self, "fresh_pages_from", None if start is None else float(start))
        object.__setattr__(self, "combines_all_reduces", bool(self.combines_all_reduces))
        object.__setattr__(self, "tree_all_reduce", bool(self.tree_all_reduce))
        for name in ("hbm_bandwidth", "fusion_traffic"):
            value = float(getattr(self, name))
            if not value > 0:
                raise SpmdError(
                    op="Topology",
                    must=f"{name} is > 0",
                    given=str(value),
                    fix="pass e.g. hbm_bandwidth=3.35e12 (bytes/s), fusion_traffic=1.0",
                )
            object.__setattr__(self, name, value)
        tile = tuple(self.gemm_tile)
        ints = {"sm_count": self.sm_count, "attention_block": self.attention_block}
        ints.update({f"gemm_tile[{i}]": t for i, t in enumerate(tile)})
        ints["k_ramp + 1"] = self.k_ramp + 1 if isinstance(self.k_ramp, int) else self.k_ramp
        for name, value in ints.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or len(tile) != 2:
                raise SpmdError(
                    op="Topology",
                    must="sm_count, attention_block and both gemm_tile sizes are positive "
                    "ints, k_ramp an int >= 0",
                    given=f"{name} = {value!r}, gemm_tile = {self.gemm_tile!r}",
                    fix="pass e.g. sm_count=132, gemm_tile=(128, 256), k_ramp=256",
                )
        object.__setattr__(self, "gemm_tile", tile)

    @classmethod
    def h100(cls, gpus_per_node: int = 8, stack: str = "xla") -> Topology:
        """A cluster of H100 SXM nodes.

        Inside a node NVLink 4 gives ≈ 450 GB/s per direction per GPU with ≈ 5 µs
        per hop; across nodes InfiniBand NDR (400 Gb/s per GPU) gives ≈ 50 GB/s
        with ≈ 10 µs per hop. Intra- vs inter-node follows the node heuristic of
        the module docstring.

        Args:
          gpus_per_node: GPUs per node (8 on a DGX/HGX H100).
          stack: whose fitted compute constants (:data:`STACKS`): ``"xla"``
            (JAX/XLA, the default), ``"pytorch"`` (torchtitan's eager PyTorch) or
            ``"pytorch_compile"`` (torchtitan under ``torch.compile``).

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
            tree_all_reduce=True,
            **_stack(stack),
            name=_gpu_name("h100", gpus_per_node, stack),
        )

    @classmethod
    def a100(cls, gpus_per_node: int = 8, stack: str = "xla") -> Topology:
        """A cluster of A100 SXM nodes: NVLink 3 (≈ 300 GB/s per direction) inside
        a node, HDR InfiniBand (200 Gb/s, ≈ 25 GB/s per GPU) across, PCIe Gen4
        host links, A100 peaks (no float8), 2.0 TB/s HBM2e, 108 SMs, 128 × 128
        GEMM tiles; ``stack`` as for :meth:`h100` (fitted on H100 runs)."""
        return cls(
            hbm_bandwidth=_A100_HBM,
            sm_count=_A100_SMS,
            gemm_tile=_A100_TILE,
            **_stack(stack),
            default_bandwidth=25e9,
            default_latency=_IB_NDR_LATENCY,
            gpus_per_node=gpus_per_node,
            node_bandwidth=300e9,
            node_latency=_NVLINK4_LATENCY,
            peak_flops=A100_PEAK_FLOPS,
            host_bandwidth=_PCIE4_BANDWIDTH,
            tree_all_reduce=True,
            name=_gpu_name("a100", gpus_per_node, stack),
        )

    @classmethod
    def cpu(cls, devices: int, cores: int | None = None) -> Topology:
        """``devices`` virtual CPU devices sharing one host's ``cores``
        (``--xla_force_host_platform_device_count``, ``sk.use_virtual_cpu_devices``).

        The devices are threads of one process: while a step runs on all of them,
        each gets ``cores / devices`` of the host's matmul rate and memory
        bandwidth, so a replicated step costs ``devices`` times the host's work
        and a sharded one the host's work once. A collective is a rendezvous of
        device threads and copies through host memory: each ring hop costs
        :data:`CPU_CONSTANTS`'s latency, stretched by ``devices / cores`` when the
        threads outnumber the cores (they wait for each other to be scheduled).
        XLA:CPU runs collectives synchronously: nothing overlaps (``overlap=0``),
        and combines independent all-reduces into one (``combines_all_reduces``).
        A device's temporaries at or above glibc's largest mmap threshold come back
        as fresh pages each step, which the kernel faults in and zero-fills
        (``fresh_page_s``, ``fresh_pages_from``; :meth:`fresh_pages_time`).
        It has no bf16 or float8 matmul units (it widens those operands to f32),
        so both are priced below the f32 rate, float8 included so a float8 recipe
        plans and verifies on CPU devices as on an H100.
        The per-core constants (:data:`CPU_CONSTANTS`) were measured on a 2-core
        x86 host with 8 virtual devices (``benchmarks/overhead.py``).

        Args:
          devices: the mesh's devices (all running the step).
          cores: the host's cores (default: those this process may run on).

        Example::

            >>> Topology.cpu(8, cores=2).name
            'cpu: 8 devices on 2 cores'
        """
        cores = host_cores() if cores is None else cores
        for what, value in (("devices", devices), ("cores", cores)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpmdError(
                    op="Topology.cpu",
                    must=f"{what} is a positive int",
                    given=repr(value),
                    fix="pass the mesh's device count and the host's cores, e.g. cpu(8, cores=2)",
                )
        share = cores / devices
        rate = CPU_CONSTANTS["flops_per_core"] * share
        memory = CPU_CONSTANTS["memory_bytes_per_core"] * share
        return cls(
            default_bandwidth=CPU_CONSTANTS["link_bytes_per_core"] * share,
            default_latency=CPU_CONSTANTS["latency_per_hop_s"] * max(1.0, devices / cores),
            gpus_per_node=None,
            peak_flops={
                "float32": rate,
                "tfloat32": rate,
                "bfloat16": rate * CPU_CONSTANTS["bf16_rate"],
                "float16": rate * CPU_CONSTANTS["bf16_rate"],
                "float8": rate * CPU_CONSTANTS["float8_rate"],
            },
            matmul_efficiency=1.0,  # the constant is the rate a step's GEMMs reach
            attention_efficiency=1.0,
            overlap=0.0,
            host_bandwidth=memory,  # "host" memory is the same memory
            hbm_bandwidth=memory,
            sm_count=1,  # a core's GEMM: no waves, no tiles to quantize
            gemm_tile=(1, 1),
            k_ramp=0,
            # a device's pages on its share of the cores, as its compute
            fresh_page_s=CPU_CONSTANTS["fresh_page_cpu_s"] / share,
            fresh_pages_from=CPU_CONSTANTS["fresh_pages_from"],
            combines_all_reduces=True,
            platform="cpu",
            name=f"cpu: {devices} devices on {cores} cores",
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
        """Seconds to run ``matmul_flops`` of weight matmuls (at the large-GEMM
        ceiling) and ``attention_flops`` of attention in ``dtype``."""
        peak = self.peak(dtype)
        return matmul_flops / (peak * self.matmul_efficiency) + attention_flops / (
            peak * self.attention_efficiency
        )

    def gemm_efficiency(self, m: float, k: float, n: float) -> float:
        """Fraction of the peak an ``m × k`` by ``k × n`` GEMM reaches when
        compute bound: ``matmul_efficiency`` × tile and wave quantization of the
        ``m × n`` output × ``k / (k + k_ramp)`` (module docstring).

        Example::

            >>> round(Topology.h100().gemm_efficiency(8192, 8192, 8192), 3)
            0.621
        """
        tm, tn = self.gemm_tile
        m, n, k = max(m, 1.0), max(n, 1.0), max(k, 1.0)
        # few rows: the kernel takes a shorter tile, down to the 64 rows of an MMA
        tm = min(tm, max(64, 2 ** math.ceil(math.log2(m))))
        rows, cols = math.ceil(m / tm), math.ceil(n / tn)
        tiles = rows * cols
        quant = (m * n) / (rows * tm * cols * tn)
        if tiles >= self.sm_count:  # fewer tiles than SMs: split-k spreads them
            quant *= tiles / (math.ceil(tiles / self.sm_count) * self.sm_count)
        return self.matmul_efficiency * quant * k / (k + self.k_ramp)

    def matmul_time(
        self, flops: float, m: float, k: float, n: float, dtype: str, itemsize: int = 2
    ) -> float:
        """Seconds for ``flops`` FLOPs of GEMMs shaped ``m × k`` by ``k × n``
        (``flops / (2 m k n)`` of them) in ``dtype``: the roofline of
        :meth:`gemm_efficiency` against streaming each GEMM's operands and
        output (``itemsize`` bytes an element) through HBM.

        Example::

            >>> t = Topology.h100()
            >>> t.matmul_time(2 * 16 * 8192 * 8192, 16, 8192, 8192, "bfloat16") > (
            ...     2 * 16 * 8192 * 8192 / t.peak("bfloat16"))  # 16 tokens: memory bound
            True
        """
        if flops <= 0:
            return 0.0
        compute = flops / (self.peak(dtype) * self.gemm_efficiency(m, k, n))
        gemms = flops / (2.0 * max(m, 1.0) * max(k, 1.0) * max(n, 1.0))
        traffic = gemms * itemsize * (m * k + k * n + m * n) / self.hbm_bandwidth
        return max(compute, traffic)

    def memory_time(self, nbytes: float) -> float:
        """Seconds of memory-bound work moving ``nbytes`` through HBM at fusion
        boundaries (× ``fusion_traffic``)."""
        return nbytes * self.fusion_traffic / self.hbm_bandwidth

    def causal_share(self, seq: int) -> float:
        """Fraction of a causal attention's blocks a fused kernel computes at
        sequence length ``seq`` (it skips the blocks above the diagonal):
        ``(b + 1) / 2b`` for ``b`` key blocks of ``attention_block``."""
        blocks = max(math.ceil(seq / self.attention_block), 1)
        return (blocks + 1) / (2 * blocks)

    def target(self, mesh: MeshLike) -> str:
        """The XLA backend a plan on ``mesh`` is compiled by: the platform of the
        mesh's devices when it has devices (what runs), else :attr:`platform` (an
        abstract mesh: the cluster this topology describes, so an H100 plan made
        on a CPU-only machine predicts what XLA:GPU emits), else jax's default
        backend.

        Example::

            >>> Topology.h100().target(abstract_mesh(data=2, model=4))
            'gpu'
        """
        return mesh_platform(mesh) or self.platform or _default_backend()

    def fresh_pages_time(self, temp_bytes: float) -> float:
        """Seconds a device's step spends on its ``temp_bytes`` of temporaries
        coming back as fresh pages (the kernel faults each 4 KiB page in and
        zero-fills it): 0 below :attr:`fresh_pages_from` or where none are fresh.

        Example::

            >>> Topology.h100().fresh_pages_time(64 * 2**20)
            0.0
        """
        start = self.fresh_pages_from
        if start is None or temp_bytes < start:
            return 0.0
        return temp_bytes / 4096 * self.fresh_page_s

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

    def node_share(self, axes: Iterable[str], mesh: MeshLike) -> int:
        """Devices of a group spanning ``axes`` that share one node: the mesh's axes
        laid out major → minor over nodes of ``gpus_per_node`` devices (the node
        heuristic), an axis larger than the room a node has left split over nodes
        (its ``gcd`` with that room inside one). 1 when the heuristic is off.

        Example::

            >>> Topology.h100().node_share(("expert", "model"), abstract_mesh(expert=32, model=2))
            8
        """
        if self.gpus_per_node is None:
            return 1
        axes, room, share = set(axes), self.gpus_per_node, 1
        for name, size in reversed(list(axis_sizes(mesh).items())):
            inside = size if size <= room else math.gcd(size, room)
            if name in axes:
                share *= inside
            room = max(room // inside, 1)
        return share

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
        all_gather / reduce_scatter / all_to_all, ``2 (n - 1)`` for all_reduce
        (or :meth:`tree_latency`'s, lower, with ``tree_all_reduce``), 1 for a
        collective_permute (each device sends one buffer to one peer), and 0 s for
        local kinds or a group of one device.

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
        cut = 0.0  # NCCL's tree, where its latency is below the ring's
        if kind == "all_reduce" and self.tree_all_reduce and levels:
            ring = 2 * sum((n - 1) * lat for n, _, lat in levels)
            cut = max(0.0, ring - self.tree_latency(group_size, tuple(axes), mesh))
        if len(levels) <= 1:
            bandwidth, latency = self.link(axes, mesh)
            steps = 2 * (group_size - 1) if kind == "all_reduce" else group_size - 1
            return latency * steps + wire_bytes / bandwidth - cut
        if kind == "all_to_all":
            # each level's peers get their pieces over its link, the levels at once
            piece, near, time = wire_bytes / (group_size - 1), 1, 0.0
            for n, bandwidth, latency in levels:
                peers = near * n - near
                time = max(time, peers * (latency + piece / bandwidth))
                near *= n
            return time
        # Hierarchical: the fastest level first on the whole buffer, each slower level
        # on the 1/n piece the faster ones leave (reduce-scatter down the levels; an
        # all-reduce climbs back up with the mirror all-gathers, doubling the time).
        rounds = 2 if kind == "all_reduce" else 1
        full = wire_bytes * group_size / (rounds * (group_size - 1))
        time, piece = 0.0, full
        for n, bandwidth, latency in levels:
            time += rounds * ((n - 1) * latency + (n - 1) / n * piece / bandwidth)
            piece /= n
        return time - cut

    def tree_latency(self, group_size: int, axes: tuple[str, ...], mesh: MeshLike) -> float:
        """Latency (s) of an all-reduce over ``axes`` by NCCL's tree, up and down: the
        faster levels (:meth:`_levels`) chained, the slowest ``ceil(log2 n)`` deep
        where it crosses nodes (else chained)."""
        levels = self._levels(tuple(axes), mesh)
        if group_size <= 1 or not levels:
            return 0.0
        *inner, (n, _, latency) = levels
        chained = sum((m - 1) * lat for m, _, lat in inner)
        crosses = self.gpus_per_node is None or self.node_share(axes, mesh) < group_size
        hops = math.ceil(math.log2(n)) if crosses else n - 1
        return 2 * (chained + hops * latency)

    def _levels(
        self, axes: tuple[str, ...], mesh: MeshLike
    ) -> tuple[tuple[int, float, float], ...]:
        """The group's axes merged by link, fastest first: ``(devices, bw, latency)``
        (memoized per topology, axes and axis sizes: the planner asks millions of times)."""
        return _levels(self, axes, tuple(axis_sizes(mesh).items()))


def _gpu_name(kind: str, gpus_per_node: int, stack: str) -> str:
    extra = "" if stack == "xla" else f", {stack} constants"
    return f"{kind} ({gpus_per_node} GPUs a node{extra})"


def _stack(stack: str) -> dict[str, float]:
    if stack not in STACKS:
        raise SpmdError(
            op="Topology",
            must=f"stack is one of {sorted(STACKS)}",
            given=repr(stack),
            fix='pass stack="xla" (JAX/XLA), "pytorch" or "pytorch_compile" (the '
            "torchtitan cross-checks, eager and compiled)",
        )
    return dict(STACKS[stack])


class _SizesOnly:
    """Just enough of a mesh for :func:`axis_sizes` (names and sizes)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.axis_names = tuple(sizes)
        self.axis_sizes = tuple(sizes.values())


@cached(
    maxsize=4096, why="the link an axis group's collectives cross, per topology and mesh sizes."
)
def _link(
    topology: Topology, axes: tuple[str, ...], sizes_items: tuple[tuple[str, int], ...]
) -> tuple[float, float]:
    return topology._link_uncached(axes, sizes_items)


@cached(maxsize=4096, why="the network levels an axis group spans, per topology and mesh sizes.")
def _levels(
    topology: Topology, axes: tuple[str, ...], sizes_items: tuple[tuple[str, int], ...]
) -> tuple[tuple[int, float, float], ...]:
    sizes = dict(sizes_items)
    by_link: dict[tuple[float, float], int] = {}
    for a in axes:
        link = _link(topology, (a,), sizes_items)
        by_link[link] = by_link.get(link, 1) * sizes[a]
    return tuple((n, bw, lat) for (bw, lat), n in sorted(by_link.items(), key=lambda kv: -kv[0][0]))


#: The topology plans use when none is given: H100 nodes of 8 GPUs.
DEFAULT_TOPOLOGY = Topology.h100()


def host_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the count)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def topology_for(mesh: MeshLike) -> Topology:
    """The topology a plan on ``mesh`` is priced on when none is given.

    ===================  ======================================================
    mesh                 topology
    ===================  ======================================================
    abstract (no         :data:`DEFAULT_TOPOLOGY` (H100 nodes): the cluster a
    devices)             plan made ahead of time is for
    CPU devices          :meth:`Topology.cpu` of the mesh's devices on this
                         host's cores
    GPU devices          by device kind: an A100 (or A800) :meth:`Topology.a100`,
                         else :meth:`Topology.h100` (H100, H200, H800 and GPUs
                         without a topology of their own), 8 GPUs a node
    other devices (TPU)  :data:`DEFAULT_TOPOLOGY` (no topology of their own yet)
    ===================  ======================================================

    Example::

        >>> topology_for(abstract_mesh(data=8)) is DEFAULT_TOPOLOGY
        True
    """
    platform = mesh_platform(mesh)
    if platform == "cpu":
        return Topology.cpu(int(math.prod(axis_sizes(mesh).values())))
    if platform in ("gpu", "cuda", "rocm"):
        kind = str(getattr(mesh.devices.flat[0], "device_kind", ""))
        return Topology.a100() if ("A100" in kind or "A800" in kind) else DEFAULT_TOPOLOGY
    return DEFAULT_TOPOLOGY
