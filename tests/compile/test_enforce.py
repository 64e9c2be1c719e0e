"""spmdkit.compile.enforce: the replayed program computes the same values, pinned to the
propagated layouts, and the compiled program then moves what was predicted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.compile import jit, verify_plan
from spmdkit.compile.enforce import enforced, replay
from spmdkit.introspect import describe
from spmdkit.planner import plan
from spmdkit.propagation import propagate
from spmdkit.step.fp8 import fp8_dot
from spmdkit.verification.hlo import parse_collectives
from spmdkit.verification.planned import as_on_cpu
from tests.plan_model import ops_toy_init, ops_toy_loss, toy_batch, toy_init, toy_loss


@jax.custom_jvp
def _softplus(x):
    return jnp.logaddexp(x, 0.0)


@_softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _softplus(x), t * jax.nn.sigmoid(x)


def _step(w, xs):
    """A scan over layers, a remat region, a custom_jvp and literals."""

    @jax.checkpoint
    def layer(h, wi):
        return _softplus(h @ wi) * 0.5 + 1.0

    def body(h, wi):
        return layer(h, wi), jnp.sum(h)

    def loss(w):
        h, sums = jax.lax.scan(body, xs, w)
        return jnp.mean(h**2) + 0.1 * jnp.sum(sums)

    return jax.value_and_grad(loss)(w)


@pytest.fixture(scope="module")
def mesh():
    return sk.make_mesh(data=2, model=4, axis_types="auto")


def test_replay_matches_the_traced_function(mesh):
    w = jax.random.normal(jax.random.key(0), (3, 16, 16)) * 0.3
    xs = jax.random.normal(jax.random.key(1), (8, 16))
    prop = propagate(_step, w, xs, mesh=mesh, in_specs=(P(None, None, "model"), P("data")))
    assert prop.program is not None
    with jax.set_mesh(mesh):
        got = jax.jit(enforced(prop))(w, xs)
        flat = jax.jit(lambda *a: replay(prop, *a))(w, xs)
    want = jax.jit(_step)(w, xs)
    for g, f, r in zip(jax.tree.leaves(got), flat, jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(f, r, rtol=1e-5, atol=1e-6)


def test_replay_pins_every_propagated_layout(mesh):
    def f(x, w):
        return jnp.tanh(x @ w).sum(axis=0)

    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    prop = propagate(f, x, w, mesh=mesh, in_specs=(P("data"), P(None, "model")))
    with jax.set_mesh(mesh):
        text = jax.jit(enforced(prop)).lower(x, w).as_text()
    # one constraint per operand and result of each equation that has a layout
    assert text.count("sharding_constraint") >= 4
    pinned = [s for r in prop.records for s in (*r.inputs, *r.outputs) if not s.partial]
    assert pinned and any(s.sharding_axes for s in pinned)


def _repeated_pins(text):
    """The constraints of a lowered step that ask for the layout their operand
    already has: an argument's ``in_shardings`` entry, or an identical constraint
    right before."""
    import re

    sig = re.search(r"func.func public @main\((.*?)\) -> ", text, re.S).group(1)
    held = dict(
        re.findall(
            r"(%arg\d+): tensor<[^>]*> \{[^}]*?sdy.sharding = #sdy.sharding<@mesh, (\[.*?\])>", sig
        )
    )
    repeated, total = [], 0
    for res, operand, layout in re.findall(
        r"(%[\w#]+) = sdy.sharding_constraint (%[\w#]+) <@mesh, (\[.*?\])>", text
    ):
        total += 1
        if held.get(operand) == layout:
            repeated.append(f"{res} = {operand} {layout}")
        held[res] = layout
    return repeated, total


def test_a_step_constrains_no_value_twice(mesh):
    """The arguments arrive in their in specs and the batch constraint sk.jit
    puts on a step is the replay's own pin: no constraint asks for the layout its
    operand already has. Replayed without that knowledge, the same step does."""
    info = describe(ops_toy_init, loss=ops_toy_loss, batch=toy_batch())
    p = plan(info, mesh, "megatron", estimator="analytic")
    step = jit(jax.value_and_grad(info.loss_fn), p)
    params, batch = info.abstract_params, toy_batch()
    repeated, total = _repeated_pins(step.lower(params, batch).as_text())
    assert total > 0 and not repeated, repeated
    _, prop = step.program(params, batch)
    flat = jax.tree.leaves((params, batch))
    specs = [NamedSharding(step.mesh, s.to_partition_spec()) for s in prop.in_specs]
    with jax.set_mesh(step.mesh):
        text = (
            jax.jit(lambda *a: replay(prop, *a), in_shardings=tuple(specs)).lower(*flat).as_text()
        )
    assert _repeated_pins(text)[0]


def test_a_replay_takes_one_placed_flag_per_argument(mesh):
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    prop = propagate(jnp.tanh, x, mesh=mesh, in_specs=(P("data"),))
    with jax.set_mesh(mesh), pytest.raises(sk.SpmdError, match="one entry per flat argument"):
        jax.jit(lambda x: replay(prop, x, placed=[True, True])).lower(x)


def test_without_a_program_replay_says_why():
    class Bare:
        program = None
        mesh = None

    with pytest.raises(ValueError, match="no program"):
        replay(Bare())


@pytest.mark.slow
@pytest.mark.parametrize("enforce", [True, False])
@pytest.mark.heavy
def test_enforced_step_moves_what_was_predicted(enforce):
    """GPT, FSDP on 8 devices: pinned, the step moves exactly the plan's
    collectives; left to itself XLA moves others (and the values are the same
    either way). With fsdp's table read in rule order (weights split on
    ``embed``, the head on ``vocab``), unpinned XLA all-reduces the weight
    gradients whole instead of reduce-scattering them (jax 0.10.2: all_reduce
    predicted 66.5 KiB, compiled 462.5 KiB; reduce_scatter 456.5 KiB vs none),
    so the totals agree within tolerance while the kinds do not; under dim
    order it moved activations with all-to-alls the plan did not have."""
    from spmdkit.models import get_model

    spec = get_model("gpt")
    cfg = spec.config("tiny")
    batch = spec.batch(cfg, 8, np.random.default_rng(0))
    info = describe(spec, config=cfg, batch=batch)
    p = plan(info, sk.make_mesh(data=8), "fsdp", estimator="analytic")
    step = jit(jax.value_and_grad(info.loss_fn), p, enforce=enforce)
    report = verify_plan(p, step, info.abstract_params, batch)
    rows = {r[0]: r for r in report.rows}
    assert report.ok is enforce, str(report)
    if enforce:
        for kind in ("all_gather", "all_reduce"):
            _, pk, ck, _ = rows[kind]
            assert abs(pk - ck) <= 0.02 * ck, str(report)
    loss, _ = step(info.init_fn(), batch)
    ref, _ = jax.jit(jax.value_and_grad(info.loss_fn))(info.init_fn(), batch)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


def test_explicit_axes_are_not_replayed(mesh):
    info = describe(toy_init, loss=toy_loss, batch=toy_batch())
    p = plan(info, mesh, "dp", estimator="analytic")
    assert jit(lambda a: a, p, axis_types="explicit").enforce is False
    assert jit(lambda a: a, p).enforce is True


def test_parse_collectives_sees_pinned_reduction(mesh):
    """A contraction over a sharded dim, pinned replicated: one all-reduce."""

    def f(x, w):
        return x @ w

    x = jax.ShapeDtypeStruct((8, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 8), jnp.float32)
    prop = propagate(f, x, w, mesh=mesh, in_specs=(P(None, "model"), P("model")))
    with jax.set_mesh(mesh):
        compiled = (
            jax.jit(
                enforced(prop),
                in_shardings=(
                    NamedSharding(mesh, P(None, "model")),
                    NamedSharding(mesh, P("model")),
                ),
            )
            .lower(x, w)
            .compile()
        )
    kinds = [c.kind for c in parse_collectives(compiled.as_text()) if c.group_size > 1]
    assert kinds == ["all_reduce"]
    assert prop.comm_bytes_by_kind == {"all_reduce": 8 * 8 * 4}


def _compiled(prop, mesh, *args, outs=False):
    """``prop``'s replay compiled (with its output shardings, as sk.jit does, when
    ``outs``) and the compiled collectives."""
    shardings = tuple(NamedSharding(mesh, s.to_partition_spec()) for s in prop.in_specs)
    kw = {}
    if outs:
        kw["out_shardings"] = tuple(
            NamedSharding(mesh, s.to_partition_spec()) for s in prop.out_specs
        )
    with jax.set_mesh(mesh):
        compiled = jax.jit(enforced(prop), in_shardings=shardings, **kw).lower(*args).compile()
    return compiled, parse_collectives(compiled.as_text())


def test_a_multi_step_reshard_runs_in_the_planned_order():
    """A weight tiled over both axes and gathered whole: the plan gathers the
    small ``data`` step first (48 + 192 KiB); left to itself XLA gathers ``model``
    first (96 + 192 KiB). Pinned step by step, the program moves the plan's bytes,
    and the gathered copy is made once for both of its readers."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(w):
        # a product over every dim gathers its whole operand (no partial form)
        return jnp.prod(w) + jnp.prod(w, keepdims=True).sum()

    w = jax.ShapeDtypeStruct((4, 64, 192), jnp.float32)
    prop = propagate(f, w, mesh=mesh, in_specs=(P("data", "model"),))
    compiled, got = _compiled(prop, mesh, w)
    gathers = [c.payload_bytes for c in got if c.kind == "all_gather"]
    assert sum(gathers) == prop.comm_bytes_by_kind["all_gather"], (gathers, prop)
    assert sorted(gathers) == [48 * 1024, 192 * 1024]
    # near 1, so the product of the 49,152 elements neither vanishes nor overflows
    near_one = 1 + (jnp.arange(4 * 64 * 192, dtype=jnp.float32).reshape(4, 64, 192) % 97) / 2**20
    x = jax.device_put(near_one, NamedSharding(mesh, P("data", "model")))
    np.testing.assert_allclose(compiled(x), f(np.asarray(x, np.float64)), rtol=1e-3)


