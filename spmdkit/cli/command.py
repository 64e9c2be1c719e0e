"""One ``spmdkit`` subcommand (its own module so that command modules and
:mod:`spmdkit.cli` can import it without importing each other)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import NamedTuple, TextIO

from spmdkit.errors import UsageError

__all__ = [
    "MODELS_HELP",
    "PRESETS_HELP",
    "Command",
    "dir_to_write",
    "expand_help",
    "existing_dir",
    "model_help",
    "non_negative_int",
    "parse_mesh",
    "positive_int",
    "report_error",
    "strategy_name",
]


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


def report_error(verb: str, error: Exception, stream: TextIO) -> int:
    """Print a typed error for the user, no traceback: ``spmdkit VERB: <error>``
    (once: an error whose op already names the command is printed as it is).
    Returns 2, the exit status of bad usage."""
    text = str(error)
    stream.write((text if text.startswith("spmdkit ") else f"spmdkit {verb}: {text}") + "\n")
    return 2


# -- checks run before any planning (nothing here touches the disk or jax) -----------


def positive_int(text: str) -> int:
    """An ``argparse`` type: an int >= 1 (argparse names the flag when it fails).

    Example::

        >>> positive_int("8")
        8
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, given {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An ``argparse`` type: an int >= 0.

    Example::

        >>> non_negative_int("0")
        0
    """
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, given {text!r}")
    return value


def strategy_name(text: str) -> str:
    """An ``argparse`` type for ``--strategy``: ``auto`` or a preset name, checked
    when the command line is parsed (nothing imported: :mod:`spmdkit.strategies`).

    Example::

        >>> strategy_name("fsdp")
        'fsdp'
    """
    from spmdkit.strategies import STRATEGIES, unknown_strategy

    fix = unknown_strategy(text)
    if fix is not None:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(STRATEGIES)}; given {text!r}: {fix}"
        )
    return text


def _nearest_existing(path: str) -> str:
    """``path`` or its closest ancestor that exists."""
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here


def dir_to_write(op: str, flag: str, path: str, *, what: str = "a checkpoint directory") -> None:
    """A directory a command may write into: an existing directory, or a path that
    can be created as one (its nearest existing ancestor is a directory). Checked
    without creating anything.

    Args:
      op: the command (``"spmdkit train"``).
      flag: the flag or argument that gave the path (``"--ckpt"``, ``"OUT"``).
      path: the path given.
      what: what the directory is for, for the message.

    Raises:
      UsageError: the path, or a parent of it, is a file.
    """
    if os.path.isdir(path):
        return
    found = _nearest_existing(path)
    if not os.path.isdir(found):
        where = "is a file" if found == os.path.abspath(path) else f"is under the file {found}"
        raise UsageError(
            op=f"{op} {flag}",
            must=f"{flag} names {what} (an existing one, or one to create)",
            given=f"{path}, which {where}",
            fix=f"pass a directory path to {flag}, or move the file away",
        )


def existing_dir(op: str, name: str, path: str, *, what: str, fix: str) -> None:
    """``path`` must be an existing directory (an input the command reads).

    Args:
      op: the command (``"spmdkit export"``).
      name: the argument or flag (``"CKPT"``, ``"--ckpt"``).
      path: the path given.
      what: what the directory holds, for the message (``"a checkpoint"``).
      fix: how to get one.

    Raises:
      UsageError: the path does not exist or is not a directory.
    """
    if os.path.isdir(path):
        return
    state = "is a file" if os.path.exists(path) else "does not exist"
    raise UsageError(
        op=f"{op} {name}",
        must=f"{name} is a directory holding {what}",
        given=f"{path}, which {state}",
        fix=fix,
    )


#: Written in a help text where ``--help`` lists the reference models and their
#: configs (:func:`model_help`): listing them imports the models (jax, flax), so
#: it happens only when help is printed (:func:`expand_help`), not on every
#: command line.
MODELS_HELP = "<the reference models>"

#: Written in a help text where ``--help`` lists the plan presets (importing them
#: imports the planner).
PRESETS_HELP = "<the presets>"


def expand_help(text: str) -> str:
    """``text`` with :data:`MODELS_HELP` and :data:`PRESETS_HELP` replaced by the
    lists they stand for (imported only here, when help is printed)."""
    if MODELS_HELP in text:
        text = text.replace(MODELS_HELP, model_help())
    if PRESETS_HELP in text:
        from spmdkit.strategies import PRESETS, SHARDED_OPT_PRESETS

        text = text.replace(PRESETS_HELP, ", ".join((*PRESETS, *SHARDED_OPT_PRESETS)))
    return text


def model_help() -> str:
    """The reference models and their config names, for ``--help``:
    ``gpt (configs: tiny, 124m, ...); llama (...)``."""
    from spmdkit.models import MODELS

    return "; ".join(f"{n} (configs: {', '.join(m.configs)})" for n, m in MODELS.items())
