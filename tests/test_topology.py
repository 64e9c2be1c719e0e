"""Topology: links per mesh axis, the node heuristic, and alpha-beta times."""

import dataclasses

import pytest

from spmdkit.errors import SpmdError
from spmdkit.mesh import abstract_mesh
from spmdkit.topology import DEFAULT_TOPOLOGY, Topology

NVLINK = (450e9, 5e-6)
IB = (50e9, 10e-6)


def test_h100_inner_axis_is_nvlink_outer_axis_is_infiniband():
    mesh = abstract_mesh(data=16, model=8)
    topo = Topology.h100()
    assert topo.link(("model",), mesh) == NVLINK
    assert topo.link(("data",), mesh) == IB
    # a group spanning both runs at the pace of its slowest link
    assert topo.link(("data", "model"), mesh) == IB


@pytest.mark.parametrize(
    ("gpus_per_node", "inside"),
    [(8, {"b", "c"}), (4, {"c"}), (16, {"a", "b", "c"}), (1, set())],
)
def test_node_heuristic_takes_minor_axes_up_to_gpus_per_node(gpus_per_node, inside):
    mesh = abstract_mesh(a=2, b=4, c=2)  # minor-most c (2), then b (2*4=8), then a (16)
    topo = Topology.h100(gpus_per_node=gpus_per_node)
    assert topo.intra_node_axes(mesh) == frozenset(inside)
    for axis in ("a", "b", "c"):
        assert topo.link((axis,), mesh) == (NVLINK if axis in inside else IB)


def test_per_axis_overrides_win_over_the_heuristic_and_defaults():
    mesh = abstract_mesh(data=4, model=8)
    topo = Topology(
        bandwidth={"data": 25e9},
        latency={"data": 20e-6},
        default_bandwidth=100e9,
        default_latency=1e-6,
    )
    assert topo.link(("data",), mesh) == (25e9, 20e-6)
    assert topo.link(("model",), mesh) == (100e9, 1e-6)
    assert topo.intra_node_axes(mesh) == frozenset()  # no gpus_per_node: heuristic off
    assert Topology.h100().link(("model",), mesh) == NVLINK


def test_collective_time_is_alpha_beta_with_ring_steps():
    mesh = abstract_mesh(x=4)
    topo = Topology(default_bandwidth=1e9, default_latency=1e-6)
    wire = 3_000_000
    assert topo.collective_time("all_gather", wire, 4, ("x",), mesh) == pytest.approx(
        3 * 1e-6 + wire / 1e9
    )
    assert topo.collective_time("reduce_scatter", wire, 4, ("x",), mesh) == pytest.approx(
        3e-6 + 3e-3
    )
    assert topo.collective_time("all_to_all", wire, 4, ("x",), mesh) == pytest.approx(3e-6 + 3e-3)
    assert topo.collective_time("all_reduce", wire, 4, ("x",), mesh) == pytest.approx(
        6 * 1e-6 + wire / 1e9
    )
    assert topo.collective_time("slice", wire, 4, ("x",), mesh) == 0.0
    assert topo.collective_time("to_partial", 0, 4, ("x",), mesh) == 0.0
    assert topo.collective_time("all_gather", wire, 1, ("x",), mesh) == 0.0


def test_topology_is_hashable_and_order_insensitive():
    t1 = Topology(bandwidth={"a": 1e9, "b": 2e9})
    t2 = Topology(bandwidth={"b": 2e9, "a": 1e9})
    assert t1 == t2
    assert hash(t1) == hash(t2)
    assert {t1: 1}[t2] == 1
    assert Topology.h100(gpus_per_node=8) == DEFAULT_TOPOLOGY


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bandwidth": {"a": 0.0}},
        {"latency": {"a": -1e-6}},
        {"default_bandwidth": -5.0},
        {"node_latency": -1.0},
        {"gpus_per_node": 0},
    ],
)
def test_bad_numbers_raise(kwargs):
    with pytest.raises(SpmdError, match="Topology"):
        Topology(**kwargs)