def test_a_partial_contraction_is_reduced_as_planned():
    """``x @ w`` contracting a ``model``-sharded dim, wanted sharded over
    ``model`` by columns: the plan reduce-scatters the partial product. XLA's CPU
    partitioner would all-reduce it whole; the replay runs the contraction per
    device and reduce-scatters it itself, so the compiled program has the
    planned reduce-scatter, and the prediction for CPU keeps it one."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(x, w):
        return jnp.tanh(x @ w)

    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    prop = propagate(
        f, x, w, mesh=mesh, in_specs=(P("data", "model"), P("model")), out_specs=P("data", "model")
    )
    planned = [c.kind for c in prop.collectives()]
    assert planned == ["reduce_scatter"], prop.collectives()
    compiled, got = _compiled(prop, mesh, x, w)
    assert [(c.kind, c.payload_bytes) for c in got] == [("reduce_scatter", 8 * 32 * 4)]
    rng = np.random.default_rng(0)
    xv = jax.device_put(
        rng.normal(size=(16, 64)).astype(np.float32), NamedSharding(mesh, P("data", "model"))
    )
    wv = jax.device_put(
        rng.normal(size=(64, 32)).astype(np.float32), NamedSharding(mesh, P("model"))
    )
    np.testing.assert_allclose(
        compiled(xv, wv), f(np.asarray(xv), np.asarray(wv)), rtol=1e-5, atol=1e-5
    )


def test_a_partial_reduced_in_several_steps_is_not_moved_again_by_its_reader():
    """A weight gradient ``x.T @ dy`` partial over ``data``, transposed into a layout
    tiled over ``(data, model)``: the plan reduces it in two collectives (an
    all-reduce over ``data``, a permute of the blocks into ``(data, model)``), which
    the replay runs where it is computed. Its reader reads the reduced value as it
    is; pinned again at each intermediate layout of the reduction (as if still
    partial), XLA undid the shard_map's move and permuted and gathered the gradient
    a second time (tiny GPT's fc and tied embedding gradients under auto on 2x4)."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(x, dy):
        return (x.T @ dy).T

    # a batch large enough that reducing the product beats gathering the operands
    x = jax.ShapeDtypeStruct((512, 64), jnp.float32)
    dy = jax.ShapeDtypeStruct((512, 256), jnp.float32)
    specs = (P("data"), P("data", "model"))
    prop = propagate(f, x, dy, mesh=mesh, in_specs=specs, out_specs=P(("data", "model")))
    planned = [(c.kind, c.payload_bytes) for c in prop.collectives()]
    assert planned == [("all_reduce", 64 * 64 * 4), ("collective_permute", 64 * 32 * 4)]
    compiled, got = _compiled(prop, mesh, x, dy)
    assert [(c.kind, c.payload_bytes) for c in got if c.group_size > 1] == planned
    rng = np.random.default_rng(0)
    xv = jax.device_put(
        rng.normal(size=(512, 64)).astype(np.float32), NamedSharding(mesh, P("data"))
    )
    dv = jax.device_put(
        rng.normal(size=(512, 256)).astype(np.float32), NamedSharding(mesh, P("data", "model"))
    )
    np.testing.assert_allclose(  # sums of 512 products, in another order
        compiled(xv, dv), f(np.asarray(xv), np.asarray(dv)), rtol=1e-4, atol=1e-4
    )


def test_a_scaled_partial_contraction_is_reduced_as_planned():
    """A float8 GEMM's result times its per-tensor scale: the weight gradient of
    ``spmdkit.step.fp8.fp8_dot`` under FSDP contracts the sharded batch, and the
    pending sum passes the multiply by a replicated scalar on its way to the
    gradient's shards. The replay runs the contraction per device and
    reduce-scatters it as planned; left to XLA, the product was all-reduced
    whole and sliced (the CPU's emission), where the plan reduce-scatters."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")
    dn = (((1,), (0,)), ((), ()))

    def grad(w, x):
        def loss(w):
            return jnp.mean(fp8_dot(x, w.astype(jnp.bfloat16), dn).astype(jnp.float32) ** 2)

        return jax.grad(loss)(w)

    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    x = jax.ShapeDtypeStruct((16, 64), jnp.bfloat16)
    fsdp = P(("data", "model"))
    prop = propagate(grad, w, x, mesh=mesh, in_specs=(fsdp, fsdp), out_specs=fsdp)
    big = [(c.kind, c.payload_bytes) for c in prop.collectives() if c.payload_bytes > 8]
    assert big == [("all_gather", 2048), ("reduce_scatter", 4096)], big  # float8 gathered
    compiled, got = _compiled(prop, mesh, w, x)
    # XLA:CPU reduces bf16 in f32: twice the planned bytes, as verify_plan counts
    assert [c.kind for c in got if c.payload_bytes > 8] == ["all_gather", "reduce_scatter"]
    rng = np.random.default_rng(0)
    wv = rng.normal(size=(64, 32)).astype(np.float32)
    xv = rng.normal(size=(16, 64)).astype(jnp.bfloat16)
    put = NamedSharding(mesh, fsdp)
    got = compiled(jax.device_put(wv, put), jax.device_put(xv, put))
    # each device's bf16 share of the sum rounds before the reduction
    np.testing.assert_allclose(got, jax.jit(grad)(wv, xv), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize(
    ("mode", "table"),
    [("fill", P("model")), ("clip", P("model")), ("promise_in_bounds", P("model", "data"))],
)
def test_a_masked_lookup_is_reduced_as_planned(mode, table):
    """Rows of a table sharded over ``model`` by rows, looked up and wanted
    sequence-sharded over ``model`` (megatron_sp's position embedding): the plan
    looks up each device's own rows with a mask and reduce-scatters the partial
    rows. Left alone XLA splits the indices over the idle ``data`` axis,
    all-reduces the half and permutes it into place (a collective-permute the plan
    lacks); the replay runs the masked lookup per device and reduce-scatters it
    itself. The gather's mode holds for the whole table (rows outside it: the
    fill value once, or clamped); a table also split by columns gives each device
    its block of columns."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(t, i):
        return jnp.tanh(t.at[i].get(mode=mode))

    t = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    i = jax.ShapeDtypeStruct((16,), jnp.int32)
    prop = propagate(f, t, i, mesh=mesh, in_specs=(table, P()), out_specs=table)
    assert [c.kind for c in prop.collectives()] == ["reduce_scatter"], prop.collectives()
    compiled, got = _compiled(prop, mesh, t, i)
    block = 16 * 32 * 4 // (2 if table == P("model", "data") else 1)  # columns over data
    assert [(c.kind, c.payload_bytes) for c in got] == [("reduce_scatter", block)]
    rows = np.arange(16) * 4 + 1
    if mode != "promise_in_bounds":
        rows[[2, 9]] = [64, 70]  # outside the table
    tv = np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32)
    got = compiled(jax.device_put(tv, NamedSharding(mesh, table)), jnp.asarray(rows))
    np.testing.assert_allclose(got, f(jnp.asarray(tv), rows), rtol=1e-6)


