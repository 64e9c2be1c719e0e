"""Write the three notebooks of this folder (without outputs) from the cells below,
and execute them for the docs.

Run ``python notebooks/_build.py`` after editing a cell; commit the ``.ipynb`` files
(they store no outputs). ``tests/test_notebooks.py`` executes them (:func:`execute`)
and, with ``SPMDKIT_EXECUTED_NOTEBOOKS=DIR`` set (``.ci/run`` sets it), keeps the
executed copies there; the docs build renders those copies with their outputs, and
executes a notebook itself when its copy is missing or was made from another source
(``docs/_hooks.py``). ``python notebooks/_build.py --execute DIR`` executes all three.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
import tempfile

import nbformat

HERE = pathlib.Path(__file__).resolve().parent

SETUP = """\
import os

# 8 virtual CPU devices; must be set before JAX starts.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
# Where the plots are saved (the test suite points this at a temporary folder).
OUT = os.environ.get("SPMDKIT_NB_OUT", ".")
os.makedirs(OUT, exist_ok=True)"""

# A small drawing of "which device holds which block" for a 2-D tensor (or the last
# two dims of an N-D one), shared by two notebooks.
DRAW_SPEC = '''\
import math

import matplotlib.patches as mpatches


def draw_spec(ax, shape, dims, sizes, *, partial=(), title=""):
    """Draw the blocks of a tensor and the devices holding each.

    shape: the tensor shape; dims: per dim, the mesh axes sharding it (major to
    minor); sizes: mesh axis -> size (devices are numbered row-major over the
    mesh axes); partial: (axis, reduce op) pairs. Only the last two dims are drawn.
    """
    shape = tuple(shape)[-2:] if len(shape) >= 2 else (1, *shape)
    dims = tuple(dims)[-2:] if len(dims) >= 2 else ((), *dims)
    names = list(sizes)
    n_dev = math.prod(sizes.values())
    holders = {}
    for dev in range(n_dev):
        coord, rest = {}, dev
        for name in reversed(names):
            coord[name], rest = rest % sizes[name], rest // sizes[name]
        block = []
        for axes in dims:
            idx = 0
            for a in axes:
                idx = idx * sizes[a] + coord[a]
            block.append(idx)
        holders.setdefault(tuple(block), []).append(dev)
    n_rows = math.prod(sizes[a] for a in dims[0])
    n_cols = math.prod(sizes[a] for a in dims[1])
    cmap = plt.get_cmap("tab20")
    for (r, c), devs in holders.items():
        ax.add_patch(
            mpatches.Rectangle(
                (c / n_cols, 1 - (r + 1) / n_rows), 1 / n_cols, 1 / n_rows,
                facecolor=cmap((r * n_cols + c) % 20), edgecolor="black",
                hatch="//" if partial else None, alpha=0.85,
            )
        )
        text = ",".join(map(str, devs)) if len(devs) <= 4 else f"{devs[0]}..{devs[-1]}"
        if partial:  # every device of the group holds a term of the pending reduction
            text = f"{partial[0][1]}({text})"
        ax.text((c + 0.5) / n_cols, 1 - (r + 0.5) / n_rows, text, ha="center",
                va="center", fontsize=8, bbox={"facecolor": "white", "alpha": 0.7, "lw": 0})
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xticks([])
    ax.set_yticks([])
    lab = lambda n, axes: f"{n}" + (f" @ {'+'.join(axes)}" if axes else "")  # noqa: E731
    ax.set_ylabel(lab(shape[0], dims[0]))
    ax.set_xlabel(lab(shape[1], dims[1]))
    if partial:
        title += "\\n{" + ", ".join(f"{op}:{a}" for a, op in partial) + "} (pending)"
    ax.set_title(title, fontsize=9)


def draw_tensor_spec(ax, spec, mesh, title=""):
    """draw_spec for an sk.TensorSpec on a mesh."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    draw_spec(ax, spec.shape, spec.dims, sizes, partial=spec.partial, title=title or str(spec))'''


def md(text: str):
    return nbformat.v4.new_markdown_cell(text)


def code(text: str):
    return nbformat.v4.new_code_cell(text)


# ---------------------------------------------------------------------------------------
# layout_explorer.ipynb
# ---------------------------------------------------------------------------------------

