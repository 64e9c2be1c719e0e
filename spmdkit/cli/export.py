"""CLI subcommands ``spmdkit export`` and ``spmdkit import`` (append :data:`COMMANDS`
to ``spmdkit.cli.COMMANDS``).

``spmdkit export CKPT OUT [--step N]`` writes a checkpoint's parameters (the
``params/...`` arrays) as a safetensors file set (:mod:`spmdkit.runtime.export`),
with the model config saved in the checkpoint as ``config.json``.

``spmdkit import EXPORT MODEL --mesh data=4,model=2 [--strategy fsdp] [--ckpt DIR]``
plans the model on the mesh, loads the export onto the plan's parameter
shardings shard by shard, prints what arrived where, and with ``--ckpt`` saves a
params-only checkpoint (step 0) that ``spmdkit train --resume`` continues from
with a fresh optimizer state.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from spmdkit.cli.command import (
    Command,
    dir_to_write,
    existing_dir,
    non_negative_int,
    parse_mesh,
    report_error,
    strategy_name,
)
from spmdkit.cli.model_arg import add_model_arguments, check_model_arg, resolve_model
from spmdkit.errors import SpmdError, UsageError

__all__ = ["COMMANDS", "check_export_args", "check_import_args"]


def _configure_export(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "ckpt", metavar="CKPT", help="checkpoint directory (spmdkit.runtime.checkpoint)"
    )
    parser.add_argument("out", metavar="OUT", help="directory to write the safetensors files into")
    parser.add_argument(
        "--step", type=non_negative_int, default=None, help="checkpoint step (default: latest)"
    )
    parser.add_argument("--max-file-gb", type=float, default=4.0, help="split files above this")


def check_export_args(args: argparse.Namespace) -> None:
    """``spmdkit export``'s arguments, checked before anything is opened or
    written: CKPT an existing directory, OUT a directory or a path to create one.

    Raises:
      UsageError: naming the argument.
    """
    existing_dir(
        "spmdkit export",
        "CKPT",
        args.ckpt,
        what="a checkpoint",
        fix="pass the --ckpt directory of a `spmdkit train` run (or of "
        "spmdkit.runtime.checkpoint.Manager)",
    )
    dir_to_write("spmdkit export", "OUT", args.out, what="the export's directory")


def _checkpoint_step(mgr: Any, args: argparse.Namespace) -> int:
    """The step to export: ``--step`` if the checkpoint has it, else the latest."""
    steps = mgr.all_steps()
    if not steps:
        raise UsageError(
            op="spmdkit export CKPT",
            must="CKPT holds at least one complete checkpoint",
            given=f"{args.ckpt}, which holds none",
            fix="pass the --ckpt directory of a `spmdkit train` run that saved a step",
        )
    if args.step is not None and args.step not in steps:
        raise UsageError(
            op="spmdkit export --step",
            must="--step is a step CKPT holds",
            given=f"--step {args.step}; {args.ckpt} holds steps {steps}",
            fix=f"pass one of {steps}, or drop --step for the latest ({steps[-1]})",
        )
    return steps[-1] if args.step is None else args.step


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` → ``{"a": {"b": x}}``."""
    out: dict[str, Any] = {}
    for path, x in flat.items():
        node = out
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = x
    return out


def _run_export(args: argparse.Namespace, out: TextIO) -> int:
    try:
        return _export(args, out)
    except SpmdError as e:
        return report_error("export", e, sys.stderr)


def _export(args: argparse.Namespace, out: TextIO) -> int:
    check_export_args(args)  # before importing orbax (about a second)
    from spmdkit.runtime.checkpoint import Manager

    # read-only: nothing written, and no cleanup thread left to outlive the process
    with Manager(args.ckpt, read_only=True) as mgr:
        return _export_from(mgr, args, out)