def test_a_partial_summed_on_its_way_is_reduced_after_the_sum():
    """Grouped-query attention's value gradient under megatron_sp: ``probs^T @ dout``
    contracts the ``model``-sharded queries, and the partial product is transposed,
    regrouped and summed over each group's heads before its reader wants it
    sequence-sharded. The plan reduce-scatters the summed half (8 KiB); left to
    XLA, the product was all-reduced whole right after the contraction (16 KiB;
    the Llama of tests/zoo/outside.py under megatron_sp, 32 KiB per layer). The
    replay runs the path per device and reduce-scatters its end."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(a, b):
        y = jnp.einsum("bqhk,bqhd->bhdk", a, b)  # partial over model
        y = jnp.transpose(y, (0, 3, 1, 2)).reshape(8, 16, 4, 2, 8).sum(3)
        return jnp.tanh(y)

    a = jax.ShapeDtypeStruct((8, 16, 8, 16), jnp.float32)
    b = jax.ShapeDtypeStruct((8, 16, 8, 8), jnp.float32)
    spec = P("data", "model")
    prop = propagate(f, a, b, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    assert [(c.kind, c.payload_bytes) for c in prop.collectives()] == [("reduce_scatter", 8192)]
    compiled, got = _compiled(prop, mesh, a, b)
    assert [(c.kind, c.payload_bytes) for c in got] == [("reduce_scatter", 8192)]
    rng = np.random.default_rng(0)
    av, bv = (rng.normal(size=x.shape).astype(np.float32) for x in (a, b))
    put = NamedSharding(mesh, spec)
    got = compiled(jax.device_put(av, put), jax.device_put(bv, put))
    np.testing.assert_allclose(got, f(av, bv), rtol=1e-5, atol=1e-5)


def test_a_grouped_gemms_partial_over_experts_and_width_is_reduced_once():
    """``ragged_dot`` with the experts split over ``data`` and the contracted width
    over ``model`` (fsdp's expert weights): each device's rows of its own experts,
    summed over its slice of the width, are sum-partial over both axes, and the plan
    all-reduces them once over the eight devices. Left to XLA the partial was
    all-reduced twice, whole each time (over ``model``, then over ``data``); the
    replay runs the rule's local grouped GEMM (the group sizes shifted to each
    device's experts) and reduces it itself."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(x, w, sizes):
        return jnp.tanh(jax.lax.ragged_dot(x, w, sizes))

    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((4, 32, 16), jnp.float32)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    specs = (P(None, "model"), P("data", "model"), P())
    prop = propagate(f, x, w, sizes, mesh=mesh, in_specs=specs)
    assert [(c.kind, c.payload_bytes) for c in prop.collectives()] == [("all_reduce", 4096)]
    compiled, got = _compiled(prop, mesh, x, w, sizes)
    assert [(c.kind, c.group_size, c.payload_bytes) for c in got] == [("all_reduce", 8, 4096)]
    rng = np.random.default_rng(0)
    xv = rng.normal(size=(64, 32)).astype(np.float32)
    wv = rng.normal(size=(4, 32, 16)).astype(np.float32)
    sv = np.array([20, 0, 30, 10], np.int32)  # 4 trailing rows in no group
    vals = (xv, wv, sv)
    args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip(vals, specs, strict=True)]
    np.testing.assert_allclose(compiled(*args), f(xv, wv, sv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("w_grad", [P(), P("x")])
def test_an_expert_parallel_grouped_gemm_compiles_only_the_predicted_collectives(w_grad):
    """``ragged_dot`` and its two cotangents with the experts over ``x`` (expert
    parallel): the forward and the lhs cotangent are sum-partial over ``x`` alone,
    and the weights' cotangent (a ragged contraction) is made whole or split over
    the experts. The replay runs each with the rule's local computation (each
    device's group sizes computed from the replicated global ones, no collective)
    and all-reduces as the plan does, so every compiled collective is a predicted
    one. Left to XLA, the partitioned lowering all-gathered the group ends it split
    with the groups (an ``s32[4]``, 16 B, once per partial equation and twice per
    split contraction on jaxlib 0.10 CPU), which no plan predicts."""
    from spmdkit.verification.compiled import report

    mesh = sk.make_mesh(x=4, axis_types="auto")

    def f(x, w, sizes):
        def loss(x, w):
            return jnp.sum(jnp.tanh(jax.lax.ragged_dot(x, w, sizes)) ** 2)

        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((4, 32, 16), jnp.float32)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    specs = (P(), P("x"), P())
    outs = (P(), (P(), w_grad))
    prop = propagate(f, x, w, sizes, mesh=mesh, in_specs=specs, out_specs=outs)
    ragged = [r for r in prop.records if r.primitive == "ragged_dot_general"]
    assert ragged[0].outputs[0].partial == (("x", "sum"),)  # the forward's rows
    (contraction,) = [r.outputs[0] for r in ragged if r.outputs[0].ndim == 3]
    assert contraction.dims[0] == tuple(w_grad[:1]) and not contraction.partial
    want = sorted((c.kind, c.payload_bytes) for c in prop.collectives())
    compiled, got = _compiled(prop, mesh, x, w, sizes)
    assert sorted((c.kind, c.payload_bytes) for c in got) == want
    assert not [c for c in got if "s32" in tuple(c.dtypes)]
    assert report(compiled).bytes_by_kind() == as_on_cpu(prop).comm_bytes_by_kind
    rng = np.random.default_rng(0)
    vals = (
        rng.normal(size=(64, 32)).astype(np.float32),
        rng.normal(size=(4, 32, 16)).astype(np.float32),
        np.array([20, 0, 30, 10], np.int32),  # an empty group, 4 rows in none
    )
    args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip(vals, specs, strict=True)]
    for g, r in zip(jax.tree.leaves(compiled(*args)), jax.tree.leaves(f(*vals)), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_a_scatter_adds_operand_made_partial_keeps_its_planned_layout():
    """The unpermute's backward in a user's MoE (tests/zoo/moe.py): rows
    scatter-added into zeros, the updates split by rows over ``data`` and by width
    over ``model``. The plan splits the zeros by width and makes them partial over
    ``data`` (local), scatter-adds each device's rows and all-reduces its slice
    of the width over ``data``. A partial layout cannot be pinned: left without a
    constraint, XLA laid the zeros out whole, gathered the updates over ``model``
    and all-reduced the whole result; the replay pins the zeros to the layout
    before the local step that makes them partial."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(rows, order):
        return jnp.tanh(jnp.zeros((64, 32)).at[order].add(rows))

    rows = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    order = jax.ShapeDtypeStruct((64,), jnp.int32)
    specs = (P("data", "model"), P("data"))
    prop = propagate(f, rows, order, mesh=mesh, in_specs=specs, out_specs=P(None, "model"))
    want = [("all_reduce", 64 * 8 * 4)]
    assert [(c.kind, c.payload_bytes) for c in prop.collectives()] == want
    compiled, got = _compiled(prop, mesh, rows, order)
    assert [(c.kind, c.payload_bytes) for c in got] == want
    rng = np.random.default_rng(0)
    rv = rng.normal(size=(64, 32)).astype(np.float32)
    ov = rng.permutation(64).astype(np.int32)
    args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip((rv, ov), specs, strict=True)]
    np.testing.assert_allclose(compiled(*args), f(rv, ov), rtol=1e-6)


def test_a_partial_contraction_replays_under_the_users_mesh_context():
    """A step traced under ``jax.set_mesh`` records that (Auto) mesh on its
    equations; the per-device contraction must not rebind it inside the
    ``shard_map`` (it raised "context mesh ... should match the aval mesh")."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    tp = sk.Plan(mesh, specs, specs, {"batch": ("data",)})

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]) ** 2)

    params = {"w1": jnp.ones((8, 16)) / 8, "w2": jnp.ones((16, 1)) / 16}
    batch = {"x": jnp.ones((16, 8))}
    opt = optax.adam(1e-2)  # its update gives the propagation a partial contraction
    step = jit(sk.train_step(loss, opt, tp), tp, donate_state=True)
    want = jax.jit(loss)(params, batch)
    with jax.set_mesh(mesh):
        got = step(params, opt.init(params), batch)[2]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_partial_attention_output_is_reduced_before_its_transpose(monkeypatch):
    """GPT with its sequence over ``model`` on (2, 4) and no weight there (under
    ``megatron_sp`` the tensor-parallel weights keep ``model`` and the
    activations are gathered over the sequence before them:
    ``spmdkit.propagation.contest``): ``probs @ v`` contracts the sequence-sharded
    keys, so the attention output is partial over ``model``, and it is transposed
    and reshaped before its readers (the output projection, and its weight
    gradient in the backward pass) reduce it. The replay reduces it right where it
    is computed and the transpose and reshape move reduced values; left to XLA,
    it was reduce-scattered and gathered again, 16 KiB per layer more than the
    plan (the slow matrix in tests/test_compile.py checks the compiled bytes).
    Without the pass-through, no forward contraction ahead of a transpose is
    reduced by the replay. The plain attention (``attention="xla"``) is the one whose
    ``probs @ v`` feeds a transpose; the blockwise one's sits inside a scan. The
    models call attention as a region now; this test puts the plain kernel back in
    jnp (the case of a model written with jnp attention)."""
    import dataclasses

    from spmdkit import kernels
    from spmdkit.models import get_model
    from spmdkit.models import layers as lyr

    def jnp_attention(q, k, v, *, causal=True, implementation=None, block_size=512):
        return kernels.plain_attention(q, k, v, causal=causal)

    monkeypatch.setattr(lyr, "attention", jnp_attention)

    spec = get_model("gpt")
    cfg = dataclasses.replace(spec.config("tiny"), attention="xla")
    batch = spec.batch(cfg, 8, np.random.default_rng(0))
    info = describe(spec, config=cfg, batch=batch)
    mesh = sk.make_mesh(data=2, model=4)
    p = plan(info, mesh, "dp", rules=[("batch", "data"), ("seq", "model")])
    assert (p.activation["batch"], p.activation["seq"]) == (("data",), ("model",))
    _, prop = jit(jax.value_and_grad(info.loss_fn), p).program(info.abstract_params, batch)
    program = prop.program
    nodes = program.graph.all_nodes or program.graph.nodes
    reader = {v: n for n in nodes for v in n.ins}
    passed = []
    for n in nodes:
        entry = program.specs.get(id(n))
        if n.prim != "dot_general" or n.backward or entry is None or entry[3] is None:
            continue
        t = reader.get(n.outs[0])
        if t is not None and t.prim == "transpose":
            (before,), (after,) = program.specs[id(t)][:2]
            assert before == entry[3].dst and not after.partial
            passed.append(t)
    assert len(passed) >= cfg.n_layers, len(passed)  # one per layer at least