def test_unknown_axis_and_unknown_kind_raise():
    mesh = abstract_mesh(x=4)
    with pytest.raises(SpmdError, match="mesh axis"):
        DEFAULT_TOPOLOGY.link(("y",), mesh)
    with pytest.raises(SpmdError, match="kind"):
        DEFAULT_TOPOLOGY.collective_time("broadcast", 10, 4, ("x",), mesh)


def test_groups_over_two_links_run_hierarchically():
    # 4 nodes (data, InfiniBand) x 8 GPUs (model, NVLink): the NVLink level moves the
    # whole buffer, the InfiniBand level only the 1/8 piece each GPU is left with
    mesh = abstract_mesh(data=4, model=8)
    topo = Topology.h100()
    (ib, ib_lat), (nv, nv_lat) = topo.link(("data",), mesh), topo.link(("model",), mesh)
    full, n = 64 * 2**20, 32
    rs_wire = full * (n - 1) // n
    rs = topo.collective_time("reduce_scatter", rs_wire, n, ("data", "model"), mesh)
    want = 7 * nv_lat + 7 / 8 * full / nv + 3 * ib_lat + 3 / 4 * (full / 8) / ib
    assert rs == pytest.approx(want)
    ag = topo.collective_time("all_gather", rs_wire, n, ("data", "model"), mesh)
    assert ag == pytest.approx(rs)
    # on the ring, an all-reduce is its reduce-scatter plus its all-gather, whichever
    # axes it spans: dp's gradient all-reduce and ZeRO-1's reduce-scatter + all-gather
    # cost the same
    ring = dataclasses.replace(topo, tree_all_reduce=False)
    ar = ring.collective_time("all_reduce", 2 * rs_wire, n, ("data", "model"), mesh)
    assert ar == pytest.approx(rs + ag)
    # NCCL's tree takes 2 (7 + log2 4) hops where the ring takes 2 (7 + 3): the same
    # bytes, 2 inter-node hops fewer
    tree = topo.collective_time("all_reduce", 2 * rs_wire, n, ("data", "model"), mesh)
    assert tree == pytest.approx(ar - 2 * ib_lat)
    # between the all-NVLink and the flat all-InfiniBand prices
    flat_ib = 2 * (n - 1) * ib_lat + 2 * rs_wire / ib
    assert 2 * rs_wire / nv < ar < flat_ib
    # one link: the flat ring formula, unchanged
    one = Topology(default_bandwidth=1e9, default_latency=1e-6)
    assert one.collective_time("all_reduce", rs_wire, n, ("data", "model"), mesh) == (
        pytest.approx(2 * (n - 1) * 1e-6 + rs_wire / 1e9)
    )
    # an all-to-all sends each peer its piece directly: the 7 peers in the node over
    # NVLink while the 24 in other nodes get theirs over InfiniBand
    a2a = topo.collective_time("all_to_all", rs_wire, n, ("data", "model"), mesh)
    piece = rs_wire / (n - 1)
    assert a2a == pytest.approx(max(7 * (nv_lat + piece / nv), 24 * (ib_lat + piece / ib)))
    assert a2a < (n - 1) * ib_lat + rs_wire / ib  # below the flat slowest-link price


