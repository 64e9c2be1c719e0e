"""Which temporaries XLA's buffer assignment keeps out of its temp heap.

XLA's ``BufferAssigner`` (``xla/service/buffer_assignment.cc``) gives every
entry parameter and every output (live-out) value an allocation of its own, and
packs the remaining values (temporaries) into one heap, the temp allocation that
``memory_analysis().temp_size_in_bytes`` reports. Before a temporary goes to
that heap it is offered the allocations that already exist, and it takes the
first one that can hold it. So a temporary can live in an output's buffer
before the output is made, or in a donated argument's buffer between the
argument's last reader and the output that reuses it, at no cost beyond the
outputs' bytes. The rules (``MaybeAssignBuffer`` and its callers):

- values are taken largest first (live-out ones first among equal sizes, then
  in program order), and the allocations are made in that order, so every
  allocation that exists when a temporary is taken is at least as large as it;
- a temporary tries the allocations newest first (the smallest that fit);
- it fits where no value already placed there is live at any step it is: one
  value at a time, at the allocation's start, however small it is. An output
  is live from the step that makes it to the end of the program; a donated
  argument from the start to its last reader, and its output after;
- an operand and its user's result may share a step only where the user can
  write over the operand (an elementwise op on an operand of its size);
- an allocation of an argument that is not donated takes nothing else.

Measured on XLA:CPU (jax 0.10.2): a VGG's dense-kernel gradient's buffer first
holds the forward activations, one at a time, then the partial gradient; a
one-device SGD step's weight gradient is written over in place by its update.

Steps are the liveness model's (:mod:`spmdkit.propagation.memory`): three per
node (its collectives, the node itself, what is made as soon as the node's
results exist); a span is inclusive at both ends.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from spmdkit.propagation.graph import Graph

__all__ = [
    "Allocation",
    "NodeHolds",
    "ELEMENTWISE",
    "Span",
    "heap_temps",
    "hosted",
    "output_allocations",
    "peak",
    "own_parts",
    "peak_parts",
    "without",
    "zero_values",
]

#: Elementwise primitives: XLA fuses them, and may write their result over an operand.
ELEMENTWISE = frozenset(
    {
        "abs",
        "add",
        "add_any",
        "and",
        "clamp",
        "convert_element_type",
        "cos",
        "div",
        "eq",
        "erf",
        "exp",
        "exp2",
        "expm1",
        "ge",
        "gt",
        "integer_pow",
        "is_finite",
        "le",
        "log",
        "log1p",
        "logistic",
        "lt",
        "max",
        "min",
        "mul",
        "name",
        "ne",
        "neg",
        "not",
        "one_minus_square",
        "or",
        "pow",
        "rsqrt",
        "select_n",
        "sign",
        "sin",
        "sqrt",
        "square",
        "sub",
        "tanh",
        "xor",
        "stop_gradient",
        "copy",
    }
)


class Span(NamedTuple):
    """A buffer's bytes over an inclusive range of time steps.

    Attributes:
      start: the first step it is live.
      end: the last step it is live.
      nbytes: its size.
      at: where in the program the op that makes it is (for a backend copy,
        the op that reads it): XLA takes values of equal size in program order.
    """

    start: int
    end: int
    nbytes: int
    at: int = 0


def peak_parts(spans: Iterable[Span]) -> list[int]:
    """The sizes of the buffers live at the first step where :func:`peak` is
    reached, largest first (they sum to it): what a loop body or a region holds at
    its peak, each a buffer XLA may place on its own (in an output's buffer not
    yet written).

    Example::

        >>> peak_parts([Span(0, 3, 10), Span(2, 5, 5), Span(4, 6, 7)])
        [10, 5]
    """
    spans = [s for s in spans if s.nbytes and s.start <= s.end]
    _, at = _crest(spans)
    return sorted((s.nbytes for s in spans if s.start <= at <= s.end), reverse=True)


def _crest(spans: Iterable[Span]) -> tuple[int, int]:
    """The most bytes live at any one step, and the first step they are."""
    events: dict[int, int] = {}
    for s in spans:
        if s.nbytes and s.start <= s.end:
            events[s.start] = events.get(s.start, 0) + s.nbytes
            events[s.end + 1] = events.get(s.end + 1, 0) - s.nbytes
    live = top = at = 0
    for t in sorted(events):
        live += events[t]
        if live > top:
            top, at = live, t
    return top, at


def peak(spans: Iterable[Span]) -> int:
    """The most bytes live at any one step.

    Example::

        >>> peak([Span(0, 3, 10), Span(2, 5, 5), Span(4, 6, 7)])
        15
    """
    return _crest(spans)[0]


class Allocation(NamedTuple):
    """An output's (or a donated argument's) buffer, as :func:`hosted` sees it.

    Attributes:
      nbytes: its size.
      busy: the inclusive spans of steps its own values are live (an output:
        from the step that makes it to the end; a donated argument: also from
        the start to its last reader).
      inplace: temporaries that the op making the output reads last and may
        overwrite in place (an elementwise op on an operand of the output's
        size), by index: the step each ends at when it is.
    """

    nbytes: int
    busy: Sequence[tuple[int, int]]
    inplace: Mapping[int, int] = {}


class _Placed:
    """An allocation being filled: the disjoint spans placed in it, by start."""

    __slots__ = ("ends", "inplace", "nbytes", "starts")

    def __init__(self, a: Allocation):
        self.nbytes = a.nbytes
        self.inplace = a.inplace
        spans = sorted((s, e) for s, e in a.busy if s <= e)
        self.starts = [s for s, _ in spans]
        self.ends = [e for _, e in spans]

    def take(self, start: int, end: int) -> bool:
        """Place a value live over ``[start, end]`` if nothing placed is live then."""
        k = bisect_left(self.starts, start)
        if k < len(self.starts) and self.starts[k] <= end:
            return False
        if k > 0 and self.ends[k - 1] >= start:
            return False
        self.starts.insert(k, start)
        self.ends.insert(k, end)
        return True


def hosted(
    temps: Sequence[Span], allocations: Sequence[Allocation], stay: Collection[int] = ()
) -> set[int]:
    """Indices of ``temps`` that XLA places in the ``allocations`` (module
    docstring) rather than in its temp heap.

    Args:
      temps: the temporaries, each a :class:`Span`.
      allocations: the outputs' and donated arguments' buffers.
      stay: indices of temporaries kept in the heap (a loop's results: their
        buffers are its carries, live from the carries' initial values through
        the loop's body, longer than their spans here).

    Example::

        >>> # a 128-byte output made at step 10 holds a 64-byte temporary of
        >>> # steps 2-5 and then one of steps 6-8; a third, overlapping both, stays out
        >>> out = Allocation(128, [(10, 20)])
        >>> sorted(hosted([Span(2, 5, 64), Span(6, 8, 64), Span(4, 7, 32)], [out]))
        [0, 1]
    """
    if not allocations or not temps:
        return set()
    allocs = [_Placed(a) for a in sorted(allocations, key=lambda a: -a.nbytes)]
    sizes = [-a.nbytes for a in allocs]  # ascending, for bisect
    # each allocation's free window: after its first busy span when that starts
    # the program (a donated argument's), before its last (the output)
    lo = np.array([a.ends[0] + 1 if a.starts and a.starts[0] <= 0 else 0 for a in allocs])
    hi = np.array([a.starts[-1] - 1 if a.starts else np.iinfo(np.int64).max for a in allocs])
    inplace: dict[int, list[int]] = {}
    for k, a in enumerate(allocs):
        for i in a.inplace:
            inplace.setdefault(i, []).append(k)
    placed = set()
    for i in sorted(range(len(temps)), key=lambda i: (-temps[i].nbytes, temps[i].at)):
        s = temps[i]
        if not s.nbytes or s.start > s.end or i in stay:
            continue
        # the allocations made before this value whose window holds it, newest first
        n = _made_before(sizes, s.nbytes)
        fits = (lo[:n] <= s.start) & (hi[:n] >= s.end)
        for k in inplace.get(i, ()):
            if k < n:
                fits[k] = lo[k] <= s.start
        for k in np.flatnonzero(fits)[::-1]:
            a = allocs[k]
            # an operand overwritten in place ends as the output begins
            if a.take(s.start, min(s.end, a.inplace.get(i, s.end))):
                placed.add(i)
                break
    return placed


def _made_before(neg_sizes: Sequence[int], nbytes: int) -> int:
    """How many allocations (sorted largest first, ``neg_sizes`` their negated
    sizes) are at least ``nbytes``: those XLA has made when it takes a value of
    that size (outputs before temporaries among equal sizes)."""
    return bisect_left(neg_sizes, -nbytes + 1)


def output_allocations(
    graph: Graph,
    outputs: Sequence[tuple[int | None, int, int | None]],
    last: Mapping[int, int],
    fused: set[int],
    applied: Mapping[int, int],
    temps: Sequence[Span],
    temp_of: Mapping[int, int],
    reduced: Mapping[int, set[int]] | None = None,
) -> tuple[list[Allocation], dict[int, int], set[tuple[int, int]]]:
    """The outputs' buffers of a program for :func:`hosted`, in the liveness
    model's steps (three per node); {index in ``temps`` of a temporary that an
    output reads last: the step it ends, as the output is made}; and the
    reductions deferred to the end, as (node index, partial value id).

    An output made from a partial sum reduced on its way (a gradient all-reduced
    or reduce-scattered: ``reduced``) is made at the end: XLA's all-reduce
    combiner merges those independent reductions into one after the last
    gradient, so each partial sum lives until then (measured on XLA:CPU: a
    llama's ZeRO-1 step keeps every gradient's reduced copy in its temp heap at
    the end, the partial sums in the outputs' buffers). Not a contraction's
    partial sum reduce-scattered, which XLA:CPU does not combine: it is reduced,
    and freed, as soon as it exists (:func:`scattered_at_once`).

    Args:
      graph: the program.
      outputs: per output, the value that is it (None: made at the end, as a
        reduction's or a copy's result), its bytes, and the donated argument
        whose buffer it reuses (or None).
      last: value id → the node that reads it last.
      fused: values fused into their readers (never a buffer).
      applied: value id → the value whose buffer it is (a bitcast).
      temps: the temporaries.
      temp_of: value id → its index in ``temps``.
      reduced: node index → the partial values it reads through a reduction.
    """
    producer = {o: i for i, node in enumerate(graph.nodes) for o in node.outs}
    early = set()  # arguments moved about (a kernel reshaped and flipped)
    for node in graph.nodes:
        if node.prim in _REARRANGES and all(u not in producer or u in early for u in node.ins):
            early.update(node.outs)
    end = 3 * len(graph.nodes) + 1
    out, ends, deferred = [], {}, set()
    for value, size, arg in outputs:
        made, inplace, v = end - 1, {}, value
        while v is not None and v in applied:
            v = applied[v]
        if v is not None and v in producer:
            made, reads, elementwise, chain = _made(graph, v, producer, fused, applied, early)
            red = reduced or {}
            partial = {(i, u) for u, i in reads.items() if u in red.get(i, ())}
            # a gradient output moved and cast from a partial sum fused on the way (a
            # weight gradient's transpose, which the reduction's operand layout
            # absorbs, cast to its parameter's dtype): the values the chain reads are
            # the reduction's operands, held with the other gradients to the end
            moved = all(graph.nodes[i].prim in _MOVES_AND_CASTS for i in chain)
            folded = {(i, u) for i in chain for u in red.get(i, ()) if u in fused and moved}
            if partial or folded:  # reduced with the other gradients, at the end
                made = end - 1
                held = {u for _, u in partial} | (set(reads) if folded else set())
                ends.update((temp_of[u], end) for u in held if u in temp_of)
                deferred |= partial | folded
            else:
                read_last = [
                    temp_of[u] for u, i in reads.items() if u in temp_of and last.get(u) == i
                ]
                if elementwise:  # made over what it reads last, of its size
                    inplace = {k: made - 1 for k in read_last if temps[k].nbytes == size}
                elif graph.nodes[producer[v]].prim in _CONTRACTIONS:
                    # run early: what it reads last dies then
                    ends.update((k, min(made, ends.get(k, made))) for k in read_last)
                else:  # a loop, a call: where the program runs it
                    made = 3 * producer[v] + 1
        busy = [(made, end)]
        if arg is not None and arg in last:
            busy.append((0, 3 * last[arg] + 1))
        out.append(Allocation(size, busy, inplace))
    return out, ends, deferred


def heap_temps(
    graph: Graph,
    outputs: Sequence[tuple[int | None, int, int | None]],
    spec: Mapping[int, Any],
    mesh: Any,
    widen: Mapping[np.dtype, np.dtype] | None,
    copy_reads: Mapping[int, Mapping[int, Any]],
    temps: list[Span],
    temp_of: Mapping[int, int],
    extras: list[int],
    last: Mapping[int, int],
    fused: set[int],
    applied: Mapping[int, int],
    movable: Sequence[Span] = (),
) -> tuple[list[Span], set[int]]:
    """The temporaries XLA keeps in its temp heap: not those it places in the
    outputs' buffers (:func:`output_allocations`), with the spans the outputs
    give them; ``extras`` (bytes live while each node runs) loses the copies of
    reductions deferred to the end. ``spec``: value id → its layout;
    ``copy_reads``: node index → {value id: the resharded copy
    (:class:`~spmdkit.propagation.memory.CopyRead`) it reads in its place}.
    ``movable``: buffers held while one node runs (a loop body's at its peak, a
    region's own), which XLA places in the outputs' buffers too where one is
    free then and large enough: the indices of those it places come back with
    the temporaries."""
    producer = {o: node.prim for node in graph.nodes for o in node.outs}
    reduced = {
        i: {
            u
            for u, c in via.items()
            if c.spec is not None
            and u in spec
            and spec[u].partial
            and not scattered_at_once(producer.get(u), spec[u], c.spec)
        }
        for i, via in copy_reads.items()
    }
    allocations, ends, deferred = output_allocations(
        graph, outputs, last, fused, applied, temps, temp_of, reduced
    )
    # a reduction deferred to the end: its result is the output's (or the
    # partial sum's, in the output's buffer), no copy of its own on the way
    for i, u in deferred:
        c = copy_reads[i][u]
        s = c.spec.replace(dtype=widen[c.spec.dtype]) if widen and c.spec.dtype in widen else c.spec
        for k in range(c.made, min(c.last, len(extras) - 1) + 1):
            extras[k] = max(0, extras[k] - s.local_bytes(mesh))
    temps = [t._replace(end=ends[k]) if k in ends else t for k, t in enumerate(temps)]
    loops = {temp_of[o] for node in graph.nodes if node.subs for o in node.outs if o in temp_of}
    n = len(temps)
    out = hosted([*temps, *movable], allocations, loops)
    return [t for k, t in enumerate(temps) if k not in out], {k - n for k in out if k >= n}


def scattered_at_once(producer: str | None, partial: Any, reduced: Any) -> bool:
    """Whether XLA:CPU reduce-scatters a contraction's partial sum as soon as it
    exists (not with the other gradients at the end).

    The enforced step reduces a contraction's pending sum under ``shard_map`` with
    the plan's collectives (``spmdkit.compile.enforce``); a reduce-scatter among
    them stays one on CPU, and XLA:CPU combines all-reduces only, so the scheduler
    runs it, and frees the partial sum, as soon as the contraction has made it.
    Measured on XLA:CPU: an FSDP dropout MLP's two weight gradients are each
    reduce-scattered before the next contraction runs, one freed before the
    other is made.

    Args:
      producer: the primitive that makes the partial value (None: an input).
      partial: the partial value's layout.
      reduced: the layout its reduction makes.
    """
    if producer not in _CONTRACTIONS:
        return False
    split = {a for axes in reduced.dims for a in axes}
    return any(axis in split for axis, _ in partial.partial)


def _made(
    graph: Graph,
    v: int,
    producer: Mapping[int, int],
    fused: set[int],
    applied: Mapping[int, int],
    early: set[int],
) -> tuple[int, dict[int, int], bool, list[int]]:
    """(the step an output ``v`` is made, {materialized value it reads: the node
    reading it}, whether it is elementwise, the nodes of its fusion). XLA's
    scheduler makes an output as soon as the values it reads exist (measured on
    XLA:CPU: a convolution's input gradient, an output, runs before its filter
    gradient although autodiff emits it after), its fused operands in its
    fusion; an argument's
    elements moved about (a kernel flipped) can be made at any time. An
    elementwise fusion writes its result over an operand of its size that it
    reads last."""
    stack, seen, at = [v], {v}, []
    reads: dict[int, int] = {}
    while stack:
        i = producer[stack.pop()]
        at.append(i)
        for operand in graph.nodes[i].ins:
            u = operand
            while u in applied and u not in seen:
                seen.add(u)
                u = applied[u]
            if u in seen or u not in producer:
                continue
            seen.add(u)
            if u in fused:
                stack.append(u)
            elif u not in early:
                reads[u] = i
    made = 3 * max(producer[u] for u in reads) + 2 if reads else 3 * min(at) + 1
    return made, reads, all(graph.nodes[i].prim in _IN_PLACE for i in at), at


#: Primitives XLA's scheduler runs as soon as their operands exist (measured: a
#: convolution's input gradient before its filter gradient).
_CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})

#: Primitives that only rearrange their operand's elements.
_REARRANGES = frozenset({"transpose", "reshape", "squeeze", "broadcast_in_dim", "rev"})

#: What lies between a weight gradient's contraction and the gradient output: moves
#: of its elements and a cast to the parameter's dtype.
_MOVES_AND_CASTS = _REARRANGES | {"convert_element_type"}

#: Primitives whose result XLA may write over an operand of its size: elementwise,
#: and moves that a layout folds into the operand's producer.
_IN_PLACE = ELEMENTWISE | {"transpose", "reshape", "squeeze", "broadcast_in_dim"}


def own_parts(inner: Mapping[int, Sequence[int]] | None, node: Any) -> tuple[int, ...]:
    """The buffers a node holds while it runs besides its results (``inner``:
    ``id(node)`` → the buffers live at its region program's peak)."""
    return tuple(b for b in (inner or {}).get(id(node), ()) if b)


def without(parts: Sequence[int], nbytes: int) -> tuple[int, ...]:
    """``parts`` less one buffer of ``nbytes`` (placed elsewhere)."""
    out = list(parts)
    if nbytes in out:
        out.remove(nbytes)
    return tuple(out)


class NodeHolds(NamedTuple):
    """Per node of a graph, what it holds while it runs besides the values the
    liveness tracks: ``extras`` (resharded operands, backend workspaces), ``own``
    (a region's own program, by buffer), ``bodies`` (its loop bodies' peak) and
    ``body_parts`` (the buffers live at that peak). XLA places the buffers of a
    region and of a loop body in the outputs' buffers as it does the top level's
    temporaries, where one is free then and large enough (:meth:`movable`,
    :meth:`place`); the rest are held at the node (:meth:`spans`), a body's peak
    beyond what the node already holds."""

    extras: list[int]
    own: list[tuple[int, ...]]
    bodies: list[int]
    body_parts: list[tuple[int, ...]]

    def movable(self) -> list[Span]:
        """The buffers XLA may place elsewhere: each region buffer over its
        node's two steps, each body buffer at its node's own step."""
        out = [Span(3 * i, 3 * i + 1, b) for i, parts in enumerate(self.own) for b in parts]
        out += [Span(3 * i + 1, 3 * i + 1, b) for i, ps in enumerate(self.body_parts) for b in ps]
        return out

    def place(self, placed: Collection[int], movable: Sequence[Span]) -> None:
        """Drop the buffers of :meth:`movable` (``movable``, as it gave them) that
        are placed in the outputs' buffers (``placed``: their indices)."""
        owners = [i for i, parts in enumerate(self.own) for _ in parts]
        owners += [-1 - i for i, ps in enumerate(self.body_parts) for _ in ps]
        for k in sorted(placed):
            i, b = owners[k], movable[k].nbytes
            if i >= 0:
                self.own[i] = without(self.own[i], b)
            else:
                self.bodies[-1 - i] = max(0, self.bodies[-1 - i] - b)
                self.body_parts[-1 - i] = without(self.body_parts[-1 - i], b)

    def spans(self) -> list[Span]:
        """What each node holds while it runs, by buffer where it can be told."""
        fixed = [Span(3 * i, 3 * i + 1, e) for i, e in enumerate(self.extras) if e]
        fixed += [Span(3 * i, 3 * i + 1, b) for i, parts in enumerate(self.own) for b in parts]
        for i, b in enumerate(self.bodies):
            held = self.extras[i] + sum(self.own[i])
            rest = max(0, b - held)
            if rest and rest == sum(self.body_parts[i]):
                fixed += [Span(3 * i + 1, 3 * i + 1, p) for p in self.body_parts[i]]
            elif rest:
                fixed.append(Span(3 * i + 1, 3 * i + 1, rest))
        return fixed


#: Primitives that keep a zero operand's values zero.
_ZERO_PRESERVING = frozenset({"broadcast_in_dim", "convert_element_type", "reshape", "squeeze"})


def zero_values(graph: Graph, prog: Any) -> set[int]:
    """Ids of values that are all zeros: literal zeros, and broadcasts, casts and
    reshapes of them (``jnp.zeros``, an autodiff's instantiated zero cotangent)."""
    out = {v for v, c in prog.values.items() if np.size(c) == 1 and not np.any(np.asarray(c))}
    for node in graph.nodes:
        if node.prim in _ZERO_PRESERVING and node.ins and node.ins[0] in out:
            out.update(node.outs)
    return out
