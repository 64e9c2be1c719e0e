"""``print(plan)``: a plan as a readable table.

One row per parameter group (the parameters of one role in different layers
share a row, with their count): its shape, logical names, spec, optimizer
state's spec and the bytes one device holds. Under the rows: the activations'
mesh axes, context parallelism, the recipe, the pipeline and its stages, the
cost (memory by kind, bytes moved by kind, the estimated step, the composite
ops' strategies), the runner-up plans and the notes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from spmdkit.spec import axis_sizes
from spmdkit.step.master import stored_dtype
from spmdkit.util import fmt_bytes, fmt_time

__all__ = ["axes_text", "plan_table", "spec_text"]


def plan_table(plan: Any, *, max_rows: int = 60, notes: bool = True) -> str:
    """The table ``print(plan)`` shows (:meth:`~spmdkit.planner.plans.Plan.table`).

    Args:
      plan: the :class:`~spmdkit.planner.plans.Plan`.
      max_rows: parameter rows shown; the rest are counted in one line.
      notes: ``False`` leaves the notes out (for a caller that says them elsewhere).

    Example::

        >>> print(plan_table(plan).splitlines()[0])
        Plan 'megatron' on mesh data=2 × model=4 (8 devices)
    """
    sizes = axis_sizes(plan.mesh)
    mesh_text = " × ".join(f"{k}={v}" for k, v in sizes.items())
    head = f"Plan {plan.strategy!r}"
    if plan.chosen and plan.chosen != plan.strategy:
        head += f" (chose {plan.chosen})"
    lines = [f"{head} on mesh {mesh_text} ({math.prod(sizes.values())} devices)"]
    rows: dict[tuple, list] = {}
    entries = [(path, spec, plan.opt.get(path, spec)) for path, spec in plan.params.items()]
    entries += [(path, spec, None) for path, spec in plan.state.items()]
    for path, spec, ospec in entries:
        shape, dtype, logical = plan.info.get(path, ((), "float32", None))
        key = (re.sub(r"(^|/)\d+(?=/|$)", r"\1*", path), spec, ospec)
        if key in rows:
            rows[key][0] += 1
            continue
        if ospec is not None and np.issubdtype(np.dtype(dtype), np.floating):
            dtype = stored_dtype(plan.recipe) or dtype  # bf16 under master_weights
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        shards = math.prod(sizes[a] for a in _flat(spec))
        text = "-" if logical is None else ",".join(n or "_" for n in logical)
        source = plan.names_from.get(path, "model")
        if ospec is None:
            text = f"state, {plan.state_from.get(path, 'given')}"
        elif source != "model":
            text += f" ({source})"
        rows[key] = [1, shape, text, nbytes // max(shards, 1)]
    header = ("param", "n", "shape", "logical", "spec", "opt spec", "bytes/dev")
    body = []
    for (path, spec, ospec), (count, shape, logical, per_dev) in rows.items():
        body.append(
            (
                path,
                str(count),
                "×".join(map(str, shape)) or "scalar",
                logical,
                spec_text(spec),
                "none" if ospec is None else "=" if ospec == spec else spec_text(ospec),
                fmt_bytes(per_dev),
            )
        )
    shown = body[:max_rows]
    widths = [max(len(r[i]) for r in [header, *shown]) for i in range(len(header))]
    for r in [header, *shown]:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    if len(body) > max_rows:
        lines.append(f"  ... {len(body) - max_rows} more rows")
    if plan.activation:
        acts = ", ".join(f"{k}→{axes_text(v)}" for k, v in plan.activation.items() if v)
        lines.append(f"activations: {acts or 'replicated'}")
    if plan.context is not None:
        lines.append(f"context parallel: {plan.context.short()}")
    if plan.grads or not plan.recipe.is_default:
        grads = " (gradients sharded like the optimizer state)" if plan.grads else ""
        lines.append(f"recipe: {plan.recipe.short()}{grads}")
    if plan.pipeline is not None:
        pp = plan.pipeline
        lines.append(
            f"pipeline: {pp.short()} over '{pp.axis}' ({pp.chunks} chunks, "
            f"bubble {pp.bubble_fraction:.1%}"
            + ("; row statistics per device" if pp.local_statistics else "")
            + ")"
        )
        if plan.cost is not None and plan.cost.stage_memory:
            lines.append(_stages_line(plan.cost))
    if plan.cost is not None:
        lines += _cost_lines(plan.cost, plan.topology)
    lines += _tail_lines(plan, notes)
    return "\n".join(lines)


def _tail_lines(plan: Any, notes: bool) -> list[str]:
    """The table's last sections: the runner-ups (those over the memory
    budget marked) and the notes."""
    lines = []
    if plan.alternatives:
        lines.append("runner-up plans:")
        budget = plan.memory_budget
        for name, cost in plan.alternatives:
            over = budget is not None and cost.peak_bytes > budget
            mark = f"  OVER BUDGET ({fmt_bytes(budget)})" if over else ""
            lines.append(f"  {name:<12} {cost.summary()}{mark}")
    if plan.notes and notes:
        lines.append("notes:")
        lines += [f"  - {n}" for n in plan.notes]
    return lines


def _cost_lines(c: Any, topology: str | None) -> list[str]:
    """The table's cost section: memory, bytes moved, the estimated step, the ops."""
    mem = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in c.memory.items())
    comm = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(c.comm_bytes.items()) if v)
    # hidden = comm - (step - compute): rounding leaves ±1 ulp where nothing overlaps
    shown = c.hidden_comm_s > 1e-9 * c.comm_time_s
    hidden = f", {fmt_time(c.hidden_comm_s)} of it hidden" if shown else ""
    return [
        f"memory/device: {fmt_bytes(c.peak_bytes)} ({mem})",
        f"comm/step/device: {comm or 'none'}",
        f"estimated step: {fmt_time(c.step_time_s)} = compute "
        f"{fmt_time(c.compute_time_s)} + comm {fmt_time(c.comm_time_s)}{hidden} "
        f"({c.estimator}" + (f", priced on {topology})" if topology else ")"),
        *_ops_lines(c.ops),
    ]