def test_all_reduce_takes_nccls_tree_where_its_latency_is_lower():
    # NCCL's tuner prices ring and tree per call (src/graph/tuning.cc): the tree
    # chains the GPUs of a node and spans the nodes in a binary tree
    topo = Topology.h100()
    mesh = abstract_mesh(data=16, expert=32, model=2)  # DeepSeek-V3's flat 1,024
    axes = ("data", "expert", "model")
    ring = dataclasses.replace(topo, tree_all_reduce=False)
    (_, nv_lat), (_, ib_lat) = topo.link(("model",), mesh), topo.link(("expert",), mesh)
    # a float8 scale's amax, 4 bytes: the ring's 2 (1 + 511) hops against 2 (1 + 9)
    assert ring.collective_time("all_reduce", 4, 1024, axes, mesh) == pytest.approx(
        2 * (nv_lat + 511 * ib_lat), rel=1e-6
    )
    assert topo.tree_latency(1024, axes, mesh) == pytest.approx(2 * (nv_lat + 9 * ib_lat))
    small = topo.collective_time("all_reduce", 4, 1024, axes, mesh)
    assert small == pytest.approx(2 * (nv_lat + 9 * ib_lat), rel=1e-6)
    # the bytes' term is the ring's at any size: the tree saves the same latency
    big = 2**30
    saved = ring.collective_time("all_reduce", big, 1024, axes, mesh) - topo.collective_time(
        "all_reduce", big, 1024, axes, mesh
    )
    assert saved == pytest.approx(2 * (511 - 9) * ib_lat)
    # inside one node the tree is a chain: the ring's latency
    node = abstract_mesh(data=4, model=8)
    assert topo.tree_latency(8, ("model",), node) == pytest.approx(2 * 7 * nv_lat)
    assert topo.collective_time("all_reduce", 4, 8, ("model",), node) == (
        ring.collective_time("all_reduce", 4, 8, ("model",), node)
    )
    # one GPU a node over 64 nodes: log2 64 hops each way
    wide = abstract_mesh(data=64, model=8)
    assert topo.tree_latency(64, ("data",), wide) == pytest.approx(2 * 6 * ib_lat)
    # the other kinds and the CPU (XLA:CPU's collectives) keep the ring
    assert topo.collective_time("all_gather", 4, 1024, axes, mesh) == (
        ring.collective_time("all_gather", 4, 1024, axes, mesh)
    )
    assert not Topology.cpu(8, cores=2).tree_all_reduce
    assert Topology.a100().tree_all_reduce and not Topology().tree_all_reduce


# -- compute and overlap -----------------------------------------------------------------


def test_peaks_per_dtype_and_float8_only_where_the_device_has_it():
    h100, a100 = Topology.h100(), Topology.a100()
    assert h100.peak("bfloat16") == pytest.approx(2 * h100.peak("tfloat32"), rel=1e-3)
    assert h100.peak("float8_e4m3fn") == h100.peak("float8") == pytest.approx(1978.9e12)
    assert h100.peak("float32") < h100.peak("tfloat32") < h100.peak("bfloat16")
    assert a100.peak("bfloat16") == 312e12
    with pytest.raises(SpmdError, match="float8") as err:
        a100.peak("float8")
    assert "peak_flops=" in str(err.value)  # says the fix


def test_compute_time_uses_the_achievable_rates():
    topo = Topology(peak_flops={"bfloat16": 1e15}, matmul_efficiency=0.5, attention_efficiency=0.25)
    assert topo.compute_time(1e15, 0.0, "bfloat16") == pytest.approx(2.0)
    assert topo.compute_time(0.0, 1e15, "bfloat16") == pytest.approx(4.0)


def test_overlappable_collectives_hide_under_compute_up_to_the_overlap_share():
    topo = Topology(overlap=0.5)
    assert topo.exposed_comm(hidden_s=1.0, exposed_s=0.25, compute_s=4.0) == 0.25
    assert topo.exposed_comm(hidden_s=3.0, exposed_s=0.25, compute_s=4.0) == pytest.approx(1.25)
    assert Topology(overlap=0.0).exposed_comm(1.0, 0.0, 10.0) == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"matmul_efficiency": 0.0},
        {"attention_efficiency": 1.5},
        {"overlap": -0.1},
        {"host_bandwidth": 0},
        {"peak_flops": {"bfloat16": -1.0}},
        {"hbm_bandwidth": 0.0},
        {"fusion_traffic": -1.0},
        {"sm_count": 0},
        {"gemm_tile": (128,)},
        {"k_ramp": -1},
        {"attention_block": 1.5},
    ],
)
def test_compute_numbers_are_checked(kwargs):
    with pytest.raises(SpmdError):
        Topology(**kwargs)


