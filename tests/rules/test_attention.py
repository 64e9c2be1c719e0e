"""Attention family: layouts per strategy, GQA head mapping, errors, collective budgets."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.context_parallel import BalancedOrder
from spmdkit.engine.local import shard_program
from spmdkit.engine.registry import get_rule
from spmdkit.errors import ShardingConflictError
from spmdkit.testing import check_forward_case, check_grad_case
from spmdkit.verification.hlo import check_plan, compiled_collectives
from tests.sampling import latin, sampled

T = sk.TensorSpec
F32 = "float32"


def q_spec(shape=(4, 8, 4, 8), spec=None):
    return T(shape, spec, dtype=F32)


def kv_spec(shape=(4, 8, 2, 8), spec=None):
    return T(shape, spec, dtype=F32)


def _compiled(specs, mesh, **attrs):
    """The collectives of the rule's own program for ``specs`` (no input reshards)."""
    res = sk.infer_forward("attention", *specs, mesh=mesh, **attrs)
    amesh = Mesh(mesh.devices, mesh.axis_names)
    program = shard_program(get_rule("attention"), res, attrs, amesh)
    args = [s.to_shape_dtype_struct(amesh) for s in res.inputs]
    return res, compiled_collectives(program, *args)


def test_reference_keeps_batch_and_heads_and_replicates_the_sequence():
    mesh = sk.abstract_mesh(a=2, b=4)
    q = q_spec(spec=P("a", "b"))
    k = kv_spec(spec=P("a", "b"))
    r = sk.infer_forward("attention", q, k, k, mesh=mesh)
    assert [str(s) for s in r.inputs] == [
        "f32[4@a,8,4,8]",
        "f32[4@a,8,2,8]",
        "f32[4@a,8,2,8]",
    ]
    assert str(r.outputs[0]) == "f32[4@a,8,4,8]"
    assert r.collectives == ()


def test_heads_sharded_with_whole_gqa_groups():
    mesh = sk.abstract_mesh(a=2, b=4)
    q = q_spec((2, 8, 8, 4), P(None, None, "b"))
    k = kv_spec((2, 8, 4, 4))
    r = sk.infer_forward("attention", q, k, k, mesh=mesh)
    assert str(r.inputs[1]) == "f32[2,8,4@b,4]"  # 4 kv heads over b=4: one group each
    g = sk.infer_grad("attention", q, k, k, out_grads=(q,), mesh=mesh)
    assert [str(s) for s in g.outputs] == ["f32[2,8,8@b,4]", "f32[2,8,4@b,4]", "f32[2,8,4@b,4]"]


def test_kv_heads_replicated_when_the_head_axes_do_not_divide_them():
    mesh = sk.abstract_mesh(a=2, b=4)
    q = q_spec((2, 8, 4, 4), P(None, None, "b"))
    k = kv_spec((2, 8, 2, 4), P(None, None, "a"))  # 2 kv heads: cannot follow b=4
    r = sk.infer_forward("attention", q, k, k, mesh=mesh)
    assert str(r.inputs[0]) == "f32[2,8,4@b,4]"
    assert str(r.inputs[1]) == "f32[2,8,2,4]"
    g = sk.infer_grad("attention", q, k, k, out_grads=(q,), mesh=mesh)
    assert str(g.outputs[1]) == "f32[2,8,2,4]{sum:b}"  # every device's query heads add up


def test_kv_heads_stay_sharded_unevenly_when_their_blocks_line_up():
    mesh = sk.abstract_mesh(a=2, c=3)
    q = q_spec((2, 8, 4, 4), P(None, None, "c"))  # blocks of 2 query heads (last padded)
    k = kv_spec((2, 8, 2, 4))  # blocks of 1 kv head: query heads 2h, 2h+1 read kv head h
    r = sk.infer_forward("attention", q, k, k, mesh=mesh)
    assert [str(s) for s in r.inputs] == ["f32[2,8,4@c,4]", *["f32[2,8,2@c,4]"] * 2]
    g = sk.infer_grad("attention", q, k, k, out_grads=(q,), mesh=mesh)
    assert str(g.outputs[1]) == "f32[2,8,2@c,4]"  # no sum: each device owns its kv heads
    q8 = q_spec((2, 8, 8, 4), P(None, None, "c"))  # blocks of 3 query heads vs 2·ceil(4/3)
    r = sk.infer_forward("attention", q8, kv_spec((2, 8, 4, 4)), kv_spec((2, 8, 4, 4)), mesh=mesh)
    assert str(r.inputs[1]) == "f32[2,8,4,4]"


