"""Context parallelism in the step: the load-balanced sequence order and its trace context.

A causal mask gives query ``i`` the keys ``0..i``, so with the sequence split into
``n`` contiguous shards the last shard does most of the attention work (shard ``i``
of ``n`` attends to ``i + 1`` shards of keys). The balanced order splits the
sequence into ``2n`` chunks of ``C = S / 2n`` tokens and puts chunks ``i`` and
``2n - 1 - i`` on shard ``i``: in the permuted array, slots ``2i`` and ``2i + 1``
hold natural chunks ``i`` and ``2n - 1 - i``. Every shard then does the same masked
work (``2n + 1`` chunk-pairs' worth, the diagonal halves included).

:class:`BalancedOrder` is the permutation. A context-parallel step applies it once,
to the batch (tokens and targets alike, so a token-mean loss is unchanged), and
traces its loss under :func:`context_parallel`: the reference models' RoPE reads
:func:`current_order` for the tokens' positions, and the causal ``attention`` op
(:func:`spmdkit.ops.attention`) masks by the natural positions of its rows.

Example::

    >>> BalancedOrder(2).permutation(8).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from spmdkit.errors import SpmdError
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.state import register_context
from spmdkit.util import path_str

__all__ = [
    "BalancedOrder",
    "CONTEXT_ATTENTION",
    "ContextPlan",
    "ContextShard",
    "ContextSplit",
    "PIPELINED_STRATEGIES",
    "SequenceOrderError",
    "balance_batch",
    "context_parallel",
    "context_parallel_loss",
    "context_shard",
    "current_attention",
    "current_order",
    "current_shard",
    "note_exchange",
    "plan_context",
]


class SequenceOrderError(SpmdError, ValueError):
    """A sequence does not split into the balanced order's chunks.

    Broken example: ``BalancedOrder(4).permutation(100)`` (100 tokens in 8 chunks).
    """


@dataclasses.dataclass(frozen=True)
class BalancedOrder:
    """The load-balanced order of a sequence split over ``shards`` devices
    (module docstring): ``2 · shards`` chunks, shard ``i`` holding natural chunks
    ``i`` and ``2 · shards - 1 - i``.

    Attributes:
      shards: the number of devices the sequence is split over (>= 1; 1 is the
        natural order).
    """

    shards: int

    def __post_init__(self) -> None:
        if not isinstance(self.shards, int) or isinstance(self.shards, bool) or self.shards < 1:
            raise SequenceOrderError(
                op="BalancedOrder",
                must="shards be a positive int",
                given=repr(self.shards),
                fix="pass the size of the mesh axes the sequence is split over",
            )

    @property
    def chunks(self) -> int:
        """The number of chunks, ``2 · shards``."""
        return 2 * self.shards

    def chunk_size(self, seq_len: int, *, op: str = "BalancedOrder") -> int:
        """Tokens per chunk, ``seq_len / (2 · shards)``.

        Raises:
          SequenceOrderError: ``2 · shards`` does not divide ``seq_len``.
        """
        if seq_len % self.chunks:
            raise SequenceOrderError(
                op=op,
                must=f"the sequence length divide into 2 · {self.shards} = {self.chunks} chunks",
                given=f"sequence length {seq_len}",
                fix=f"use a sequence length that is a multiple of {self.chunks}, or fewer "
                "context shards",
            )
        return seq_len // self.chunks

    def natural_chunk(self, slot: Any) -> Any:
        """The natural chunk at balanced chunk ``slot`` (an int or a traced int):
        slot ``2i`` holds chunk ``i``, slot ``2i + 1`` chunk ``2n - 1 - i``."""
        half = slot // 2
        return (
            jnp.where(slot % 2 == 0, half, self.chunks - 1 - half)
            if _traced(slot)
            else (half if slot % 2 == 0 else self.chunks - 1 - half)
        )

    def permutation(self, seq_len: int) -> np.ndarray:
        """``perm[p]``: the natural position of the token at balanced position ``p``."""
        c = self.chunk_size(seq_len)
        slots = [self.natural_chunk(s) for s in range(self.chunks)]
        return np.concatenate([np.arange(k * c, (k + 1) * c) for k in slots]).astype(np.int32)

    def positions(self, seq_len: int) -> jax.Array:
        """The natural positions of the balanced order's tokens (RoPE's positions),
        ``int32 [seq_len]`` (computed from an iota, no constant array)."""
        return self.position_of(jnp.arange(seq_len, dtype=jnp.int32), seq_len)

    def position_of(self, index: Any, seq_len: int) -> Any:
        """The natural position of the token at balanced ``index`` (traced ints)."""
        c = self.chunk_size(seq_len)
        return self.natural_chunk(index // c) * c + index % c

    def apply(self, x: Any, axis: int = 1) -> Any:
        """``x`` with its ``axis`` put in the balanced order (a numpy array stays
        numpy; a jax array is cut into its chunks and concatenated in the new order:
        static slices, no gather)."""
        n = x.shape[axis]
        if isinstance(x, np.ndarray):
            return np.take(x, self.permutation(n), axis)
        return _reorder(
            x, axis, self.chunk_size(n), [self.natural_chunk(s) for s in range(self.chunks)]
        )

    def restore(self, x: Any, axis: int = 1) -> Any:
        """The inverse of :meth:`apply`: ``axis`` back in natural order."""
        n = x.shape[axis]
        if isinstance(x, np.ndarray):
            return np.take(x, np.argsort(self.permutation(n)), axis)
        slot = {self.natural_chunk(s): s for s in range(self.chunks)}
        return _reorder(x, axis, self.chunk_size(n), [slot[c] for c in range(self.chunks)])


def _reorder(x: jax.Array, axis: int, chunk: int, take: list[int]) -> jax.Array:
    """The chunks of ``x`` along ``axis`` in the order ``take`` lists them."""
    parts = [jax.lax.slice_in_dim(x, i * chunk, (i + 1) * chunk, axis=axis) for i in take]
    return jnp.concatenate(parts, axis=axis)


def _traced(x: Any) -> bool:
    return not isinstance(x, int | np.integer)


_CONTEXT: contextvars.ContextVar[tuple[BalancedOrder | None, str | None]] = register_context(
    contextvars.ContextVar("spmdkit_sequence_context", default=(None, None)),
    module=__name__,
    name="_CONTEXT",
    set_by="`context_parallel()`",
    read_by="`current_order()`, `current_attention()` (RoPE, the attention op)",
    why="the sequence order and attention strategy a context-parallel loss is traced with.",
)


@contextlib.contextmanager
def context_parallel(
    order: BalancedOrder | int | None, *, attention: str | None = None
) -> Iterator[BalancedOrder | None]:
    """Trace a loss whose batch is in ``order`` (a :class:`BalancedOrder`, its shard
    count, or ``None``/1 for the natural order) and whose attention ops run
    ``attention`` (``"ring"``, ``"gather_kv"``; ``None``: as planned): inside,
    :func:`current_order` and :func:`current_attention` return them.

    Example::

        >>> with context_parallel(4, attention="ring"):
        ...     current_order(), current_attention()
        (BalancedOrder(shards=4), 'ring')
    """
    if isinstance(order, int) and not isinstance(order, bool):
        order = BalancedOrder(order)
    if order is not None and order.shards == 1:
        order = None
    token = _CONTEXT.set((order, attention))
    try:
        yield order
    finally:
        _CONTEXT.reset(token)


def current_order() -> BalancedOrder | ContextShard | None:
    """The sequence order the loss being traced runs in (:func:`context_parallel`);
    ``None``: natural. Inside :func:`context_shard` (one device's tokens of the
    sequence), the :class:`ContextShard`, whose ``positions`` are that device's."""
    shard = _SHARD.get()
    return shard if shard is not None else _CONTEXT.get()[0]