def test_gemm_efficiency_loses_to_tiles_waves_and_small_k():
    topo = Topology.h100()
    big = topo.gemm_efficiency(8192, 8192, 8192)
    assert 0.9 * topo.matmul_efficiency < big < topo.matmul_efficiency
    # 133 output tiles on 132 SMs: a second wave for one tile
    assert topo.gemm_efficiency(128, 8192, 256 * 133) < 0.6 * big
    # a k of 256 spends half its main loop ramping
    ramp = topo.gemm_efficiency(8192, 256, 8192)
    assert ramp == pytest.approx(big * 0.5 * (8192 + 256) / 8192)
    # tile quantization: one row more than a tile multiple pays for a whole row of tiles
    assert topo.gemm_efficiency(8192 + 1, 8192, 8192) < topo.gemm_efficiency(8192 + 128, 8192, 8192)


def test_matmul_time_is_a_roofline_of_compute_against_hbm():
    topo = Topology.h100()
    peak = topo.peak("bfloat16")
    flops = 2.0 * 8192**3
    t = topo.matmul_time(flops, 8192, 8192, 8192, "bfloat16")
    assert t == pytest.approx(flops / (peak * topo.gemm_efficiency(8192, 8192, 8192)))
    # 8 tokens against an 8192 x 8192 weight: streaming the weight dominates
    small = 2.0 * 8 * 8192 * 8192
    bytes_ = 2 * (8 * 8192 + 8192 * 8192 + 8 * 8192)
    assert topo.matmul_time(small, 8, 8192, 8192, "bfloat16") == pytest.approx(
        bytes_ / topo.hbm_bandwidth
    )


def test_device_constants_and_stacks():
    h100, a100 = Topology.h100(), Topology.a100()
    assert (h100.hbm_bandwidth, a100.hbm_bandwidth) == (3.35e12, 2.0e12)
    assert h100.memory_time(3.35e12) == pytest.approx(1.0)
    torch = Topology.h100(stack="pytorch")
    assert torch.fusion_traffic > 1 and torch.memory_time(3.35e12) > 1.0
    assert torch.matmul_efficiency < h100.matmul_efficiency
    # compiled PyTorch fuses like XLA and keeps eager's attention kernel
    compiled = Topology.h100(stack="pytorch_compile")
    assert compiled.fusion_traffic == h100.fusion_traffic
    assert compiled.attention_efficiency == torch.attention_efficiency
    with pytest.raises(SpmdError, match="stack"):
        Topology.h100(stack="jax")


def test_a_fused_causal_kernel_computes_about_half_the_blocks():
    topo = Topology.h100()
    assert topo.causal_share(128) == 1.0
    assert topo.causal_share(8192) == pytest.approx(65 / 128)


def test_the_target_backend_is_the_devices_else_the_topologys():
    """An abstract mesh compiles for the topology's platform (an H100 plan made on
    a CPU machine predicts XLA:GPU), a mesh of devices for its devices'."""
    from dataclasses import replace

    import jax

    import spmdkit as sk

    assert Topology.h100().target(abstract_mesh(data=2, model=4)) == "gpu"
    assert replace(DEFAULT_TOPOLOGY, platform="cpu").target(abstract_mesh(x=2)) == "cpu"
    on_default = replace(DEFAULT_TOPOLOGY, platform=None).target(abstract_mesh(x=2))
    assert on_default == jax.default_backend()
    assert Topology.h100().target(sk.make_mesh(x=2)) == jax.devices()[0].platform
    with pytest.raises(SpmdError, match="platform"):
        Topology(platform="")


