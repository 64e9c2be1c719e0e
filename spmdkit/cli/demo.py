"""``spmdkit demo``: a short tour on a 2x4 ``(data, model)`` mesh.

Part 1 asks the rule registry what four ops do to specs (no data moves): a
matmul whose contraction dim is sharded (the output is sum-partial), its grad,
a softmax whose axis must be replicated, and an add with a broadcast bias.
Part 2 runs real arrays: the matmul's sum-partial output is reduce-scattered
into a sharded layout and then gathered to replicated with
:func:`spmdkit.resharding.reshard`; each plan (collectives, bytes per device,
modelled time) is printed next to the collectives found in the compiled HLO
(:mod:`spmdkit.verification.hlo`), and the values are checked against numpy.

Runs on 8 virtual CPU devices unless 8 accelerators are present. It must pick
its devices before JAX's backends start, so call it from a fresh process
(``python -m spmdkit demo``).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.engine.inference import InferenceResult, infer_forward, infer_grad
from spmdkit.engine.registry import get_rule
from spmdkit.errors import SpmdError
from spmdkit.mesh import make_mesh, use_virtual_cpu_devices
from spmdkit.resharding import plan_reshard, reshard
from spmdkit.spec import TensorSpec
from spmdkit.topology import DEFAULT_TOPOLOGY
from spmdkit.verification.hlo import check_plan, compiled_collectives

__all__ = ["pick_devices", "run_demo"]

_N_DEVICES = 8


def pick_devices(*, force_cpu: bool = False) -> tuple[list[jax.Device], str]:
    """Eight devices for the demo mesh, and a sentence saying which.

    Asks JAX for 8 virtual CPU devices first (this only works before its
    backends start). Uses accelerators instead when at least 8 are present and
    ``force_cpu`` is False.

    Raises:
      SpmdError: fewer than 8 devices can be had (JAX already started).

    Example::

        >>> devices, where = pick_devices(force_cpu=True)
        >>> where
        '8 virtual CPU devices'
    """
    use_virtual_cpu_devices(_N_DEVICES)
    accel: list[jax.Device] = []
    if not force_cpu:
        accel = [d for d in jax.devices() if d.platform != "cpu"]
        if len(accel) >= _N_DEVICES:
            return accel[:_N_DEVICES], f"{_N_DEVICES} {accel[0].platform.upper()} devices"
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:
        cpus = []
    if len(cpus) < _N_DEVICES:
        raise SpmdError(
            op="spmdkit demo",
            must=f"{_N_DEVICES} devices are available",
            given=f"{len(accel)} accelerators and {len(cpus)} CPU devices",
            fix=(
                "run it in a fresh process (python -m spmdkit demo), or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={_N_DEVICES} "
                "(and do not set JAX_PLATFORMS to exclude cpu)"
            ),
        )
    where = f"{_N_DEVICES} virtual CPU devices"
    if accel:
        where += f" ({len(accel)} {accel[0].platform.upper()} device(s) present: too few for 2x4)"
    return cpus[:_N_DEVICES], where


class _Out:
    """Printing plus a tally of the demo's checks."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.passed = 0
        self.failed: list[str] = []

    def __call__(self, text: str = "") -> None:
        self.stream.write(text + "\n")

    def check(self, ok: bool, what: str) -> None:
        if ok:
            self.passed += 1
            self(f"    check: {what}: ok")
        else:
            self.failed.append(what)
            self(f"    check: {what}: FAILED")


def _show(out: _Out, title: str, why: str, result: InferenceResult, notation: str) -> None:
    out(f"  {title}")
    out(f"    rule     {notation}")
    for line in str(result).splitlines():
        out(f"    {line.strip()}" if not line.startswith("  ") else f"      reshard {line.strip()}")
    out(f"    why      {why}")