def current_attention() -> str | None:
    """The attention strategy a context-parallel step pins (:func:`context_parallel`);
    ``None``: the planner's choice per op."""
    return _CONTEXT.get()[1]


@dataclasses.dataclass(frozen=True)
class ContextShard:
    """One device's tokens of sequences split over the manual mesh ``axes`` (of
    ``sizes`` devices each), in the balanced order when ``balanced``, else
    contiguous: what a pipelined context-parallel stage traces its layers on
    (:func:`context_shard`). The shard's index is ``jax.lax.axis_index`` over
    ``axes``, so its methods trace inside ``shard_map`` (or under
    ``jax.make_jaxpr(..., axis_env=...)``).

    Attributes:
      axes: the context axes (manual where the layers run), major first.
      sizes: their sizes.
      balanced: the sequence is in the :class:`BalancedOrder` of ``shards``.
      attention: the strategy attention runs (``"ring"`` or ``"gather_kv"``).
    """

    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    balanced: bool = True
    attention: str = "ring"

    @property
    def shards(self) -> int:
        """The devices one sequence is split over."""
        return math.prod(self.sizes)

    def index(self) -> Any:
        """This device's shard index (traced), major axis first."""
        idx: Any = 0
        for a, n in zip(self.axes, self.sizes, strict=True):
            idx = idx * n + jax.lax.axis_index(a)
        return idx

    def positions(self, seq_len: int) -> jax.Array:
        """The natural positions of this device's ``seq_len`` tokens, ``int32 [seq_len]``."""
        index = self.index() * seq_len + jnp.arange(seq_len, dtype=jnp.int32)
        if not self.balanced:
            return index
        return BalancedOrder(self.shards).position_of(index, seq_len * self.shards)


