"""The `spmdkit` command line: demo, rules, plan, report, train, launch, doctor."""

from spmdkit.cli.app import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]
