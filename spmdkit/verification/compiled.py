"""What the compiler did: collectives, memory and flops of a compiled step, and
how they compare with a :class:`~spmdkit.propagation.Propagation`.

:func:`report` compiles ``fn`` for its arguments (real arrays or
``jax.ShapeDtypeStruct`` with shardings; nothing runs) and reads three things
from the compiled executable: the collectives of the post-partitioning HLO
(:func:`spmdkit.verification.hlo.parse_collectives`: kind, shapes, per-device payload bytes,
group size, the JAX op that made it and whether it belongs to the backward
pass; collectives inside loops count once per iteration, from XLA's
``known_trip_count``), ``memory_analysis()`` (per device) and ``cost_analysis()`` flops.

:func:`verify` puts a prediction next to it: payload bytes per collective kind
and in total, and peak memory, each within a relative tolerance. Peak memory is
predicted as a range: from every cheap elementwise value recomputed inside each
consumer's fusion (``Propagation.memory``) to every value read by several
consumers materialized once (``Propagation.memory_materialized``); which one
XLA does per value is its fusion heuristic's choice. On CPU XLA may
emit an all-reduce where a GPU emits a reduce-scatter and combines several
collectives into one; bytes are compared, not instruction counts, and
``by_kind=False`` compares only the totals.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax

from spmdkit.util import fmt_bytes as _fmt
from spmdkit.verification.hlo import HloCollective, parse_collectives

if TYPE_CHECKING:
    from spmdkit.propagation.records import Propagation
    from spmdkit.verification.blame import Attribution

__all__ = ["CompiledReport", "VerifyReport", "executions", "report", "verify"]


@dataclass
class CompiledReport:
    """Facts of one compiled step (per device).

    Attributes:
      collectives: every collective of the compiled HLO.
      argument_bytes: ``memory_analysis().argument_size_in_bytes``.
      output_bytes: ``output_size_in_bytes``.
      alias_bytes: ``alias_size_in_bytes`` (outputs reusing donated inputs).
      temp_bytes: ``temp_size_in_bytes``.
      peak_bytes: arguments + outputs − aliased + temporaries.
      flops: ``cost_analysis()['flops']`` (None when unavailable).
      hlo_text: the compiled HLO.
      executions: collective name → runs per step (loop trip counts; a share of
        them for a collective in a branch that runs on some iterations only).
    """

    collectives: list[HloCollective]
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int
    flops: float | None
    hlo_text: str = field(default="", repr=False)
    executions: dict[str, float] = field(default_factory=dict, repr=False)

    def runs(self, c: HloCollective) -> float:
        """How many times collective ``c`` runs per step."""
        return self.executions.get(c.name, 1)

    def bytes_by_kind(self, *, backward: bool | None = None) -> dict[str, int]:
        """Payload bytes per collective kind; ``backward`` selects one pass."""
        out: dict[str, float] = {}
        for c in self.collectives:
            if c.group_size <= 1 and c.kind != "collective_permute":
                continue
            if backward is not None and c.is_backward != backward:
                continue
            out[c.kind] = out.get(c.kind, 0) + c.payload_bytes * self.runs(c)
        return {k: round(v) for k, v in sorted(out.items())}

    @property
    def comm_bytes(self) -> int:
        """Total per-device payload bytes of the collectives."""
        return sum(self.bytes_by_kind().values())

    def __str__(self) -> str:
        lines = [
            f"compiled: {len(self.collectives)} collectives, {_fmt(self.comm_bytes)} per device; "
            f"memory peak {_fmt(self.peak_bytes)} (arguments {_fmt(self.argument_bytes)}, "
            f"outputs {_fmt(self.output_bytes)}, aliased {_fmt(self.alias_bytes)}, "
            f"temporaries {_fmt(self.temp_bytes)})"
            + (f"; {self.flops:.3g} flops" if self.flops is not None else "")
        ]
        for c in self.collectives:
            where = "bwd" if c.is_backward else "fwd"
            times = f" ×{self.runs(c):g}" if self.runs(c) != 1 else ""
            lines.append(f"  {where} {c}{times}  {c.op_name}")
        return "\n".join(lines)


_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=")
_CALLEE = re.compile(
    r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def executions(hlo_text: str) -> dict[str, int]:
    """Instruction name → how many times it runs per call of the entry computation.

    Instructions inside a ``while`` body run ``known_trip_count`` times (1 when XLA
    does not know the count); nesting multiplies.
    """
    comp_of: dict[str, str] = {}
    edges: list[tuple[str, str, int]] = []
    entry = None
    current = None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m:
            current = m["name"]
            if line.lstrip().startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        comp_of[m["name"]] = current
        trip = _TRIP.search(line)
        n = int(trip.group(1)) if trip and " while(" in line else 1
        for callee in _CALLEE.findall(line):
            edges.append((current, callee, n))
        for group in _BRANCHES.findall(line):
            for callee in group.split(","):
                edges.append((current, callee.strip().lstrip("%"), 1))
    times: dict[str, int] = {entry: 1} if entry else {}
    for _ in range(len(edges) + 1):  # call graphs are DAGs: this settles
        changed = False
        for caller, callee, n in edges:
            if caller in times and times.get(callee, 0) < times[caller] * n:
                times[callee] = times[caller] * n
                changed = True
        if not changed:
            break
    return {name: times.get(comp, 1) for name, comp in comp_of.items()}


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


def report(fn: Callable, *args: Any, **jit_kwargs: Any) -> CompiledReport:
    """Compile ``fn`` for ``args`` and report its collectives, memory and flops.

    Args:
      fn: a function, an already jitted one (then ``jit_kwargs`` must be empty),
        or a ``jax.stages.Compiled`` executable (then nothing is compiled and
        ``args`` are not needed).
      *args: arrays or ``jax.ShapeDtypeStruct`` (with shardings) to compile for.
      **jit_kwargs: passed to ``jax.jit`` (``in_shardings=``, ``donate_argnums=``…).

    Example::

        >>> rep = report(train_step, params, batch, donate_argnums=0)
        >>> rep.bytes_by_kind(backward=True)
        {'all_reduce': 8392704}
    """
    if isinstance(fn, jax.stages.Compiled):
        compiled = fn
    else:
        jitted = fn if hasattr(fn, "lower") and not jit_kwargs else jax.jit(fn, **jit_kwargs)
        compiled = jitted.lower(*args).compile()
    text = compiled.as_text()
    cols = parse_collectives(text)
    runs = executions(text)
    mem = compiled.memory_analysis()
    arg = int(getattr(mem, "argument_size_in_bytes", 0))
    out = int(getattr(mem, "output_size_in_bytes", 0))
    alias = int(getattr(mem, "alias_size_in_bytes", 0))
    temp = int(getattr(mem, "temp_size_in_bytes", 0))
    return CompiledReport(
        collectives=cols,
        argument_bytes=arg,
        output_bytes=out,
        alias_bytes=alias,
        temp_bytes=temp,
        peak_bytes=arg + out - alias + temp,
        flops=_flops(compiled),
        hlo_text=text,
        executions={c.name: runs.get(c.name, 1) for c in cols},
    )


@dataclass
class VerifyReport:
    """Prediction next to the compiled facts.

    Attributes:
      rows: ``(what, predicted, compiled, ok)`` per compared quantity. Where the
        prediction is a range (peak memory), ``predicted`` is the point of the
        range nearest the compiled value.
      mismatches: one sentence per quantity outside its tolerance.
      ranges: ``what`` → ``(low, high)`` for quantities predicted as a range.
      attribution: each compiled collective with its origin and the predicted
        ones it runs, and the predictions no compiled one runs
        (:class:`~spmdkit.verification.blame.Attribution`; None when the step was
        not replayed by ``sk.jit``). ``str(report)`` prints it when a row misses
        or a compiled collective is unpredicted or unplaced.
    """

    rows: list[tuple[str, int, int, bool]]
    mismatches: list[str]
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    attribution: Attribution | None = None

    @property
    def ok(self) -> bool:
        """True when every compared quantity is within tolerance."""
        return not self.mismatches

    def __str__(self) -> str:
        width = max([12] + [len(_span(*r)) + 1 for r in self.ranges.values()])
        lines = [f"{'':<22}{'predicted':>{width}}{'compiled':>12}"]
        for what, p, c, ok in self.rows:
            shown = _span(*self.ranges[what]) if what in self.ranges else _fmt(p)
            lines.append(f"{what:<22}{shown:>{width}}{_fmt(c):>12}  {'ok' if ok else 'MISMATCH'}")
        lines.append(
            "verified: ok" if self.ok else "mismatches:\n  " + "\n  ".join(self.mismatches)
        )
        # the attribution speaks when there is something to trace: a row that misses,
        # or a compiled collective the plan did not predict or cannot place. A
        # prediction XLA folded away (a scalar sum it merged) is in
        # ``report.attribution``, not on every verified report.
        a = self.attribution
        if a is not None and (not self.ok or a.unmatched_compiled or a.unattributed):
            lines.extend(a.lines())
        return "\n".join(lines)


def _span(low: int, high: int) -> str:
    return _fmt(low) if low == high else f"{_fmt(low)} – {_fmt(high)}"


def _close(p: float, c: float, tol: float, slack: float) -> bool:
    return abs(p - c) <= tol * max(abs(p), abs(c)) + slack


def verify(
    prop: Propagation,
    compiled: CompiledReport,
    *,
    bytes_tol: float = 0.10,
    mem_tol: float = 0.20,
    bytes_slack: int = 256,
    by_kind: bool = True,
    memory: bool = True,
) -> VerifyReport:
    """Compare a :class:`~spmdkit.propagation.Propagation` with a :class:`CompiledReport`.

    Args:
      prop: the prediction.
      compiled: what :func:`report` found.
      bytes_tol: relative tolerance on collective payload bytes.
      mem_tol: relative tolerance on peak memory.
      bytes_slack: absolute slack in bytes (scalar reductions such as a returned loss).
      by_kind: compare every collective kind, not only the total.
      memory: compare peak memory.

    Example::

        >>> v = verify(prop, report(step, *args))
        >>> v.ok, v.mismatches
        (True, [])
    """
    rows: list[tuple[str, int, int, bool]] = []
    bad: list[str] = []
    pred = dict(prop.comm_bytes_by_kind)
    comp = compiled.bytes_by_kind()
    if by_kind:
        for kind in sorted(set(pred) | set(comp)):
            p, c = pred.get(kind, 0), comp.get(kind, 0)
            ok = _close(p, c, bytes_tol, bytes_slack)
            rows.append((kind, p, c, ok))
            if not ok:
                bad.append(
                    f"{kind}: predicted {_fmt(p)} per device, compiled {_fmt(c)} "
                    f"(tolerance {bytes_tol:.0%})"
                )
    p, c = sum(pred.values()), sum(comp.values())
    ok = _close(p, c, bytes_tol, bytes_slack)
    rows.append(("collectives total", p, c, ok))
    if not ok:
        bad.append(f"collective bytes: predicted {_fmt(p)}, compiled {_fmt(c)}")
    ranges: dict[str, tuple[int, int]] = {}
    if memory:
        low = prop.memory.peak_bytes
        upper = getattr(prop, "memory_materialized", None)
        high = max(low, upper.peak_bytes) if upper is not None else low
        c = compiled.peak_bytes
        p = min(max(c, low), high)  # the point of the predicted range nearest c
        ok = _close(p, c, mem_tol, 0)
        rows.append(("peak memory", p, c, ok))
        ranges["peak memory"] = (low, high)
        if not ok:
            bad.append(
                f"peak memory: predicted {_span(low, high)} per device, compiled "
                f"{_fmt(c)} (tolerance {mem_tol:.0%})"
            )
    return VerifyReport(rows, bad, ranges)
