"""Routed experts traced on one device's tokens and experts, where the mesh axes
that split them are manual (a pipelined stage).

Inside the pipeline's ``shard_map`` (manual over the pipe axis and the batch
axes: :mod:`spmdkit.pipeline.execute`) a device runs its stages on its own rows of
each micro-batch. A plan whose routed experts' ``expert`` dim is split over batch
axes (expert parallelism) keeps them split there: each device holds its experts
only, and the tokens travel to them. The executor traces the layers on a
device's rows and experts under :func:`expert_shard`; the ``moe_experts`` op
(:func:`spmdkit.ops.moe_experts`) then runs its ``all_to_all`` strategy's
per-device program directly over the manual axes, and notes the collectives it
runs (what ``plan.verify`` predicts the stages to run).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from spmdkit.state import register_context

__all__ = ["ExpertShard", "current_expert_shard", "expert_shard", "note_expert_exchange"]


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """One device's tokens and routed experts: the tokens' rows split over the manual
    ``tokens`` axes, the experts (dim 0 of the expert weights) over the manual
    ``experts`` axes (a subset of them).

    Attributes:
      tokens: the axes the tokens are split over (the pipeline's batch axes), major first.
      experts: the axes the experts are split over.
      sizes: every axis of ``tokens`` → its size.
    """

    tokens: tuple[str, ...]
    experts: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]

    @property
    def token_shards(self) -> int:
        """The devices the tokens are split over."""
        return math.prod(dict(self.sizes)[a] for a in self.tokens)

    @property
    def expert_shards(self) -> int:
        """The devices the experts are split over (the expert-parallel degree)."""
        return math.prod(dict(self.sizes)[a] for a in self.experts)


_SHARD: contextvars.ContextVar[ExpertShard | None] = register_context(
    contextvars.ContextVar("spmdkit_expert_shard", default=None),
    module=__name__,
    name="_SHARD",
    set_by="`expert_shard()`",
    read_by="`current_expert_shard()` (the moe_experts op)",
    why="the one device's tokens and experts pipelined layers are traced on.",
)

_EXCHANGES: contextvars.ContextVar[list | None] = register_context(
    contextvars.ContextVar("spmdkit_expert_exchanges", default=None),
    module=__name__,
    name="_EXCHANGES",
    set_by="`expert_shard()`",
    read_by="`note_expert_exchange()` (the moe_experts op), which appends",
    why="the collectives the moe_experts ops traced on one device's tokens run.",
)


@contextlib.contextmanager
def expert_shard(shard: ExpertShard | None) -> Iterator[list[tuple[str, float, bool]]]:
    """Trace layers on one device's tokens and experts (``shard``; ``None``: no
    effect): inside, :func:`current_expert_shard` returns ``shard`` and the
    ``moe_experts`` op runs its per-device program over the manual axes. Yields a
    list the ops traced inside add their forward collectives to, ``(kind, payload
    bytes per device, whether the backward runs its transpose)``.

    Example::

        >>> with expert_shard(ExpertShard(("data",), ("data",), (("data", 4),))) as seen:
        ...     local = split_loss(loss_fn, local_params, rows, (), axis_env=[("data", 4)])
    """
    seen: list[tuple[str, float, bool]] = []
    tokens = (_SHARD.set(shard), _EXCHANGES.set(seen))
    try:
        yield seen
    finally:
        _EXCHANGES.reset(tokens[1])
        _SHARD.reset(tokens[0])


def note_expert_exchange(collectives: Any, transposed: Any) -> None:
    """Add the collectives (``kind``, ``payload_bytes``) an op traced under
    :func:`expert_shard` runs, and per collective whether its backward runs the
    transpose (``transposed``), to its list."""
    seen = _EXCHANGES.get()
    if seen is not None:
        seen.extend(
            (c.kind, float(c.payload_bytes), bool(t))
            for c, t in zip(collectives, transposed, strict=True)
        )


def current_expert_shard() -> ExpertShard | None:
    """The :class:`ExpertShard` layers are traced on (:func:`expert_shard`), or ``None``."""
    return _SHARD.get()