LAYOUT = [
    md(
        "# Layout explorer\n\n"
        "Pick a model and a mesh, build several plans (presets and `auto`), compare what "
        "each costs per device, look at how the parameters are laid out, drill into the "
        "shardings propagation chose for one layer, and compile one plan to check the "
        "prediction against XLA.\n\n"
        "Everything runs on 8 virtual CPU devices. Planning needs no devices at all: the "
        "comparison below plans GPT-2 124M on an *abstract* 2×4 mesh; the compiled part "
        "uses the tiny GPT config on the real (virtual) devices."
    ),
    code(SETUP),
    code(
        """\
import time

import jax
import matplotlib.pyplot as plt
import numpy as np
import optax
import treescope

import spmdkit as sk
from spmdkit.compile import jit
from spmdkit.compile import init_sharded
from spmdkit.introspect import describe, path_str
from spmdkit.models import get_model
from spmdkit.planner import PRESETS, plan
from spmdkit.propagation import propagate

print(jax.device_count(), "devices;", "presets:", ", ".join(PRESETS))"""
    ),
    md(
        "## Several plans for one model\n\n"
        "`describe` reads the model once (abstractly: shapes, logical axis names, the "
        "traced train step); every `plan` call on that `ModelInfo` reuses the trace. "
        '`estimator="analytic"` is the fast per-parameter cost model, which splits '
        "memory into params, grads, optimizer state and activations; the default "
        '`"propagate"` runs the rule registry over the whole traced step (slower, exact '
        "to the rules)."
    ),
    code(
        """\
# Change these to explore another model, size, batch or mesh (get_model("llama"), "moe"...).
MODEL, CONFIG, BATCH = "gpt", "124m", 16
MESH = {"data": 2, "model": 4}
ESTIMATOR = "analytic"  # or "propagate": slower, memory split by buffer kind instead

spec = get_model(MODEL)
t0 = time.perf_counter()
info = describe(spec, config=CONFIG, batch_size=BATCH)
amesh = sk.abstract_mesh(**MESH)
strategies = ["dp", "fsdp", "zero1", "megatron", "tp_fsdp", "auto"]
plans = {s: plan(info, amesh, s, estimator=ESTIMATOR) for s in strategies}
print(f"{len(plans)} plans in {time.perf_counter() - t0:.1f} s")
for name, p in plans.items():
    label = f"{name} ({p.chosen})" if p.chosen else name
    print(f"{label:<32} {p.cost.summary()}")"""
    ),
    code('print(plans["auto"])'),
    md(
        "### Side by side\n\n"
        "Per-device memory by kind, communication per step by collective kind, and the "
        "estimated step time (compute + communication, no overlap assumed; H100 "
        "numbers from the default topology)."
    ),
    code(
        """\
names = list(plans)
costs = [plans[n].cost for n in names]
fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))

ax = axes[0]
bottom = np.zeros(len(names))
for kind in dict.fromkeys(k for c in costs for k in c.memory):  # params, grads, opt_state, ...
    vals = np.array([c.memory.get(kind, 0) for c in costs]) / 2**30
    ax.bar(names, vals, bottom=bottom, label=kind)
    bottom += vals
ax.set_ylabel("GiB per device")
ax.set_title("memory per device")
ax.legend(fontsize=8)

ax = axes[1]
kinds = sorted({k for c in costs for k in c.comm_bytes})
bottom = np.zeros(len(names))
for kind in kinds:
    vals = np.array([c.comm_bytes.get(kind, 0) for c in costs]) / 2**20
    ax.bar(names, vals, bottom=bottom, label=kind)
    bottom += vals
ax.set_ylabel("MiB per device per step")
ax.set_title("communication by collective")
ax.legend(fontsize=8)

ax = axes[2]
compute = np.array([c.compute_time_s for c in costs]) * 1e3
comm = np.array([c.comm_time_s for c in costs]) * 1e3
ax.bar(names, compute, label="compute")
ax.bar(names, comm, bottom=compute, label="communication")
ax.set_ylabel("ms")
ax.set_title("estimated step time")
ax.legend(fontsize=8)
for a in axes:
    a.tick_params(axis="x", rotation=30)
mesh_text = " × ".join(f"{k}={v}" for k, v in MESH.items())
fig.suptitle(f"{MODEL} {CONFIG}, batch {BATCH}, mesh {mesh_text}: auto is {plans['auto'].chosen}")
fig.tight_layout()
fig.savefig(os.path.join(OUT, "layout_compare.png"), dpi=80)
plt.show()"""
    ),
    md(
        "## Parameter shardings\n\n"
        "The same plans on the real 2×4 mesh, for the tiny GPT config. `init_sharded` "
        "initialises the parameters directly into the plan's shardings. First "
        "`jax.debug.visualize_array_sharding` (2-D arrays) and treescope's N-D view, then a "
        "drawing of one MLP kernel under each preset: each block is labelled with the "
        "devices holding it (devices numbered row-major over `data`, `model`)."
    ),
    code(
        """\
mesh = sk.make_mesh(data=2, model=4)
tiny = describe(spec, config="tiny", batch_size=8)
tiny_plans = {
    s: plan(tiny, mesh, s, estimator="analytic") for s in ["dp", "fsdp", "megatron", "tp_fsdp"]
}
chosen = tiny_plans["megatron"]
params = init_sharded(tiny, chosen)
arrays = {path_str(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]}
fc = arrays["blocks/0/fc/kernel"]
print("blocks/0/fc/kernel", fc.shape, fc.sharding.spec)
jax.debug.visualize_array_sharding(fc)"""
    ),
    code(
        """\
wq = arrays["blocks/0/attn/wq"]  # (embed, heads, head_dim): 3-D
print("blocks/0/attn/wq", wq.shape, wq.sharding.spec)
treescope.render_array_sharding(wq)"""
    ),
    code(
        DRAW_SPEC
        + """


def dims_of(pspec, ndim):
    entries = tuple(pspec) + (None,) * (ndim - len(tuple(pspec)))
    return tuple(() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries)


sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
fig, axes = plt.subplots(2, len(tiny_plans), figsize=(3.2 * len(tiny_plans), 6))
for col, (name, p) in enumerate(tiny_plans.items()):
    for row, path in enumerate(["blocks/0/fc/kernel", "blocks/0/proj/kernel"]):
        shape = p.info[path][0]
        draw_spec(axes[row, col], shape, dims_of(p.params[path], len(shape)), sizes,
                  title=f"{name}: {path.split('/')[-2]} {p.params[path]}")
fig.tight_layout()
fig.savefig(os.path.join(OUT, "layout_params.png"), dpi=80)
plt.show()"""
    ),
    md(
        "## The whole plan as a picture\n\n"
        "`plan.to_html(path)` writes one self-contained page (no script, no network): "
        "each parameter group's layout as a grid of the mesh's devices coloured by the "
        "shard each holds, memory per device by kind, and the predicted collectives of "
        "one step on a timeline, one lane per pass. `plan.plot()` draws the same as "
        "matplotlib figures. The timeline needs the propagate estimator (it records "
        "which equation moves what)."
    ),
    code(
        """\
pictured = plan(tiny, mesh, "megatron")  # propagate: the timeline's equations recorded
pictured.to_html(os.path.join(OUT, "layout_picture.html"))
figs = pictured.plot(max_groups=8)
figs.collectives.savefig(os.path.join(OUT, "layout_picture.png"), dpi=80)
plt.show()"""
    ),
    md(
        "## Drill into one layer\n\n"
        "`spmdkit.propagation.propagate` runs the rule registry over the traced step "
        "(forward and backward) with the megatron plan's input specs. The summary lists "
        "the equations that communicate, costliest first; below it, block 0's MLP: "
        "`fc` (column-parallel: its output stays sharded on `mlp`), the GELU, and `proj` "
        "(row-parallel: the contraction over the sharded `mlp` dim leaves a pending sum "
        "over `model`, which is where Megatron's all-reduce comes from)."
    ),
    code(
        """\
batch = spec.batch(spec.config("tiny"), 8, np.random.default_rng(0))
abstract_batch = jax.eval_shape(lambda b: b, batch)
prop = propagate(
    jax.value_and_grad(tiny.loss_fn),
    tiny.abstract_params,
    abstract_batch,
    mesh=mesh,
    in_specs=(chosen.param_specs(tiny.abstract_params), chosen.batch_specs(abstract_batch)),
)
print(prop)"""
    ),
    code(
        """\
dense = [r for r in prop.records if "_Dense.__call__" in r.source]
fwd = [r for r in dense if not r.backward]
first, last = fwd[0].index, fwd[3].index  # block 0: fc (dot, +bias), proj (dot, +bias)
layer = [r for r in prop.records if first <= r.index <= last and not r.backward]
bwd = [r for r in dense if r.backward and r.primitive == "dot_general"][-4:]  # block 0's


def show(records):
    for r in records:
        ins = ", ".join(map(str, r.inputs))
        outs = ", ".join(map(str, r.outputs))
        print(f"{r.index:>4} {r.primitive:<12} {r.op or '-':<12} {ins}  ->  {outs}")
        for a in r.reshards:
            if a.plan.collectives:
                print(f"{'':>6}{a}")


print("forward, block 0 MLP:")
show(layer)
print("\\nbackward, block 0 MLP matmuls (input grads and weight grads):")
show(bwd)"""
    ),
    md(
        "## Compile the plan and verify the prediction\n\n"
        "`sk.jit` (`spmdkit.compile.jit`) compiles a train step (Adam) with the plan's "
        "in/out shardings and donation; `plan.verify` propagates the plan through the same step "
        "and compares predicted collective bytes (per kind) and peak memory with the "
        "compiled HLO. On CPU, XLA may pick other collectives than a GPU would (e.g. an "
        "all-reduce for a reduce-scatter), so read the rows as a comparison, not a verdict."
    ),
    code(
        """\
opt = optax.adam(1e-3)
opt_shardings = chosen.opt_shardings(jax.eval_shape(opt.init, params))
opt_state = jax.jit(opt.init, out_shardings=opt_shardings)(params)


def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(tiny.loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


step = jit(train_step, chosen, donate_state=True)
t0 = time.perf_counter()
report = chosen.verify(step, params, opt_state, batch)
print(f"verified in {time.perf_counter() - t0:.1f} s")
print(report)"""
    ),
    code(
        """\
rows = report.rows
fig, ax = plt.subplots(figsize=(7, 3.5))
x = np.arange(len(rows))
ax.bar(x - 0.2, [r[1] / 2**10 for r in rows], 0.4, label="predicted")
ax.bar(x + 0.2, [r[2] / 2**10 for r in rows], 0.4, label="compiled")
ax.set_xticks(x, [r[0] + ("" if r[3] else " ✗") for r in rows], rotation=20)
ax.set_ylabel("KiB per device")
ax.set_title("megatron plan, tiny GPT on 2×4: prediction vs compiled HLO")
ax.legend()
fig.tight_layout()
fig.savefig(os.path.join(OUT, "layout_verify.png"), dpi=80)
plt.show()"""
    ),
]

