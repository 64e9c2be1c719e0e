"""verify_plan's checks and the CPU-emission adjustment of the prediction."""

import ast
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
import spmdkit.verification.compiled
import spmdkit.verification.hlo
import spmdkit.verification.planned
from spmdkit.propagation import propagate
from spmdkit.resharding import plan_reshard
from spmdkit.verification.planned import (
    PlannedProgram,
    as_on_cpu,
    as_replayed,
    platform,
    unsliced_plan_bytes,
    verify_plan,
)
from tests.sampling import sampled

S = jax.ShapeDtypeStruct


def _prop(mesh):
    return propagate(
        lambda x: jnp.tanh(x) * 2, S((16, 16), "float32"), in_specs=(P("a"),), mesh=mesh
    )


def _toy_program(strategy):
    """The plan tests' toy LM (tests/plan_model.py) under ``strategy`` on
    data=2 × model=4: the propagation ``sk.jit`` replays."""
    from tests.plan_model import toy_batch, toy_init, toy_loss

    info = sk.describe(toy_init, loss=toy_loss, batch=toy_batch())
    p = sk.plan(info, sk.make_mesh(data=2, model=4), strategy, estimator="analytic")
    step = sk.jit(jax.value_and_grad(info.loss_fn), p)
    return step.program(sk.init_sharded(info, p), toy_batch())[1]


def test_as_replayed_moves_a_sum_the_replay_reduces_as_it_does():
    """Under megatron_sp the norm's output gradient (the qkv einsum's sum over
    ``model``) is read split over the sequence by the scale gradient's mul and
    whole by the input gradient's: priced there as a reduce-scatter and a gather
    back (8 KiB each, per layer), the replay all-reduces it once where the dot
    makes it. A plan whose sums have one reader each is unchanged."""
    prop = _toy_program("megatron_sp")
    replayed = as_replayed(prop)
    before, after = prop.comm_bytes_by_kind, replayed.comm_bytes_by_kind
    kib = 1024
    assert before["all_gather"] - after["all_gather"] == 2 * 8 * kib  # two layers
    assert before["reduce_scatter"] - after["reduce_scatter"] == 2 * 8 * kib
    assert after["all_reduce"] - before["all_reduce"] == 2 * 8 * kib
    moved = [
        (r.primitive, a.arg, c.kind)
        for r in replayed.records
        for a in r.reshards
        if a.arg == "output 0"
        for c in a.plan.collectives
    ]
    assert moved.count(("dot_general", "output 0", "all_reduce")) >= 2
    assert sum(r.comm_bytes for r in replayed.records) == sum(after.values())
    fsdp = _toy_program("fsdp")
    assert as_replayed(fsdp).comm_bytes_by_kind == fsdp.comm_bytes_by_kind


def test_a_plain_function_is_refused_with_the_fix(mesh2d):
    plan = sk.Plan(mesh2d, {}, {}, {})
    assert not isinstance(jnp.tanh, PlannedProgram)
    with pytest.raises(sk.SpmdError, match=r"wrap with sk\.jit\(step, plan\)"):
        verify_plan(plan, jnp.tanh, S((4,), "float32"))


def test_platform_of_device_and_abstract_meshes(mesh2d):
    assert platform(mesh2d) == "cpu"
    assert platform(sk.abstract_mesh(a=2)) is None


def test_cpu_all_reduces_what_a_gpu_reduce_scatters(mesh2d):
    prop = _prop(mesh2d)
    assert as_on_cpu(prop) is prop  # nothing to adjust
    scattered = dataclasses.replace(
        prop, comm_bytes_by_kind={"reduce_scatter": 4096, "all_gather": 512}, program=None
    )
    assert as_on_cpu(scattered).comm_bytes_by_kind == {"all_gather": 512, "all_reduce": 4096}


def test_staged_reduce_scatters_reduce_the_whole_block_at_each_stage(mesh2d):
    src = sk.TensorSpec((64, 64), partial={"a": "sum", "b": "sum"})
    plan = plan_reshard(src, sk.TensorSpec((64, 64), P(("a", "b"))), mesh2d)
    kinds = [c.kind for c in plan.collectives]
    assert kinds == ["reduce_scatter", "reduce_scatter"], plan
    first, second = (c.payload_bytes for c in plan.collectives)
    assert unsliced_plan_bytes(plan) == first - second > 0


def test_verification_never_imports_compile():
    """sk.jit's PlannedFunction calls verification (its ``verify``), so
    verification reads it through PlannedProgram instead of importing it."""
    for module in (
        spmdkit.verification.hlo,
        spmdkit.verification.compiled,
        spmdkit.verification.planned,
    ):
        tree = ast.parse(inspect.getsource(module))
        names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.startswith("spmdkit.compile")], module.__name__