def _stages_line(cost: Any) -> str:
    """Per-stage memory and the bubble's time, e.g. ``stages: memory/device d0
    70.1 GiB, d1 64.3 GiB; bubble 0.21 s``; past four stages, the first, the
    fullest middle one and the last."""
    mem = cost.stage_memory
    if len(mem) <= 4:
        parts = [f"d{d} {fmt_bytes(b)}" for d, b in enumerate(mem)]
    else:
        mid = max(range(1, len(mem) - 1), key=lambda d: (mem[d], -d))
        parts = [f"d0 {fmt_bytes(mem[0])}", f"d{mid} {fmt_bytes(mem[mid])} (fullest middle)"]
        parts.append(f"d{len(mem) - 1} {fmt_bytes(mem[-1])}")
    return f"stages: memory/device {', '.join(parts)}; bubble {fmt_time(cost.bubble_s)}"


def _flat(spec: P) -> tuple[str, ...]:
    out: list[str] = []
    for e in tuple(spec):
        if e is None:
            continue
        out.extend((e,) if isinstance(e, str) else e)
    return tuple(out)


def axes_text(axes: tuple[str, ...]) -> str:
    return axes[0] if len(axes) == 1 else "(" + ",".join(axes) + ")"


def spec_text(spec: P) -> str:
    parts = []
    for e in tuple(spec):
        parts.append("_" if e is None else e if isinstance(e, str) else "(" + ",".join(e) + ")")
    return "[" + ",".join(parts) + "]" if parts else "[]"


def _ops_lines(ops: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The table's ``ops`` section: one row per composite op and chosen strategy, with
    its forward and grad regions' counts (``op:grad`` keys are the grad regions)."""
    rows: dict[tuple[str, str], list[int]] = {}
    for key, per in ops.items():
        op, grad = key.removesuffix(":grad"), key.endswith(":grad")
        for strategy, n in per.items():
            rows.setdefault((op, strategy), [0, 0])[grad] += n
    if not rows:
        return []
    body = [("op", "strategy", "fwd", "grad")]
    body += [(op, name, str(f), str(g)) for (op, name), (f, g) in rows.items()]
    widths = [max(len(r[i]) for r in body) for i in range(4)]
    out = ["ops (strategy chosen per composite op; regions in the step):"]
    for r in body:
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return out