@pytest.mark.slow
def test_uneven_kv_heads_run_numerically():
    mesh = sk.make_mesh(a=2, c=3)
    rng = np.random.default_rng(0)
    q, k = q_spec((2, 8, 4, 4), P("a", None, "c")), kv_spec((2, 8, 2, 4))
    xs = [rng.standard_normal(s.shape).astype(np.float32) for s in (q, k, k)]
    for strategy in ("default", "gather_kv"):
        attrs = {"causal": True, "strategy": strategy}
        failure, res = check_forward_case("attention", [q, k, k], mesh, values=xs, attrs=attrs)
        assert failure is None, str(failure)
        assert str(res.inputs[1]) == "f32[2@a,8,2@c,4]"
        cot = rng.standard_normal(q.shape).astype(np.float32)
        failure, _ = check_grad_case(
            "attention", [q, k, k], [q], mesh, values=xs, cotangents=[cot], attrs=attrs
        )
        assert failure is None, str(failure)


def test_gather_kv_keeps_the_query_sequence_and_states_the_gather():
    mesh = sk.abstract_mesh(a=2, b=4)
    q = q_spec(spec=P("a", "b"))
    k = kv_spec(spec=P("a", "b"))
    r = sk.infer_forward("attention", q, k, k, mesh=mesh, strategy="gather_kv")
    assert str(r.inputs[0]) == "f32[4@a,8@b,4,8]"
    assert str(r.inputs[1]) == "f32[4@a,8@b,2,8]"
    assert str(r.outputs[0]) == "f32[4@a,8@b,4,8]"
    assert r.reshards == ()
    # two all-gathers over b, each of the whole local K (or V): 2*8*2*8 floats
    assert [(c.kind, c.axes, c.payload_bytes) for c in r.collectives] == [
        ("all_gather", ("b",), 2 * 8 * 2 * 8 * 4)
    ] * 2
    g = sk.infer_grad("attention", q, k, k, out_grads=(q,), mesh=mesh, strategy="gather_kv")
    assert str(g.outputs[1]) == "f32[4@a,8@b,2,8]"  # reduce-scattered back
    assert [c.kind for c in g.collectives] == ["all_gather"] * 2 + ["reduce_scatter"] * 2


def test_gather_kv_with_replicated_kv_moves_nothing_and_sums_dk():
    mesh = sk.abstract_mesh(x=4)
    q = q_spec(spec=P(None, "x"))
    k = kv_spec()
    r = sk.infer_forward("attention", q, k, k, mesh=mesh, strategy="gather_kv")
    assert r.collectives == () and r.reshards == ()
    g = sk.infer_grad("attention", q, k, k, out_grads=(q,), mesh=mesh, strategy="gather_kv")
    assert str(g.outputs[1]) == "f32[4,8,2,8]{sum:x}"


def test_ring_shards_both_sequences_alike():
    mesh = sk.abstract_mesh(x=4)
    q = q_spec(spec=P(None, "x"))
    k = kv_spec()
    r = sk.infer_forward("attention", q, k, k, mesh=mesh, strategy="ring")
    assert str(r.inputs[1]) == "f32[4,8@x,2,8]"
    # stated as what runs: n - 1 = 3 collective-permutes of one K and one V block each
    block = 4 * 2 * 2 * 8 * 4
    assert [(c.kind, c.payload_bytes, c.wire_bytes) for c in r.collectives] == [
        ("collective_permute", block, block)
    ] * 6
    g = sk.infer_grad("attention", q, k, k, out_grads=(q,), mesh=mesh, strategy="ring")
    assert str(g.outputs[1]) == "f32[4,8@x,2,8]"
    assert [c.kind for c in g.collectives] == ["collective_permute"] * 12  # and back


