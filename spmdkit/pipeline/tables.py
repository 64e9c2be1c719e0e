"""A schedule's tick table as the per-device integer tables the executor indexes.

The executor runs one program on every device of the pipe axis; at tick ``t``
device ``d`` reads row ``[t, d]`` of each table to know what to do: the action
(idle, forward, backward), its micro-batch and local chunk, and which buffer
slot to read its input from, to stash its residuals in, and to file the value
its neighbour sends at the end of the tick in. Slots are assigned here, once,
by replaying the schedule: a slot is taken when a value arrives (or a forward
stashes) and freed when the action that needs it runs, so buffers hold only
what is in flight (1F1B's ``p − d`` micro-batches on device ``d``, not ``m``).
Each inbox has one extra *trash* slot that ticks receiving nothing write to;
the stash has none: a tick that stashes nothing has the stash's length as its
slot, which the executor's scatter drops (out of bounds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spmdkit.pipeline.schedule import Schedule

__all__ = ["FIELDS", "Tables", "build_tables", "forward_ticks"]

#: The per-(tick, device) fields of :class:`Tables`.
FIELDS = (
    "kind",  # 0 idle, 1 forward, 2 backward
    "mb",  # micro-batch
    "local",  # local chunk index j (global chunk j * p + d)
    "first",  # 1 when the chunk is the first (input: the micro-batch's embedding)
    "last",  # 1 when the chunk is the last (the head and loss run after it)
    "f_in",  # forward: inbox_f slot of the input
    "b_in",  # backward: inbox_b slot of the output cotangent
    "stash",  # forward: stash slot written; backward: read and freed
    "recv_f",  # inbox_f slot the forward value arriving this tick is filed in
    "recv_b",  # inbox_b slot the backward value arriving this tick is filed in
    "self_b",  # last-chunk forward: inbox_b slot of the loss's cotangent
)


#: The most runs of ticks a repeating unit of :meth:`Tables.blocks` holds.
MAX_UNIT = 8


@dataclass(frozen=True)
class Tables:
    """Per-(tick, device) integer tables (:data:`FIELDS`) and buffer sizes.

    Attributes:
      fields: name → ``int32[ticks, stages]``.
      n_inbox_f, n_inbox_b, n_stash: slots per buffer (an inbox's trash slot not counted).
      send_f, send_b: per tick, whether any device sends a forward (backward) value.
    """

    fields: dict[str, np.ndarray]
    n_inbox_f: int
    n_inbox_b: int
    n_stash: int
    send_f: tuple[bool, ...]
    send_b: tuple[bool, ...]

    @property
    def n_ticks(self) -> int:
        """Ticks in the table."""
        return len(self.send_f)

    def stacked(self) -> np.ndarray:
        """``int32[ticks, fields, stages]``: what the executor scans over."""
        return np.stack([self.fields[f] for f in FIELDS], axis=1)

    def segments(self) -> list[tuple[int, int, bool, bool]]:
        """Runs of ticks with the same sends: ``(start, stop, send_f, send_b)``; each
        run is one ``lax.scan`` whose body has only the permutes it needs."""
        out: list[tuple[int, int, bool, bool]] = []
        for t, flags in enumerate(zip(self.send_f, self.send_b, strict=True)):
            if out and (out[-1][2], out[-1][3]) == flags:
                out[-1] = (out[-1][0], t + 1, *flags)
            else:
                out.append((t, t + 1, *flags))
        return out

    def blocks(self) -> list[tuple[int, int, tuple[tuple[int, bool, bool], ...]]]:
        """The :meth:`segments` with repeating stretches folded: ``(start, reps,
        unit)``, where ``unit``'s runs ``(ticks, send_f, send_b)`` follow one another
        ``reps`` times from tick ``start``.

        A 2-stage 1F1B alternates ticks that send both ways with ticks that send
        nothing (a run per tick, so a program of run-by-run scans grows with the
        micro-batches); the executor scans a folded stretch once over its repeats,
        each repeat running the unit's runs in order with the permutes they had.
        Units of up to :data:`MAX_UNIT` runs; the repeats that cover the most runs
        win.

        Example::

            >>> t = Tables({}, 0, 0, 0, (1, 0, 1, 0, 1, 0), (0, 0, 1, 0, 1, 1))
            >>> for block in t.blocks():
            ...     print(block)
            (0, 1, ((1, True, False),))
            (1, 2, ((1, False, False), (1, True, True)))
            (5, 1, ((1, False, True),))
        """
        runs = [(stop - start, bool(f), bool(b)) for start, stop, f, b in self.segments()]
        out: list[tuple[int, int, tuple[tuple[int, bool, bool], ...]]] = []
        i = tick = 0
        while i < len(runs):
            best_k, best_reps = 1, 1
            for k in range(2, MAX_UNIT + 1):
                reps = 1
                while runs[i + reps * k : i + (reps + 1) * k] == runs[i : i + k]:
                    reps += 1
                if reps > 1 and reps * k > best_reps * best_k:
                    best_k, best_reps = k, reps
            unit = tuple(runs[i : i + best_k])
            out.append((tick, best_reps, unit))
            tick += best_reps * sum(n for n, _, _ in unit)
            i += best_reps * best_k
        return out


class _Pool:
    def __init__(self) -> None:
        self.free: list[int] = []
        self.size = 0

    def take(self) -> int:
        if self.free:
            return self.free.pop(0)
        self.size += 1
        return self.size - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)
        self.free.sort()


def forward_ticks(schedule: Schedule) -> int:
    """Ticks before the first backward (all of GPipe's forward phase)."""
    for t, row in enumerate(schedule.ticks):
        if any(a is not None and a.kind == "B" for a in row):
            return t
    return schedule.n_ticks


def _consume(t: int, d: int, a: object, f: dict, pools: dict, where: dict, last: int) -> None:
    i, c = a.microbatch, a.chunk  # type: ignore[attr-defined]
    p = len(pools["f"])
    f["kind"][t, d] = 1 if a.kind == "F" else 2  # type: ignore[attr-defined]
    f["mb"][t, d], f["local"][t, d] = i, c // p
    f["first"][t, d], f["last"][t, d] = int(c == 0), int(c == last)
    if a.kind == "F":  # type: ignore[attr-defined]
        if c > 0:
            f["f_in"][t, d] = slot = where.pop(("f", i, c - 1))
            pools["f"][d].give(slot)
        f["stash"][t, d] = where[("s", i, c)] = pools["s"][d].take()
        if c == last:
            f["self_b"][t, d] = where[("b", i, c)] = pools["b"][d].take()
    else:
        f["b_in"][t, d] = slot = where.pop(("b", i, c))
        pools["b"][d].give(slot)
        f["stash"][t, d] = slot = where.pop(("s", i, c))
        pools["s"][d].give(slot)


def build_tables(schedule: Schedule, *, ticks: int | None = None) -> Tables:
    """The executor's tables for the first ``ticks`` ticks of ``schedule`` (all by default).

    Example::
        >>> from spmdkit.pipeline import Pipeline, build_schedule
        >>> t = build_tables(build_schedule(Pipeline(stages=2, microbatches=4)))
        >>> t.n_stash, t.n_inbox_f
        (2, 1)
    """
    pipe = schedule.pipeline
    p, last = pipe.stages, pipe.chunks - 1
    rows = schedule.ticks[: schedule.n_ticks if ticks is None else ticks]
    f = {name: np.full((len(rows), p), -1, np.int32) for name in FIELDS}
    for name in ("kind", "mb", "local", "first", "last"):
        f[name][:] = 0
    pools = {k: [_Pool() for _ in range(p)] for k in ("f", "b", "s")}
    where: dict[tuple, int] = {}
    send_f, send_b = [], []
    for t, row in enumerate(rows):
        for d, a in enumerate(row):
            if a is not None:
                _consume(t, d, a, f, pools, where, last)
        sf = sb = False
        for a in row:
            if a is None:
                continue
            i, c = a.microbatch, a.chunk
            if a.kind == "F" and c < last:
                dest = (c + 1) % p
                f["recv_f"][t, dest] = where[("f", i, c)] = pools["f"][dest].take()
                sf = True
            elif a.kind == "B" and c > 0:
                dest = (c - 1) % p
                f["recv_b"][t, dest] = where[("b", i, c - 1)] = pools["b"][dest].take()
                sb = True
        send_f.append(sf)
        send_b.append(sb)
    sizes = {k: max(pool.size for pool in pools[k]) for k in pools}
    for name, pool in (("f_in", "f"), ("recv_f", "f"), ("b_in", "b"), ("recv_b", "b")):
        f[name][f[name] < 0] = sizes[pool]
    for name in ("self_b",):
        f[name][f[name] < 0] = sizes["b"]
    f["stash"][f["stash"] < 0] = sizes["s"]
    return Tables(f, sizes["f"], sizes["b"], sizes["s"], tuple(send_f), tuple(send_b))