def test_a_reshard_runs_with_the_plans_own_collectives():
    """Rows over ``data`` (2) wanted over ``model`` (4): the plan permutes half of
    each device's block to the device that needs it (320 B), as XLA would. The
    replay runs exactly that under ``shard_map`` (a ``ppermute``)."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(w):
        return jnp.tanh(w)

    w = jax.ShapeDtypeStruct((32, 10), jnp.float32)
    prop = propagate(f, w, mesh=mesh, in_specs=(P("data"),), out_specs=P("model"))
    compiled, got = _compiled(prop, mesh, w)
    planned = [(c.kind, c.payload_bytes) for c in prop.collectives()]
    assert planned == [("collective_permute", 32 * 10 * 4 // 4)], prop.collectives()
    assert [(c.kind, c.payload_bytes) for c in got] == planned
    x = jax.device_put(
        jnp.arange(320, dtype=jnp.float32).reshape(32, 10) / 320, NamedSharding(mesh, P("data"))
    )
    out = compiled(x)
    assert out.sharding.spec == P("model")
    np.testing.assert_allclose(out, np.tanh(np.asarray(x)), rtol=1e-6)


def test_an_output_moves_into_its_returned_layout_with_the_plans_collectives():
    """A value made over ``model`` (4) that a reader keeps there, returned over
    ``data`` (2), as an optimizer's results leave the gradient's layout for the
    parameters' (tiny GPT under auto on 2x4): the plan gathers over ``model`` and
    slices. The replay runs that itself; left to the output sharding, XLA
    permuted the blocks and gathered over half of ``model`` (a collective-permute
    the plan does not have)."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(m, g):
        y = jnp.tanh(g)
        return y, y * m

    x = jax.ShapeDtypeStruct((64,), jnp.float32)
    prop = propagate(
        f, x, x, mesh=mesh, in_specs=(P("model"), P("model")), out_specs=(P("data"), P("model"))
    )
    planned = [(c.kind, c.payload_bytes) for c in prop.collectives()]
    assert planned == [("all_gather", 64 * 4)], prop.collectives()
    compiled, got = _compiled(prop, mesh, x, x, outs=True)
    assert [(c.kind, c.payload_bytes) for c in got] == planned
    v = jax.device_put(jnp.linspace(-2, 2, 64), NamedSharding(mesh, P("model")))
    y, ym = compiled(v, v)
    assert y.sharding.spec == P("data") and ym.sharding.spec == P("model")
    np.testing.assert_allclose(y, np.tanh(np.asarray(v)), rtol=1e-6)
    np.testing.assert_allclose(ym, np.tanh(np.asarray(v)) * np.asarray(v), rtol=1e-6)


