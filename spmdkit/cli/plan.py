"""CLI subcommands ``spmdkit plan`` and ``spmdkit report`` (alias ``spmdkit verify``),
appended to ``cli.COMMANDS``.

``spmdkit plan MODEL --mesh data=2,model=4 [--strategy auto] [--config tiny]
[--batch-size 8] [--abstract] [--measure] [--json PATH] [--html PATH]`` prints the plan
table for a reference model (``spmdkit.models``) or the user's (``pkg.module:factory``,
:mod:`spmdkit.cli.model_arg`); ``--abstract`` plans on an abstract mesh (no
devices, any size), otherwise on virtual CPU devices. ``--measure`` (auto only)
times auto's candidates on those devices and keeps the fastest (:func:`spmdkit.tune`).

``spmdkit report MODEL --mesh data=2,model=4 [--strategy ...] [--config tiny]``
compiles one train step on virtual CPU devices with the plan (params born
sharded, ``sk.jit``) and prints the strategy chosen per composite op (the
``spmdkit.ops`` regions: ``softmax_cross_entropy vocab_parallel``...) and
predicted vs compiled collectives and memory (``plan.verify``). Exit status 1
when they disagree beyond the tolerances. ``--html PATH`` draws the plan with
the compiled figures (``plan.to_html(path, report=...)``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, TextIO

from spmdkit.cli.command import PRESETS_HELP, Command, parse_mesh, report_error, strategy_name
from spmdkit.cli.model_arg import add_model_arguments, check_model_arg, resolve_model
from spmdkit.errors import SpmdError, UsageError

__all__ = ["PLAN_COMMANDS", "check_plan_args", "parse_mesh", "throughput_line"]


def _common(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--mesh", default="data=2,model=4", help="mesh axes NAME=SIZE,...")
    parser.add_argument(
        "--strategy",
        default="auto",
        type=strategy_name,
        help=f"auto or a preset ({PRESETS_HELP})",
    )


def _configure_plan(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--abstract", action="store_true", help="plan on an abstract mesh")
    parser.add_argument("--json", help="also write the plan as JSON to this path")
    parser.add_argument("--html", help="also draw the plan as one HTML page at this path")
    parser.add_argument(
        "--estimator", default="propagate", choices=("propagate", "analytic"), help="cost model"
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="auto only: time auto's candidates on the mesh's devices and keep the fastest "
        "(sk.tune; a compile per candidate)",
    )


def check_plan_args(verb: str, args: argparse.Namespace) -> dict[str, int]:
    """``spmdkit VERB`` (``plan``, ``report``) flags checked before planning: the mesh,
    ``--json`` and ``--html`` file paths whose directory exists, then MODEL and ``--config``
    (a reference model's name and config; a factory path's syntax, the factory is
    imported later). ``--strategy`` was checked when parsed. Returns the mesh axes.

    Raises:
      UsageError: naming the flag; UnknownModelError: no such model or config.
    """
    axes = parse_mesh(args.mesh)
    if getattr(args, "measure", False) and (args.strategy != "auto" or args.abstract):
        raise UsageError(
            op=f"spmdkit {verb} --measure",
            must="--measure times auto's candidates on real devices: --strategy auto, "
            "no --abstract",
            given=f"--strategy {args.strategy}" + (" --abstract" if args.abstract else ""),
            fix="drop --measure, or plan with --strategy auto on the mesh's devices",
        )
    for flag in ("json", "html"):
        path = getattr(args, flag, None)
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path) or not os.path.isdir(folder):
            raise UsageError(
                op=f"spmdkit {verb} --{flag}",
                must=f"--{flag} names a file in an existing directory",
                given=f"{path}, "
                + ("a directory" if os.path.isdir(path) else f"and {folder} is no directory"),
                fix=f"pass a file path, e.g. --{flag} plan.{flag}",
            )
    check_model_arg(f"spmdkit {verb}", args.model, args.config)  # imports the models: last
    return axes


def _run_plan(args: argparse.Namespace, out: TextIO) -> int:
    try:
        axes = check_plan_args("plan", args)
        import spmdkit as sk
        from spmdkit.planner import plan
        from spmdkit.planner.notes import quiet_notes

        if args.abstract:
            mesh = sk.abstract_mesh(**axes)
        else:
            sk.use_virtual_cpu_devices(max(8, math.prod(axes.values())))
            mesh = sk.make_mesh(**axes)
        model = resolve_model(
            "spmdkit plan", args.model, config=args.config, batch_size=args.batch_size
        )
        info = model.describe()
        with quiet_notes():  # the table below lists them
            if args.measure:
                p = sk.tune(info, mesh, cost_model=sk.CostModel(estimator=args.estimator))
            else:
                p = plan(info, mesh, args.strategy, estimator=args.estimator)
    except SpmdError as e:
        return report_error("plan", e, sys.stderr)
    out.write(throughput_line(p, info) + "\n" + p.table() + "\n")
    if args.json:
        with open(args.json, "w") as f:
            f.write(p.to_json())
        out.write(f"saved {args.json}\n")
    if args.html:
        p.to_html(args.html)
        out.write(f"drew {args.html}\n")
    return 0


def throughput_line(plan: Any, info: Any, optimizer: Any = None) -> str:
    """One line for the top of a plan's printout: the global batch, the sequence
    length and tokens per step, and from the plan's estimated step time the
    throughput per device and the MFU, as ``benchmarks/planner.py`` quotes them.

    tok/s/GPU is ``batch × seq / step time / devices`` (samples/s/GPU for a model
    without a sequence dim). MFU is the model's FLOPs per step (the traced train
    step's matmuls and attention, recomputation not counted: attention at three
    times its forward) / (step time × devices × the device's dense peak for the
    plan's compute dtype) on :data:`spmdkit.DEFAULT_TOPOLOGY` (H100 SXM).

    Args:
      plan: the plan (costed: its ``cost`` gives the step time).
      info: the described model it was planned for (``sk.describe``).
      optimizer: the optimizer it was planned with (default ``optax.adam``).

    Example::

        >>> throughput_line(p, info)  # doctest: +SKIP
        'global batch 16, sequence 8192 (131,072 tokens/step): est. 5,743 tok/s/GPU, MFU 34%
        (bf16 peak 989 TFLOP/s), step 2.85 s'
    """
    from spmdkit.planner.trace import trace_step
    from spmdkit.spec import axis_sizes
    from spmdkit.topology import DEFAULT_TOPOLOGY
    from spmdkit.util import fmt_time

    t = trace_step(info, optimizer)
    text = f"global batch {t.batch_size}"
    if t.seq_len > 1:
        text += f", sequence {t.seq_len} ({t.batch_size * t.seq_len:,} tokens/step)"
    if plan.cost is None or plan.cost.step_time_s <= 0:
        return text
    step = plan.cost.step_time_s
    devices = math.prod(axis_sizes(plan.mesh).values())
    if t.seq_len > 1:
        rate = f"{t.batch_size * t.seq_len / step / devices:,.0f} tok/s/GPU"
    else:
        rate = f"{t.batch_size / step / devices:,.0f} samples/s/GPU"
    dtype = plan.recipe.compute_dtype or (str(info.params[0].dtype) if info.params else "float32")
    dtype = "tfloat32" if dtype == "float32" else dtype
    try:
        peak = DEFAULT_TOPOLOGY.peak(dtype)
    except SpmdError:  # a dtype without a datasheet peak: no MFU
        return f"{text}: est. {rate}, step {fmt_time(step)}"
    model_flops = t.flops - max(t.attn_flops - 3 * t.attn_fwd_flops, 0.0)
    mfu = model_flops / (step * devices * peak)
    mfu_text = f"{mfu:.1%}" if mfu >= 1e-3 else "<0.1%"
    short = {"bfloat16": "bf16", "float16": "fp16", "tfloat32": "tf32"}.get(dtype, dtype)
    return (
        f"{text}: est. {rate}, MFU {mfu_text} ({short} peak {peak / 1e12:,.0f} TFLOP/s), "
        f"step {fmt_time(step)}"
    )


def _configure_report(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument(
        "--html", help="also draw the plan with the compiled figures as an HTML page here"
    )


def _run_report(args: argparse.Namespace, out: TextIO) -> int:
    return _compile_and_verify("report", args, out)


def _run_verify(args: argparse.Namespace, out: TextIO) -> int:
    return _compile_and_verify("verify", args, out)


def _compile_and_verify(verb: str, args: argparse.Namespace, out: TextIO) -> int:
    """``spmdkit report`` and its alias ``spmdkit verify``: errors name ``verb``."""
    try:
        axes = check_plan_args(verb, args)
        import spmdkit as sk

        sk.use_virtual_cpu_devices(max(8, math.prod(axes.values())))
        import numpy as np

        from spmdkit.compile import init_sharded, jit
        from spmdkit.introspect import describe
        from spmdkit.planner import plan
        from spmdkit.planner.notes import quiet_notes

        model = resolve_model(
            f"spmdkit {verb}", args.model, config=args.config, batch_size=args.batch_size
        )
        spec, cfg = model.require_spec(f"spmdkit {verb}"), model.config
        batch = spec.batch(cfg, model.batch_size, np.random.default_rng(0))
        info = describe(spec, config=cfg, batch=batch)
        mesh = sk.make_mesh(**axes)
        with quiet_notes():  # the table below lists them
            p = plan(info, mesh, args.strategy)
        params = init_sharded(info, p)
        step = jit(sk.value_and_grad(info.loss_fn, p), p)  # the plan's recipe applied
        result = p.verify(step, params, batch)
        # the plan table's ops section names each composite op's strategy; a plan
        # costed without propagation has none, so the compiled program's are listed
        ops = "" if getattr(p.cost, "ops", None) else _op_strategies(step, params, batch)
    except SpmdError as e:
        return report_error(verb, e, sys.stderr)
    out.write(throughput_line(p, info) + "\n" + p.table() + "\n" + ops + "\n" + str(result) + "\n")
    if args.html:
        p.to_html(args.html, report=result)
        out.write(f"drew {args.html}\n")
    return 0 if result.ok else 1


def _op_strategies(step: Any, params: Any, batch: Any) -> str:
    """One line naming the strategy the step's propagation chose per composite op
    (its regions), e.g. ``ops (strategy): softmax_cross_entropy vocab_parallel``."""
    chosen = step.program(params, batch)[1].region_strategies()
    if not chosen:
        return ""
    text = ", ".join(
        f"{op} {name}" + (f" ×{n}" if n > 1 else "")
        for op, per in chosen.items()
        for name, n in per.items()
    )
    return f"ops (strategy): {text}\n"


#: Commands for ``spmdkit.cli.COMMANDS``.
PLAN_COMMANDS = [
    Command(
        "plan",
        "plan a reference model or your own (module:factory) on a mesh and print the plan",
        _configure_plan,
        _run_plan,
    ),
    Command(
        "report",
        "compile a planned train step on virtual CPU devices: predicted vs compiled",
        _configure_report,
        _run_report,
    ),
    Command(
        "verify",
        "the same as report: plan, compile on virtual CPU devices, check the prediction",
        _configure_report,
        _run_verify,
    ),
]
