"""Sharded data feeding: each process's host batch becomes global sharded arrays.

Every process reads its own slice of the data (its *local* batch, numpy on the
host). :func:`to_global` turns a local batch into global ``jax.Array`` s laid out
by the batch sharding (``jax.make_array_from_process_local_data``): the global
batch is the concatenation of the processes' local batches along the sharded
dims, and no process ever holds the global batch.

A batch is any tree of dicts, lists, tuples (named or not) and dataclass
instances. Its *array leaves* (numeric or bool numpy/jax arrays, at any depth)
become global arrays; every other leaf (strings, bytes, ``None``, python
objects, lists of those, numpy arrays of strings) is *non-tensor* and passes
through untouched. A non-tensor sequence as long as the batch (example ids) is
*example-aligned*: padded with ``None`` by ``last_batch="pad"`` (and split per
micro-batch by the step that accumulates: :func:`spmdkit.batch.microbatches`).

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

Variable lengths (``bucket_sizes=``, ``bucket_dims=``): a field whose examples
differ in size along some dims (token lists of different lengths, images of
different sizes) is given as a list of per-example arrays; each batch pads those
dims up to the smallest bucket size that fits the batch's longest example and
adds ``<field>_mask`` (``True`` on real positions). A run then compiles at most
one step per bucket instead of one per length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from spmdkit.batch import is_array_field, map_leaves, path_name
from spmdkit.errors import SpmdError

__all__ = ["DataError", "ShardedLoader", "to_global"]

LastBatch = Literal["drop", "pad", "keep"]


class DataError(SpmdError, ValueError):
    """A batch, source or loader option is malformed.

    Broken example: ``ShardedLoader({"x": np.ones((8, 2)), "y": np.ones(7)}, s, batch_size=4)``
    (fields with different numbers of examples).
    """


# -- to_global --------------------------------------------------------------------


def _sharding_for(sharding: Any, path: tuple) -> Any:
    """The sharding for the leaf at ``path``: dict shardings are followed down the path
    as far as they go; a sharding met on the way serves the whole subtree."""
    for depth, key in enumerate(path):
        if not isinstance(sharding, Mapping):
            return sharding
        if key not in sharding:
            raise DataError(
                op="data.to_global",
                must="the batch sharding names every array field",
                given=f"no sharding for field {path_name(path[: depth + 1])!r}; "
                f"shardings for {sorted(map(str, sharding))}",
                fix=f"add {key!r} to the batch shardings (or pass one sharding for all)",
            )
        sharding = sharding[key]
    if isinstance(sharding, Mapping):
        raise DataError(
            op="data.to_global",
            must="an array field's sharding is a sharding, not a dict",
            given=f"{path_name(path)}: a dict of shardings for keys {sorted(map(str, sharding))}",
            fix="give the array field one NamedSharding",
        )
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


def to_global(batch: Any, sharding: Any) -> Any:
    """Turn one process's host batch into global arrays sharded by ``sharding``.

    Args:
      batch: a tree (dicts, lists, tuples, dataclasses) of local data. Numeric/bool
        arrays at any depth become global arrays; anything else (strings, lists,
        ids, ``None``, objects) passes through untouched.
      sharding: one ``NamedSharding`` for every array field (trailing unsharded
        entries are dropped for lower-rank fields), or a dict field → sharding,
        nested as deep as the batch (a sharding met on the way serves its subtree).

    Returns:
      The batch with array leaves replaced by global ``jax.Array`` s.

    Raises:
      DataError: a field has no sharding, or its shape does not divide evenly.

    Example::

        >>> s = NamedSharding(mesh, P("data"))
        >>> g = to_global({"img": {"pix": np.ones((8, 4))}, "ids": ["a"] * 8}, s)
        >>> g["img"]["pix"].sharding.spec, g["ids"][0]
        (PartitionSpec('data',), 'a')
    """

    def place(path: tuple, value: Any) -> Any:
        if not is_array_field(value):
            return value
        s = _fit_spec(_sharding_for(sharding, path), np.ndim(value))
        try:
            return jax.make_array_from_process_local_data(s, np.asarray(value))
        except (ValueError, TypeError) as e:
            raise DataError(
                op="data.to_global",
                must="each local field's shape divides evenly over the batch sharding",
                given=f"{path_name(path)}: local shape {np.shape(value)}, sharding {s}: {e}",
                fix="choose a batch size divisible by the devices sharding the batch dim",
            ) from e

    return map_leaves(place, batch)


# -- the loader ---------------------------------------------------------------------


def _source_fields(source: Mapping[str, Any], path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """A dict source's per-example fields: nested dicts are walked, anything else is
    one field (an array, or a sequence with one item per example)."""
    for k, v in source.items():
        if isinstance(v, Mapping):
            yield from _source_fields(v, (*path, k))
        else:
            yield (*path, k), v


def _take_source(source: Mapping[str, Any], idx: np.ndarray) -> dict[str, Any]:
    return {
        k: _take_source(v, idx) if isinstance(v, Mapping) else _take(v, idx)
        for k, v in source.items()
    }


def _source_length(source: Mapping[str, Any], op: str) -> int:
    lengths: dict[str, Any] = {}
    for path, v in _source_fields(source):
        try:
            lengths[path_name(path)] = len(v)
        except TypeError:
            lengths[path_name(path)] = f"{type(v).__name__} (no length)"
    if not lengths or len(set(map(str, lengths.values()))) != 1:
        raise DataError(
            op=op,
            must="a dict source has fields, each with the same number of examples",
            given=str(lengths) if lengths else "no fields",
            fix="give every field one item per example (arrays, lists), trimmed to one length",
        )
    n = next(iter(lengths.values()))
    if not isinstance(n, int):
        raise DataError(
            op=op,
            must="every field of a dict source is a sequence of examples",
            given=str(lengths),
            fix="pass arrays or lists with one item per example",
        )
    return n


def _example_aligned(v: Any, n: int) -> bool:
    """A non-tensor leaf with one item per example (ids, texts)."""
    if n < 1:
        return False
    if isinstance(v, list | tuple) and not hasattr(v, "_fields"):
        return len(v) == n
    return isinstance(v, np.ndarray) and v.ndim > 0 and v.shape[0] == n


def _example_count(local: Any) -> int:
    sizes: list[int] = []

    def count(_: tuple, v: Any) -> Any:
        if is_array_field(v) and np.ndim(v) > 0:
            sizes.append(int(np.shape(v)[0]))
        return v

    map_leaves(count, local)
    return max(sizes, default=0)


def _check_options(last_batch: Any, op: str) -> None:
    if last_batch not in ("drop", "pad", "keep"):
        raise DataError(
            op=op,
            must="last_batch is 'drop', 'pad' or 'keep'",
            given=repr(last_batch),
            fix="pass last_batch='drop' (default) or 'pad' (adds a mask field)",
        )


def _check_buckets(sizes: Any, dims: Any, op: str) -> tuple[tuple[int, ...], dict[str, tuple]]:
    if sizes is None and dims is None:
        return (), {}
    ok_sizes = (
        isinstance(sizes, Sequence)
        and len(sizes) > 0
        and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)
    )
    if not ok_sizes:
        raise DataError(
            op=op,
            must="bucket_sizes is a non-empty sequence of positive ints",
            given=repr(sizes),
            fix="pass e.g. bucket_sizes=(32, 64, 128) with bucket_dims={'tokens': 0}",
        )
    if not isinstance(dims, Mapping) or not dims:
        raise DataError(
            op=op,
            must="bucket_sizes comes with bucket_dims: field → the example dims that vary",
            given=repr(dims),
            fix="pass e.g. bucket_dims={'tokens': 0} or {'image': (0, 1)}",
        )
    out: dict[str, tuple] = {}
    for name, d in dims.items():
        ds = (d,) if isinstance(d, int) else tuple(d) if isinstance(d, Sequence) else None
        if not ds or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ds):
            raise DataError(
                op=op,
                must="each bucket_dims entry is a dim index >= 0 or a tuple of them",
                given=f"{name!r}: {d!r}",
                fix="count dims within one example: 0 is the first dim after the batch dim",
            )
        out[name] = ds
    return tuple(sorted(set(sizes))), out


class ShardedLoader:
    """A re-iterable, resumable loader of global sharded batches.

    Args:
      source: either a dict field → per-process examples (arrays, or sequences such
        as lists of strings or of variable-size arrays, all with the same number of
        examples; nested dicts allowed), or a zero-argument callable returning a
        fresh iterator of host batches (trees of dicts, lists, tuples,
        dataclasses) — the generic form; its position is the number of batches
        consumed.
      sharding: the batch sharding (one ``NamedSharding`` or a dict per field),
        e.g. ``plan.batch_sharding(abstract_batch)``.
      batch_size: examples per batch *per process* (required for dict sources; for a
        generic source the default is the size of its first batch).
      last_batch: ``"drop"``, ``"pad"`` or ``"keep"`` (see the module docstring).
      shuffle_seed: with a dict source, shuffle examples per epoch with
        ``np.random.default_rng((seed, epoch))`` (``None``: keep the order).
      bucket_sizes: the sizes variable dims are padded up to (sorted; the smallest
        that fits each batch is used).
      bucket_dims: field → the dims of one example that vary (``0`` or ``(0, 1)``);
        such a field is a list of per-example arrays (or an array to pad further).
        Each batch gets ``<field>_mask`` (``True`` on real positions, shape
        ``(batch, *padded dims)``); a dict ``sharding`` without that key shards the
        mask like the field.

    Iterating yields the rest of the current epoch from the current position, then
    moves to the next epoch; iterate again for the next epoch.

    Example::

        >>> loader = ShardedLoader({"tokens": token_lists, "ids": names},
        ...                        NamedSharding(mesh, P("data")), batch_size=32,
        ...                        bucket_sizes=(64, 128, 256), bucket_dims={"tokens": 0})
        >>> for batch in loader: ...   # batch["tokens"]: (32, 64|128|256), + "tokens_mask"
        >>> pos = loader.state(); loader.set_state(pos)
    """

    def __init__(
        self,
        source: Mapping[str, Any] | Callable[[], Iterable[Any]],
        sharding: Any,
        *,
        batch_size: int | None = None,
        last_batch: LastBatch = "drop",
        shuffle_seed: int | None = None,
        bucket_sizes: Sequence[int] | None = None,
        bucket_dims: Mapping[str, int | Sequence[int]] | None = None,
    ) -> None:
        op = "data.ShardedLoader"
        _check_options(last_batch, op)
        self.bucket_sizes, self.bucket_dims = _check_buckets(bucket_sizes, bucket_dims, op)
        self.sharding = sharding
        self.last_batch = last_batch
        self.shuffle_seed = shuffle_seed
        self._epoch = 0
        self._batch = 0
        if isinstance(source, Mapping):
            if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
                raise DataError(
                    op=op,
                    must="a dict source comes with a positive int batch_size (per process)",
                    given=repr(batch_size),
                    fix="pass batch_size=<examples per batch per process>",
                )
            self._n = _source_length(source, op)
            self._arrays: Mapping[str, Any] | None = source
            self._factory = None
        elif callable(source):
            if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
                raise DataError(
                    op=op,
                    must="batch_size is a positive int or None",
                    given=repr(batch_size),
                    fix="pass batch_size=None to take the first batch's size",
                )
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
            epoch, batch = int(state["epoch"]), int(state["batch"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(
                op="data.ShardedLoader.set_state",
                must="the state is {'epoch': int, 'batch': int}",
                given=repr(state),
                fix="pass what state() returned (it is saved in checkpoint metadata)",
            ) from e
        if epoch < 0 or batch < 0:
            raise DataError(
                op="data.ShardedLoader.set_state",
                must="epoch and batch are >= 0",
                given=repr(state),
                fix="pass what state() returned (it is saved in checkpoint metadata)",
            )
        self._epoch, self._batch = epoch, batch

    def batches_per_epoch(self) -> int | None:
        """Batches in one epoch (dict sources), or ``None`` for a generic source."""
        if self._arrays is None:
            return None
        full, rest = divmod(self._n, self.batch_size)
        return full + (1 if rest and self.last_batch != "drop" else 0)

    # iteration
    def __iter__(self) -> Iterator[Any]:
        if self._arrays is not None and self._batch >= (self.batches_per_epoch() or 0):
            # a position saved after an epoch's last batch: that epoch is over
            self._epoch, self._batch = self._epoch + 1, 0
        host = self._host_batches()
        for local in host:
            batch = self._finish(local)
            if batch is None:  # a short trailing batch of a generic source, dropped
                break
            self._batch += 1
            yield batch
        self._epoch += 1
        self._batch = 0

    def _host_batches(self) -> Iterator[Any]:
        if self._arrays is None:
            try:
                it = iter(self._factory())
            except TypeError as e:
                raise DataError(
                    op="data.ShardedLoader",
                    must="a callable source returns an iterable of batches",
                    given=f"{self._factory!r} raised or returned a non-iterable: {e}",
                    fix="return a generator or list of batches from the callable",
                ) from e
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
            yield _take_source(self._arrays, idx)

    def _finish(self, local: Any) -> Any:
        if self.bucket_dims:
            local = _bucket(local, self.bucket_sizes, self.bucket_dims)
        n = _example_count(local)
        if self._full is None:  # a generic source: its first batch sets the size
            self._full = self.batch_size or n
        want = self._full
        if self.last_batch == "pad":
            local, n = _pad(local, n, want), max(n, want)
        elif n < want and self.last_batch == "drop":
            return None
        return to_global(local, self._batch_sharding(local))

    def _batch_sharding(self, local: Any) -> Any:
        """The sharding with entries for the masks this loader adds to a dict sharding."""
        if not isinstance(self.sharding, Mapping) or not isinstance(local, Mapping):
            return self.sharding
        extra = {f"{k}_mask": self.sharding[k] for k in self.bucket_dims if k in self.sharding}
        return {**extra, **self.sharding}


def _take(v: Any, idx: np.ndarray) -> Any:
    if isinstance(v, np.ndarray | jax.Array):
        return np.asarray(v)[idx]
    return [v[int(i)] for i in idx]


def _pad(local: Any, n: int, want: int) -> Any:
    if not isinstance(local, Mapping):
        raise DataError(
            op="data.ShardedLoader",
            must="last_batch='pad' batches are dicts (the loader adds a 'mask' field)",
            given=type(local).__name__,
            fix="yield dict batches, or use last_batch='drop' or 'keep'",
        )

    def pad(_: tuple, v: Any) -> Any:
        if n >= want:
            return v
        if is_array_field(v) and np.ndim(v) > 0 and np.shape(v)[0] == n:
            arr = np.asarray(v)
            return np.concatenate([arr, np.zeros((want - n, *arr.shape[1:]), arr.dtype)])
        if not is_array_field(v) and _example_aligned(v, n):
            if isinstance(v, np.ndarray):
                return np.concatenate([v, np.zeros((want - n, *v.shape[1:]), v.dtype)])
            return type(v)([*v, *([None] * (want - n))])  # padded examples carry no value
        return v

    out = dict(map_leaves(pad, local))
    out["mask"] = np.arange(want) < n
    return out


def _bucket_size(longest: int, sizes: tuple[int, ...], where: str) -> int:
    for s in sizes:
        if s >= longest:
            return s
    raise DataError(
        op="data.ShardedLoader",
        must="every example fits the largest bucket",
        given=f"{where}: size {longest}, buckets {list(sizes)}",
        fix=f"add a bucket >= {longest} to bucket_sizes, or truncate the examples",
    )


def _bucket(local: Any, sizes: tuple[int, ...], dims: dict[str, tuple]) -> Any:
    """Pad each bucketed field's variable dims up to a bucket size; add its mask."""
    if not isinstance(local, Mapping):
        raise DataError(
            op="data.ShardedLoader",
            must="bucketed batches are dicts",
            given=type(local).__name__,
            fix="yield dict batches naming the fields of bucket_dims",
        )
    out = dict(local)
    for name, ds in dims.items():
        if name not in local:
            raise DataError(
                op="data.ShardedLoader",
                must="every bucket_dims field is in the batch",
                given=f"{name!r} missing; fields {sorted(map(str, local))}",
                fix="name top-level batch fields in bucket_dims",
            )
        out[name], out[f"{name}_mask"] = _pad_examples(name, local[name], sizes, ds)
    return out


