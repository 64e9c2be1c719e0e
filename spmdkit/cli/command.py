"""One ``spmdkit`` subcommand (its own module so that command modules and
:mod:`spmdkit.cli` can import it without importing each other)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple, TextIO

__all__ = ["Command", "parse_mesh"]


class Command(NamedTuple):
    """One subcommand.

    Attributes:
      name: what the user types (``spmdkit NAME``).
      help: one line for ``spmdkit --help``.
      configure: adds the subcommand's arguments to its parser.
      run: runs it on the parsed arguments, writing to the given stream; returns
        the exit status.
    """

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, TextIO], int]


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` → ``{"data": 2, "model": 4}`` (the ``--mesh`` option).

    Raises:
      SpmdError: malformed text.

    Example::

        >>> parse_mesh("data=2,model=4")
        {'data': 2, 'model': 4}
    """
    from spmdkit.errors import SpmdError

    axes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        if not sep or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise SpmdError(
                op="spmdkit --mesh",
                must="the mesh is NAME=SIZE pairs separated by commas",
                given=repr(text),
                fix="write e.g. --mesh data=2,model=4",
            )
        axes[name.strip()] = int(size)
    return axes