def test_partial_v_passes_to_the_output():
    mesh = sk.abstract_mesh(x=4)
    v = kv_spec().replace(partial={"x": "sum"})
    r = sk.infer_forward("attention", q_spec(), kv_spec(), v, mesh=mesh)
    assert str(r.outputs[0]) == "f32[4,8,4,8]{sum:x}"
    r = sk.infer_forward(
        "attention", q_spec().replace(partial={"x": "sum"}), kv_spec(), v, mesh=mesh
    )
    assert not r.outputs[0].partial  # attention is not linear in q


def test_backward_from_a_sequence_sharded_output():
    mesh = sk.abstract_mesh(x=4)
    out = q_spec(spec=P(None, "x"))
    r = sk.infer_backward(
        "attention", q_spec(), kv_spec(), kv_spec(), outputs=(out,), mesh=mesh, strategy="gather_kv"
    )
    assert str(r.inputs[0]) == "f32[4,8@x,4,8]"
    r = sk.infer_backward("attention", q_spec(), kv_spec(), kv_spec(), outputs=(out,), mesh=mesh)
    assert str(r.inputs[0]) == "f32[4,8,4,8]"


@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 8, 4, 4), (2, 8, 3, 4), (2, 8, 3, 4)),  # 4 query heads, 3 kv heads
        ((2, 8, 4, 4), (2, 8, 2, 4), (2, 8, 2, 8)),  # v head dim differs
        ((2, 8, 4), (2, 8, 4), (2, 8, 4)),  # rank 3
    ],
)
def test_bad_shapes_raise(shapes):
    mesh = sk.abstract_mesh(x=4)
    with pytest.raises(ShardingConflictError):
        sk.infer_forward("attention", *(T(s, dtype=F32) for s in shapes), mesh=mesh)


def test_bad_gqa_ratio_names_the_heads():
    mesh = sk.abstract_mesh(x=4)
    with pytest.raises(ShardingConflictError, match="multiple of the key/value heads"):
        sk.infer_forward(
            "attention", q_spec(), kv_spec((4, 8, 3, 8)), kv_spec((4, 8, 3, 8)), mesh=mesh
        )


def test_unknown_strategy_and_int_inputs_raise():
    mesh = sk.abstract_mesh(x=4)
    with pytest.raises(ShardingConflictError, match="strategy"):
        sk.infer_forward("attention", q_spec(), kv_spec(), kv_spec(), mesh=mesh, strategy="flash")
    ints = [T(s.shape, dtype="int32") for s in (q_spec(), kv_spec(), kv_spec())]
    with pytest.raises(ShardingConflictError, match="floating"):
        sk.infer_forward("attention", *ints, mesh=mesh)


def test_gather_kv_moves_exactly_the_stated_kv_gather(mesh1d):
    q = q_spec(spec=P(None, "x"))
    k = kv_spec(spec=P(None, "x"))
    res, compiled = _compiled((q, k, k), mesh1d, strategy="gather_kv", causal=True)
    assert check_plan(res.collectives, compiled) == []
    assert sum(c.payload_bytes for c in compiled) == 2 * (4 * 8 * 2 * 8 * 4)


def test_reference_and_heads_parallel_move_nothing(mesh2d):
    q = q_spec(spec=P("a", None, "b"))
    k = kv_spec((4, 8, 4, 8), P("a", None, "b"))
    _, compiled = _compiled((q, k, k), mesh2d, causal=True)
    assert compiled == []