LAYOUT += [
    md(
        "## Pipeline schedules\n\n"
        "A pipelined plan splits the stacked layers over a `pipe` mesh axis "
        "(`spmdkit.pipeline.Pipeline`: stages, virtual chunks per device, micro-batches, "
        "schedule). `build_schedule` turns a configuration into its tick table: what each "
        "device runs at each tick (forward `F` or backward `B` of one micro-batch through "
        "one chunk), or nothing (a bubble). Below, 1F1B and interleaved 1F1B (2 virtual "
        "chunks per device) on 4 stages with 8 micro-batches: the interleaved bubble is "
        "half as long, (p−1)/(v·m+p−1), at the price of twice the point-to-point sends and "
        "a few more activations held on the first devices. Forward ticks are blue "
        "(darker: later chunks), backward ones orange, bubbles white."
    ),
    code(
        """\
from matplotlib.colors import to_rgb

from spmdkit.pipeline import Pipeline, build_schedule


def draw_schedule(ax, schedule):
    pipe = schedule.pipeline
    for t, row in enumerate(schedule.ticks):
        for d, action in enumerate(row):
            if action is None:
                continue
            base = np.array(to_rgb("tab:blue" if action.kind == "F" else "tab:orange"))
            shade = 1.0 - 0.45 * (action.chunk // pipe.stages) / max(pipe.virtual - 1, 1)
            ax.add_patch(plt.Rectangle((t, d), 1, 1, color=base * shade, ec="white", lw=0.5))
            ax.text(t + 0.5, d + 0.5, action.microbatch, ha="center", va="center",
                    fontsize=6, color="white")
    ax.set_xlim(0, schedule.n_ticks)
    ax.set_ylim(pipe.stages, 0)
    rows = range(pipe.stages)
    ax.set_yticks([d + 0.5 for d in rows], [f"device {d}" for d in rows])
    ax.set_xlabel("tick")
    ax.set_title(f"{pipe.short()}: bubble {schedule.bubble_fraction:.1%}, "
                 f"held {schedule.peak_in_flight}", fontsize=9)


schedules = [
    build_schedule(Pipeline(stages=4, microbatches=8, schedule="1f1b")),
    build_schedule(Pipeline(stages=4, microbatches=8, schedule="interleaved", virtual=2)),
]
width = max(s.n_ticks for s in schedules)
fig, axes = plt.subplots(1, 2, figsize=(16, 2.8), sharey=True)
for ax, sched in zip(axes, schedules):
    draw_schedule(ax, sched)
    ax.set_xlim(0, width)
fig.tight_layout()
fig.savefig(os.path.join(OUT, "layout_pipeline.png"), dpi=80)
plt.show()
print(schedules[0].table())"""
    ),
    md(
        '`auto` searches pipelines when asked (`pipeline="auto"`): for a mesh without a '
        "`pipe` axis it splits the data axis into `pipe × data`, and picks the degree, "
        "virtual chunks, micro-batches and schedule with the layouts and the recipe, within "
        "the memory budget. Here the tiny Llama on 8 devices with a budget too small for "
        "the plain plans; the table shows the stages, the schedule and each stage's memory."
    ),
    code(
        """\
llama = describe(get_model("llama"), config="tiny_scan", batch_size=16)
piped = plan(llama, sk.abstract_mesh(data=8), "auto", pipeline="auto",
             estimator="analytic", memory_budget=0.6e6)
print(piped)"""
    ),
]

