"""What :func:`~spmdkit.runtime.train.train` is asked besides model, data and plan: two values.

A run *checkpoints* (:class:`Checkpointing`: the manager, resuming, what a
checkpoint holds and what a resume restores, the model config saved beside it)
and *reports* (:class:`Reporting`: the verify table before the first step,
progress lines and where they go). Both are frozen and validate themselves when
built; ``train``'s keywords of the same names build them (:func:`given`), so
``train(..., ckpt=m, resume=True)`` and ``train(...,
checkpointing=Checkpointing(m, resume=True))`` are one run.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any, TextIO, TypeVar

from spmdkit.errors import TrainError
from spmdkit.runtime.checkpoint import Manager

__all__ = ["Checkpointing", "Reporting", "given"]

Options = TypeVar("Options", "Checkpointing", "Reporting")


@dataclass(frozen=True)
class Checkpointing:
    """How :func:`~spmdkit.runtime.train.train` checkpoints and resumes.

    Attributes:
      ckpt: a :class:`~spmdkit.runtime.checkpoint.Manager`; saves on its
        interval and at the end. None: no checkpoints.
      resume: continue from the manager's latest complete checkpoint, if any.
      save_opt_state: checkpoints hold the optimizer state (False: parameters,
        RNG and data position only).
      restore_opt_state: on resume, restore the optimizer state (True: it must be
        there), start a fresh one (False), or restore it when the checkpoint has
        one (None).
      config: the model config (dataclass or dict), saved in every checkpoint.

    Raises:
      TrainError: ``resume`` without a manager.

    Example::

        >>> ck = Checkpointing(Manager("/tmp/run", save_interval_steps=50), resume=True)
        >>> res = train(info, params, opt, data, steps=100, plan=plan, checkpointing=ck)
    """

    ckpt: Manager | None = None
    resume: bool = False
    save_opt_state: bool = True
    restore_opt_state: bool | None = None
    config: Any = None

    def __post_init__(self) -> None:
        if self.resume and self.ckpt is None:
            raise TrainError(
                op="train",
                must="resume=True comes with a checkpoint manager",
                given="ckpt=None",
                fix="pass ckpt=spmdkit.runtime.checkpoint.Manager(directory)",
            )


@dataclass(frozen=True)
class Reporting:
    """What :func:`~spmdkit.runtime.train.train` prints, and where.

    Attributes:
      verify: print the step's verify table (``plan.verify``) before it runs.
      log_every: steps between progress lines (and metric fetches), at least 1.
      progress: print the plan made here (or a given plan's notes), the restore
        line and progress lines (process 0 only).
      out: stream for those lines (None: stderr).

    Raises:
      TrainError: ``log_every`` is not a positive int.
    """

    verify: bool = False
    log_every: int = 10
    progress: bool = True
    out: TextIO | None = None

    def __post_init__(self) -> None:
        every = self.log_every
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise TrainError(
                op="train",
                must="log_every is a positive int",
                given=repr(every),
                fix="log_every=10",
            )


def given(value: Options | None, built: Options) -> Options:
    """``value``, or where it is None ``built`` (the value ``train``'s keywords of
    the same names make): the thin layer that keeps those keywords working.

    Raises:
      TrainError: ``value`` is not of ``built``'s type, or it is given with one of
        its keywords set off its default.
    """
    cls = type(built)
    if value is None:
        return built
    if not isinstance(value, cls):
        raise TrainError(
            op="train",
            must=f"the value is a {cls.__name__}",
            given=type(value).__name__,
            fix=f"pass spmdkit.runtime.train.{cls.__name__}(...) or its fields as keywords",
        )
    default = cls()
    clash = [f.name for f in fields(cls) if _set(getattr(built, f.name), getattr(default, f.name))]
    if clash:
        raise TrainError(
            op="train",
            must=f"each option given once: as a {cls.__name__} field or as a keyword",
            given=f"a {cls.__name__} and the keywords {', '.join(clash)}",
            fix=f"set {', '.join(clash)} in the {cls.__name__} only",
        )
    return value


def _set(value: Any, default: Any) -> bool:
    """Whether a keyword was set off its default (by identity first: a config or
    a stream need not compare with ``==``)."""
    return value is not default and (type(value) is not type(default) or value != default)