def _part_rules(out: _Out, mesh: Any) -> None:
    out("1. Rule inference: specs only, nothing runs on the devices")
    out("   (spec notation: f32[64@data,256@model] = dim 0 sharded over data, dim 1 over model;")
    out("    {sum:model} = each device holds a partial sum still to be added over model)")
    out()
    x = TensorSpec((64, 256), P("data", "model"), dtype="float32")
    w = TensorSpec((256, 128), P("model", None), dtype="float32")
    fwd = infer_forward("matmul", x, w, mesh=mesh)
    _show(
        out,
        "matmul x @ w, contraction dim k sharded over model in both operands",
        "each device multiplies its k-slices; the k-sum is left pending over model",
        fwd,
        get_rule("matmul").describe([x.shape, w.shape]),
    )
    want = TensorSpec((64, 128), P("data"), partial=("model",), dtype="float32")
    out.check(fwd.outputs[0] == want, f"matmul output is {want}")
    out()

    g = TensorSpec((64, 128), P("data", None), dtype="float32")
    grad = infer_grad("matmul", x, w, out_grads=(g,), mesh=mesh)
    _show(
        out,
        "grad of that matmul, output cotangent sharded over data",
        "dW = x^T @ g sums over the data-sharded rows, so dW is sum-partial over data",
        grad,
        get_rule("matmul").describe([x.shape, w.shape]),
    )
    out.check(grad.outputs[1].partial_ops == {"data": "sum"}, "dW is sum-partial over data")
    out()

    sm = infer_forward("softmax", x, mesh=mesh, axis=-1)
    _show(
        out,
        "softmax over the last dim, which is sharded over model",
        "every output element needs its whole row (max and sum), so that dim is gathered",
        sm,
        get_rule("softmax").describe([x.shape], axis=-1),
    )
    out.check(sm.inputs[0].dims == (("data",), ()), "softmax asks for the axis replicated")
    out()

    b = TensorSpec((256,), P(None), dtype="float32")
    add = infer_forward("add", x, b, mesh=mesh)
    _show(
        out,
        "add x + b, b broadcast along the rows",
        "b's only dim meets x's model-sharded dim; taking a local slice of b costs nothing",
        add,
        get_rule("add").describe([x.shape, b.shape]),
    )
    out.check(add.outputs[0].dims == x.dims, "add keeps x's layout")
    out()


def _plan_vs_hlo(out: _Out, label: str, value: jax.Array, dst: TensorSpec, mesh: Any) -> jax.Array:
    """Plan, compile and run one reshard; print and check the three against each other."""
    src = TensorSpec.from_value(value)
    plan = plan_reshard(src, dst, mesh)
    out(f"  {label}")
    out(f"    from     {src}")
    out(f"    to       {dst}")
    out(f"    plan     {len(plan.steps)} step(s)")
    for step in plan.steps:
        out(f"      {step}")
    out(
        f"    cost     {plan.payload_bytes:,} B per device, {plan.wire_bytes:,} B on the wire, "
        f"{plan.time_s * 1e6:.1f} µs modelled"
    )
    hlo = compiled_collectives(lambda a: reshard(a, dst), value)
    out(f"    HLO      {len(hlo)} collective(s) in the compiled program")
    for c in hlo:
        out(f"      {c}")
    problems = check_plan(plan, hlo)
    for p in problems:
        out(f"      mismatch: {p}")
    out.check(not problems, "compiled collectives match the plan (kind, group, bytes)")
    t0 = time.perf_counter()
    result = reshard(value, dst)
    result.block_until_ready()
    out(f"    ran in   {(time.perf_counter() - t0) * 1e3:.1f} ms (compile included)")
    out.check(TensorSpec.from_value(result) == dst, f"result layout is {dst}")
    return result


def _part_reshard(out: _Out, mesh: Any) -> None:
    out("2. Reshard real arrays on the mesh")
    out(
        "   (cost model: the default topology, H100 nodes of 8 GPUs: "
        f"{DEFAULT_TOPOLOGY.node_bandwidth / 1e9:.0f} GB/s per GPU inside a node)"
    )
    out()
    rng = np.random.default_rng(0)
    xn = rng.standard_normal((64, 256), dtype=np.float32)
    wn = rng.standard_normal((256, 128), dtype=np.float32)
    want = xn @ wn
    x = jax.device_put(xn, NamedSharding(mesh, P("data", "model")))
    w = jax.device_put(wn, NamedSharding(mesh, P("model", None)))
    predicted = infer_forward(
        "matmul", TensorSpec.from_value(x), TensorSpec.from_value(w), mesh=mesh
    ).outputs[0]
    out_sharding = NamedSharding(mesh, predicted.to_partition_spec())
    y = jax.jit(lambda a, b: jnp.matmul(a, b, out_sharding=out_sharding))(x, w)
    out(f"  y = x @ w computed with the rule's output spec {predicted}")
    out(f"    jax.typeof(y) = {jax.typeof(y)}")
    out.check(TensorSpec.from_value(y) == predicted, "JAX's type of y agrees with the rule")
    out()

    sharded = _plan_vs_hlo(
        out,
        "sum-partial -> sharded (reduce-scatter the pending sum into dim 1)",
        y,
        predicted.replace(spec=P("data", "model"), partial={}),
        mesh,
    )
    out.check(_close(sharded, want), "values equal numpy x @ w")
    out()
    replicated = _plan_vs_hlo(
        out,
        "sharded -> replicated (all-gather both dims)",
        sharded,
        predicted.replace(spec=P(), partial={}),
        mesh,
    )
    out.check(_close(replicated, want), "values equal numpy x @ w")
    out()