# -- composite ops traced as regions ------------------------------------------------


def _ops_step(info, p):
    return jit(jax.value_and_grad(info.loss_fn), p)


@pytest.fixture(scope="module")
def ops_reference():
    """The ops toy's loss and grads on one device (plain jit: regions lower to the
    unsharded computation)."""
    from flax import nnx

    info = describe(ops_toy_init, loss=ops_toy_loss, batch=toy_batch())
    with nnx.use_eager_sharding(False):
        params = info.init_fn()
    return info, jax.jit(jax.value_and_grad(info.loss_fn))(params, toy_batch())


@pytest.mark.slow
def test_megatron_with_ops_compiles_the_plans_collectives(ops_reference):
    """The ops toy (spmdkit.ops with no in_specs, Auto axes) under sk.jit: values equal
    the single-device run, the compiled collectives equal the propagation's, and the
    loss is vocab-parallel (the class dim stays sharded into the loss region)."""
    info, (ref_loss, ref_grads) = ops_reference
    mesh = sk.make_mesh(data=4, model=2)
    p = plan(info, mesh, "megatron", estimator="analytic")
    params = sk.init_sharded(info, p)
    step = _ops_step(info, p)
    loss, grads = step(params, toy_batch())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
    report = p.verify(step, params, toy_batch())
    assert report.ok, str(report)
    prop = step.program(params, toy_batch())[1]
    regions = prop.region_strategies()
    assert set(regions) == {
        "embedding",
        "embedding:grad",
        "rms_norm",
        "rms_norm:grad",
        "softmax_cross_entropy",
        "softmax_cross_entropy:grad",
    }
    (ce,) = [r for r in prop.records if r.primitive == "spmdkit_op" and r.op.startswith("softmax")]
    assert ce.inputs[0].dims[-1] == ("model",)  # logits stay vocab-sharded into the loss
    assert "ops (strategy): " in str(prop)


