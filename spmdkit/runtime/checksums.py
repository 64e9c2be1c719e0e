"""Checksums of checkpointed arrays: one 64-bit sum per array, the same whether
computed from the device shards before a save or from the host copy after a
restore, so a restore can tell a corrupted or mismatched file from a good one.

:func:`checksums` sums each array's words with a multiplicative hash per
position; on CPU the host sums shards in threads (blocks sized to stay in cache),
elsewhere a jitted reduction runs on the devices. Both give the same numbers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.errors import CheckpointError
from spmdkit.state import cached

__all__ = ["EVALUATORS", "checksummable", "checksums"]


_CHECKSUM_MUL = 2654435761  # Knuth's multiplicative hash constant


def _checksum_leaf(x: jax.Array) -> jax.Array:
    """The checksum, evaluated on the devices (used off CPU, and as the reference the
    host evaluator is tested against).

    A position-weighted sum of the array's bits, mod 2**32: sum over elements of
    ``word[i] * (i * 2654435761 + 1)``, ``i`` the global row-major index. It is
    independent of the sharding and of the reduction order (integer addition) and
    sensitive to any changed or moved element. The weights come from per-dim iotas
    so XLA fuses them into the reduction instead of materialising an index array."""
    words = _device_words(x)
    index = jnp.zeros((), jnp.uint32)
    stride = 1
    for d in reversed(range(words.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, d)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= words.shape[d]
    weights = index * jnp.uint32(_CHECKSUM_MUL) + jnp.uint32(1)
    return jnp.sum(words * weights, dtype=jnp.uint32)


def _device_words(x: jax.Array) -> jax.Array:
    # one uint32 word per element of <= 32 bits; 64-bit elements become two words
    # (a trailing dim of 2, low word first), exactly as the host view below
    bits = x.dtype.itemsize * 8
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if bits <= 32:
        unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
        return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _host_words(a: np.ndarray) -> np.ndarray:
    """The host twin of :func:`_device_words` on one shard (C-contiguous)."""
    a = np.ascontiguousarray(a)
    size = a.dtype.itemsize
    if a.dtype == np.bool_ or size < 4:
        unsigned = {1: np.uint8, 2: np.uint16}[size]
        return a.view(unsigned).astype(np.uint32)
    if size == 4:
        return a.view(np.uint32)
    return a.reshape((*a.shape, 1)).view(np.uint32)  # (..., 2), low word first


def checksummable(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if not isinstance(x, jax.Array) or dtype is None:
        return False
    return dtype == jnp.bool_ or (
        jnp.issubdtype(dtype, jnp.number) and not jnp.issubdtype(dtype, jnp.complexfloating)
    )


# one compiled checksum per (shape, dtype, sharding), whatever the leaf's name
_checksum_jit = jax.jit(_checksum_leaf)

_U64 = np.uint64


@dataclasses.dataclass
class _ShardSum:
    """The checksum's contribution of one shard, computed on the host from its sums
    over the last dim (``rows``) and over the other dims (``cols``).

    With ``i = base(row) + col`` the global row-major index of a word, the shard's
    part of ``sum(word * (i * M + 1))`` is ``M * (rows . base + cols . col) +
    sum(rows)`` (mod 2**32): each word is added twice and multiplied never. Both
    sums are taken block by block (a block stays in cache for the second), and row
    ranges run on threads: numpy releases the GIL inside reductions."""

    words: np.ndarray  # (rows, cols) uint32 view of the shard
    lead: tuple[int, ...]  # the shard's shape without its last dim
    start: tuple[int, ...]  # the shard's offset in the global (word) array
    shape: tuple[int, ...]  # the global (word) array's shape

    def __post_init__(self) -> None:
        self.rows = np.empty(self.words.shape[0], np.uint32)
        self.cols: list[np.ndarray] = []

    @classmethod
    def of(cls, shard: Any, global_shape: tuple[int, ...]) -> _ShardSum:
        data = np.asarray(shard.data)
        words = _host_words(data)
        start = tuple(0 if s.start is None else s.start for s in shard.index)
        shape = tuple(global_shape)
        if words.ndim > data.ndim:  # 64-bit elements: the trailing pair of words
            start, shape = (*start, 0), (*shape, 2)
        if not shape:  # a scalar is one word at index 0
            words, start, shape = words.reshape(1), (0,), (1,)
        return cls(words.reshape(-1, words.shape[-1]), words.shape[:-1], start, shape)

    def ranges(self) -> list[tuple[int, int]]:
        """Row ranges of about ``_JOB_BYTES`` each: the units of threaded work."""
        n, row_bytes = self.words.shape[0], max(1, self.words.shape[1] * 4)
        step = max(1, _JOB_BYTES // row_bytes)
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def reduce(self, lo: int, hi: int) -> None:
        """Row sums of rows ``lo:hi`` into ``rows``, their column sums onto ``cols``."""
        cols = np.zeros(self.words.shape[1], np.uint32)
        step = max(1, _BLOCK_BYTES // max(1, self.words.shape[1] * 4))
        for i in range(lo, hi, step):
            block = self.words[i : min(i + step, hi)]
            np.sum(block, axis=1, dtype=np.uint32, out=self.rows[i : i + len(block)])
            cols += block.sum(axis=0, dtype=np.uint32)
        self.cols.append(cols)

    def value(self) -> int:
        stride, base = self.shape[-1], np.zeros(self.lead, _U64)
        for d in range(len(self.lead) - 1, -1, -1):
            n = self.lead[d]
            index = (np.arange(n, dtype=_U64) + _U64(self.start[d])) * _U64(stride % 2**64)
            base = base + index.reshape((n,) + (1,) * (len(self.lead) - 1 - d))
            stride *= self.shape[d]
        cols = np.sum(self.cols, axis=0, dtype=_U64)
        col = np.arange(self.words.shape[1], dtype=_U64) + _U64(self.start[-1])
        with np.errstate(over="ignore"):
            weighted = int((self.rows.astype(_U64) * base.reshape(-1)).sum(dtype=_U64))
            weighted += int((cols * col).sum(dtype=_U64))
        return (weighted * _CHECKSUM_MUL + int(self.rows.sum(dtype=_U64))) % 2**32


_BLOCK_BYTES = 1 << 20  # a block's two sums share one read from memory (L2-sized)
_JOB_BYTES = 8 << 20  # rows per thread job; smaller shards run inline


@cached(
    maxsize=None, why="the checksum thread pool, made on first use (cleared: a new one is made)."
)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 1)), "spmdkit-checksum")


def _host_checksums(flat: dict[str, jax.Array]) -> dict[str, int]:
    """Checksums of CPU-resident arrays from their shards in host memory (zero-copy
    views), one replica of each shard, summed over processes."""
    parts = {
        k: [
            _ShardSum.of(sh, v.shape)
            for sh in v.addressable_shards
            if sh.replica_id == 0 and sh.data.size  # an empty shard adds nothing
        ]
        for k, v in flat.items()
    }
    jobs = [(p, lo, hi) for ps in parts.values() for p in ps for lo, hi in p.ranges()]
    threaded = [j for j in jobs if j[0].words.nbytes >= _JOB_BYTES]
    for p, lo, hi in jobs:
        if p.words.nbytes < _JOB_BYTES:
            p.reduce(lo, hi)
    if threaded:
        list(_pool().map(lambda job: job[0].reduce(job[1], job[2]), threaded))
    sums = np.array([sum(p.value() for p in ps) % 2**32 for ps in parts.values()], _U64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        sums = np.asarray(multihost_utils.process_allgather(sums)).sum(axis=0, dtype=_U64)
    return {k: int(c) % 2**32 for k, c in zip(parts, sums, strict=True)}


#: Where :func:`checksums` evaluates: by platform, in host memory, or on the devices.
EVALUATORS = ("auto", "host", "device")


def checksums(flat: Mapping[str, Any], *, evaluator: str = "auto") -> dict[str, int]:
    """One checksum per checksummable leaf (numbers and bools) of a flat dict of arrays.

    What :meth:`Manager.save` records and a verifying restore compares: a
    position-weighted sum of the array's bits mod 2**32, the same number for
    every sharding, mesh and platform, and sensitive to any changed or moved
    element.

    Args:
      flat: name → ``jax.Array``; other leaves (keys, complex, non-arrays) are skipped.
      evaluator: ``"auto"``: from the shards in host memory for arrays on CPU (no
        XLA program, about 7 GB/s on two cores), one device reduction per leaf
        elsewhere; ``"host"`` or ``"device"``: always that way (they agree).

    Raises:
      CheckpointError: an unknown ``evaluator``.

    Example::

        >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
        >>> checksums({"x": x}) == checksums({"x": x}, evaluator="device")
        True
    """
    if evaluator not in EVALUATORS:
        raise CheckpointError(
            op="checkpoint.checksums",
            must=f"evaluator is one of {EVALUATORS}",
            given=repr(evaluator),
            fix="pass evaluator='auto'",
        )
    leaves = {k: v for k, v in flat.items() if checksummable(v)}
    if evaluator == "auto":
        host = {k: v for k, v in leaves.items() if all(d.platform == "cpu" for d in v.devices())}
    else:
        host = leaves if evaluator == "host" else {}
    out = _host_checksums(host) if host else {}
    # One device checksum at a time: each is a program with a cross-device reduction,
    # and several such programs in flight at once can deadlock XLA:CPU's in-process
    # collectives (seen restoring onto another mesh: 7 of 8 devices joined an
    # all-reduce). Blocking per leaf also bounds the transient memory to one leaf.
    for k, v in leaves.items():
        if k not in out:
            out[k] = int(np.asarray(_checksum_jit(v)))
    return {k: out[k] for k in leaves}
