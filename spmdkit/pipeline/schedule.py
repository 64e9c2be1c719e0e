"""Pipeline configurations and their schedules as tick tables.

A :class:`Pipeline` says how the stacked layers of a model are split over a
``pipe`` mesh axis: ``stages`` devices on that axis (``p``), ``virtual`` chunks
per device (``v``: the layers split into ``p · v`` chunks, chunk ``c`` on device
``c mod p``, round-robin as in interleaved schedules), ``microbatches`` (``m``)
and a ``schedule``:

- ``"gpipe"``: every forward, then every backward; each micro-batch's stage
  input *and* the output it sent stay held until the backward phase is over
  (nothing is released early).
- ``"fthenb"``: the same order, but each micro-batch's stage output is released
  once it is sent and its stage input once its backward has consumed it
  (PaddlePaddle's ``FThenB`` with input release).
- ``"1f1b"``: after a warm-up of ``p − d − 1`` forwards on device ``d``, one
  forward and one backward alternate, so device ``d`` holds at most ``p − d``
  micro-batches (PipeDream-flush, Megatron-LM's default).
- ``"interleaved"``: 1F1B over ``v ≥ 2`` virtual chunks per device, in
  Megatron-LM's order (micro-batches in groups of ``p``); the bubble shrinks by
  ``v``: ``(p − 1) / (v · m + p − 1)``.

:func:`build_schedule` turns a configuration into a :class:`Schedule`: for
every tick and device the action it runs (:class:`Action`: forward or backward
of one micro-batch through one chunk) or ``None`` (a bubble). Every action takes
one tick (forward and backward priced alike, as the published bubble formulas
do); an action waits for its input from the neighbouring chunk's action at an
earlier tick. The table is what the executor runs, what the cost model counts
(bubble, held micro-batches, point-to-point sends) and what the layout explorer
draws.

Example::
    >>> s = build_schedule(Pipeline(stages=4, microbatches=8, schedule="1f1b"))
    >>> round(s.bubble_fraction, 4), s.peak_in_flight
    (0.2727, (4, 3, 2, 1))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from spmdkit.errors import SpmdError

__all__ = [
    "SCHEDULES",
    "Action",
    "balanced_layout",
    "Pipeline",
    "PipelineError",
    "Schedule",
    "build_schedule",
    "device_orders",
]

#: The schedules :func:`build_schedule` knows, in the order the docs list them.
SCHEDULES = ("gpipe", "fthenb", "1f1b", "interleaved")

ScheduleName = Literal["gpipe", "fthenb", "1f1b", "interleaved"]


class PipelineError(SpmdError, ValueError):
    """A pipeline configuration cannot run as asked.

    Broken example: ``Pipeline(stages=4, microbatches=2, schedule="1f1b")``:
    1F1B needs at least as many micro-batches as stages.
    """


@dataclass(frozen=True)
class Pipeline:
    """How the stacked layers are pipelined over a mesh axis.

    Attributes:
        stages: devices on the pipe axis (``p``).
        microbatches: micro-batches per step (``m``); the batch's leading dim
            is split into this many.
        schedule: one of :data:`SCHEDULES`.
        virtual: chunks per device (``v``); only ``"interleaved"`` (which needs
            ``v ≥ 2``), ``"gpipe"`` and ``"fthenb"`` (circular) take ``v > 1``.
        axis: the mesh axis the stages live on.
        return_output: the last stage's outputs are returned (evaluation):
            :func:`~spmdkit.pipeline.execute.pipelined_value_and_grad` then
            returns ``((loss, outputs), grads)``, ``outputs`` the layer stack's
            final carry values (the hidden state, and any other carried value)
            for every example, in the batch's row order.
        local_statistics: with the batch also split over other mesh axes, a
            layer that combines a micro-batch's rows (a mixture-of-experts
            router's load-balancing statistics, a batch norm) computes it over
            each device's rows of the micro-batch, as Megatron-LM computes MoE
            load balancing per data-parallel rank. Off (the default), such a
            layer is a :class:`PipelineError` that names it; without batch axes
            it is computed over the whole micro-batch either way.
        layout: the stacked layers each chunk runs, in chunk order (``p · v``
            counts summing to the layer count; a chunk may run none), as
            Megatron-LM's ``--pipeline-model-parallel-layout`` places them;
            None (the default): ``L / (p · v)`` each. Under an uneven layout
            every chunk's slice of the stacked weights is padded to the largest
            chunk's layers inside the step (the padded layers skipped: no
            compute, no gradient; parameters and gradients keep the model's
            shapes); the planner prices a device by its chunks' layers and the
            bubble as ``p − 1`` ticks of the largest chunk.
    """

    stages: int
    microbatches: int
    schedule: ScheduleName = "1f1b"
    virtual: int = 1
    axis: str = "pipe"
    return_output: bool = False
    local_statistics: bool = False
    layout: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        op = "Pipeline"
        if self.layout is not None:
            self._check_layout(op)
        for name in ("stages", "microbatches", "virtual"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PipelineError(
                    op=op,
                    must=f"{name} must be a positive int",
                    given=repr(value),
                    fix=f"pass {name}=1 or more",
                )
        if self.schedule not in SCHEDULES:
            raise PipelineError(
                op=op,
                must=f"schedule must be one of {SCHEDULES}",
                given=repr(self.schedule),
                fix='pick one, e.g. schedule="1f1b"',
            )
        if self.schedule == "1f1b" and self.virtual > 1:
            raise PipelineError(
                op=op,
                must="1f1b runs one chunk per device; virtual stages need the interleaved schedule",
                given=f"virtual={self.virtual}",
                fix='pass schedule="interleaved" (or virtual=1)',
            )
        if self.schedule == "interleaved" and self.virtual < 2:
            raise PipelineError(
                op=op,
                must="the interleaved schedule needs virtual >= 2 chunks per device",
                given=f"virtual={self.virtual}",
                fix='pass virtual=2 or more, or schedule="1f1b"',
            )
        if self.schedule in ("1f1b", "interleaved") and self.microbatches < self.stages:
            raise PipelineError(
                op=op,
                must=f"{self.schedule} needs at least as many micro-batches as stages",
                given=f"microbatches={self.microbatches}, stages={self.stages}",
                fix=f"pass microbatches={self.stages} or more (or schedule='fthenb')",
            )
        if self.schedule == "interleaved" and self.microbatches % self.stages:
            raise PipelineError(
                op=op,
                must="the interleaved schedule runs micro-batches in groups of `stages`",
                given=f"microbatches={self.microbatches}, stages={self.stages}",
                fix=f"pass a multiple of {self.stages} micro-batches",
            )

    def _check_layout(self, op: str) -> None:
        layout = self.layout
        ok = isinstance(layout, tuple) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in layout
        )
        if not ok or not sum(layout) or len(layout) != self.stages * self.virtual:
            raise PipelineError(
                op=op,
                must="layout is a tuple of stages x virtual layer counts (ints >= 0, "
                "summing to the stacked layers)",
                given=f"layout={layout!r}, stages={self.stages}, virtual={self.virtual}",
                fix=f"pass {self.stages * self.virtual} counts, e.g. layout=(2,) * "
                f"{self.stages * self.virtual}, or layout=None for equal chunks",
            )

    @property
    def uneven(self) -> bool:
        """The layout gives chunks different layer counts (the executor pads them)."""
        return self.layout is not None and len(set(self.layout)) > 1

    def chunk_layers(self, n_layers: int) -> tuple[int, ...]:
        """The stacked layers each chunk runs, in chunk order: the layout's, else
        ``L / (p · v)`` each."""
        if self.layout is not None:
            return self.layout
        return (n_layers // self.chunks,) * self.chunks

    def device_layers(self, n_layers: int) -> tuple[int, ...]:
        """The stacked layers each pipe-axis device runs (its chunks' summed)."""
        out = [0] * self.stages
        for c, n in enumerate(self.chunk_layers(n_layers)):
            out[self.chunk_device(c)] += n
        return tuple(out)

    @property
    def chunks(self) -> int:
        """How many pieces the layer stack is cut into: ``stages · virtual``."""
        return self.stages * self.virtual

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step: ``(p − 1) / (v · m + p − 1)``."""
        p, v, m = self.stages, self.virtual, self.microbatches
        return (p - 1) / (v * m + p - 1)

    def check_layers(self, n_layers: int, *, op: str = "pipeline") -> int:
        """Layers per chunk (the largest chunk's under a :attr:`layout`); a
        :class:`PipelineError` unless ``p · v`` divides them, or the layout sums to them.

        Args:
            n_layers: the stacked (scanned) layer count.
            op: names the caller in the error.
        """
        if self.layout is not None:
            if sum(self.layout) != n_layers:
                raise PipelineError(
                    op=op,
                    must="the layout's chunks run every stacked layer once",
                    given=f"layout summing to {sum(self.layout)}, {n_layers} layers",
                    fix=f"pass a layout summing to {n_layers}",
                )
            return max(self.layout)
        if n_layers < 1 or n_layers % self.chunks:
            raise PipelineError(
                op=op,
                must=f"the stacked layers split evenly into stages x virtual = {self.chunks}",
                given=f"{n_layers} layers",
                fix=f"use a layer count divisible by {self.chunks}, or change stages/virtual",
            )
        return n_layers // self.chunks

    def chunk_device(self, chunk: int) -> int:
        """The pipe-axis index that runs ``chunk`` (round-robin)."""
        return chunk % self.stages

    def short(self) -> str:
        """Compact label, e.g. ``pp4 1f1b m8`` or ``pp2x2 interleaved m4``."""
        v = f"x{self.virtual}" if self.virtual > 1 else ""
        out = f"pp{self.stages}{v} {self.schedule} m{self.microbatches}"
        return out + (f" layout {_runs(self.layout)}" if self.layout else "")

    def to_json(self) -> dict:
        """A JSON-able dict; :meth:`from_json` reads it back."""
        return {
            "stages": self.stages,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "virtual": self.virtual,
            "axis": self.axis,
            "return_output": self.return_output,
            "local_statistics": self.local_statistics,
            **({"layout": list(self.layout)} if self.layout is not None else {}),
        }

    @classmethod
    def from_json(cls, d: Mapping | None) -> Pipeline | None:
        """Inverse of :meth:`to_json` (``None`` stays ``None``)."""
        if d is None:
            return None
        d = dict(d)
        if d.get("layout") is not None:
            d["layout"] = tuple(d["layout"])
        return cls(**d)


def balanced_layout(
    layers: int, stages: int, virtual: int = 1, ends: tuple[float, float] = (0.0, 0.0)
) -> tuple[int, ...]:
    """A :attr:`Pipeline.layout` of ``layers`` stacked layers over ``stages · virtual``
    chunks that keeps the busiest device's work, then the slowest chunk's, least.

    Layers go one at a time to the device with the least work (its chunks'
    layers, plus ``ends[0]`` on the first device and ``ends[1]`` on the last:
    what they run before and after the stack, in layers), there to its chunk
    with the least (the first chunk carries ``ends[0]``, the last ``ends[1]``);
    ties go to the middle devices and chunks, as the end stages hold more. With
    ``ends`` zero every chunk gets ``⌊L / (p·v)⌋`` or ``⌈L / (p·v)⌉`` layers
    and the devices' layers differ by at most one; heavier ends take fewer.

    Args:
        layers: the stacked layer count ``L``.
        stages: devices on the pipe axis (``p``).
        virtual: chunks per device (``v``).
        ends: the first and the last device's work besides their layers, in
            layers (``≥ 0``).

    Raises:
        PipelineError: a count is not positive, or an end's work is negative.

    Example::
        >>> balanced_layout(58, 8)
        (7, 7, 7, 8, 8, 7, 7, 7)
        >>> balanced_layout(10, 2, 2, ends=(1.0, 0.0))
        (2, 3, 3, 2)
    """
    if min(layers, stages, virtual) < 1 or min(ends) < 0:
        raise PipelineError(
            op="balanced_layout",
            must="layers, stages and virtual are positive and the ends' work is not negative",
            given=f"layers={layers}, stages={stages}, virtual={virtual}, ends={ends}",
            fix="pass positive counts and ends >= 0",
        )
    p, n = stages, stages * virtual
    load = [0.0] * p
    load[0] += ends[0]
    load[-1] += ends[1]
    work = [0.0] * n  # a chunk's layers and end work
    work[0] += ends[0]
    work[-1] += ends[1]
    counts = [0] * n

    def outer(i: int, size: int) -> tuple[bool, int]:  # ends last, then the middle first
        return i in (0, size - 1), abs(2 * i - (size - 1))

    by_device, by_chunk = [outer(d, p) for d in range(p)], [outer(c, n) for c in range(n)]
    for _ in range(layers):
        d = min(range(p), key=lambda d: (load[d], *by_device[d]))
        c = min(range(d, n, p), key=lambda c: (work[c], *by_chunk[c]))
        load[d] += 1
        work[c] += 1
        counts[c] += 1
    return tuple(counts)


def _runs(counts: tuple[int, ...]) -> str:
    """``(0, 0, 2, 2, 2, 0)`` as ``0x2-2x3-0``: runs of equal counts."""
    out: list[list[int]] = []
    for n in counts:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return "-".join(f"{n}x{k}" if k > 1 else str(n) for n, k in out)


@dataclass(frozen=True)
class Action:
    """One tick of work on one device: ``kind`` ``"F"`` or ``"B"`` of
    ``microbatch`` through global chunk ``chunk``."""

    kind: Literal["F", "B"]
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


@dataclass(frozen=True)
class Schedule:
    """A pipeline's tick table and what it implies.

    Attributes:
        pipeline: the configuration.
        ticks: ``ticks[t][d]``: the action device ``d`` runs at tick ``t``, or
            ``None`` (idle).
    """

    pipeline: Pipeline
    ticks: tuple[tuple[Action | None, ...], ...]

    @property
    def n_ticks(self) -> int:
        """Ticks from the first forward to the last backward."""
        return len(self.ticks)

    @property
    def bubble_fraction(self) -> float:
        """Idle device-ticks over all device-ticks of the table."""
        p = self.pipeline.stages
        idle = sum(a is None for row in self.ticks for a in row)
        return idle / (self.n_ticks * p)

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        """Per device, the most (micro-batch, chunk) pairs forwarded and not
        yet backwarded at once: how many stage activations it holds at its peak."""
        p = self.pipeline.stages
        held, peak = [0] * p, [0] * p
        for row in self.ticks:
            for d, a in enumerate(row):
                if a is not None:
                    held[d] += 1 if a.kind == "F" else -1
                    peak[d] = max(peak[d], held[d])
        return tuple(peak)

    @property
    def sends(self) -> tuple[int, ...]:
        """Per device, point-to-point sends of one micro-batch's activation (or
        its cotangent) to the neighbouring device: forward outputs of every
        chunk but the last, backward outputs of every chunk but the first."""
        p, last = self.pipeline.stages, self.pipeline.chunks - 1
        out = [0] * p
        for row in self.ticks:
            for d, a in enumerate(row):
                if a is None:
                    continue
                if (a.kind == "F" and a.chunk < last) or (a.kind == "B" and a.chunk > 0):
                    out[d] += 1
        return tuple(out)

    def table(self) -> str:
        """The tick table as text: one row per device, one column per tick."""
        width = max((len(str(a)) for row in self.ticks for a in row if a), default=1)
        lines = []
        for d in range(self.pipeline.stages):
            cells = [(str(row[d]) if row[d] else ".").ljust(width) for row in self.ticks]
            lines.append(f"d{d}: " + " ".join(cells))
        return "\n".join(lines)


def _orders(pipe: Pipeline) -> list[list[Action]]:
    """Per device, its actions in the order it runs them."""
    p, v, m = pipe.stages, pipe.virtual, pipe.microbatches
    out = []
    for d in range(p):
        chunks = [j * p + d for j in range(v)]
        if pipe.schedule in ("gpipe", "fthenb"):
            fwd = [Action("F", i, c) for c in chunks for i in range(m)]
            bwd = [Action("B", i, c) for c in reversed(chunks) for i in range(m)]
            out.append(fwd + bwd)
            continue
        # 1F1B and Megatron's interleaved order: micro-batches in groups of p,
        # each group through every local chunk (backward: chunks reversed).
        groups = [range(g, min(g + p, m)) for g in range(0, m, p)]
        fwd = [Action("F", i, c) for grp in groups for c in chunks for i in grp]
        bwd = [Action("B", i, c) for grp in groups for c in reversed(chunks) for i in grp]
        warm = (p - d - 1) if v == 1 else (p - d - 1) * 2 + (v - 1) * p
        warm = min(warm, len(fwd))
        seq = fwd[:warm]
        rest_f, rest_b = fwd[warm:], bwd
        for k in range(len(rest_f)):
            seq += [rest_f[k], rest_b[k]]
        seq += rest_b[len(rest_f) :]
        out.append(seq)
    return out


def device_orders(pipe: Pipeline) -> tuple[tuple[Action, ...], ...]:
    """Per device, the actions it runs in the order it runs them (the tick table
    without its idle ticks): enough for what depends only on the order, such as
    the held micro-batches and the sends, without timing the whole table.

    Example::
        >>> [str(a) for a in device_orders(Pipeline(2, 2, "1f1b"))[1]]
        ['F0.1', 'B0.1', 'F1.1', 'B1.1']
    """
    return tuple(tuple(o) for o in _orders(pipe))


def build_schedule(pipe: Pipeline) -> Schedule:
    """The tick table of ``pipe``'s schedule.

    Each device runs its actions in its schedule's order; an action starts at
    the first tick after its input exists (the previous chunk's forward of that
    micro-batch, or the next chunk's backward; a last chunk's backward follows
    its own forward).

    Args:
        pipe: the configuration.

    Returns:
        The :class:`Schedule`.
    """
    orders = _orders(pipe)
    last = pipe.chunks - 1
    done: dict[tuple[str, int, int], int] = {}
    pos = [0] * pipe.stages
    rows: list[tuple[Action | None, ...]] = []
    t = 0
    while any(pos[d] < len(orders[d]) for d in range(pipe.stages)):
        row: list[Action | None] = []
        for d in range(pipe.stages):
            a = orders[d][pos[d]] if pos[d] < len(orders[d]) else None
            if a is not None:
                if a.kind == "F":
                    need = ("F", a.microbatch, a.chunk - 1) if a.chunk > 0 else None
                else:
                    nxt = ("F", a.microbatch, last) if a.chunk == last else None
                    need = nxt or ("B", a.microbatch, a.chunk + 1)
                if need is not None and done.get(need, t) >= t:
                    a = None
            row.append(a)
        for d, a in enumerate(row):
            if a is not None:
                done[(a.kind, a.microbatch, a.chunk)] = t
                pos[d] += 1
        rows.append(tuple(row))
        t += 1
        if t > 4 * (pipe.microbatches * pipe.chunks + pipe.stages) + 8:  # pragma: no cover
            raise RuntimeError(f"schedule {pipe} does not finish")
    return Schedule(pipe, tuple(rows))
