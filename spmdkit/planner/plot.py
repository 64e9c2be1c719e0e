"""``plan.plot()``: the page of :mod:`spmdkit.planner.picture` as matplotlib figures.

Three figures, from the same data as the HTML page: the memory per device by
kind (one stacked bar), the predicted collectives of one step on a timeline
(one lane per pass, one bar per collective), and each parameter group's layout
over the mesh (a grid of devices per group, coloured by the shard each holds
and labelled with its index per dim). matplotlib is imported only here, when
called; without it :class:`MissingDependencyError` says what to install.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from spmdkit.errors import MissingDependencyError
from spmdkit.planner.picture import (
    KIND_COLOURS,
    MEMORY_COLOURS,
    PHASES,
    layout_cells,
    timeline,
)
from spmdkit.planner.provenance import ACTIVATIONS, group_key

__all__ = ["PlanFigures", "plot"]


@dataclass(frozen=True)
class PlanFigures:
    """``plan.plot()``'s figures (matplotlib ``Figure`` s).

    Attributes:
      memory: memory per device by kind.
      collectives: the predicted collectives of one step, lane by lane.
      layouts: each parameter group's layout over the mesh.
    """

    memory: Any
    collectives: Any
    layouts: Any


def plot(plan: Any, *, max_groups: int = 24) -> PlanFigures:
    """``plan`` drawn as three matplotlib figures (module docstring).

    Args:
      plan: a :class:`~spmdkit.planner.plans.Plan`.
      max_groups: the most parameter groups the layout figure draws (in the
        plan's order); the title says how many were left out.

    Raises:
      MissingDependencyError: matplotlib is not installed.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingDependencyError(
            op="Plan.plot",
            must="matplotlib is installed",
            given=f"no module {e.name!r}",
            fix='pip install "spmdkit[plot]" (or matplotlib), or use plan.to_html(path)',
        ) from None
    return PlanFigures(_memory(plt, plan), _collectives(plt, plan), _layouts(plt, plan, max_groups))


def _memory(plt: Any, plan: Any) -> Any:
    fig, ax = plt.subplots(figsize=(8, 1.6))
    memory = {k: v for k, v in (plan.cost.memory if plan.cost else {}).items() if v}
    left = 0.0
    for kind, n in memory.items():
        ax.barh(0, n / 2**20, left=left, color=MEMORY_COLOURS.get(kind, "#999"), label=kind)
        left += n / 2**20
    ax.set_yticks([])
    ax.set_xlabel("MiB per device")
    ax.set_title("memory per device" if memory else "memory per device: not costed")
    if memory:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6), ncol=len(memory), frameon=False)
    fig.tight_layout()
    return fig


def _collectives(plt: Any, plan: Any) -> Any:
    segments = timeline(plan)
    lanes = [lane for lane in (*PHASES, ACTIVATIONS) if any(s.lane == lane for s in segments)]
    fig, ax = plt.subplots(figsize=(10, 0.6 * max(len(lanes), 1) + 1.2))
    seen = set()
    for i, lane in enumerate(lanes):
        for s in (s for s in segments if s.lane == lane):
            label = s.kind if s.kind not in seen else None
            seen.add(s.kind)
            ax.barh(
                i,
                s.time_s * 1e3,
                left=s.start_s * 1e3,
                color=KIND_COLOURS.get(s.kind, "#999"),
                edgecolor="white",
                linewidth=0.3,
                label=label,
            )
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("modelled time per step (ms)")
    if segments:
        ax.set_title("predicted collectives of one step")
        ax.legend(loc="lower right", fontsize="small")
    else:
        ax.set_title("no equations recorded (the analytic estimator)")
    fig.tight_layout()
    return fig


def _layouts(plt: Any, plan: Any, max_groups: int) -> Any:
    groups: dict[tuple, list[str]] = {}
    for path, spec in plan.params.items():
        groups.setdefault((group_key(path), spec), []).append(path)
    shown = list(groups.items())[:max_groups]
    ncols = min(4, max(len(shown), 1))
    nrows = max(math.ceil(len(shown) / ncols), 1)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.2 * nrows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, ((key, spec), paths) in zip(axes.flat, shown, strict=False):
        shape = plan.info.get(paths[0], ((),))[0]
        cells = layout_cells(plan.mesh, spec, len(shape))
        nr, nc = max(c.row for c in cells) + 1, max(c.col for c in cells) + 1
        cmap = plt.get_cmap("hsv")
        for c in cells:
            colour = cmap(c.block / c.blocks) if c.blocks > 1 else (0.85, 0.85, 0.85, 1)
            xy = (c.col, nr - 1 - c.row)
            ax.add_patch(plt.Rectangle(xy, 0.95, 0.95, color=colour, alpha=0.5))
            if nc * nr <= 64 and shape:
                ax.text(
                    c.col + 0.47,
                    nr - 0.53 - c.row,
                    ",".join(map(str, c.shard)),
                    ha="center",
                    va="center",
                    fontsize=7,
                )
        ax.set_xlim(0, nc)
        ax.set_ylim(0, nr)
        ax.set_aspect("equal")
        dims = ",".join(
            "_" if e is None else e if isinstance(e, str) else "+".join(e) for e in tuple(spec)
        )
        ax.set_title(f"{key} ({len(paths)})\n[{dims}]", fontsize=8)
    left_out = len(groups) - len(shown)
    fig.suptitle("layouts over the mesh" + (f" ({left_out} groups not drawn)" if left_out else ""))
    fig.tight_layout()
    return fig