def test_ring_permutes_one_block_per_step(mesh1d):
    q = q_spec(spec=P(None, "x"))
    k = kv_spec(spec=P(None, "x"))
    res, compiled = _compiled((q, k, k), mesh1d, strategy="ring", causal=True)
    assert {c.kind for c in compiled} == {"collective_permute"}
    block = 4 * 2 * 2 * 8 * 4  # [B, Sk/4, Hkv, D] f32
    sizes = [s for c in compiled for s in [c.payload_bytes // len(c.shapes)] * len(c.shapes)]
    # one K and one V permute in the loop body, which runs n - 1 = 3 times
    assert sorted(sizes) == [block] * 2
    assert all(len(c.source_target_pairs) == 4 for c in compiled)
    # stated as the equivalent all-gathers: the same bytes on the wire
    assert sum(c.wire_bytes for c in res.collectives) == 3 * sum(sizes)


def _ring_case(mesh, shapes, specs, *, grad=True, **attrs):
    rng = np.random.default_rng(0)
    vals = [rng.standard_normal(sh).astype(np.float32) for sh in shapes]
    specs = tuple(T(sh, sp, dtype=F32) for sh, sp in zip(shapes, specs, strict=True))
    attrs = {"causal": True, "strategy": "ring", **attrs}
    fail, res = check_forward_case("attention", specs, mesh, values=vals, attrs=attrs)
    assert fail is None, str(fail)
    if not grad:
        return res
    cot = [rng.standard_normal(shapes[0]).astype(np.float32)]
    plain = tuple(s.without_partial() for s in specs)
    fail, _ = check_grad_case(
        "attention", plain, (plain[0],), mesh, values=vals, cotangents=cot, attrs=attrs
    )
    assert fail is None, str(fail)
    return res


@pytest.mark.slow
def test_ring_uneven_blocks_and_query_heads_over_another_axis(mesh2d):
    # Sq = 6 and Sk = 5 over b=4: padded query rows and keys never leak; the 2 query
    # heads over a=2 read the one (replicated) kv head
    res = _ring_case(
        mesh2d,
        ((1, 6, 2, 4), (1, 5, 1, 4), (1, 5, 1, 4)),
        (P(None, "b", "a"), P(), P()),
        scale=0.3,
    )
    assert str(res.inputs[0]) == "f32[1,6@b,2@a,4]"
    assert str(res.inputs[1]) == "f32[1,5@b,1,4]"


def test_ring_over_two_axes(mesh2d):
    both = P(None, ("a", "b"))
    res = _ring_case(mesh2d, ((1, 8, 2, 4),) * 3, (both, both, both), grad=False)
    assert str(res.inputs[1]) == "f32[1,8@(a,b),2,4]"


def test_ring_with_query_heads_sharded_permutes_the_kv_heads_only(mesh2d):
    q = T((2, 8, 4, 4), P(None, "b", "a"), dtype=F32)
    k = T((2, 8, 1, 4), P(None, "b"), dtype=F32)  # multi-query: replicated over a
    res, compiled = _compiled((q, k, k), mesh2d, causal=True, strategy="ring")
    block = 2 * 2 * 1 * 4 * 4  # [B, Sk/4, Hkv, D]: the kv head moves, not its query copies
    assert [c.payload_bytes for c in compiled] == [block, block]
    assert sum(c.wire_bytes for c in res.collectives) == 3 * 2 * block


def test_gather_kv_gathers_kv_in_their_own_dtype(mesh1d):
    spec = T((2, 8, 2, 8), P(None, "x"), dtype="bfloat16")
    attrs = {"strategy": "gather_kv"}
    res = sk.infer_forward("attention", spec, spec, spec, mesh=mesh1d, **attrs)
    assert [c.payload_bytes for c in res.collectives] == [2 * 8 * 2 * 8 * 2] * 2
    amesh = Mesh(mesh1d.devices, mesh1d.axis_names)
    program = shard_program(get_rule("attention"), res, attrs, amesh)
    args = [s.to_shape_dtype_struct(amesh) for s in res.inputs]
    text = str(jax.make_jaxpr(program)(*args))
    # the program gathers bf16 (XLA's CPU backend then widens bf16 collectives to f32)
    gathers = [line for line in text.splitlines() if "= all_gather[" in line]
    assert len(gathers) == 2 and all("bf16[2,8,2,8]" in line for line in gathers)


# -- implementation=: the reference models' kernels as the local computation -----------

_KERNEL_CASES = [
    # (mesh axes, shapes q/k/v, given layouts)
    ({"x": 4}, ((2, 8, 4, 4), (2, 8, 2, 4), (2, 8, 2, 4)), (P(None, "x"),) * 3),
    (
        {"a": 2, "b": 4},
        ((2, 8, 4, 4), (2, 8, 2, 4), (2, 8, 2, 4)),
        (P("a", None, "b"), P("a"), P("a")),
    ),
    # Sq = 6, Sk = 5 over b=4: padded query rows and keys; 2 query heads over a, 1 kv head
    ({"a": 2, "b": 4}, ((1, 6, 2, 4), (1, 5, 1, 4), (1, 5, 1, 4)), (P(None, "b", "a"), P(), P())),
    # multi-query with the query heads sharded and the sequences over b
    (
        {"a": 2, "b": 4},
        ((2, 8, 4, 4), (2, 8, 1, 4), (2, 8, 1, 4)),
        (P(None, "b", "a"), P(None, "b"), P(None, "b")),
    ),
]


_KERNELS = ["auto", "blockwise", "xla"]
_STRATEGIES = ["default", "gather_kv", "ring"]
#: CI's sample runs each strategy with one kernel, each kernel with one strategy
#: (tests/sampling.py): default-auto, gather_kv-blockwise, ring-xla (on CPU ``auto``
#: is the blockwise kernel, which the models' ring runs in the reference matrix).
_KERNEL_STRATEGIES = [(s, k) for s in _STRATEGIES for k in _KERNELS]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "implementation"),
    sampled(_KERNEL_STRATEGIES, latin(_STRATEGIES, _KERNELS)),
    ids=[f"{s}-{k}" for s, k in _KERNEL_STRATEGIES],
)
def test_kernel_implementations_run_every_strategy_numerically(implementation, strategy):
    """Each kernel (block size 3: padded key blocks) under each strategy, causal and
    not, equals the unsharded kernel, forward and grad, on even and uneven layouts
    (gather_kv: the query block's offset in the causal mask; ring: per-block
    partial results merged by their log-sum-exp)."""
    rng = np.random.default_rng(0)
    for axes, shapes, given in _KERNEL_CASES:
        mesh = sk.make_mesh(**axes)
        specs = tuple(T(s, p, dtype=F32) for s, p in zip(shapes, given, strict=True))
        for causal in (True, False):
            vals = [rng.standard_normal(s).astype(np.float32) for s in shapes]
            attrs = {
                "causal": causal,
                "strategy": strategy,
                "implementation": implementation,
                "block_size": 3,
            }
            fail, _ = check_forward_case("attention", specs, mesh, values=vals, attrs=attrs)
            assert fail is None, str(fail)
            cot = [rng.standard_normal(shapes[0]).astype(np.float32)]
            fail, _ = check_grad_case(
                "attention", specs, (specs[0],), mesh, values=vals, cotangents=cot, attrs=attrs
            )
            assert fail is None, str(fail)