def _hybrid_bytes(norm_strategy):
    info = describe(lambda: ops_toy_init(norm_strategy), loss=ops_toy_loss, batch=toy_batch())
    mesh = sk.make_mesh(data=2, model=4)
    table = {"embed": "model", "vocab": None, "mlp": None, "norm": None}
    p = plan(info, mesh, table, estimator="analytic")
    params = sk.init_sharded(info, p)
    step = _ops_step(info, p)
    report = p.verify(step, params, toy_batch())
    assert report.ok, str(report)
    prop = step.program(params, toy_batch())[1]
    return prop, report


@pytest.mark.slow
def test_d_model_sharded_into_the_norm_picks_sharded_stats():
    """d_model sharded over `model` into the norms: left to choose, the planner takes
    sharded_stats (row statistics all-reduced, the activation all-gather gone), and
    the compiled program moves what it predicted; a norm fixed to the default gathers."""
    prop, _ = _hybrid_bytes(None)
    assert prop.region_strategies()["rms_norm"] == {"sharded_stats": 2}
    assert prop.region_strategies()["rms_norm:grad"] == {"sharded_stats": 2}
    gathers = [c for c in prop.collectives() if c.kind == "all_gather" and c.payload_bytes > 512]
    assert not gathers
    fixed, _ = _hybrid_bytes("default")
    assert fixed.region_strategies()["rms_norm"] == {"default": 2}
    assert fixed.comm_bytes_by_kind.get("all_gather", 0) >= 2 * 8 * 16 * 32 * 4
    assert prop.comm_bytes < fixed.comm_bytes


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bias_on_a_pending_sum", "bias_gradient"])
def test_a_bias_moves_as_planned_around_a_batch_over_model(case):
    """The batch over ``model``, features over ``data``, a bias over ``model``
    (ViT auto on 2x4). A bias added to a pending sum is gathered and made partial;
    a bias's gradient, summed over the sharded batch, is gathered over ``data``
    and reduce-scattered over ``model`` into the bias's layout. Left to
    constraints, XLA adds the bias after the sum, and reduces the gradient whole,
    each then moved by slicing and permuting (a collective-permute the plan does
    not have); the replay runs the plan's collectives, and the compiled program
    moves exactly the bytes predicted for CPU, kind by kind."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")
    b = jax.ShapeDtypeStruct((32,), jnp.float32)
    if case == "bias_on_a_pending_sum":

        def f(x, w, r, b):  # contracts the data-sharded features: a pending sum
            return jnp.sum(jnp.tanh(r + (jnp.einsum("bf,fg->bg", x, w) + b)))

        x, w, r = ((8, 64), (64, 32), (8, 32))
        args = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in (x, w, r))
        specs, out = (P("model", "data"), P("data"), P("model", "data")), None
    else:

        def f(x, b):
            return jax.grad(lambda b: jnp.sum(jnp.tanh(x + b)))(b)

        args, specs, out = (
            (jax.ShapeDtypeStruct((8, 32), jnp.float32),),
            (P("model", "data"),),
            P("model"),
        )
    prop = propagate(f, *args, b, mesh=mesh, in_specs=(*specs, P("model")), out_specs=out)
    _, got = _compiled(prop, mesh, *args, b)
    kinds = {}
    for c in got:
        kinds[c.kind] = kinds.get(c.kind, 0) + c.payload_bytes
    assert "collective_permute" not in kinds, got
    assert kinds == {k: n for k, n in as_on_cpu(prop).comm_bytes_by_kind.items() if n}


def test_a_partial_gathered_by_rows_is_reduced_before_the_gather():
    """A grouped GEMM with its experts over ``model`` (expert parallelism) leaves
    its rows sum-partial over ``model``; the unpermute then gathers them by
    indices split over ``data``. A pending sum cannot be pinned or carried into
    the gather, so XLA all-reduces the rows whole where they are made; the gather
    rule passes no sum, and the plan counts that all-reduce (the MoE of
    tests/zoo/moe.py under megatron counted the gathered half)."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(x, w, sizes, order):
        return jnp.tanh(jax.lax.ragged_dot(x, w, sizes)[order])

    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((4, 32, 16), jnp.float32)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    order = jax.ShapeDtypeStruct((64,), jnp.int32)
    specs = (P(), P("model"), P(), P("data"))
    prop = propagate(f, x, w, sizes, order, mesh=mesh, in_specs=specs, out_specs=P("data"))
    want = [("all_reduce", 64 * 16 * 4)]
    assert [(c.kind, c.payload_bytes) for c in prop.collectives()] == want
    compiled, got = _compiled(prop, mesh, x, w, sizes, order)
    assert [(c.kind, c.payload_bytes) for c in got if c.dtypes != ("s32",)] == want
    rng = np.random.default_rng(0)
    vals = (
        rng.normal(size=(64, 32)).astype(np.float32),
        rng.normal(size=(4, 32, 16)).astype(np.float32),
        np.array([20, 0, 30, 10], np.int32),
        rng.permutation(64).astype(np.int32),
    )
    args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip(vals, specs, strict=True)]
    np.testing.assert_allclose(compiled(*args), f(*vals), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cut", ["slice", "dynamic_slice"])
def test_a_partial_is_reduced_before_a_slice(cut):
    """A matmul with its contraction over ``model`` leaves a sum-partial; slicing
    rows off it cannot carry the pending sum (as the gather above), so XLA
    all-reduces the whole product and the slice and dynamic_slice rules count
    that, not the kept rows' quarter."""
    mesh = sk.make_mesh(data=2, model=4, axis_types="auto")

    def f(x, w):
        y = x @ w
        y = y[:16] if cut == "slice" else jax.lax.dynamic_slice_in_dim(y, 5, 16)
        return jnp.tanh(y)

    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    specs = (P(None, "model"), P("model"))
    prop = propagate(f, x, w, mesh=mesh, in_specs=specs)
    want = [("all_reduce", 64 * 16 * 4)]
    assert [(c.kind, c.payload_bytes) for c in prop.collectives()] == want
    compiled, got = _compiled(prop, mesh, x, w)
    assert [(c.kind, c.payload_bytes) for c in got] == want
    rng = np.random.default_rng(0)
    vals = (rng.normal(size=(64, 32)).astype(np.float32), rng.normal(size=(32, 16)))
    vals = (vals[0], vals[1].astype(np.float32))
    args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip(vals, specs, strict=True)]
    np.testing.assert_allclose(compiled(*args), f(*vals), rtol=1e-5, atol=1e-5)