#: The name of the call a pipelined stage's attention runs its per-device
#: computation in (:func:`spmdkit.ops.attention` under :func:`context_shard`): the
#: one op that may mix a device's tokens with others' (its K/V gathered over the
#: context axes), as :mod:`spmdkit.pipeline.context_parallel` checks.
CONTEXT_ATTENTION = "spmdkit_context_attention"

#: The attention strategies a pipelined stage runs under context parallelism:
#: K/V all-gathered. The ring's collective-permutes would run inside the
#: schedule's per-device branches (a forward on one stage while the next runs a
#: backward), and XLA:CPU rendezvouses a collective-permute over every device of
#: the program, so the ring's blocks meet the wrong peers (or wait forever); the
#: pipeline executor refuses it and the planner prices only these.
PIPELINED_STRATEGIES = ("gather_kv",)

_SHARD: contextvars.ContextVar[ContextShard | None] = register_context(
    contextvars.ContextVar("spmdkit_context_shard", default=None),
    module=__name__,
    name="_SHARD",
    set_by="`context_shard()`",
    read_by="`current_order()`, `current_shard()` (the attention op, RoPE)",
    why="the one device's tokens layers are traced on.",
)


_EXCHANGES: contextvars.ContextVar[list | None] = register_context(
    contextvars.ContextVar("spmdkit_context_exchanges", default=None),
    module=__name__,
    name="_EXCHANGES",
    set_by="`context_shard()`",
    read_by="`note_exchange()` (the attention op), which appends",
    why="the collectives the attention ops traced on one device's tokens run.",
)


@contextlib.contextmanager
def context_shard(shard: ContextShard | None) -> Iterator[list[tuple[str, float]]]:
    """Trace layers on one device's tokens (``shard``; ``None``: no effect): inside,
    :func:`current_order` returns ``shard`` (RoPE reads its positions),
    :func:`current_shard` too, the attention op runs its ``shard.attention``
    strategy's per-device computation directly over ``shard.axes``
    (:func:`spmdkit.ops.attention`), and :func:`context_parallel_loss` passes the
    loss through (its batch is already the shard's tokens). Yields a list that
    the attention ops traced inside add their forward collectives to, ``(kind,
    payload bytes per device)`` (:func:`note_exchange`)."""
    seen: list[tuple[str, float]] = []
    tokens = (_SHARD.set(shard), _EXCHANGES.set(seen))
    try:
        yield seen
    finally:
        _EXCHANGES.reset(tokens[1])
        _SHARD.reset(tokens[0])


def note_exchange(collectives: Any) -> None:
    """Add collectives (``kind``, ``payload_bytes``) an op traced under
    :func:`context_shard` runs to its list."""
    seen = _EXCHANGES.get()
    if seen is not None:
        seen.extend((c.kind, float(c.payload_bytes)) for c in collectives)


def current_shard() -> ContextShard | None:
    """The :class:`ContextShard` layers are traced on (:func:`context_shard`), or ``None``."""
    return _SHARD.get()


class ContextSplit(Protocol):
    """A plan's context parallelism as the step reads it
    (:class:`spmdkit.planner.plans.ContextParallel` is one)."""

    @property
    def axes(self) -> tuple[str, ...]: ...
    @property
    def degree(self) -> int: ...
    @property
    def attention(self) -> str: ...
    @property
    def load_balanced(self) -> bool: ...


