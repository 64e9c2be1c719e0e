"""Where :func:`spmdkit.runtime.train.train` reads its batches: the example batch
planning reads, and the batches from a step on.

- a :class:`~spmdkit.runtime.data.ShardedLoader` (anything with ``state`` and
  ``set_state``): epoch after epoch, resumed from its checkpointed position;
- a sequence of batches: each once, in order, resumed at its index; one too short
  for ``steps`` is refused before anything compiles unless ``repeat=True``
  starts it over;
- another re-iterable: iterated once (``repeat=True``: again and again), resumed
  by replaying the consumed batches;
- a one-shot iterator (a generator): its batches once; it cannot be positioned,
  so it cannot resume.

Data that runs out mid-run raises :class:`~spmdkit.errors.TrainError` (never a
silent second epoch, never a bare ``StopIteration``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from spmdkit.errors import TrainError

__all__ = ["Source"]


class Source:
    """The data: the example batch planning reads, and the batches from a step on
    (module docstring: how each kind resumes)."""

    def __init__(self, data: Any, *, resuming: bool, repeat: bool = False) -> None:
        self.data = data
        self.repeat = repeat
        self.loader = hasattr(data, "set_state") and hasattr(data, "state")
        try:
            self.one_shot = iter(data) is data
        except TypeError as e:
            raise TrainError(
                op="train",
                must="data is an iterable of batches",
                given=f"{type(data).__name__}: {e}",
                fix="pass a ShardedLoader, a list of batches, or an iterable "
                "(wrap a generator function as ShardedLoader(fn, sharding))",
            ) from e
        if self.one_shot and resuming:
            raise TrainError(
                op="train",
                must="resumed data starts where the checkpointed run stopped",
                given=f"a one-shot iterator ({type(data).__name__}): its position is unknown",
                fix="pass a ShardedLoader (its position is checkpointed), a list of batches, "
                "or a callable source wrapped in ShardedLoader",
            )
        self.pending: list[Any] = []
        self.example = self._peek()

    def _peek(self) -> Any:
        data = self.data
        if self.one_shot:
            self.pending = [next(data, None)]
            first = self.pending[0]
        elif self.loader:
            position = data.state()
            first = next(iter(data), None)
            data.set_state(position)
        elif isinstance(data, Sequence):
            first = data[0] if len(data) else None
        else:
            first = next(iter(data), None)
        if first is None:
            raise TrainError(
                op="train",
                must="the data yields at least one batch",
                given=f"an empty {type(data).__name__}",
                fix="pass batches (a ShardedLoader, a list of batch dicts, an iterable)",
            )
        return first

    def mesh(self) -> Any:
        """The mesh of the data's sharding (the loader's, or the example's arrays'), if any."""
        found = [s for s in _shardings(getattr(self.data, "sharding", None))]
        found += [getattr(x, "sharding", None) for x in jax.tree.leaves(self.example)]
        meshes = [s.mesh for s in found if isinstance(s, NamedSharding)]
        return meshes[0] if meshes else None

    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes splitting the data's leading (batch) dim."""
        found = [s for s in _shardings(getattr(self.data, "sharding", None))]
        found += [getattr(x, "sharding", None) for x in jax.tree.leaves(self.example)]
        for s in found:
            if isinstance(s, NamedSharding) and len(s.spec):
                head = s.spec[0]
                return () if head is None else (head,) if isinstance(head, str) else tuple(head)
        return ()

    def check_length(self, start: int, steps: int) -> None:
        """Refuse a sequence of batches too short to reach ``steps`` without
        starting over, unless starting over was asked for (``repeat=True``).

        Raises:
          TrainError: ``steps - start`` batches are needed, fewer remain.
        """
        data = self.data
        if self.repeat or self.loader or not isinstance(data, Sequence) or steps <= start:
            return
        if steps > len(data):
            raise TrainError(
                op="train",
                must=f"the data holds a batch for every step up to steps={steps}, or "
                "repeat=True asks to start over when it runs out",
                given=f"a {type(data).__name__} of {len(data)} batches",
                fix=f"pass more batches, steps={len(data)}, or repeat=True (one more epoch "
                "of the same batches)",
            )

    def batches(self, start: int, saved: Any) -> tuple[Iterator[Any], str]:
        """The batches from step ``start`` on (``saved``: the loader position
        the checkpoint recorded) and where they start, in words: endless for a
        loader (epoch after epoch) and with ``repeat``; otherwise a
        :class:`TrainError` when they run out."""
        data = self.data
        if self.loader:
            if saved is not None:
                data.set_state(saved)
            return _endless(data), f"data at {data.state()}"
        if self.one_shot:
            return _until_out(itertools.chain(self.pending, data), start), (
                "data from its first batch"
            )
        again = _endless(data) if self.repeat else _until_out(iter(data), 0)
        if isinstance(data, Sequence):
            n = len(data)
            if not self.repeat:
                return _until_out(itertools.islice(data, start, None), start), (
                    f"data at batch {start} of {n}"
                )
            first = itertools.islice(data, start % n, None)
            return itertools.chain(first, again), f"data at batch {start % n} of {n}"
        for _ in range(start):
            next(again)
        return again, f"data replayed past {start} batches"


def _until_out(batches: Iterator[Any], start: int) -> Iterator[Any]:
    """``batches``, then a :class:`TrainError` (not a bare ``StopIteration``) when
    the loop asks for one more than there are."""
    step = start
    for batch in batches:
        yield batch
        step += 1
    raise TrainError(
        op="train",
        must="the data yields a batch for every step",
        given=f"the data ran out after step {step}",
        fix="pass steps= no more than the batches there are, more data, or a re-iterable "
        "(a list, a ShardedLoader) with repeat=True to start over",
    )


def _shardings(sharding: Any) -> list[Any]:
    if isinstance(sharding, Mapping):
        return [s for v in sharding.values() for s in _shardings(v)]
    return [sharding] if sharding is not None else []


def _endless(data: Any) -> Iterator[Any]:
    """Endless batches: iterate the data again (next epoch) whenever it runs out.
    One empty pass is allowed (a position restored at the very end of an epoch)."""
    empties = 0
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch
        empties = empties + 1 if empty else 0
        if empties == 2:
            raise TrainError(
                op="train",
                must="the data yields at least one batch per epoch",
                given="an empty epoch",
                fix="use a smaller batch_size or last_batch='pad'",
            )