def _close(value: jax.Array, want: np.ndarray) -> bool:
    return bool(np.allclose(np.asarray(value), want, rtol=1e-4, atol=1e-4))


def _part_train(out: _Out, devices: list[jax.Device], *, steps: int = 3) -> None:
    """Plan the tiny GPT, train, checkpoint, restore on another mesh and plan, continue.

    The continued run is compared with one that never stopped (same data, same
    seeds): the losses after the restore must agree within fp32 reduction-order
    tolerance, since the second mesh sums in another order.
    """
    import tempfile

    import optax
    from flax import nnx

    from spmdkit.models import get_model
    from spmdkit.planner import plan as make_plan
    from spmdkit.planner.notes import quiet_notes
    from spmdkit.runtime.checkpoint import Manager
    from spmdkit.runtime.data import ShardedLoader
    from spmdkit.runtime.train import train

    spec = get_model("gpt")
    config = spec.config("tiny")
    batch_size = 8

    def run(axes: dict[str, int], strategy: str, total: int, ckpt_dir: str | None, resume: bool):
        mesh = make_mesh(devices=devices, **axes)
        optimizer = optax.adam(1e-3)
        with quiet_notes():  # a fixed demo: its plans are the point, not their notes
            p = make_plan(
                spec, mesh, strategy, config="tiny", batch_size=batch_size, optimizer=optimizer
            )
        with nnx.use_eager_sharding(False):
            model = spec.build(config, nnx.Rngs(0))
        sharding = p.batch_sharding(spec.batch(config, batch_size, None))

        def batches():
            for i in range(total):
                yield spec.batch(config, batch_size, np.random.default_rng((0, i)))

        ckpt = Manager(ckpt_dir, save_interval_steps=steps) if ckpt_dir else None
        try:
            result = train(
                spec.loss,
                model,
                optimizer,
                ShardedLoader(batches, sharding, batch_size=batch_size),
                steps=total,
                plan=p,
                ckpt=ckpt,
                resume=resume,
                progress=False,
                log_every=total + 1,
            )
        finally:
            if ckpt is not None:
                ckpt.close()
        return p, result

    out("3. Training: plan the tiny GPT, train, checkpoint, restore on another mesh, continue")
    with tempfile.TemporaryDirectory() as tmp:
        first, r1 = run({"data": 2, "model": 4}, "megatron", steps, tmp, False)
        out("\n".join("   " + line for line in str(first).splitlines()))
        out(f"  steps 1..{r1.step} on data=2 x model=4 (megatron): " + _losses(r1.losses))
        second, r2 = run({"data": 4, "model": 2}, "fsdp", 2 * steps, tmp, True)
        out(
            f"  restored step {r2.start_step} onto data=4 x model=2 ({second.strategy}), "
            f"steps {r2.start_step + 1}..{r2.step}: " + _losses(r2.losses)
        )
    _, ref = run({"data": 2, "model": 4}, "megatron", 2 * steps, None, False)
    out(f"  uninterrupted run, steps 1..{ref.step}: " + _losses(ref.losses))
    want = np.asarray(ref.losses[steps:])
    out.check(
        len(r2.losses) == steps and bool(np.allclose(r2.losses, want, rtol=1e-4)),
        "losses after the restore match the uninterrupted run (rtol 1e-4)",
    )
    out.check(
        list(r1.losses) == list(ref.losses[:steps]),
        "losses before the stop are bit-identical to the uninterrupted run",
    )
    out()


def _losses(values: Any) -> str:
    return ", ".join(f"{float(v):.4f}" for v in values)


def run_demo(*, force_cpu: bool = False, out: TextIO | None = None) -> int:
    """Run the demo; returns 0 when every check passed, 1 otherwise.

    Args:
      force_cpu: use 8 virtual CPU devices even when accelerators are present.
      out: where to print (default ``sys.stdout``).

    Example::

        >>> run_demo()  # doctest: +SKIP
        spmdkit demo: mesh data=2 x model=4 on 8 virtual CPU devices
        ...
    """
    t0 = time.perf_counter()
    say = _Out(out or sys.stdout)
    devices, where = pick_devices(force_cpu=force_cpu)
    mesh = make_mesh(data=2, model=4, devices=devices)
    say(f"spmdkit demo: mesh data=2 x model=4 on {where}, jax {jax.__version__}")
    say()
    _part_rules(say, mesh)
    _part_reshard(say, mesh)
    _part_train(say, devices)
    elapsed = time.perf_counter() - t0
    if say.failed:
        say(f"demo FAILED: {len(say.failed)} of {say.passed + len(say.failed)} checks failed:")
        for what in say.failed:
            say(f"  - {what}")
        return 1
    say(f"demo OK: {say.passed} checks passed in {elapsed:.1f} s")
    return 0
