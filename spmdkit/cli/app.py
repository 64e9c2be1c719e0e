"""The ``spmdkit`` command line: ``demo``, ``rules [OP]``, ``plan``, ``diff``, ``report``,
``train``, ``launch``, ``export``, ``import``, ``deps``, ``doctor``.

Each subcommand is one :class:`Command`: a name, a help line, a function that
adds its arguments to its sub-parser, and a function that runs it and returns
the exit status. New subcommands (``plan``, ``train``, ``report``) are added by
appending to :data:`COMMANDS`. Nothing here starts JAX's backends: the demo
must choose its devices (virtual CPU devices or an accelerator) before they
start, so it is imported only when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from spmdkit.cli.command import Command, expand_help
from spmdkit.errors import SpmdError

if TYPE_CHECKING:
    from spmdkit.engine.rule import Example, Rule

__all__ = ["COMMANDS", "Command", "build_parser", "main"]


# -- demo ---------------------------------------------------------------------


def _configure_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="use 8 virtual CPU devices even when an accelerator is present",
    )


def _run_demo(args: argparse.Namespace, out: TextIO) -> int:
    from spmdkit.cli.demo import run_demo

    try:
        return run_demo(force_cpu=args.cpu, out=out)
    except SpmdError as e:  # e.g. too few devices: say why and how to fix it, no traceback
        sys.stderr.write(f"spmdkit demo: {e}\n")
        return 2


# -- rules --------------------------------------------------------------------


def _configure_rules(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("op", nargs="?", help="show one op in detail (default: list all ops)")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the Markdown rule reference (the source of docs/rule-reference.md)",
    )


def _summary(rule: Rule) -> str:
    """``rule.describe()``, expanded for the first example when it depends on shapes."""
    from spmdkit.engine.factor_rule import FactorRule

    text = rule.describe()
    if isinstance(rule, FactorRule) and callable(rule.notation) and rule.examples:
        ex = rule.examples[0]
        text = rule.describe(ex.shapes, **dict(ex.attrs)) + f"  (for {_call(ex)})"
    return text


def _call(ex: Example) -> str:
    shapes = ", ".join(str(tuple(s)) for s in ex.shapes)
    return shapes + "".join(f", {k}={v!r}" for k, v in dict(ex.attrs).items())


def _run_rules(args: argparse.Namespace, out: TextIO) -> int:
    from spmdkit.engine.registry import get_rule, registered_ops
    from spmdkit.errors import NoRuleError

    if args.markdown:
        from spmdkit.cli.docgen import rules_markdown

        out.write(rules_markdown())
        return 0
    if args.op is None:
        names = registered_ops()
        rules = [get_rule(n) for n in names]
        width = max(len(n) for n in names)
        fam_width = max(len(getattr(r, "family", "")) for r in rules)
        out.write(f"{len(names)} registered ops (spmdkit rules OP for details)\n")
        for name, rule in zip(names, rules, strict=True):
            family = getattr(rule, "family", "")
            line = f"  {name:<{width}}  {family:<{fam_width}}  {_summary(rule)}"
            out.write(line + (f"  -- {rule.doc}" if rule.doc else "") + "\n")
        return 0
    try:
        rule = get_rule(args.op)
    except NoRuleError as e:
        sys.stderr.write(f"spmdkit rules: {e}\n")
        return 2
    out.write(f"{rule.name}  (family: {getattr(rule, 'family', '?')})\n")
    out.write(f"  doc:       {rule.doc or '(none)'}\n")
    out.write(f"  rule:      {rule.describe()}\n")
    if len(rule.strategies) > 1:
        out.write(f"  strategies: {', '.join(rule.strategies)}\n")
    if rule.examples:
        out.write("  examples (notation expanded for the example shapes):\n")
        for ex in rule.examples:
            out.write(f"    ({_call(ex)}):  {rule.describe(ex.shapes, **dict(ex.attrs))}\n")
    return 0


#: The subcommands, in the order ``--help`` lists them.
COMMANDS: list[Command] = [
    Command(
        "demo",
        "run a short tour on a 2x4 mesh: rule inference, reshards, compiled collectives",
        _configure_demo,
        _run_demo,
    ),
    Command("rules", "list the registered ops, or describe one", _configure_rules, _run_rules),
]


def _more_commands() -> list[Command]:
    """``plan``/``report`` (planner) and ``train``/``launch`` (training), defined in
    their own modules; imported after :class:`Command` exists."""
    from spmdkit.cli.compare import COMMANDS as DIFF_COMMANDS
    from spmdkit.cli.deps import COMMANDS as DEPS_COMMANDS
    from spmdkit.cli.doctor import COMMANDS as DOCTOR_COMMANDS
    from spmdkit.cli.export import COMMANDS as EXPORT_COMMANDS
    from spmdkit.cli.plan import PLAN_COMMANDS
    from spmdkit.cli.train import COMMANDS as TRAIN_COMMANDS

    return [
        *PLAN_COMMANDS,
        *DIFF_COMMANDS,
        *TRAIN_COMMANDS,
        *EXPORT_COMMANDS,
        *DEPS_COMMANDS,
        *DOCTOR_COMMANDS,
    ]


COMMANDS.extend(_more_commands())


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` names each option's default (options without one, and on/off
    flags, stay as written) and lists the reference models and presets where a
    help text says :data:`~spmdkit.cli.command.MODELS_HELP` or
    :data:`~spmdkit.cli.command.PRESETS_HELP`."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if action.default not in (None, False) and action.default is not argparse.SUPPRESS:
            text = super()._get_help_string(action)
        # the model list imports the models (jax, flax): only when help is printed
        return expand_help(text) if text else text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per entry of :data:`COMMANDS`.

    Example::

        >>> build_parser().parse_args(["rules", "matmul"]).op
        'matmul'
    """
    parser = argparse.ArgumentParser(
        prog="spmdkit",
        description="Explicit, predictable, testable SPMD sharding for JAX and flax.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        child = sub.add_parser(
            cmd.name, help=cmd.help, description=cmd.help, formatter_class=_HelpFormatter
        )
        cmd.configure(child)
        child.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``spmdkit`` and ``python -m spmdkit``.

    Args:
      argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
      The exit status: 0 on success, 1 when a check failed, 2 on bad usage.

    Example::

        >>> main(["rules", "softmax"])  # doctest: +SKIP
        softmax  (family: softmax)
        ...
    """
    args = build_parser().parse_args(argv)
    try:
        return args._run(args, sys.stdout)
    except BrokenPipeError:
        # the reader (``| head``) left early; silence the flush at exit
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - must outlive this call
        return 0
