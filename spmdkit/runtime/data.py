"""Sharded data feeding: each process's host batch becomes one global sharded array.

Every process reads its own slice of the data (its *local* batch, numpy on the
host). :func:`to_global` turns a dict of local batches into global ``jax.Array``
s laid out by the batch sharding (``jax.make_array_from_process_local_data``):
the global batch is the concatenation of the processes' local batches along the
sharded dims, and no process ever holds the global batch. Fields that are not
numeric arrays (strings, ids, lists, metadata) pass through untouched.

:class:`ShardedLoader` iterates over a dict of per-process example arrays (or
any re-iterable source of host batches) and yields global batches. Its position
(``state()``) is plain JSON, saved with checkpoints and given back with
``set_state()``; iteration resumes exactly there.

Uneven last batch policy (``last_batch=``):

* ``"drop"`` (default) — the examples that do not fill a whole batch are skipped;
  every batch has the same shape, so one compiled step serves all.
* ``"pad"`` — the last batch is filled with zeros up to the batch size and every
  batch carries a boolean field ``mask`` (``True`` for real examples) that a loss
  must use to ignore the padding.
* ``"keep"`` — yield the short batch as is (a new shape: the step recompiles).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from spmdkit.errors import SpmdError

__all__ = ["DataError", "ShardedLoader", "to_global", "is_array_field"]

LastBatch = Literal["drop", "pad", "keep"]


class DataError(SpmdError, ValueError):
    """A batch, source or loader option is malformed.

    Broken example: ``ShardedLoader({"x": np.ones((8, 2)), "y": np.ones(7)}, s, batch_size=4)``
    (fields with different numbers of examples).
    """


def is_array_field(value: Any) -> bool:
    """Whether a batch field becomes a global array (numeric/bool numpy or jax arrays).

    Example::

        >>> is_array_field(np.ones(3)), is_array_field(["a", "b"])
        (True, False)
    """
    if isinstance(value, jax.Array):
        return True
    return isinstance(value, np.ndarray) and value.dtype.kind in "biufc"


def _sharding_for(sharding: Any, name: str) -> Any:
    if isinstance(sharding, Mapping):
        if name not in sharding:
            raise DataError(
                op="data.to_global",
                must="the batch sharding names every array field",
                given=f"no sharding for field {name!r}; shardings for {sorted(sharding)}",
                fix=f"add {name!r} to the batch shardings (or pass one sharding for all)",
            )
        return sharding[name]
    return sharding


def _fit_spec(sharding: Any, ndim: int) -> Any:
    """One sharding for all fields: drop trailing spec entries a low-rank field lacks."""
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > ndim:
        extra = [e for e in sharding.spec[ndim:] if e is not None]
        if extra:
            raise DataError(
                op="data.to_global",
                must="a field's rank covers every sharded dim of its batch spec",
                given=f"rank {ndim} field, spec {sharding.spec}",
                fix="give that field its own sharding in a dict of shardings",
            )
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:ndim]))
    return sharding


def to_global(batch: Mapping[str, Any], sharding: Any) -> dict[str, Any]:
    """Turn one process's host batch into global arrays sharded by ``sharding``.

    Args:
      batch: field name → local data. Numeric/bool arrays become global arrays;
        anything else (strings, lists, ids, scalars) passes through untouched.
      sharding: one ``NamedSharding`` for every array field (trailing unsharded
        entries are dropped for lower-rank fields), or a dict field → sharding.

    Returns:
      The batch with array fields replaced by global ``jax.Array`` s.

    Example::

        >>> s = NamedSharding(mesh, P("data"))
        >>> g = to_global({"x": np.ones((8, 4)), "ids": ["a"] * 8}, s)
        >>> g["x"].sharding.spec, g["ids"][0]
        (PartitionSpec('data',), 'a')
    """
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if not is_array_field(value):
            out[name] = value
            continue
        s = _fit_spec(_sharding_for(sharding, name), np.ndim(value))
        try:
            out[name] = jax.make_array_from_process_local_data(s, np.asarray(value))
        except (ValueError, TypeError) as e:
            raise DataError(
                op="data.to_global",
                must="each local field's shape divides evenly over the batch sharding",
                given=f"{name}: local shape {np.shape(value)}, sharding {s}: {e}",
                fix="choose a batch size divisible by the devices sharding the batch dim",
            ) from e
    return out


class ShardedLoader:
    """A re-iterable, resumable loader of global sharded batches.

    Args:
      source: either a dict field → per-process example array (all with the same
        number of examples; non-array fields are lists/sequences of that length),
        or a zero-argument callable returning a fresh iterator of host batches
        (dicts) — the generic form; its position is the number of batches consumed.
      sharding: the batch sharding (one ``NamedSharding`` or a dict per field),
        e.g. ``plan.batch_sharding(abstract_batch)``.
      batch_size: examples per batch *per process* (required for dict sources; for a
        generic source the default is the size of its first batch).
      last_batch: ``"drop"``, ``"pad"`` or ``"keep"`` (see the module docstring).
      shuffle_seed: with a dict source, shuffle examples per epoch with
        ``np.random.default_rng((seed, epoch))`` (``None``: keep the order).
      microbatches: split every batch into this many micro-batches stacked on a new
        leading dim (unsharded) for gradient accumulation; the batch size must divide.

    Iterating yields the rest of the current epoch from the current position, then
    moves to the next epoch; iterate again for the next epoch.

    Example::

        >>> loader = ShardedLoader({"x": xs, "y": ys}, NamedSharding(mesh, P("data")),
        ...                        batch_size=32)
        >>> for batch in loader: ...
        >>> pos = loader.state(); loader.set_state(pos)
    """

    def __init__(
        self,
        source: Mapping[str, Any] | Callable[[], Iterable[Mapping[str, Any]]],
        sharding: Any,
        *,
        batch_size: int | None = None,
        last_batch: LastBatch = "drop",
        shuffle_seed: int | None = None,
        microbatches: int = 1,
    ) -> None:
        op = "data.ShardedLoader"
        if last_batch not in ("drop", "pad", "keep"):
            raise DataError(
                op=op,
                must="last_batch is 'drop', 'pad' or 'keep'",
                given=repr(last_batch),
                fix="pass last_batch='drop' (default) or 'pad' (adds a mask field)",
            )
        if not isinstance(microbatches, int) or microbatches < 1:
            raise DataError(
                op=op,
                must="microbatches is a positive int",
                given=repr(microbatches),
                fix="pass microbatches=1 or the gradient-accumulation step count",
            )
        self.sharding = sharding
        self.last_batch = last_batch
        self.shuffle_seed = shuffle_seed
        self.microbatches = microbatches
        self._epoch = 0
        self._batch = 0
        if isinstance(source, Mapping):
            if not isinstance(batch_size, int) or batch_size < 1:
                raise DataError(
                    op=op,
                    must="a dict source comes with a positive int batch_size (per process)",
                    given=repr(batch_size),
                    fix="pass batch_size=<examples per batch per process>",
                )
            lengths = {k: len(v) for k, v in source.items()}
            if len(set(lengths.values())) != 1:
                raise DataError(
                    op=op,
                    must="every field of a dict source has the same number of examples",
                    given=str(lengths),
                    fix="trim the fields to one length",
                )
            self._arrays: Mapping[str, Any] | None = source
            self._n = next(iter(lengths.values()))
            self._factory = None
        elif callable(source):
            self._arrays = None
            self._n = 0
            self._factory = source
        else:
            raise DataError(
                op=op,
                must="source is a dict of example arrays or a callable returning an iterator",
                given=type(source).__name__,
                fix="wrap an iterable as `lambda: iter(batches)`",
            )
        self.batch_size = batch_size
        self._full: int | None = batch_size

    # position
    def state(self) -> dict[str, int]:
        """The current position as JSON: ``{"epoch": e, "batch": i}``."""
        return {"epoch": self._epoch, "batch": self._batch}

    def set_state(self, state: Mapping[str, int] | None) -> None:
        """Move to a position returned by :meth:`state` (``None``: the start)."""
        state = state or {"epoch": 0, "batch": 0}
        try:
            self._epoch, self._batch = int(state["epoch"]), int(state["batch"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(
                op="data.ShardedLoader.set_state",
                must="the state is {'epoch': int, 'batch': int}",
                given=repr(state),
                fix="pass what state() returned (it is saved in checkpoint metadata)",
            ) from e

    def batches_per_epoch(self) -> int | None:
        """Batches in one epoch (dict sources), or ``None`` for a generic source."""
        if self._arrays is None:
            return None
        full, rest = divmod(self._n, self.batch_size)
        return full + (1 if rest and self.last_batch != "drop" else 0)

    # iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:
        host = self._host_batches()
        for local in host:
            batch = self._finish(local)
            if batch is None:  # a short trailing batch of a generic source, dropped
                break
            self._batch += 1
            yield batch
        self._epoch += 1
        self._batch = 0

    def _host_batches(self) -> Iterator[Mapping[str, Any]]:
        if self._arrays is None:
            it = iter(self._factory())
            for _ in range(self._batch):  # a generic source can only be replayed
                next(it, None)
            yield from it
            return
        order = np.arange(self._n)
        if self.shuffle_seed is not None:
            order = np.random.default_rng((self.shuffle_seed, self._epoch)).permutation(self._n)
        total = self.batches_per_epoch()
        for i in range(self._batch, total):
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
            yield {k: _take(v, idx) for k, v in self._arrays.items()}

    def _finish(self, local: Mapping[str, Any]) -> dict[str, Any] | None:
        sizes = {len(v) for v in local.values() if is_array_field(v) and np.ndim(v) > 0}
        n = max(sizes) if sizes else 0
        if self._full is None:  # a generic source: its first batch sets the size
            self._full = self.batch_size or n
        want = self._full
        if self.last_batch == "pad":
            local = _pad(local, n, want)
        elif n < want and self.last_batch == "drop":
            return None
        if self.microbatches > 1:
            local = self._split(local)
        return to_global(local, self._micro_sharding())

    def _split(self, local: Mapping[str, Any]) -> dict[str, Any]:
        k = self.microbatches
        out = {}
        for name, v in local.items():
            if not is_array_field(v):
                out[name] = v
                continue
            arr = np.asarray(v)
            if arr.shape[0] % k:
                raise DataError(
                    op="data.ShardedLoader",
                    must="the per-process batch size divides into microbatches",
                    given=f"{name}: {arr.shape[0]} examples, microbatches={k}",
                    fix="choose batch_size a multiple of microbatches",
                )
            # micro-batch i takes rows i, i+k, i+2k, ...
            out[name] = np.swapaxes(arr.reshape(arr.shape[0] // k, k, *arr.shape[1:]), 0, 1)
        return out

    def _micro_sharding(self) -> Any:
        if self.microbatches == 1:
            return self.sharding

        def lift(s: Any) -> Any:
            if isinstance(s, NamedSharding):
                return NamedSharding(s.mesh, PartitionSpec(None, *s.spec))
            raise DataError(
                op="data.ShardedLoader",
                must="micro-batching needs NamedSharding batch shardings",
                given=type(s).__name__,
                fix="pass NamedSharding(mesh, P(...)) shardings",
            )

        if isinstance(self.sharding, Mapping):
            return {k: lift(v) for k, v in self.sharding.items()}
        return lift(self.sharding)


def _take(v: Any, idx: np.ndarray) -> Any:
    if isinstance(v, np.ndarray | jax.Array):
        return np.asarray(v)[idx]
    return [v[int(i)] for i in idx]


def _pad(local: Mapping[str, Any], n: int, want: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, v in local.items():
        if is_array_field(v) and np.ndim(v) > 0 and n < want:
            arr = np.asarray(v)
            pad = np.zeros((want - n, *arr.shape[1:]), arr.dtype)
            out[name] = np.concatenate([arr, pad])
        else:
            out[name] = v
    out["mask"] = np.arange(want) < n
    return out