# ---------------------------------------------------------------------------------------
# rules_playground.ipynb
# ---------------------------------------------------------------------------------------

RULES = [
    md(
        "# Rules playground\n\n"
        "Ask the rule registry what an op does to shardings (forward, backward, grad), see "
        "the input and output specs drawn, check a rule numerically on a virtual mesh, then "
        "write, register and test a rule for an op of your own."
    ),
    code(SETUP),
    code(
        """\
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.testing import check_jit, check_rule

mesh = sk.make_mesh(a=2, b=4)  # 8 virtual CPU devices, Explicit axes
print(len(sk.registered_ops()), "registered ops, e.g.", ", ".join(sk.registered_ops()[:8]))"""
    ),
    code(DRAW_SPEC),
    md(
        "## Forward: input specs → required inputs and outputs\n\n"
        "`x` is sharded on both dims, `w` on its contracted dim: each device multiplies "
        "its blocks, and the output is a *pending sum* over `b` (`{sum:b}`): no "
        "communication yet."
    ),
    code(
        """\
x = sk.TensorSpec((8, 16), P("a", "b"))
w = sk.TensorSpec((16, 12), P("b", None))
fwd = sk.infer_forward("matmul", x, w, mesh=mesh)
print(fwd)
print("inputs:", fwd.inputs, " outputs:", fwd.outputs, " bytes moved:", fwd.payload_bytes)"""
    ),
    code(
        """\
fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
draw_tensor_spec(axes[0], fwd.inputs[0], mesh, "x " + str(fwd.inputs[0]))
draw_tensor_spec(axes[1], fwd.inputs[1], mesh, "w " + str(fwd.inputs[1]))
draw_tensor_spec(axes[2], fwd.outputs[0], mesh, "x @ w " + str(fwd.outputs[0]))
fig.suptitle("matmul forward on mesh a=2 × b=4 (block labels: devices holding it)")
fig.tight_layout()
fig.savefig(os.path.join(OUT, "rules_matmul.png"), dpi=80)
plt.show()"""
    ),
    md(
        "When an input is laid out in a way the op cannot use, the result says which "
        "argument moves and the planned collective. Softmax needs its axis whole:"
    ),
    code(
        """\
print(sk.infer_forward("softmax", x, mesh=mesh, axis=-1))
print(sk.infer_forward("reduce_max", x, mesh=mesh, axis=1))"""
    ),
    md(
        "## Backward: wanted output → inputs\n\n"
        "Ask which input layouts produce an output sharded `(a, b)`; unsharded "
        "placeholders go in for the inputs."
    ),
    code(
        """\
want = sk.TensorSpec((8, 12), P("a", "b"))
bwd = sk.infer_backward(
    "matmul", sk.TensorSpec((8, 16)), sk.TensorSpec((16, 12)), outputs=(want,), mesh=mesh
)
print(bwd)"""
    ),
    md(
        "## Grad: forward inputs + output cotangent → input cotangents\n\n"
        "The weight's gradient sums over the batch rows, which are sharded over `a`: it "
        "comes out as a pending sum over `a` (the data-parallel all-reduce, not yet paid)."
    ),
    code(
        """\
g = sk.TensorSpec((8, 12), P("a"))
grad = sk.infer_grad("matmul", x, w, out_grads=(g,), mesh=mesh)
print(grad)
fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
draw_tensor_spec(axes[0], grad.out_grads[0], mesh, "dy " + str(grad.out_grads[0]))
draw_tensor_spec(axes[1], grad.outputs[0], mesh, "dx " + str(grad.outputs[0]))
draw_tensor_spec(axes[2], grad.outputs[1], mesh, "dw " + str(grad.outputs[1]))
fig.tight_layout()
plt.show()"""
    ),
    md(
        "## The numeric check\n\n"
        "`check_rule` enumerates input placements (replicated, sharded on each dim, "
        "partial with every reduce op, asymmetric splits), runs the op on each device's "
        "local pieces, rebuilds the result from the spec the rule claims and compares with "
        "the unsharded op; grads against `jax.vjp`. A small sample here to keep it quick."
    ),
    code(
        """\
report = check_rule(
    "matmul", mesh=mesh, examples=[sk.Example(((4, 8), (8, 12)))], max_cases=24, max_grad_cases=6
)
print(report)
assert report.ok"""
    ),
    md(
        "## A rule for your own op\n\n"
        "`weighted_sum(x, w) = Σ_d x[..., d] · w[d]`. In factor notation that is "
        '`"... d, d -> ..."`: `d` is a reduction factor (sharding it leaves a pending '
        "sum), the leading dims pass through. The op is linear in each input separately, "
        "so a pending sum may pass through one input when the other is replicated: the "
        "`MULTIPLICATIVE` policy."
    ),
    code(
        """\
def weighted_sum(x, w):
    return jnp.sum(x * w, axis=-1)


rule = sk.FactorRule(
    "weighted_sum",
    "... d, d -> ...",
    impl=weighted_sum,
    partial="MULTIPLICATIVE",
    examples=(sk.Example(((4, 8), (8,))),),
    doc="sum over the last dim of x * w",
)
if "weighted_sum" in sk.registered_ops():  # re-running the cell
    sk.unregister_rule("weighted_sum")
sk.register_rule(rule)

r = sk.infer_forward(
    "weighted_sum", sk.TensorSpec((4, 8), P("a", "b")), sk.TensorSpec((8,), P("b")), mesh=mesh
)
print(r)
fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
for ax, s, name in zip(axes, [*r.inputs, *r.outputs], ["x", "w", "weighted_sum"]):
    draw_tensor_spec(ax, s, mesh, f"{name} {s}")
fig.tight_layout()
fig.savefig(os.path.join(OUT, "rules_custom.png"), dpi=80)
plt.show()"""
    ),
    code(
        """\
report = check_rule(rule, mesh=mesh)
print(report)
jit_report = check_jit(rule, mesh=mesh)
print(jit_report)
assert report.ok"""
    ),
    md(
        "A wrong policy is caught: `x · w` is not additive (Σx · Σw ≠ Σ(x · w)), so "
        "declaring `ADDITIVE` gives wrong numbers for some placements."
    ),
    code(
        """\
wrong = sk.FactorRule(
    "weighted_sum_additive", "... d, d -> ...", impl=weighted_sum, partial="ADDITIVE",
    examples=rule.examples,
)
bad = check_rule(wrong, mesh=mesh, grads=False, missing=False)
print(bad.ok, len(bad.wrong), "wrong cases; the first:")
print(bad.wrong[0])
assert not bad.ok
sk.unregister_rule("weighted_sum")"""
    ),
]

