"""CLI subcommands ``spmdkit train`` and ``spmdkit launch`` (append :data:`COMMANDS`
to ``spmdkit.cli.COMMANDS``).

``spmdkit train MODEL --mesh data=2,model=4 --steps N --ckpt DIR [--resume]`` plans
the model on the mesh (a ``pipe`` axis pipelines its stacked layers:
``--schedule``, ``--microbatches``, ``--virtual``; :func:`pipeline_of`), trains it
on the model's synthetic batches with the step ``sk.jit`` compiles for the plan
(``--verify`` prints that step's verify table first), checkpoints, and with
``--resume`` continues from the latest checkpoint — on whatever mesh and plan this
run has. With no accelerator
it uses virtual CPU devices (as many as the mesh needs). Under ``spmdkit launch``
each process feeds its share of the batch.

``spmdkit launch --nproc N [--devices-per-process K] -- COMMAND...`` runs COMMAND
as N local processes forming one JAX process group (:mod:`spmdkit.runtime.launch`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from spmdkit.cli.command import (
    Command,
    dir_to_write,
    non_negative_int,
    parse_mesh,
    positive_int,
    report_error,
    strategy_name,
)
from spmdkit.cli.model_arg import add_model_arguments, check_model_arg, resolve_model
from spmdkit.errors import SpmdError, UsageError
from spmdkit.pipeline.schedule import SCHEDULES

__all__ = ["COMMANDS", "check_train_args", "parse_mesh", "pipeline_of", "start_devices"]


# -- train ----------------------------------------------------------------------


def _configure_train(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--mesh", default="data=2,model=4", help="mesh axes NAME=SIZE,...")
    parser.add_argument(
        "--strategy", default="auto", type=strategy_name, help="auto or a preset name"
    )
    parser.add_argument("--steps", type=non_negative_int, default=10, help="total steps to reach")
    parser.add_argument(
        "--accum-steps", type=positive_int, default=1, help="micro-batches per step"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="adam learning rate")
    parser.add_argument("--ckpt", default=None, help="checkpoint directory (created if missing)")
    parser.add_argument(
        "--save-every", type=positive_int, default=50, help="steps between checkpoints"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --ckpt (a fresh start when it has none)",
    )
    parser.add_argument("--log-every", type=positive_int, default=1, help="steps between logs")
    parser.add_argument("--seed", type=int, default=0, help="model init and per-step key seed")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="print the verify table (predicted vs compiled) of the step before it runs",
    )
    parser.add_argument(
        "--schedule",
        default=None,
        choices=SCHEDULES,
        help="pipeline schedule when the mesh has a 'pipe' axis (default 1f1b, or "
        "interleaved with --virtual > 1)",
    )
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="pipeline micro-batches (default: 2 x pipe)",
    )
    parser.add_argument(
        "--virtual", type=positive_int, default=1, help="pipeline chunks per device (interleaved)"
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="auto only: time auto's candidates on the mesh's devices and train the fastest "
        "(sk.tune; a compile per candidate; one process)",
    )
    parser.add_argument(
        "--local-statistics",
        action="store_true",
        help="pipeline: layers that combine rows (MoE routing statistics) use each device's rows",
    )


def check_train_args(args: argparse.Namespace) -> dict[str, int]:
    """Everything about ``spmdkit train``'s flags that can be checked before jax
    starts or anything is planned or written: the mesh, the model and config,
    ``--resume`` with ``--ckpt``, ``--ckpt`` a directory (or creatable as one),
    the pipeline flags against the mesh. Returns the mesh axes.

    Raises:
      UsageError: a flag that cannot work (the message names it);
      UnknownModelError: no such model or config.
    """
    axes = parse_mesh(args.mesh)
    if args.resume and not args.ckpt:
        raise UsageError(
            op="spmdkit train --resume",
            must="--resume comes with --ckpt DIR, the checkpoint directory to continue from",
            given="--resume without --ckpt",
            fix="add --ckpt DIR (the directory the earlier run saved to), or drop --resume",
        )
    if args.ckpt:
        dir_to_write("spmdkit train", "--ckpt", args.ckpt)
    if args.measure and args.strategy != "auto":
        raise UsageError(
            op="spmdkit train --measure",
            must="--measure times auto's candidates: --strategy auto",
            given=f"--strategy {args.strategy}",
            fix="drop --measure, or train with --strategy auto",
        )
    pipeline_of(args, axes)
    check_model_arg("spmdkit train", args.model, args.config)  # imports the models: last
    return axes


def start_devices(axes: dict[str, int]) -> None:
    """Join a launched process group, or ask for enough virtual CPU devices."""
    from spmdkit.runtime.launch import initialize_from_env

    if initialize_from_env():
        return
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        from spmdkit.mesh import use_virtual_cpu_devices

        use_virtual_cpu_devices(max(math.prod(axes.values()), 1))


def run_on_mesh(
    verb: str,
    body: Callable[[argparse.Namespace, dict[str, int], TextIO], int],
    args: argparse.Namespace,
    out: TextIO,
    check: Callable[[argparse.Namespace], dict[str, int]] | None = None,
) -> int:
    """Check the flags (``check(args)``, returning the mesh axes; default: parse
    ``--mesh``), start the mesh's devices, run ``body(args, axes, out)``; a typed
    error is printed as ``spmdkit VERB: ...`` with exit status 2."""
    try:
        axes = check(args) if check is not None else parse_mesh(args.mesh)
        start_devices(axes)
        return body(args, axes, out)
    except SpmdError as e:
        return report_error(verb, e, sys.stderr)


def _run_train(args: argparse.Namespace, out: TextIO) -> int:
    return run_on_mesh("train", _train, args, out, check=check_train_args)


def _train(args: argparse.Namespace, axes: dict[str, int], out: TextIO) -> int:
    import jax
    import optax
    from flax import nnx

    from spmdkit.cli.plan import throughput_line
    from spmdkit.compile.tune import tune
    from spmdkit.introspect import describe
    from spmdkit.mesh import make_mesh
    from spmdkit.planner import plan as make_plan
    from spmdkit.planner.notes import quiet_notes
    from spmdkit.planner.options import SearchOptions
    from spmdkit.runtime.checkpoint import Manager
    from spmdkit.runtime.train import train

    model_arg = resolve_model(
        "spmdkit train", args.model, config=args.config, batch_size=args.batch_size
    )
    spec = model_arg.require_spec("spmdkit train")
    config, batch_size = model_arg.config, model_arg.batch_size
    # jax.devices() starts the backends with the device count chosen above (a launched
    # process has only its own share), so make_mesh does not ask for more
    mesh = make_mesh(devices=jax.devices(), **axes)
    optimizer = optax.adam(args.lr)
    info = describe(spec, config=config, batch_size=batch_size)
    with quiet_notes():  # train prints them before the first step
        if args.measure:
            opts = SearchOptions(pipeline=pipeline_of(args, axes))
            plan = tune(info, mesh, optimizer=optimizer, options=opts)
        else:
            plan = make_plan(
                info, mesh, args.strategy, optimizer=optimizer, pipeline=pipeline_of(args, axes)
            )
    if jax.process_index() == 0:
        out.write(f"{throughput_line(plan, info, optimizer)}\n{plan.table(notes=False)}\n")
    with nnx.use_eager_sharding(False):
        model = spec.build(config, nnx.Rngs(args.seed))
    data = _loader(args, batch_size, spec, config, plan)
    ckpt = Manager(args.ckpt, save_interval_steps=args.save_every) if args.ckpt else None
    try:
        result = train(
            spec.loss,
            model,
            optimizer,
            data,
            steps=args.steps,
            plan=plan,
            accum_steps=args.accum_steps,
            ckpt=ckpt,
            config=config,
            resume=args.resume,
            rng=args.seed,
            verify=args.verify,
            log_every=args.log_every,
            out=out,
        )
    finally:  # orbax's threads end with the manager, not at interpreter exit
        if ckpt is not None:
            ckpt.close()
    if jax.process_index() == 0 and not result.history:  # train said why
        out.write(f"nothing to train: at step {result.step} >= steps {args.steps}\n")
    elif jax.process_index() == 0:
        out.write(
            f"trained steps {result.start_step + 1}..{result.step} on mesh {args.mesh}; "
            f"losses {', '.join(f'{v:.4f}' for v in result.losses)}\n"
        )
    return 0


def _loader(args: argparse.Namespace, batch_size: int, spec: Any, config: Any, plan: Any) -> Any:
    """The model's synthetic batches, step ``i``'s from seed ``(seed, i)``, each
    process keeping its rows, placed with the plan's batch sharding."""
    import jax
    import numpy as np

    from spmdkit.runtime.data import ShardedLoader

    nproc, pid = jax.process_count(), jax.process_index()
    if batch_size % nproc:
        raise UsageError(
            op="spmdkit train --batch-size",
            must="the global batch size divides over the processes",
            given=f"--batch-size {batch_size}, {nproc} processes",
            fix=f"use a multiple of {nproc}",
        )
    local = batch_size // nproc
    sharding = plan.batch_sharding(spec.batch(config, batch_size, None))

    def batches() -> Any:
        for i in range(args.steps):
            full = spec.batch(config, batch_size, np.random.default_rng((args.seed, i)))
            yield {k: np.asarray(v)[pid * local : (pid + 1) * local] for k, v in full.items()}

    return ShardedLoader(batches, sharding, batch_size=local)