def test_cpu_topology_gives_each_device_its_share_of_the_host():
    from spmdkit.topology import CPU_CONSTANTS

    eight, two = Topology.cpu(8, cores=2), Topology.cpu(2, cores=2)
    # 8 devices on 2 cores: a quarter of a core each; 2 devices: a core each
    assert eight.peak("float32") == pytest.approx(CPU_CONSTANTS["flops_per_core"] / 4)
    assert two.peak("float32") == pytest.approx(CPU_CONSTANTS["flops_per_core"])
    assert eight.peak("bfloat16") < eight.peak("float32")  # no bf16 units: casts
    # no float8 units either (XLA:CPU widens float8 operands to f32), but priced
    assert eight.peak("float8_e4m3fn") < eight.peak("float32")
    # oversubscribed device threads wait to be scheduled: each hop 4x slower
    assert eight.link(("d",), abstract_mesh(d=8))[1] == pytest.approx(
        4 * two.link(("d",), abstract_mesh(d=2))[1]
    )
    assert eight.overlap == 0.0 and eight.platform == "cpu"
    assert eight.name == "cpu: 8 devices on 2 cores"
    with pytest.raises(SpmdError, match="positive int"):
        Topology.cpu(0)


def test_fresh_pages_are_priced_on_cpu_devices_only_above_the_threshold():
    from spmdkit.topology import CPU_CONSTANTS

    eight, two = Topology.cpu(8, cores=2), Topology.cpu(2, cores=2)
    start = CPU_CONSTANTS["fresh_pages_from"]
    # below glibc's largest mmap threshold the heap reuses the pages: nothing
    assert eight.fresh_pages_time(start - 4096) == 0.0
    pages = 2 * start / 4096
    # a page costs the kernel's CPU time, on the device's share of the cores
    assert eight.fresh_pages_time(2 * start) == pytest.approx(
        pages * CPU_CONSTANTS["fresh_page_cpu_s"] * 4
    )
    assert two.fresh_pages_time(2 * start) == pytest.approx(
        pages * CPU_CONSTANTS["fresh_page_cpu_s"]
    )
    assert eight.combines_all_reduces and not Topology.h100().combines_all_reduces
    # a GPU's allocator reuses its memory, whatever the size
    assert Topology.h100().fresh_pages_time(1e12) == 0.0
    for bad in ({"fresh_page_s": -1.0}, {"fresh_pages_from": -1.0}):
        with pytest.raises(SpmdError, match="fresh_page"):
            Topology(**bad)


def test_cpu_prices_all_device_collectives_above_smaller_groups():
    """The rendezvous of 8 device threads on 2 cores, per ring hop: the small
    GPT on data=2 x model=4 under fsdp (about 140 all-device collectives a step)
    is priced above megatron_sp (fewer, over groups of 4 and 2), the order
    ``benchmarks/overhead.py``'s auto-vs-presets table measures; with the
    bare-collective latency (5 us a hop) fsdp was priced below it."""
    import jax
    import optax

    import spmdkit as sk
    from spmdkit.models import get_model
    from spmdkit.topology import CPU_CONSTANTS

    cpu = Topology.cpu(8, cores=2)
    hop = CPU_CONSTANTS["latency_per_hop_s"] * 4  # 8 device threads on 2 cores
    assert cpu.collective_time("all_gather", 0, 8, ("d",), abstract_mesh(d=8)) == pytest.approx(
        7 * hop
    )
    info = sk.describe(get_model("gpt"), config="small", batch_size=8)
    mesh = sk.make_mesh(data=2, model=4, devices=jax.devices("cpu")[:8])
    opt = optax.adam(1e-3)

    def step_s(strategy: str, topology: Topology) -> float:
        plan = sk.plan(info, mesh, strategy, optimizer=opt, topology=topology)
        return plan.cost.step_time_s

    assert step_s("megatron_sp", cpu) < step_s("fsdp", cpu)
    bare = dataclasses.replace(cpu, default_latency=4 * 5e-6)
    assert step_s("fsdp", bare) < step_s("megatron_sp", bare)