class ContextPlan(Protocol):
    """What :func:`context_parallel_loss` reads of a plan
    (:class:`spmdkit.planner.plans.Plan` is one): its context parallelism, the
    logical names of the batch's dims, the mesh axes of each logical dim and the
    mesh it constrains the balanced batch on."""

    @property
    def context(self) -> ContextSplit | None: ...
    @property
    def batch_axes(self) -> Mapping[str, tuple]: ...
    @property
    def activation(self) -> Mapping[str, tuple[str, ...]]: ...
    @property
    def sharding_mesh(self) -> MeshLike: ...


def plan_context(plan: ContextPlan | None) -> ContextSplit | None:
    """A plan's context parallelism (its ``context``: axes, degree, attention,
    load_balanced), or ``None`` for no plan or a plan without one (or one over a
    single device)."""
    ctx = None if plan is None else plan.context
    return ctx if ctx is not None and ctx.degree > 1 else None


def balance_batch(batch: Any, batch_axes: Mapping[str, tuple], order: BalancedOrder) -> Any:
    """``batch`` with every field whose dims ``batch_axes`` names ``seq`` (the plan's
    ``batch_axes``, keyed by field path) put in the
    balanced ``order`` along those dims. Fields without a ``seq`` dim pass.

    Example::

        >>> balance_batch({"tokens": np.arange(8)[None]}, {"tokens": ("batch", "seq")},
        ...               BalancedOrder(2))["tokens"].tolist()
        [[0, 1, 6, 7, 2, 3, 4, 5]]
    """

    def one(path: tuple, x: Any) -> Any:
        names = batch_axes.get(path_str(path))
        if names is None or len(names) != np.ndim(x):
            return x
        for dim, name in enumerate(names):
            if name == "seq":  # one gather of the (small) field, as XLA partitions it
                perm = order.permutation(np.shape(x)[dim])
                x = np.take(x, perm, dim) if isinstance(x, np.ndarray) else jnp.take(x, perm, dim)
        return x

    return jax.tree_util.tree_map_with_path(one, batch)


def context_parallel_loss(
    loss_fn: Callable[..., Any], plan: ContextPlan | None
) -> Callable[..., Any]:
    """``loss_fn(params, batch, *rest)`` as a plan with context parallelism
    (``plan.context``) runs it: the batch's ``seq`` dims put in the balanced order
    first (:func:`balance_batch`, once per step; a token-mean loss is unchanged)
    and constrained back to the plan's batch layout, and the loss traced under
    :func:`context_parallel` (RoPE's positions, the causal mask's order, the
    planned attention strategy). Without ``plan.context``: ``loss_fn`` itself.
    ``sk.value_and_grad`` applies it, so ``sk.jit``, ``sk.train_step`` and
    ``train()`` do (``plan=None``: a bare recipe's loss, ``loss_fn`` itself)."""
    cp = plan_context(plan)
    if plan is None or cp is None:
        return loss_fn
    order = BalancedOrder(cp.degree) if cp.load_balanced else None
    axes = dict(plan.batch_axes)

    def balanced_loss(params: Any, batch: Any, *rest: Any) -> Any:
        if current_shard() is not None:  # a pipelined stage's tokens (already placed)
            return loss_fn(params, batch, *rest)
        if order is not None:
            batch = balance_batch(batch, axes, order)
            # (a pipeline's micro-batch too: its embedding runs on the rows and
            # tokens its devices hold, and plan.verify propagates the step so)
            batch = _keep_layout(plan, batch, axes)
        with context_parallel(order, attention=cp.attention):
            return loss_fn(params, batch, *rest)

    return balanced_loss


def _keep_layout(plan: ContextPlan, batch: Any, axes: Mapping[str, tuple]) -> Any:
    """The permuted fields with a ``seq`` dim constrained back to the plan's batch
    layout (a gather along a sharded dim would otherwise leave them replicated,
    and the model's activations with them). A dim its axes do not divide (one
    micro-batch's rows) keeps the axes that do, as many as divide it."""
    mesh = plan.sharding_mesh
    sizes = axis_sizes(mesh)

    def one(path: tuple, x: Any) -> Any:
        names = axes.get(path_str(path))
        if names is None or len(names) != np.ndim(x) or "seq" not in names:
            return x
        dims, used = [], set()
        for name, n in zip(names, np.shape(x), strict=True):
            on = tuple(a for a in plan.activation.get(name, ()) if a not in used) if name else ()
            while on and n % math.prod(sizes[a] for a in on):
                on = on[:-1]
            used.update(on)
            dims.append(on or None)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*dims)))

    return jax.tree_util.tree_map_with_path(one, batch)
