"""CLI subcommand ``spmdkit diff``: two plans of one model compared (``sk.diff``).

``spmdkit diff MODEL A B --mesh data=2,model=4 [--config tiny] [--batch-size 8]
[--abstract] [--estimator propagate]`` plans MODEL (a reference model or the
user's ``pkg.module:factory``, :mod:`spmdkit.cli.model_arg`) under A and under
B and prints what changes: the specs per tensor; memory, bytes moved and step
time per parameter group and per collective kind; strategy, recipe and mesh.
A or B may instead be a plan saved by ``spmdkit plan --json`` (a path ending in
``.json``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, TextIO

from spmdkit.cli.command import Command, report_error, strategy_name
from spmdkit.cli.model_arg import add_model_arguments, resolve_model
from spmdkit.cli.plan import check_plan_args
from spmdkit.errors import SpmdError, UsageError

__all__ = ["COMMANDS", "plan_or_path"]


def plan_or_path(text: str) -> str:
    """An ``argparse`` type for A and B: a strategy name, or a saved plan (``.json``).

    Example::

        >>> plan_or_path("fsdp")
        'fsdp'
    """
    return text if text.endswith(".json") else strategy_name(text)


def _configure(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("a", metavar="A", type=plan_or_path, help="strategy or plan.json")
    parser.add_argument("b", metavar="B", type=plan_or_path, help="strategy or plan.json")
    parser.add_argument("--mesh", default="data=2,model=4", help="mesh axes NAME=SIZE,...")
    parser.add_argument("--abstract", action="store_true", help="plan on an abstract mesh")
    parser.add_argument(
        "--estimator", default="propagate", choices=("propagate", "analytic"), help="cost model"
    )


def _load(path: str) -> Any:
    from spmdkit.planner import Plan

    if not os.path.isfile(path):
        raise UsageError(
            op="spmdkit diff",
            must="a plan given as a path is a file saved by `spmdkit plan --json`",
            given=f"{path} (no such file)",
            fix="save one with `spmdkit plan MODEL --json plan.json`, or name a strategy",
        )
    with open(path) as f:
        return Plan.from_json(f.read())


def _run(args: argparse.Namespace, out: TextIO) -> int:
    try:
        axes = check_plan_args("diff", args)
        import spmdkit as sk
        from spmdkit.planner import diff, plan
        from spmdkit.planner.notes import quiet_notes

        if args.abstract:
            mesh = sk.abstract_mesh(**axes)
        else:
            sk.use_virtual_cpu_devices(max(8, math.prod(axes.values())))
            mesh = sk.make_mesh(**axes)
        info = None
        plans = []
        for which in (args.a, args.b):
            if which.endswith(".json"):
                plans.append(_load(which))
                continue
            if info is None:
                model = resolve_model(
                    "spmdkit diff", args.model, config=args.config, batch_size=args.batch_size
                )
                info = model.describe()
            with quiet_notes():
                plans.append(plan(info, mesh, which, estimator=args.estimator))
        result = diff(*plans)
    except SpmdError as e:
        return report_error("diff", e, sys.stderr)
    out.write(str(result) + "\n")
    return 0


COMMANDS = [
    Command(
        "diff",
        "plan a model two ways (or load two saved plans) and print what changes between them",
        _configure,
        _run,
    ),
]
