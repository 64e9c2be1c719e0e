"""``sk.diff(plan_a, plan_b)``: what changes if you switch plans.

A :class:`PlanDiff` compares two plans of one model:

* per tensor, the spec change (the parameter's, its optimizer state's, its
  gradient's; layer-numbered siblings that change alike share a row);
* per parameter group and per collective kind, the change in memory per
  device, bytes moved per step and step time, from each plan's
  :class:`~spmdkit.planner.provenance.Provenance`;
* the strategy, recipe and mesh changes.

The rows add up to the plans' totals: every group's memory, plus the rest
(activations, temporaries, what the liveness estimate holds beyond the
parameters and optimizer state), is the plan's peak; every group's bytes, plus
:data:`~spmdkit.planner.provenance.ACTIVATIONS` and whatever the provenance does
not attribute (host offload traffic, a plan costed analytically), is its bytes
per step; every group's share of the exposed communication time, plus compute,
plus the rest, is its step time. So the deltas sum to the difference of the
totals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spmdkit.planner.logical import PlanError
from spmdkit.planner.plans import Plan
from spmdkit.planner.provenance import ACTIVATIONS, Provenance, group_key
from spmdkit.spec import axis_sizes
from spmdkit.util import fmt_bytes, fmt_time

__all__ = ["Change", "PlanDiff", "Row", "SpecChange", "diff"]

#: The row of what no parameter group and no activation accounts for.
REST = "rest"
#: The row of the step's compute time.
COMPUTE = "compute"


@dataclass(frozen=True)
class Change:
    """One figure in plan A and plan B; :attr:`delta` is ``b - a``."""

    a: float
    b: float

    @property
    def delta(self) -> float:
        """``b - a``."""
        return self.b - self.a


@dataclass(frozen=True)
class Row:
    """A group's (or a collective kind's) figures in both plans.

    Attributes:
      name: a parameter group (``layers/*/mlp/up``), ``activations``, ``compute``
        or ``rest``; or a collective kind.
      memory: bytes per device.
      comm_bytes: payload bytes moved per device per step.
      step_time_s: its share of the step time.
    """

    name: str
    memory: Change = Change(0, 0)
    comm_bytes: Change = Change(0, 0)
    step_time_s: Change = Change(0.0, 0.0)

    @property
    def changed(self) -> bool:
        """Whether any figure differs."""
        return any(c.delta for c in (self.memory, self.comm_bytes, self.step_time_s))


@dataclass(frozen=True)
class SpecChange:
    """A tensor whose layout differs (``None``: the same in both plans).

    Attributes:
      path: the parameter path, or its group where every member changes alike.
      count: how many parameters the row stands for.
      params, opt, grads: ``(spec in A, spec in B)`` where they differ.
    """

    path: str
    count: int
    params: tuple[str, str] | None
    opt: tuple[str, str] | None = None
    grads: tuple[str, str] | None = None


@dataclass(frozen=True)
class PlanDiff:
    """Two plans compared (module docstring); ``print`` it.

    Attributes:
      names: the two plans' names (strategy, and what auto chose).
      specs: the tensors whose layout changes.
      groups: per parameter group (then ``activations``, ``compute``, ``rest``):
        memory, bytes moved and step time; they sum to :attr:`total`.
      kinds: per collective kind: bytes moved and step time (their sum:
        :attr:`total`'s bytes, and its step time less compute and the rest).
      total: the plans' totals: peak memory, bytes moved, step time.
      mesh, recipe, strategy, activation: ``(A, B)`` where they differ, else None.
    """

    names: tuple[str, str]
    specs: tuple[SpecChange, ...]
    groups: tuple[Row, ...]
    kinds: tuple[Row, ...]
    total: Row
    mesh: tuple[str, str] | None = None
    recipe: tuple[str, str] | None = None
    strategy: tuple[str, str] | None = None
    activation: tuple[str, str] | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __str__(self) -> str:
        a, b = self.names
        lines = [f"diff {a} → {b}"]
        for what, pair in (
            ("strategy", self.strategy),
            ("mesh", self.mesh),
            ("recipe", self.recipe),
            ("activations", self.activation),
        ):
            if pair is not None:
                lines.append(f"  {what}: {pair[0]} → {pair[1]}")
        if self.specs:
            lines.append("specs:")
            rows = [("tensor", "n", "param", "opt", "grads")]
            for s in self.specs:
                rows.append(
                    (s.path, str(s.count), *(_arrow(x) for x in (s.params, s.opt, s.grads)))
                )
            lines += _table(rows)
        lines.append("per group (Δ = B − A):")
        lines += _table(_rows(self.groups, self.total))
        lines.append("per collective kind:")
        lines += _table(_rows(self.kinds, None, memory=False))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _arrow(pair: tuple[str, str] | None) -> str:
    return "=" if pair is None else f"{pair[0]} → {pair[1]}"


def _rows(rows: tuple[Row, ...], total: Row | None, *, memory: bool = True) -> list[tuple]:
    head = ("", *(("memory/device", "Δ") if memory else ()), "bytes/step", "Δ", "step", "Δ")
    out: list[tuple] = [head]
    for r in (*rows, *((total,) if total is not None else ())):
        if not r.changed and r is not total:
            continue
        cells = [r.name]
        if memory:
            cells += [_pair(r.memory, fmt_bytes), _signed(r.memory.delta, fmt_bytes)]
        cells += [_pair(r.comm_bytes, fmt_bytes), _signed(r.comm_bytes.delta, fmt_bytes)]
        cells += [_pair(r.step_time_s, fmt_time), _signed(r.step_time_s.delta, fmt_time)]
        out.append(tuple(cells))
    return out


def _pair(c: Change, fmt: Any) -> str:
    return f"{fmt(c.a)} → {fmt(c.b)}"


def _signed(x: float, fmt: Any) -> str:
    return ("+" if x > 0 else "-" if x < 0 else "±") + fmt(abs(x))


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


# -- the entry -------------------------------------------------------------------------------


def diff(a: Plan, b: Plan) -> PlanDiff:
    """Compare two plans of one model (``sk.diff``).

    Args:
      a: the plan you have.
      b: the plan you consider.

    Returns:
      A :class:`PlanDiff`: spec changes per tensor, memory, bytes and step time
      per group and per collective kind, strategy, recipe and mesh changes.

    Raises:
      PlanError: a plan is not costed, or the plans are of different models
        (their parameters differ).

    Example::

        >>> d = sk.diff(sk.plan(m, mesh, "fsdp"), sk.plan(m, mesh, "megatron"))
        >>> print(d)  # doctest: +SKIP
    """
    for name, p in (("plan_a", a), ("plan_b", b)):
        if not isinstance(p, Plan) or p.cost is None:
            raise PlanError(
                op="sk.diff",
                must=f"{name} is a costed Plan",
                given=type(p).__name__ if not isinstance(p, Plan) else "a plan without a cost",
                fix="pass what sk.plan returns (or Plan.from_json of its JSON)",
            )
    if set(a.params) != set(b.params):
        only = sorted(set(a.params) ^ set(b.params))
        raise PlanError(
            op="sk.diff",
            must="both plans are of one model (the same parameter paths)",
            given=f"{len(only)} paths in one plan only, e.g. {only[:3]}",
            fix="plan the same model twice: sk.diff(sk.plan(m, mesh, 'fsdp'), sk.plan(m, ...))",
        )
    keys = list(dict.fromkeys(group_key(p) for p in a.params))
    ga, gb = _group_figures(a, keys), _group_figures(b, keys)
    groups = tuple(
        Row(k, *(Change(ga[k][i], gb[k][i]) for i in range(3)))
        for k in (*keys, ACTIVATIONS, COMPUTE, REST)
    )
    total = Row(
        "total",
        Change(a.cost.peak_bytes, b.cost.peak_bytes),
        Change(a.cost.total_comm_bytes, b.cost.total_comm_bytes),
        Change(a.cost.step_time_s, b.cost.step_time_s),
    )
    return PlanDiff(
        names=(_name(a), _name(b)),
        specs=_spec_changes(a, b),
        groups=groups,
        kinds=_kind_rows(a, b),
        total=total,
        mesh=_changed(_mesh_text(a), _mesh_text(b)),
        recipe=_changed(a.recipe.short(), b.recipe.short()),
        strategy=_changed(_name(a), _name(b)),
        activation=_changed(_act_text(a), _act_text(b)),
        notes=_notes(a, b),
    )


def _name(p: Plan) -> str:
    return p.strategy if not p.chosen or p.chosen == p.strategy else f"{p.strategy} ({p.chosen})"


def _changed(x: str, y: str) -> tuple[str, str] | None:
    return None if x == y else (x, y)


def _mesh_text(p: Plan) -> str:
    return " × ".join(f"{k}={v}" for k, v in axis_sizes(p.mesh).items())


def _act_text(p: Plan) -> str:
    return ", ".join(f"{k}→{','.join(v) or '_'}" for k, v in p.activation.items()) or "-"


def _notes(a: Plan, b: Plan) -> tuple[str, ...]:
    out = []
    for name, p in (("A", a), ("B", b)):
        if p.provenance is None or not p.provenance.comm_bytes:
            out.append(
                f"plan {name} has no propagated provenance (estimator {p.cost.estimator!r}): "
                "its bytes and step time are all in the 'rest' row"
            )
    return tuple(out)


# -- per group ------------------------------------------------------------------------------


def _group_figures(p: Plan, keys: list[str]) -> dict[str, tuple[float, float, float]]:
    """Per group, then ``activations``, ``compute``, ``rest``: (memory, bytes,
    step time) in plan ``p``, summing to its totals."""
    cost = p.cost
    prov = p.provenance if p.provenance is not None else Provenance()
    memory = dict(prov.memory) or _param_memory(p)
    exposed = cost.step_time_s - cost.compute_time_s
    share = exposed / cost.comm_time_s if cost.comm_time_s else 0.0
    out: dict[str, tuple[float, float, float]] = {}
    for k in (*keys, ACTIVATIONS):
        moved = float(sum(prov.comm_bytes.get(k, {}).values()))
        out[k] = (float(memory.get(k, 0)), moved, prov.comm_time_s.get(k, 0.0) * share)
    sums = [sum(v[i] for v in out.values()) for i in range(3)]
    out[COMPUTE] = (0.0, 0.0, cost.compute_time_s)
    out[REST] = (
        cost.peak_bytes - sums[0],
        cost.total_comm_bytes - sums[1],
        cost.step_time_s - cost.compute_time_s - sums[2],
    )
    return out


def _param_memory(p: Plan) -> dict[str, int]:
    """Per group, its parameters' bytes per device from their specs (a plan
    without propagated provenance)."""
    sizes = axis_sizes(p.mesh)
    out: dict[str, int] = {}
    for path, spec in p.params.items():
        shape, dtype, _ = p.info.get(path, ((), "float32", None))
        shards = 1
        for e in tuple(spec):
            for a in () if e is None else (e,) if isinstance(e, str) else e:
                shards *= sizes[a]
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize // max(shards, 1)
        out[group_key(path)] = out.get(group_key(path), 0) + n
    return out


def _kind_rows(a: Plan, b: Plan) -> tuple[Row, ...]:
    """Per collective kind: bytes, and its share of the exposed communication time
    (its modelled time over all collectives' time)."""
    kinds = sorted(set(a.cost.comm_bytes) | set(b.cost.comm_bytes))

    def times(p: Plan) -> Mapping[str, float]:
        per = p.provenance.kind_time_s if p.provenance is not None else {}
        cost = p.cost
        exposed = cost.step_time_s - cost.compute_time_s
        share = exposed / cost.comm_time_s if cost.comm_time_s else 0.0
        return {k: t * share for k, t in per.items()}

    ta, tb = times(a), times(b)
    return tuple(
        Row(
            k,
            comm_bytes=Change(a.cost.comm_bytes.get(k, 0), b.cost.comm_bytes.get(k, 0)),
            step_time_s=Change(ta.get(k, 0.0), tb.get(k, 0.0)),
        )
        for k in kinds
    )


# -- per tensor -------------------------------------------------------------------------------


def _spec_changes(a: Plan, b: Plan) -> tuple[SpecChange, ...]:
    """The parameters whose spec, optimizer spec or gradient spec differs; a
    group's members that all change alike share one row."""
    rows: dict[tuple, list[str]] = {}
    for path in a.params:
        pair = (
            _pair_text(a.params[path], b.params[path]),
            _pair_text(a.opt.get(path), b.opt.get(path)),
            _pair_text(a.grads.get(path, a.params[path]), b.grads.get(path, b.params[path])),
        )
        if pair != (None, None, None):
            rows.setdefault((group_key(path), pair), []).append(path)
    out = []
    members = {}
    for path in a.params:
        members.setdefault(group_key(path), []).append(path)
    for (key, pair), paths in rows.items():
        whole = len(paths) == len(members[key]) and len(paths) > 1
        for name in [key] if whole else paths:
            out.append(SpecChange(name, len(paths) if whole else 1, *pair))
    return tuple(out)


def _pair_text(x: Any, y: Any) -> tuple[str, str] | None:
    if x == y:
        return None
    return _spec_text(x), _spec_text(y)


def _spec_text(spec: Any) -> str:
    if spec is None:
        return "-"
    parts = []
    for e in tuple(spec):
        parts.append("_" if e is None else e if isinstance(e, str) else "(" + ",".join(e) + ")")
    return "[" + ",".join(parts) + "]"
