"""The `spmdkit` command line: demo, rules, plan, report, train, launch."""

from spmdkit.cli.app import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]
