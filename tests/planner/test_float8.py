"""spmdkit.planner.float8: the LM head priced in bf16, the quantization passes as
HBM bytes (hand counts), and the float8 step's FSDP gathers."""

import dataclasses
import types

import pytest

import spmdkit as sk
from spmdkit.planner.analytic import ParamGroup
from spmdkit.planner.float8 import cast_ratio, kept_in_bf16, quantize_bytes, quantize_s
from spmdkit.topology import Topology


def _ctx(recipe, head=(), gather_once=False):
    trace = types.SimpleNamespace(act_itemsize=4, lm_head_params=frozenset(head))
    return types.SimpleNamespace(
        recipe=recipe,
        trace=trace,
        siblings={"layers/*/wq": 3},
        topology=Topology.h100(),
        gather_once=gather_once,
        compute_dtype=lambda dtype: recipe.compute_dtype,
    )


def _group(key, logical=("embed", "mlp")):
    paths = tuple(key.replace("*", str(i)) for i in range(4))
    return ParamGroup(key, paths, (256, 512), "float32", logical, None, 0)


def test_quantization_passes_are_priced_as_the_bytes_they_move():
    """Per GEMM ``m × k`` by ``k × n``: current scaling reads each bf16 operand
    twice (amax, then cast) and writes a byte; delayed once; the backward's
    transposed float8 copies read and write a byte each; the weight's cast on its
    FSDP shard, per micro-batch unless the step holds its gathered weights; a
    column-parallel sibling shares its input's cast; the LM head costs none."""
    assert (quantize_bytes("current", 2), quantize_bytes("delayed", 2)) == (5, 3)
    m, k, n, layers = 1024.0, 256.0, 512.0, 4
    flops = 6 * m * k * n * layers * 2  # two micro-batches
    hbm = Topology.h100().hbm_bandwidth
    rcp = sk.Recipe(compute_dtype="float8", microbatches=2)
    up, wq = _group("layers/*/up"), _group("layers/*/wq", ("embed", "heads", "head_dim"))
    per_gemm = (5 + 2) * (m * k + m * n) + (5 / 8 + 2) * k * n
    assert quantize_s(_ctx(rcp), up, flops, m, k, n, 8) == pytest.approx(
        8 * per_gemm / hbm, rel=1e-9
    )
    held = (5 + 2) * (m * k + m * n) * 8 + (5 / 8 + 2) * k * n * 4
    assert quantize_s(_ctx(rcp, gather_once=True), up, flops, m, k, n, 8) == pytest.approx(
        held / hbm, rel=1e-9
    )
    shared = (5 + 2) * (m * k / 3 + m * n) + (5 / 8 + 2) * k * n
    assert quantize_s(_ctx(rcp), wq, flops, m, k, n, 8) == pytest.approx(8 * shared / hbm, rel=1e-9)
    delayed = dataclasses.replace(rcp, fp8_scaling="delayed")
    one_pass = (3 + 2) * (m * k + m * n) + (3 / 8 + 2) * k * n
    assert quantize_s(_ctx(delayed), up, flops, m, k, n, 8) == pytest.approx(
        8 * one_pass / hbm, rel=1e-9
    )
    for ctx, g in (
        (_ctx(rcp, head=up.paths[:1]), up),  # the LM head: bf16
        (_ctx(sk.Recipe(compute_dtype="bfloat16")), up),
        (_ctx(rcp), _group("embed", ("vocab", "embed"))),  # a lookup table
    ):
        assert quantize_s(ctx, g, flops, m, k, n, 8) == 0.0


def test_the_lm_head_is_priced_and_gathered_in_bf16_unless_not_excluded():
    """Llama-3 8B, fsdp on 8 H100s, float8: the trace names the output projection
    (its ``embed × vocab`` weight) as what the LM head reads; its FSDP gather
    moves bf16 (2 bytes a weight, the others 1), with ``fp8_exclude=()`` float8
    like the rest; the embedding table stays a lookup."""
    from spmdkit.models import get_model
    from spmdkit.planner.analytic import param_groups
    from spmdkit.planner.trace import trace_step

    info = sk.describe(get_model("llama"), config="8b", batch_size=16)
    trace = trace_step(info, None)
    heads = [
        g
        for g in param_groups(info, trace)
        if kept_in_bf16(_ctx(sk.Recipe(compute_dtype="float8"), trace.lm_head_params), g)
    ]
    assert [g.logical for g in heads] == [("embed", "vocab")]
    mesh = sk.abstract_mesh(data=8)
    gathers = [
        sk.plan(info, mesh, "fsdp", recipe=r, estimator="analytic").cost.comm_bytes["all_gather"]
        for r in (
            sk.Recipe(compute_dtype="bfloat16"),
            sk.Recipe(compute_dtype="float8"),
            sk.Recipe(compute_dtype="float8", fp8_exclude=()),
        )
    ]
    head = 4096 * 128256  # weights of the output projection
    assert gathers[1] == pytest.approx(gathers[0] / 2 + head, rel=1e-6)
    assert gathers[2] == pytest.approx(gathers[0] / 2, rel=1e-6)
    assert cast_ratio(_ctx(sk.Recipe(compute_dtype="float8"), heads[0].paths), heads[0]) == 0.5


def test_float8_holds_no_more_than_bf16_under_2d_fsdp():
    """Llama tiny_scan, fsdp on ``data=2 × model=4``, full recompute, propagated:
    the float8 step's peak is no higher than bf16's (current scaling keeps no
    state) and its weight gradients are reduce-scattered as bf16's are, not
    all-reduced whole (each float8 GEMM ends in a multiply by its scale, no
    cast: the pending sum reaches the gradient's shards; Llama 2 70B's 8 layers
    on ``data=8 × model=8`` held 19.6 GiB of temporaries against bf16's 6.5)."""
    from spmdkit.models import get_model

    info = sk.describe(get_model("llama"), config="tiny_scan", batch_size=8)
    mesh = sk.abstract_mesh(data=2, model=4)
    bf16, fp8 = (
        sk.plan(info, mesh, "fsdp", recipe=sk.Recipe(compute_dtype=d, remat="full")).cost
        for d in ("bfloat16", "float8")
    )
    assert fp8.peak_bytes <= bf16.peak_bytes, (fp8.memory, bf16.memory)
    assert fp8.comm_bytes.get("all_reduce", 0) <= 1.01 * bf16.comm_bytes["all_reduce"]
    assert fp8.comm_bytes["reduce_scatter"] >= bf16.comm_bytes["reduce_scatter"]