# ---------------------------------------------------------------------------------------
# checkpoint_reshard.ipynb
# ---------------------------------------------------------------------------------------

CKPT = [
    md(
        "# Checkpoint resharding\n\n"
        "Train the tiny GPT for a few steps on a 2×4 mesh with a Megatron plan, saving a "
        "checkpoint; restore it on an 8×1 mesh (FSDP plan) and on a single device, keep "
        "training, and compare the loss curves across the restore. The restore reads only "
        "the shards each device needs for the *new* layout."
    ),
    code(SETUP),
    code(
        """\
import shutil
import tempfile

import jax
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

import spmdkit as sk
from spmdkit.runtime.checkpoint import Manager, abstract_target
from spmdkit.runtime.data import ShardedLoader
from spmdkit.models import get_model
from spmdkit.planner import Plan, plan
from spmdkit.runtime.train import train

spec = get_model("gpt")
cfg = spec.config("tiny")
# 64 learnable sequences: each token is the previous one + 1 (mod vocab)
start = np.random.default_rng(0).integers(0, cfg.vocab, size=(64, 1))
seqs = ((start + np.arange(cfg.seq_len + 1)) % cfg.vocab).astype(np.int32)
examples = {"tokens": seqs[:, :-1], "targets": seqs[:, 1:]}
workdir = tempfile.mkdtemp(prefix="spmdkit_ckpt_")


def new_model():
    with nnx.use_eager_sharding(False):
        return spec.build(cfg, nnx.Rngs(0))


def run(mesh, strategy, steps, directory, *, resume):
    \"\"\"Train to `steps` with a plan on `mesh`; checkpoints every 6 steps.\"\"\"
    p = plan(spec, mesh, strategy, config="tiny", batch_size=8, estimator="analytic")
    loader = ShardedLoader(examples, p.batch_sharding(spec.batch(cfg, 8, None)), batch_size=8)
    ckpt = Manager(directory, save_interval_steps=6, max_to_keep=None)
    res = train(spec.loss, new_model(), optax.adam(1e-2), loader, steps=steps, plan=p,
                ckpt=ckpt, resume=resume, progress=False)
    ckpt.close()
    return p, res"""
    ),
    md("## Train on 2×4 (Megatron plan), checkpoints at steps 6 and 12"),
    code(
        """\
mesh_2x4 = sk.make_mesh(data=2, model=4)
p_a, run_a = run(mesh_2x4, "megatron", 12, f"{workdir}/a", resume=False)
mgr = Manager(f"{workdir}/a")
print("saved steps:", mgr.all_steps())
meta = mgr.metadata(6)
print("step 6 saved on", meta["mesh"], "with plan", Plan.from_json(meta["plan"]).strategy)
print("data position:", meta["data"])"""
    ),
    md(
        "## Restore step 6 onto other layouts\n\n"
        "`Manager.restore` takes an abstract target: shapes, dtypes and the *new* "
        "shardings (here from an FSDP plan on an 8×1 mesh). Values are bit-identical to "
        "what was saved, whatever the layout."
    ),
    code(
        """\
mesh_8x1 = sk.make_mesh(data=8, model=1)
p_b = plan(spec, mesh_8x1, "fsdp", config="tiny", batch_size=8, estimator="analytic")
abstract_params = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(new_model(), nnx.Param)))
target = {"params": abstract_target(abstract_params, p_b.param_shardings(abstract_params))}
on_8x1 = mgr.restore(6, target=target, partial=True).state["params"]
on_2x4 = mgr.restore(6, target={"params": abstract_target(
    abstract_params, p_a.param_shardings(abstract_params))}, partial=True).state["params"]
k8, k24 = on_8x1["blocks"][0]["fc"]["kernel"], on_2x4["blocks"][0]["fc"]["kernel"]
print("2x4:", k24.sharding.spec, " 8x1:", k8.sharding.spec)
print("bit-identical:", all(
    np.array_equal(a, b) for a, b in zip(jax.tree.leaves(on_8x1), jax.tree.leaves(on_2x4))
))
mgr.close()"""
    ),
    md(
        "## Continue training from step 6 on 8×1 and on one device\n\n"
        "`train(resume=True)` continues from the latest checkpoint in its directory, "
        "restored onto *this* run's plan (parameters, Adam state and the data position), "
        "so each continuation gets its own directory holding a copy of step 6."
    ),
    code(
        """\
def fork(step, name):
    shutil.copytree(f"{workdir}/a/{step}", f"{workdir}/{name}/{step}")
    return f"{workdir}/{name}"


_, run_b = run(mesh_8x1, "fsdp", 12, fork(6, "b"), resume=True)
mesh_1 = sk.make_mesh(data=1, devices=jax.devices()[:1])
_, run_c = run(mesh_1, "dp", 12, fork(6, "c"), resume=True)
print("restored at", run_b.start_step, run_c.start_step)
print("2x4 steps 7-12:", np.round(run_a.losses[6:], 5))
print("8x1 steps 7-12:", np.round(run_b.losses, 5))
print("1   steps 7-12:", np.round(run_c.losses, 5))
np.testing.assert_allclose(run_b.losses, run_a.losses[6:], rtol=1e-4)
np.testing.assert_allclose(run_c.losses, run_a.losses[6:], rtol=1e-4)"""
    ),
    code(
        """\
fig, ax = plt.subplots(figsize=(7, 4))
steps_a = [h["step"] for h in run_a.history]
ax.plot(steps_a, run_a.losses, "-o", label="2×4 megatron (uninterrupted)")
ax.plot([h["step"] for h in run_b.history], run_b.losses, "s", mfc="none", ms=10,
        label="restored on 8×1 fsdp")
ax.plot([h["step"] for h in run_c.history], run_c.losses, "x", ms=9,
        label="restored on 1 device")
ax.axvline(6.5, color="gray", ls="--")
ax.text(6.6, min(run_a.losses), "restore from step 6", color="gray", va="bottom")
ax.set_xlabel("step")
ax.set_ylabel("loss")
ax.set_title("tiny GPT: loss across a checkpoint restore on other meshes")
ax.legend()
fig.tight_layout()
fig.savefig(os.path.join(OUT, "checkpoint_losses.png"), dpi=80)
plt.show()
shutil.rmtree(workdir)"""
    ),
]