def test_a_float8_recipe_plans_on_cpu_devices():
    """A mesh of CPU devices is priced on ``Topology.cpu``: a float8 recipe (the
    recipe the float8 tests verify on CPU) is priced there, not refused."""
    import jax

    import spmdkit as sk
    from spmdkit.models import get_model

    info = sk.describe(get_model("gpt"), config="tiny", batch_size=8)
    mesh = sk.make_mesh(data=2, model=4, devices=jax.devices("cpu")[:8])
    p = sk.plan(info, mesh, "fsdp", recipe=sk.Recipe(compute_dtype="float8"))
    assert p.recipe.compute_dtype == "float8"
    assert p.topology.startswith("cpu: 8 devices")


def test_topology_for_follows_the_mesh_devices():
    from types import SimpleNamespace

    import jax
    import numpy as np

    import spmdkit as sk
    from spmdkit.topology import host_cores, topology_for

    assert topology_for(abstract_mesh(data=2, model=4)) is DEFAULT_TOPOLOGY
    cpu = topology_for(sk.make_mesh(data=2, model=4, devices=jax.devices("cpu")[:8]))
    assert cpu == Topology.cpu(8, cores=host_cores())

    def gpus(kind: str) -> SimpleNamespace:
        dev = SimpleNamespace(platform="gpu", device_kind=kind)
        return SimpleNamespace(devices=np.array([dev] * 8), axis_names=("d",), axis_sizes=(8,))

    assert topology_for(gpus("NVIDIA A100-SXM4-80GB")) == Topology.a100()
    assert topology_for(gpus("NVIDIA H100 80GB HBM3")) is DEFAULT_TOPOLOGY
    assert DEFAULT_TOPOLOGY.name == "h100 (8 GPUs a node)"


@pytest.mark.parametrize(
    "sizes, axes, share",
    [
        ({"expert": 32, "model": 2}, ("expert", "model"), 8),  # 8 nodes of 8
        ({"pipe": 8, "data": 2, "expert": 32, "model": 2}, ("expert", "model"), 8),
        ({"data": 16, "model": 8}, ("data",), 1),  # the node is the model axis's
        ({"data": 4, "expert": 4}, ("data", "expert"), 8),
        ({"expert": 4}, ("expert",), 4),
    ],
)
def test_node_share_counts_a_groups_devices_inside_one_node(sizes, axes, share):
    """The devices of a group that share a node, the mesh laid out major → minor
    over nodes of 8: an axis larger than the room left is split over nodes."""
    assert Topology.h100().node_share(axes, abstract_mesh(**sizes)) == share
    assert Topology(gpus_per_node=None).node_share(axes, abstract_mesh(**sizes)) == 1


def test_an_unknown_expert_exchange_is_refused_with_the_choices():
    with pytest.raises(SpmdError, match="expert_exchange is one of"):
        Topology(expert_exchange="deepep")
    with pytest.raises(SpmdError, match="expert_overlap is a bool"):
        Topology(expert_overlap="yes")


@pytest.mark.parametrize("sms", [-1, 132, 2.5, True])
def test_exchange_sms_must_leave_the_compute_some_sms(sms):
    with pytest.raises(SpmdError, match=r"exchange_sms is an int in \[0, sm_count\)"):
        Topology(exchange_sms=sms)
    assert Topology(exchange_sms=20).exchange_sms == 20


@pytest.mark.parametrize("seconds", [-1e-3, float("nan")])
def test_a_moe_call_cost_is_seconds_not_below_zero(seconds):
    with pytest.raises(SpmdError, match=r"moe_call_s is >= 0 s"):
        Topology(moe_call_s=seconds)
    assert Topology(moe_call_s=3.5e-3).moe_call_s == 3.5e-3
    assert Topology().moe_call_s == 0.0