def test_a_loop_invariant_move_runs_once_before_the_loop():
    """A weight cast and gathered inside a micro-batch scan (4 micro-batches, the
    rows over ``data``, so the plan gathers the weight rather than the rows): the
    gather's operand is the same every iteration, and XLA's loop-invariant code
    motion runs it once, before the loop. The plan counts it once, on the scan
    (before: four times, 256 KiB predicted against 64 KiB compiled)."""
    from spmdkit.verification.compiled import report

    mesh = sk.make_mesh(data=8, axis_types="auto")

    def f(w, xs):
        def body(c, x):
            y = jnp.tanh(x @ w.astype(jnp.bfloat16).astype(jnp.float32))
            return c + jnp.sum(y), None

        return jax.lax.scan(body, 0.0, xs)[0]

    w = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    xs = jax.ShapeDtypeStruct((4, 512, 64), jnp.float32)
    prop = propagate(f, w, xs, mesh=mesh, in_specs=(P(None, "data"), P(None, "data")))
    (scan,) = [r for r in prop.records if r.primitive == "scan"]
    assert [(a.arg, a.payload_bytes) for a in scan.reshards] == [("input 0", 64 * 1024)]
    assert not any(a.plan.collectives for b in scan.body[:-1] for a in b.reshards)
    compiled, _ = _compiled(prop, mesh, w, xs)
    assert report(compiled).bytes_by_kind() == as_on_cpu(prop).comm_bytes_by_kind


# -- kept residuals: a grad region reads its forward's buffers on their layout ----------

_T, _D, _K, _E, _F, _L = 32, 8, 2, 8, 8, 2


def _moe_layers(x, idx, w, wg, wu, wd):
    """Two routed-expert layers in a layer scan, differentiated: each grad region
    (in the backward scan) reads the buffers its forward region (in the forward
    scan) kept."""

    def loss(x, w, wg, wu, wd):
        def layer(h, ws):
            return jnp.tanh(sk.ops.moe_experts(h, idx, w, *ws)), None

        return jnp.sum(jax.lax.scan(layer, x, (wg, wu, wd))[0] ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(x, w, wg, wu, wd)


def _moe_case():
    mesh = sk.make_mesh(a=2, b=4, axis_types="auto")
    tok, ex = P(("a", "b")), P(None, ("a", "b"))
    shapes = [(_T, _D), (_T, _K), (_T, _K), (_L, _E, _D, _F), (_L, _E, _D, _F), (_L, _E, _F, _D)]
    dtypes = [jnp.float32, jnp.int32, *[jnp.float32] * 4]
    avals = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    specs = (tok, tok, tok, ex, ex, ex)
    prop = propagate(_moe_layers, *avals, mesh=mesh, in_specs=specs)
    rng = np.random.default_rng(0)
    vals = [
        rng.standard_normal((_T, _D)).astype(np.float32),
        np.stack([rng.permutation(_E)[:_K] for _ in range(_T)]).astype(np.int32),
        rng.random((_T, _K)).astype(np.float32),
        *(rng.standard_normal(s).astype(np.float32) * 0.5 for s in shapes[3:]),
    ]
    args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip(vals, specs, strict=True)]
    return prop, mesh, args, jax.jit(_moe_layers)(*vals)