def write(name: str, cells: list) -> pathlib.Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell.id = f"{name.split('_', maxsplit=1)[0]}-{i:02d}"
    nbformat.validate(nb)
    path = HERE / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


NOTEBOOKS = {
    "layout_explorer": LAYOUT,
    "rules_playground": RULES,
    "checkpoint_reshard": CKPT,
}

#: Where an executed copy records the source it was made from.
SOURCE_KEY = "spmdkit_source_sha256"


def source_digest(path: pathlib.Path) -> str:
    """The sha256 of a committed notebook (the cells an executed copy came from)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def executed_copy(name: str, out_dir: pathlib.Path) -> pathlib.Path | None:
    """``out_dir/name.ipynb`` when it was executed from the committed notebook as it
    is now, else None."""
    path = out_dir / f"{name}.ipynb"
    if not path.exists():
        return None
    nb = nbformat.read(path, as_version=4)
    return path if nb.metadata.get(SOURCE_KEY) == source_digest(HERE / f"{name}.ipynb") else None


def execute(name: str, workdir: pathlib.Path, keep: pathlib.Path | None = None):
    """Execute notebook ``name`` in a fresh kernel of this interpreter, in ``workdir``
    (its plots go there), and return it with its outputs; with ``keep``, also write it
    there as ``name.ipynb``, stamped with its source's digest.

    Raises:
      nbclient.exceptions.CellExecutionError: a cell raised (names the cell).
    """
    import nbclient
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    source = HERE / f"{name}.ipynb"
    nb = nbformat.read(source, as_version=4)
    with tempfile.TemporaryDirectory() as kernels:
        spec_dir = pathlib.Path(kernels) / "spmdkit-nb"
        spec_dir.mkdir()
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "spmdkit notebooks",
            "language": "python",
            "env": {
                "SPMDKIT_NB_OUT": str(workdir),
                "MPLBACKEND": "module://matplotlib_inline.backend_inline",
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])
                ),
            },
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        km = KernelManager(
            kernel_name="spmdkit-nb", kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernels])
        )
        client = nbclient.NotebookClient(
            nb, km=km, timeout=300, resources={"metadata": {"path": str(workdir)}}
        )
        client.execute()
    if keep is not None:
        nb.metadata[SOURCE_KEY] = source_digest(source)
        keep.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, keep / f"{name}.ipynb")
    return nb


if __name__ == "__main__":
    if sys.argv[1:2] == ["--execute"]:
        out = pathlib.Path(sys.argv[2])
        for name in NOTEBOOKS:
            with tempfile.TemporaryDirectory() as work:
                execute(name, pathlib.Path(work), keep=out)
            print(out / f"{name}.ipynb")
    else:
        for name, cells in NOTEBOOKS.items():
            print(write(name, cells))