def _export_from(mgr: Any, args: argparse.Namespace, out: TextIO) -> int:
    import jax

    from spmdkit.runtime.export import export_params

    step = _checkpoint_step(mgr, args)
    shapes = mgr.saved_shapes(step)
    params = {p[len("params/") :]: s for p, s in shapes.items() if p.startswith("params/")}
    if not params:
        raise SpmdError(
            op="spmdkit export",
            must="the checkpoint holds parameters under 'params/'",
            given=f"saved paths: {sorted(shapes)[:8]}",
            fix="export a checkpoint written by spmdkit.runtime.train.train",
        )
    # single host: every tensor restored whole onto the first device, one file's
    # worth gathered to the host at a time by export_params
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {
        "params": _nest(
            {p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one) for p, s in params.items()}
        )
    }
    restored = mgr.restore(step, target=target, items=("params",))
    config = restored.config
    index = export_params(
        restored.state["params"],
        args.out,
        config=config,
        max_file_bytes=int(args.max_file_gb * (1 << 30)),
    )
    files = sorted(set(index["weight_map"].values()))
    out.write(
        f"exported {len(index['weight_map'])} tensors ({index['metadata']['total_size']} bytes) "
        f"of step {restored.step} to {args.out}: {', '.join(files)}\n"
    )
    return 0


def _configure_import(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export", metavar="EXPORT", help="directory written by `spmdkit export`")
    add_model_arguments(parser, batch_help=" (planning)")
    parser.add_argument("--mesh", default="data=2,model=4", help="mesh axes NAME=SIZE,...")
    parser.add_argument(
        "--strategy", default="fsdp", type=strategy_name, help="auto or a preset name"
    )
    parser.add_argument("--ckpt", default=None, help="write a params-only checkpoint here")


def check_import_args(args: argparse.Namespace) -> dict[str, int]:
    """``spmdkit import``'s arguments, checked before jax starts: the mesh, EXPORT
    an existing directory, the model and config, ``--ckpt`` a directory to write.
    Returns the mesh axes.

    Raises:
      UsageError: naming the argument; UnknownModelError: no such model or config.
    """
    axes = parse_mesh(args.mesh)
    existing_dir(
        "spmdkit import",
        "EXPORT",
        args.export,
        what="a safetensors export",
        fix="pass the OUT directory of `spmdkit export CKPT OUT`",
    )
    if args.ckpt:
        dir_to_write("spmdkit import", "--ckpt", args.ckpt)
    check_model_arg("spmdkit import", args.model, args.config)  # imports the models: last
    return axes


def _run_import(args: argparse.Namespace, out: TextIO) -> int:
    from spmdkit.cli.train import run_on_mesh

    return run_on_mesh("import", _import, args, out, check=check_import_args)


def _import(args: argparse.Namespace, axes: dict[str, int], out: TextIO) -> int:
    import jax
    from flax import nnx

    from spmdkit.mesh import make_mesh
    from spmdkit.models import abstract_model
    from spmdkit.planner import plan as make_plan
    from spmdkit.planner.notes import quiet_notes
    from spmdkit.runtime.checkpoint import Manager, abstract_target, tree_paths
    from spmdkit.runtime.export import exported_config, import_params

    model = resolve_model(
        "spmdkit import", args.model, config=args.config, batch_size=args.batch_size
    )
    spec, config = model.require_spec("spmdkit import"), model.config
    mesh = make_mesh(devices=jax.devices(), **axes)
    with quiet_notes():  # printed below, as the other commands print them
        plan = make_plan(spec, mesh, args.strategy, config=config, batch_size=model.batch_size)
    abstract = nnx.to_pure_dict(nnx.state(abstract_model(spec, config), nnx.Param))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
    params = import_params(args.export, abstract_target(abstract, plan.param_shardings(abstract)))
    flat = tree_paths(params)
    sharded = sum(1 for x in flat.values() if any(e is not None for e in x.sharding.spec))
    out.write(
        f"imported {len(flat)} tensors onto plan {plan.strategy!r} on mesh {args.mesh} "
        f"({sharded} sharded)\n" + "".join(f"  note: {n}\n" for n in plan.notes)
    )
    if args.ckpt:
        with Manager(args.ckpt, async_=False) as mgr:
            mgr.save(
                0, {"params": params}, plan=plan, config=exported_config(args.export), force=True
            )
        out.write(f"saved a params-only checkpoint (step 0) in {args.ckpt}\n")
    return 0


#: The subcommands this module adds to ``spmdkit.cli.COMMANDS``.
COMMANDS: list[Command] = [
    Command(
        "export",
        "write a checkpoint's parameters as safetensors files (one tensor per parameter path)",
        _configure_export,
        _run_export,
    ),
    Command(
        "import",
        "load a safetensors export onto a model's plan on a mesh, sharded at load",
        _configure_import,
        _run_import,
    ),
]