def pipeline_of(args: argparse.Namespace, axes: dict[str, int]) -> object:
    """The :class:`~spmdkit.pipeline.Pipeline` a ``pipe`` axis of the mesh asks for
    (``None`` without one): ``stages`` its size, ``--microbatches`` (default twice
    the stages), ``--virtual``, ``--schedule`` (default 1F1B, interleaved with
    ``--virtual`` > 1), ``--local-statistics``.

    Example::

        >>> pipeline_of(argparse.Namespace(schedule=None, microbatches=None, virtual=1),
        ...             {"pipe": 2, "data": 4}).short()
        'pp2 1f1b m4'
    """
    from spmdkit.pipeline import Pipeline

    stages = axes.get("pipe", 1)
    local = getattr(args, "local_statistics", False)
    if stages == 1:
        if args.schedule or args.microbatches or args.virtual > 1 or local:
            raise SpmdError(
                op="spmdkit train",
                must="pipeline flags come with a 'pipe' axis in --mesh",
                given=f"--mesh axes {axes}",
                fix="add pipe=N to --mesh (e.g. --mesh pipe=2,data=4), or drop the flags",
            )
        return None
    schedule = args.schedule or ("interleaved" if args.virtual > 1 else "1f1b")
    return Pipeline(
        stages=stages,
        microbatches=args.microbatches or 2 * stages,
        schedule=schedule,
        virtual=args.virtual,
        local_statistics=local,
    )


# -- launch ---------------------------------------------------------------------


def _configure_launch(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-process", type=int, default=1, help="virtual CPU devices per process"
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1")
    parser.add_argument("--timeout", type=float, default=None, help="stop all after S seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")


def _run_launch(args: argparse.Namespace, out: TextIO) -> int:
    from spmdkit.runtime.launch import launch

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        return launch(
            args.nproc,
            command,
            devices_per_process=args.devices_per_process,
            port=args.port,
            timeout=args.timeout,
        )
    except SpmdError as e:
        sys.stderr.write(f"spmdkit launch: {e}\n")
        return 2


#: The subcommands this module adds to ``spmdkit.cli.COMMANDS``.
COMMANDS: list[Command] = [
    Command(
        "train",
        "plan a reference model or your own (module:factory) on a mesh, train it, "
        "checkpoint, resume on any mesh",
        _configure_train,
        _run_train,
    ),
    Command(
        "launch",
        "run a command as N local processes of one JAX process group (gloo on CPU)",
        _configure_launch,
        _run_launch,
    ),
]