@pytest.mark.slow
def test_kernel_reference_is_the_models_attention():
    from spmdkit.kernels import attention_kernel

    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal(s).astype(np.float32) for s in ((2, 8, 4, 4), (2, 8, 2, 4)))
    rule = get_rule("attention")
    for impl in ("blockwise", "xla"):
        got = rule.impl(q, k, k, causal=True, implementation=impl, block_size=3)
        want = attention_kernel(q, k, k, causal=True, implementation=impl, block_size=3)
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_implementation_errors_are_typed():
    mesh = sk.abstract_mesh(x=4)
    q, k = q_spec(spec=P(None, "x")), kv_spec(spec=P(None, "x"))
    with pytest.raises(ShardingConflictError, match="implementation is None"):
        sk.infer_forward("attention", q, k, k, mesh=mesh, implementation="flash")
    with pytest.raises(ShardingConflictError, match="block_size is a positive int"):
        sk.infer_forward("attention", q, k, k, mesh=mesh, implementation="xla", block_size=0)
    # cuDNN masks causally from its block's position 0: no sequence-sharded query
    for strategy in ("gather_kv", "ring"):
        with pytest.raises(ShardingConflictError, match="keep the query sequence whole"):
            sk.infer_forward(
                "attention",
                q,
                k,
                k,
                mesh=mesh,
                causal=True,
                strategy=strategy,
                implementation="cudnn",
            )
    r = sk.infer_forward("attention", q, k, k, mesh=mesh, causal=True, implementation="cudnn")
    assert str(r.inputs[0]) == "f32[4,8,4,8]"  # the default strategy gathers the sequence