def _regions(graph, prim):
    for node in graph.nodes:
        if node.prim == prim:
            yield node
        for sub in node.subs:
            yield from _regions(sub, prim)


def _run(prop, mesh, args):
    with jax.set_mesh(mesh):
        return jax.jit(enforced(prop))(*args)


def _errors(got, want):
    """Per output leaf, the largest difference relative to the leaf's scale."""
    return [
        float(np.max(np.abs(np.asarray(g) - np.asarray(w))) / np.max(np.abs(np.asarray(w))))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    ]


def test_a_grad_region_reads_the_residuals_its_forward_kept_across_the_layer_scan():
    """The planned step: each grad region reads its forward's buffers (paired through
    the forward and backward layer scans), and the loss and grads are one device's."""
    from spmdkit.engine.region import kept_layout

    prop, mesh, args, want = _moe_case()
    (fwd,) = _regions(prop.program.graph, "spmdkit_op")
    (grad,) = _regions(prop.program.graph, "spmdkit_op_grad")
    layouts = []
    for node in (fwd, grad):
        pins = prop.program.specs[id(node)]
        args_k = (node.prim, node.eqn.params, pins.attrs, pins.required, pins.produced, mesh)
        layouts.append(kept_layout(*args_k))
    assert layouts[0] is not None and layouts[0] == layouts[1]
    assert dict(layouts[0].facts)["expert axes"] == ("a", "b")
    assert max(_errors(_run(prop, mesh, args), want)) < 1e-5


def _experts_over(spec, axes):
    """``spec`` with the experts' dim (dim 0 of the weights in a layer) over ``axes``."""
    if spec is None or spec.ndim != 3:
        return spec
    return sk.TensorSpec(spec.shape, (axes, *spec.dims[1:]), dtype=spec.dtype)


def test_a_grad_region_planned_on_another_layout_than_its_forward_is_refused(monkeypatch):
    """The grad region's experts forced over ``(b, a)`` where its forward region's
    are over ``(a, b)``: the kept buffers have the same shapes, and read there each
    device would take another device's rows. The replay refuses it with a typed
    error naming both layouts; with that check switched off the step runs and its
    expert weights' gradients are silently wrong (the hazard is real)."""
    import spmdkit.compile.enforce as enforce_mod

    prop, mesh, args, want = _moe_case()
    (grad,) = _regions(prop.program.graph, "spmdkit_op_grad")
    pins = prop.program.specs[id(grad)]
    prop.program.specs[id(grad)] = pins._replace(
        required=tuple(_experts_over(s, ("b", "a")) for s in pins.required),
        produced=tuple(_experts_over(s, ("b", "a")) for s in pins.produced),
        steps=tuple(() for _ in pins.steps),
    )
    with pytest.raises(sk.ShardingConflictError) as err:
        _run(prop, mesh, args)
    message = str(err.value)
    assert "expert axes ('a', 'b')" in message and "expert axes ('b', 'a')" in message
    assert err.value.op == "moe_experts" and err.value.fix
    monkeypatch.setattr(enforce_mod, "check_kept", lambda *a, **k: None)
    errors = _errors(_run(prop, mesh, args), want)
    assert errors[0] < 1e-5  # the loss: the forward
    assert min(errors[1:]) > 0.1  # every grad: read from another device's buffers


def _two_norms(x, s1, s2):
    """Two layers alike: each an rms_norm region (its statistics over a sharded
    d_model: a collective per norm) and a matmul."""

    def loss(s1, s2):
        h = sk.ops.rms_norm(x, s1, strategy="sharded_stats")
        h = sk.ops.rms_norm(h * 2.0, s2, strategy="sharded_stats")
        return jnp.sum(h**2)

    return jax.value_and_grad(loss, argnums=(0, 1))(s1, s2)


def test_layers_running_one_region_program_bind_it_once_and_keep_their_names(mesh):
    """Regions laid out alike (two layers' norms) are bound as one equation each
    holding the same traced program (traced and lowered once, not per layer); the
    values are the traced function's and each layer's collectives keep its own
    equation's name in the compiled HLO (what plan.verify attributes them by)."""
    from spmdkit.propagation.graph import node_tags
    from spmdkit.verification.blame import tags_in

    x = jax.random.normal(jax.random.key(0), (8, 32))
    s1, s2 = jnp.linspace(0.5, 1.5, 32), jnp.linspace(1.5, 0.5, 32)
    specs = (P("data", "model"), P("model"), P("model"))
    prop = propagate(_two_norms, x, s1, s2, mesh=mesh, in_specs=specs)
    with jax.set_mesh(mesh):
        traced = jax.jit(enforced(prop)).trace(x, s1, s2)
    bound = [e for e in traced.jaxpr.jaxpr.eqns if e.primitive.name == "spmdkit_region_program"]
    assert len(bound) == 4  # two forward regions, two grad regions
    programs = {id(e.params["jaxpr"]) for e in bound}
    assert len(programs) == 2  # one forward program and one grad program for both layers
    for got, want in zip(_run(prop, mesh, (x, s1, s2)), _two_norms(x, s1, s2), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    tags = node_tags(prop.program.graph)
    norms = {
        tags[id(n)]
        for prim in ("spmdkit_op", "spmdkit_op_grad")
        for n in _regions(prop.program.graph, prim)
    }
    assert len(norms) == 4
    with jax.set_mesh(mesh):
        hlo = traced.lower().compile().as_text()
    named = {t for c in parse_collectives(hlo) for t in tags_in(c.op_name)}
    assert norms <= named, (norms, named)