def test_cpu_holds_bf16_temporaries_in_float32():
    """A bf16 MLP's gradient on 8 CPU devices (batch-parallel, activations
    dominate): XLA:CPU computes some of it in float32 (every dot and activation
    up to jaxlib 0.10; from 0.11 the weight gradients, ``xT @ dy``, which it does
    not run natively), so the peak predicted for native bf16 is more than 20%
    under the compiled one; held as the CPU backend holds them it is within 10%,
    the arguments unchanged (fp32 parameters). Measured per device: native 896
    KiB, held 1,280 KiB, compiled 1,408 KiB on jaxlib 0.10.2; native 960, held
    1,280, compiled 1,280 on 0.12."""
    from jax.sharding import NamedSharding

    from spmdkit.compile.enforce import enforced
    from spmdkit.verification.compiled import report, verify
    from spmdkit.verification.planned import held_on_cpu, promoted_on_cpu

    mesh = sk.make_mesh(data=8, axis_types="auto")
    bf16 = jnp.bfloat16

    def f(x, w1, w2):
        h = jnp.tanh(x.astype(bf16) @ w1.astype(bf16))
        return jnp.sum((h @ w2.astype(bf16)).astype(jnp.float32) ** 2)

    args = (S((2048, 128), "float32"), S((128, 256), "float32"), S((256, 128), "float32"))
    step = jax.grad(f, argnums=(1, 2))
    prop = propagate(step, *args, mesh=mesh, in_specs=(P("data"), P(), P()))
    held = held_on_cpu(prop)
    assert held.memory.argument_bytes == prop.memory.argument_bytes
    assert held.memory.temp_bytes > prop.memory.temp_bytes
    shardings = tuple(NamedSharding(mesh, s.to_partition_spec()) for s in prop.in_specs)
    with jax.set_mesh(mesh):
        compiled = report(jax.jit(enforced(prop), in_shardings=shardings).lower(*args).compile())
    # the weight gradients reduce in bf16 at their dots, moved in float32 on CPU
    moved = promoted_on_cpu(held)
    assert verify(moved, compiled).ok, str(verify(moved, compiled))
    assert prop.memory.peak_bytes < 0.8 * compiled.peak_bytes  # native bf16: 23% under
    assert held.memory.peak_bytes == pytest.approx(compiled.peak_bytes, rel=0.1)  # 9% under
    assert held_on_cpu(_prop(sk.make_mesh(a=2, axis_types="auto"))).memory is not None  # f32


@pytest.mark.parametrize("strategy", ["dp", "zero1"])
def test_bf16_weight_gradients_wait_for_the_combined_all_reduce(strategy):
    """Tiny GPT in bf16 (float32 parameters cast to bf16) on data=8: each weight
    gradient is a contraction's partial sum transposed (fused) and cast to float32
    on its way to the all-reduce XLA combines after the backward, so every partial
    sum is live at the end beside the outputs. The estimate held it to the end
    only when the partial sum was a buffer of its own, not fused into the cast:
    peak 1.0 MiB predicted against 1.5 MiB compiled (jax 0.10.2 and 0.12 alike),
    the float32 step's own estimate 1.3 MiB."""
    import numpy as np

    from spmdkit.models import get_model

    info = sk.describe(get_model("gpt"), config="tiny", batch_size=8)
    p = sk.plan(
        info,
        sk.make_mesh(data=8),
        strategy,
        recipe=sk.Recipe(compute_dtype="bfloat16"),
        estimator="analytic",
    )
    step = sk.jit(sk.value_and_grad(info.loss_fn, p), p)
    batch = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), info.batch)
    report = p.verify(step, sk.init_sharded(info, p), batch)
    assert report.ok, str(report)


def test_cpu_holds_float8_values_in_float32():
    """XLA:CPU keeps no float8 buffer (each quantizing cast of ``spmdkit.step.fp8`` is
    fused with the widening to its float32 dot): held as the CPU backend holds
    them, a float8 MLP's gradient counts more temporaries than at float8 sizes,
    the arguments unchanged. (Against compiled programs: tiny GPT's fsdp step,
    ``tests/step/test_fp8.py``'s training test.)"""
    from spmdkit.step.fp8 import fp8_loss
    from spmdkit.verification.planned import held_on_cpu

    mesh = sk.make_mesh(data=8, axis_types="auto")
    bf16 = jnp.bfloat16

    def f(w1, w2, x):
        h = jnp.tanh(x.astype(bf16) @ w1.astype(bf16))
        return jnp.sum((h @ w2.astype(bf16)).astype(jnp.float32) ** 2)

    args = (S((128, 256), "float32"), S((256, 128), "float32"), S((2048, 128), "float32"))
    step = jax.grad(fp8_loss(f), argnums=(0, 1))
    prop = propagate(step, *args, mesh=mesh, in_specs=(P(), P(), P("data")))
    held = held_on_cpu(prop)
    assert held.memory.argument_bytes == prop.memory.argument_bytes
    assert held.memory.temp_bytes > prop.memory.temp_bytes