def test_balanced_order_needs_whole_chunks_per_shard():
    mesh = sk.abstract_mesh(x=4)
    q, k = q_spec((2, 24, 4, 8), P(None, "x")), kv_spec((2, 24, 2, 8))
    with pytest.raises(ShardingConflictError, match="divide the balanced order's 6 chunks"):
        sk.infer_forward("attention", q, k, k, mesh=mesh, strategy="ring", causal=True, balanced=3)
    q, k = q_spec((2, 12, 4, 8), P(None, "x")), kv_spec((2, 12, 2, 8))
    with pytest.raises(ShardingConflictError, match="a multiple of 8"):
        sk.infer_forward("attention", q, k, k, mesh=mesh, strategy="ring", causal=True, balanced=4)
    # layouts and collectives do not depend on the order
    q, k = q_spec((2, 16, 4, 8), P(None, "x")), kv_spec((2, 16, 2, 8))
    plain = sk.infer_forward("attention", q, k, k, mesh=mesh, strategy="ring", causal=True)
    bal = sk.infer_forward(
        "attention", q, k, k, mesh=mesh, strategy="ring", causal=True, balanced=4
    )
    assert (bal.inputs, bal.outputs, bal.collectives) == (
        plain.inputs,
        plain.outputs,
        plain.collectives,
    )


_BALANCED = [(s, k) for s in ("ring", "gather_kv") for k in (None, "blockwise", "xla")]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "implementation"),
    sampled(_BALANCED, {("ring", "blockwise"), ("gather_kv", "blockwise")}),
    ids=[f"{s}-{k}" for s, k in _BALANCED],
)
def test_balanced_order_equals_the_reference(strategy, implementation):
    """Operands in the balanced order for 4 shards (chunks i and 7 - i on shard i),
    sequence over x=4: forward and grad equal the reference (the natural-order op
    on the restored operands), GQA heads, causal."""
    rng = np.random.default_rng(0)
    mesh = sk.make_mesh(x=4, y=2)
    shapes = ((2, 16, 4, 4), (2, 16, 2, 4), (2, 16, 2, 4))
    specs = tuple(T(s, P("y", "x"), dtype=F32) for s in shapes)
    attrs = {"causal": True, "strategy": strategy, "balanced": 4, "block_size": 2}
    if implementation is not None:
        attrs["implementation"] = implementation
    vals = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    fail, _ = check_forward_case("attention", specs, mesh, values=vals, attrs=attrs)
    assert fail is None, str(fail)
    cot = [rng.standard_normal(shapes[0]).astype(np.float32)]
    fail, _ = check_grad_case(
        "attention", specs, (specs[0],), mesh, values=vals, cotangents=cot, attrs=attrs
    )
    assert fail is None, str(fail)
    ref = get_rule("attention").impl
    natural = BalancedOrder(4).restore(ref(*vals, causal=True, balanced=4), 1)
    want = ref(*(BalancedOrder(4).restore(v, 1) for v in vals), causal=True)
    np.testing.assert_allclose(natural, want, rtol=1e-6, atol=1e-6)