def _pad_examples(
    name: str, value: Any, sizes: tuple[int, ...], dims: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    must = f"a bucketed field holds numeric examples with more than {max(dims)} dims"
    try:
        examples = [np.asarray(e) for e in value]
    except TypeError:  # not a sequence of examples: None, a scalar
        raise DataError(
            op="data.ShardedLoader",
            must=must,
            given=f"{name!r}: {type(value).__name__} {value!r:.60}, not one array per example",
            fix="give one numeric array per example, or fix bucket_dims",
        ) from None
    bad = [e for e in examples if e.dtype.kind not in "biufc" or e.ndim <= max(dims)]
    if not examples or bad:
        raise DataError(
            op="data.ShardedLoader",
            must=must,
            given=f"{name!r}: {len(examples)} examples"
            + (f", e.g. {bad[0].dtype} of shape {bad[0].shape}" if bad else ""),
            fix="give one numeric array per example, or fix bucket_dims",
        )
    ndim = examples[0].ndim
    target = list(examples[0].shape)
    for d in range(ndim):
        got = {e.shape[d] if e.ndim == ndim else -1 for e in examples}
        if d in dims:
            target[d] = _bucket_size(max(got), sizes, f"{name!r} dim {d}")
        elif len(got) != 1:
            raise DataError(
                op="data.ShardedLoader",
                must="examples of a bucketed field agree on every dim not in bucket_dims",
                given=f"{name!r} dim {d}: sizes {sorted(got)}",
                fix=f"add {d} to bucket_dims[{name!r}] or fix the examples",
            )
    dtype = np.result_type(*examples)
    out = np.zeros((len(examples), *target), dtype)
    mask = np.zeros((len(examples), *(target[d] for d in dims)), bool)
    for i, e in enumerate(examples):
        out[(i, *(slice(0, s) for s in e.shape))] = e
        mask[(i, *(slice(0, e.shape[d]) for d in dims))] = True
    return out, mask