#: (strategy, mesh, model): the sharded-optimizer presets' train steps; CI runs one
#: case per strategy (tests/sampling.py), ``SPMDKIT_FULL_SWEEP=1`` all twelve.
_SHARDED_OPT = [
    (s, m, name)
    for s in ("zero1", "megatron+zero1", "megatron_sp+zero1")
    for m in ((2, 4), (4, 2))
    for name in ("gpt", "llama")
]
#: Cases whose plan.verify misses today, asserted to still miss (a fix shows up
#: here): (strategy, mesh, model) → the rows that miss. None now: tiny GPT under
#: megatron_sp+zero1 (2x4, 4x2) was listed for a 1 KiB collective-permute of its
#: position table's gradient that XLA no longer emits (jaxlib 0.10.2 and 0.12;
#: only the full sweep runs those cases).
_SHARDED_OPT_MISSES: dict[tuple, set[str]] = {}
_SHARDED_OPT_CI = {
    ("zero1", (2, 4), "gpt"),
    ("megatron+zero1", (4, 2), "llama"),
    ("megatron_sp+zero1", (2, 4), "llama"),
}


def scattered_grad_bytes(plan) -> float:
    """Bytes per device of the weight matrices' gradients a plan's optimizer
    state shards over more axes than their parameters (each reduce-scattered from
    the parameter's local block): the floor of the step's reduce-scatter payload.
    Left out: vectors (the norms' scales, biases: summed inside their ops'
    regions) and the embedding table (a scatter-add's gradient, summed in place),
    which are all-reduced."""
    import math

    sizes = dict(plan.mesh.shape)

    def shards(spec) -> int:
        axes = [a for e in spec for a in ((e,) if isinstance(e, str) else tuple(e or ()))]
        return math.prod(sizes[a] for a in axes)

    total = 0.0
    for path, spec in plan.params.items():
        shape, dtype, logical = plan.info[path]
        table = bool(logical) and logical[0] == "vocab"
        if len(shape) > 1 and not table and shards(plan.opt[path]) > shards(spec):
            total += math.prod(shape) * jnp.dtype(dtype).itemsize / shards(spec)
    return total


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:plan.strategy=:UserWarning")  # llama's 2 KV heads on model=4
@pytest.mark.parametrize(
    ("strategy", "shape", "name"),
    sampled(_SHARDED_OPT, _SHARDED_OPT_CI),
    ids=[f"{s}-{m[0]}x{m[1]}-{n}" for s, m, n in _SHARDED_OPT],
)
def test_sharded_optimizer_steps_reduce_scatter_their_gradients(strategy, shape, name):
    """ZeRO-1 and the distributed optimizer (``megatron+zero1``,
    ``megatron_sp+zero1``) on 2×4 and 4×2: the train step's collectives and peak
    verify (±10% per kind, ±20%), and every gradient the optimizer state shards
    further than its parameter is reduce-scattered into that shard (the compiled
    reduce-scatters carry at least 90% of the weight matrices' among them:
    :func:`scattered_grad_bytes`), not all-reduced and sliced."""
    import optax

    from spmdkit.introspect import describe
    from spmdkit.models import get_model
    from spmdkit.verification.compiled import report

    info = describe(get_model(name), config="tiny", batch_size=16)
    mesh = sk.make_mesh(data=shape[0], model=shape[1])
    opt = optax.adam(1e-3)
    p = sk.plan(info, mesh, strategy, optimizer=opt)
    step = sk.jit(sk.train_step(info, opt, p), p)
    args = (info.abstract_params, jax.eval_shape(opt.init, info.abstract_params), info.batch)
    verified = p.verify(step, *args)
    missed = {r[0] for r in verified.rows if not r[3]}
    assert missed == _SHARDED_OPT_MISSES.get((strategy, shape, name), set()), str(verified)
    compiled = report(step.compile(*args)).bytes_by_kind()
    assert compiled["reduce_scatter"] >= 0.9 * scattered_grad_bytes(p) > 0
