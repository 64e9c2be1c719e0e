"""``plan.to_html(path)``: a plan drawn as one self-contained HTML page.

The page needs nothing but a browser (inline CSS and SVG, no script, no
network). It shows, from the plan as data (nothing is traced again):

* the **header**: strategy, mesh, topology, the cost summary;
* **memory per device** by kind (parameters, gradients, optimizer state,
  activations), as one stacked bar;
* every **tensor's layout** over the mesh: per parameter group (parameters of
  one role in different layers share a layout), a grid of the mesh's devices
  (the leading axes down, the rest across), each device coloured by the shard
  of the tensor it holds and labelled with that shard's index per dim; devices
  of one colour hold copies of one shard. The optimizer state gets its own
  grid where its layout differs; the model state and the batch fields follow;
* the predicted **collectives of one step** on a timeline: one lane per pass
  (forward, backward, update) whose segments are the collectives each
  parameter group's equations run, as wide as their modelled time, and one
  lane for what moves no parameter; with a verify report, the compiled
  figures next to the predicted ones.

:func:`layout_cells` and :func:`timeline` are the data both this page and
``plan.plot()`` draw.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.sharding import Mesh

from spmdkit.planner.logical import PlanError
from spmdkit.planner.provenance import ACTIVATIONS, group_key
from spmdkit.spec import axis_sizes
from spmdkit.util import fmt_bytes, fmt_time

__all__ = ["Cell", "Segment", "layout_cells", "timeline", "to_html"]

#: The passes of the timeline, in step order.
PHASES = ("forward", "backward", "update")

#: Memory kinds in the order the bar stacks them, with their colours.
MEMORY_COLOURS = {
    "params": "#4e79a7",
    "grads": "#f28e2b",
    "opt_state": "#59a14f",
    "activations": "#e15759",
}

#: Collective kinds' colours (others: grey).
KIND_COLOURS = {
    "all_gather": "#4e79a7",
    "all_reduce": "#e15759",
    "reduce_scatter": "#f28e2b",
    "all_to_all": "#76b7b2",
    "collective_permute": "#b07aa1",
}


# -- the data --------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One device of a layout grid.

    Attributes:
      row: its row in the grid (the leading mesh axes).
      col: its column (the other mesh axes).
      device: its position in the mesh, row-major (a device mesh's device id).
      shard: per tensor dim, the index of the shard the device holds.
      block: the shard's number among all shards (row-major over ``shard``).
      blocks: how many distinct shards the tensor is cut into.
    """

    row: int
    col: int
    device: int
    shard: tuple[int, ...]
    block: int
    blocks: int


@dataclass(frozen=True)
class Segment:
    """One predicted collective on the step's timeline.

    Attributes:
      lane: ``"forward"``, ``"backward"``, ``"update"`` or :data:`ACTIVATIONS`.
      start_s: where it starts in its lane (the lane's earlier segments' time).
      time_s: its modelled time per step (all members of its group, all runs).
      kind: the collective kind.
      axes: the mesh axes it runs over.
      nbytes: payload bytes per device per step.
      owner: the parameter group it moves (or :data:`ACTIVATIONS`).
      source: the equation's source line (empty for activations).
    """

    lane: str
    start_s: float
    time_s: float
    kind: str
    axes: tuple[str, ...]
    nbytes: int
    owner: str
    source: str = ""


def grid_axes(mesh: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes drawn down (the leading half) and across (the rest)."""
    names = tuple(axis_sizes(mesh))
    k = len(names) // 2 if len(names) > 1 else 0
    return names[:k], names[k:]


def layout_cells(mesh: Any, spec: Any, ndim: int) -> list[Cell]:
    """Each device of ``mesh`` with the shard of a tensor laid out by ``spec``
    (a ``PartitionSpec``) it holds, in mesh order.

    Example::

        >>> cells = layout_cells(sk.abstract_mesh(data=2, model=4), P("data", None), 2)
        >>> cells[5].shard, cells[5].blocks
        ((1, 0), 2)
    """
    sizes = axis_sizes(mesh)
    names = list(sizes)
    ncols = math.prod(sizes[a] for a in grid_axes(mesh)[1])
    entries = list(tuple(spec)) + [None] * (ndim - len(tuple(spec)))
    dims = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]
    counts = [math.prod(sizes[a] for a in d) for d in dims]
    blocks = math.prod(counts)
    ids = _device_ids(mesh)
    cells = []
    for i, coord in enumerate(np.ndindex(*sizes.values())):
        at = dict(zip(names, coord, strict=True))
        shard = []
        for d in dims:
            index = 0
            for a in d:
                index = index * sizes[a] + at[a]
            shard.append(index)
        block = 0
        for index, n in zip(shard, counts, strict=True):
            block = block * n + index
        cells.append(Cell(i // ncols, i % ncols, ids[i], tuple(shard), block, blocks))
    return cells


def _device_ids(mesh: Any) -> list[int]:
    if isinstance(mesh, Mesh):
        return [int(d.id) for d in mesh.devices.flat]
    return list(range(math.prod(axis_sizes(mesh).values())))


def timeline(plan: Any) -> list[Segment]:
    """The predicted collectives of one step of ``plan``, lane by lane.

    A parameter group's collectives come from its recorded equations (one
    member's, times the group's members); what moves no parameter is one
    segment per collective kind, its bucket's modelled time split by bytes.
    Empty when the plan records no equations (the analytic estimator).
    """
    prov = plan.provenance
    if prov is None:
        return []
    members: dict[str, int] = {}
    for path in plan.params:
        members[group_key(path)] = members.get(group_key(path), 0) + 1
    ends = dict.fromkeys((*PHASES, ACTIVATIONS), 0.0)
    out: list[Segment] = []
    for key, uses in prov.uses.items():
        n = members.get(key, 1)
        for use in uses:
            lane = use.phase if use.phase in PHASES else "update"
            for m in use.moves:
                t = m.time_s * m.runs * n
                nbytes = m.payload_bytes * m.runs * n
                out.append(Segment(lane, ends[lane], t, m.kind, m.axes, nbytes, key, use.source))
                ends[lane] += t
    if prov.uses:
        rest = prov.comm_bytes.get(ACTIVATIONS, {})
        total = sum(rest.values())
        for kind, nbytes in sorted(rest.items()):
            if not nbytes:
                continue
            t = prov.comm_time_s.get(ACTIVATIONS, 0.0) * nbytes / total if total else 0.0
            out.append(Segment(ACTIVATIONS, ends[ACTIVATIONS], t, kind, (), nbytes, ACTIVATIONS))
            ends[ACTIVATIONS] += t
    return out


# -- the page --------------------------------------------------------------------------


def to_html(plan: Any, path: str | os.PathLike | None = None, *, report: Any = None) -> str:
    """The page (module docstring) of ``plan``, written to ``path`` when given.

    Args:
      plan: a :class:`~spmdkit.planner.plans.Plan`.
      path: the file to write; None: only return the text.
      report: a verify report (``plan.verify(step, ...)``): its predicted and
        compiled figures are shown under the timeline.

    Returns:
      The HTML text.

    Raises:
      PlanError: ``path`` is a directory or its directory does not exist.
    """
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path) or not os.path.isdir(folder):
            raise PlanError(
                op="Plan.to_html",
                must="path names a file in an existing directory",
                given=str(path),
                fix="pass a file path, e.g. plan.to_html('plan.html')",
            )
    sizes = axis_sizes(plan.mesh)
    mesh_text = " × ".join(f"{k}={v}" for k, v in sizes.items())
    title = f"Plan {plan.strategy!r} on {mesh_text}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        _header(plan, sizes),
        "<h2>Memory per device</h2>",
        _memory(plan),
        "<h2>Collectives of one step</h2>",
        _timeline_svg(plan),
    ]
    if report is not None:
        parts.append(_report(report))
    parts += ["<h2>Layouts over the mesh</h2>", _layouts(plan), "</body></html>"]
    text = "\n".join(parts)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1200px}
h1{font-size:1.4em}h2{font-size:1.15em;border-bottom:1px solid #ccc;margin-top:1.6em}
table{border-collapse:collapse;font-size:.9em}td,th{padding:2px 8px;text-align:left}
th{background:#f0f0f0}.tensor{display:inline-block;vertical-align:top;margin:6px;
padding:6px;border:1px solid #ddd;border-radius:4px}.tensor code{font-size:.85em}
.paths{font-size:.75em;color:#555;max-width:360px;word-break:break-all}
.note{color:#555;font-size:.9em}.bad{color:#b00}svg text{font-family:monospace}
"""


def _e(text: object) -> str:
    return html.escape(str(text))


def _header(plan: Any, sizes: Mapping[str, int]) -> str:
    rows = [
        ("strategy", plan.strategy + (f" (chose {plan.chosen})" if plan.chosen else "")),
        (
            "mesh",
            f"{', '.join(f'{k}={v}' for k, v in sizes.items())} "
            f"({math.prod(sizes.values())} devices)",
        ),
    ]
    if plan.topology:
        rows.append(("priced on", plan.topology))
    if plan.cost is not None:
        rows.append(("cost", plan.cost.summary()))
    if not plan.recipe.is_default:
        rows.append(("recipe", plan.recipe.short()))
    acts = ", ".join(f"{k}→{','.join(v)}" for k, v in plan.activation.items() if v)
    rows.append(("activations", acts or "replicated"))
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    notes = "".join(f"<li>{_e(n)}</li>" for n in plan.notes)
    return f"<table>{body}</table>" + (f"<ul class='note'>{notes}</ul>" if notes else "")


def _memory(plan: Any) -> str:
    if plan.cost is None:
        return "<p class='note'>not costed: the plan has no memory estimate.</p>"
    memory = {k: v for k, v in plan.cost.memory.items() if v}
    total = sum(memory.values()) or 1
    width, x, rects, rows = 800, 0.0, [], []
    for kind, n in memory.items():
        w = width * n / total
        colour = MEMORY_COLOURS.get(kind, "#999")
        rects.append(
            f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="28" fill="{colour}">'
            f"<title>{_e(kind)}: {fmt_bytes(n)}</title></rect>"
        )
        rows.append(
            f"<tr><td><svg width='12' height='12'><rect width='12' height='12' "
            f"fill='{colour}'/></svg> {_e(kind)}</td><td>{fmt_bytes(n)}</td></tr>"
        )
        x += w
    rows.append(f"<tr><th>per device</th><th>{fmt_bytes(plan.cost.peak_bytes)}</th></tr>")
    svg = f'<svg width="{width}" height="30" role="img">{"".join(rects)}</svg>'
    return svg + f"<table>{''.join(rows)}</table>"


def _timeline_svg(plan: Any) -> str:
    segments = timeline(plan)
    by_kind = plan.cost.comm_bytes if plan.cost is not None else {}
    kinds = "".join(
        f"<tr><td>{_e(k)}</td><td>{fmt_bytes(n)}</td></tr>" for k, n in by_kind.items() if n
    )
    table = f"<table><tr><th>kind</th><th>bytes per device</th></tr>{kinds}</table>"
    if not segments:
        why = (
            "no collectives predicted"
            if plan.provenance and plan.provenance.uses
            else ("no equations recorded (the analytic estimator): the totals per kind only")
        )
        return f"<p class='note'>{_e(why)}.</p>" + table
    lanes = [lane for lane in (*PHASES, ACTIVATIONS) if any(s.lane == lane for s in segments)]
    span = max(s.start_s + s.time_s for s in segments) or 1.0
    left, width, lane_h = 90, 860, 26
    parts = []
    for i, lane in enumerate(lanes):
        y = i * (lane_h + 6)
        parts.append(f'<text x="0" y="{y + 17}" font-size="12">{_e(lane[:11])}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{width}" height="{lane_h}" fill="#f6f6f6"/>')
        for s in (s for s in segments if s.lane == lane):
            x = left + width * s.start_s / span
            w = max(width * s.time_s / span, 0.5)
            tip = (
                f"{s.owner}: {s.kind}({','.join(s.axes)}) {fmt_bytes(s.nbytes)}, "
                f"{fmt_time(s.time_s)}" + (f" at {s.source}" if s.source else "")
            )
            parts.append(
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{lane_h}" '
                f'fill="{KIND_COLOURS.get(s.kind, "#999")}" stroke="#fff" stroke-width="0.5">'
                f"<title>{_e(tip)}</title></rect>"
            )
    h = len(lanes) * (lane_h + 6) + 16
    parts.append(
        f'<text x="{left}" y="{h - 2}" font-size="11">0</text>'
        f'<text x="{left + width}" y="{h - 2}" font-size="11" text-anchor="end">'
        f"{_e(fmt_time(span))}</text>"
    )
    legend = " ".join(
        f"<svg width='12' height='12'><rect width='12' height='12' fill='{c}'/></svg> {_e(k)}"
        for k, c in KIND_COLOURS.items()
        if any(s.kind == k for s in segments)
    )
    note = (
        "<p class='note'>Modelled time per step; a lane's segments in the order of the "
        "parameter groups, not of the compiled schedule. Hover a segment for its tensor, "
        "bytes and source line.</p>"
    )
    svg = f'<svg width="{left + width + 10}" height="{h}" role="img">{"".join(parts)}</svg>'
    return f"<div>{svg}</div><p>{legend}</p>{note}{table}"


def _report(report: Any) -> str:
    rows = "".join(
        f"<tr><td>{_e(what)}</td><td>{_e(_num(p))}</td><td>{_e(_num(c))}</td>"
        f"<td class='{'' if ok else 'bad'}'>{'ok' if ok else 'MISMATCH'}</td></tr>"
        for what, p, c, ok in report.rows
    )
    misses = "".join(f"<li>{_e(m)}</li>" for m in report.mismatches)
    return (
        "<h3>Predicted and compiled</h3><table><tr><th></th><th>predicted</th>"
        f"<th>compiled</th><th></th></tr>{rows}</table>"
        + (f"<ul class='bad'>{misses}</ul>" if misses else "<p>verified: ok</p>")
    )


def _num(n: Any) -> str:
    return fmt_bytes(n) if isinstance(n, int | np.integer) and abs(n) >= 1024 else str(n)


def _layouts(plan: Any) -> str:
    groups: dict[tuple, list[str]] = {}
    for path, spec in plan.params.items():
        groups.setdefault((group_key(path), spec, plan.opt.get(path, spec), "param"), []).append(
            path
        )
    for path, spec in plan.state.items():
        groups.setdefault((group_key(path), spec, spec, "state"), []).append(path)
    cards = []
    for (key, spec, ospec, what), paths in groups.items():
        shape, dtype, logical = plan.info.get(paths[0], ((), "float32", None))
        grids = _grid(plan.mesh, spec, len(shape), shape, "layout")
        if what == "param" and ospec != spec:
            grids += _grid(plan.mesh, ospec, len(shape), shape, "optimizer state")
        names = "-" if logical is None else ",".join(n or "_" for n in logical)
        shown = "×".join(map(str, shape)) or "scalar"
        members = "".join(f"<div>{_e(p)}</div>" for p in paths)
        cards.append(
            f"<div class='tensor'><b>{_e(key)}</b> <span class='note'>({what}, "
            f"{len(paths)} tensor{'s' if len(paths) > 1 else ''})</span><br>"
            f"<code>{_e(shown)} {_e(dtype)}</code> logical <code>{_e(names)}</code> "
            f"spec <code>{_e(_spec_text(spec))}</code><br>{grids}"
            f"<details class='paths'><summary>tensors</summary>{members}</details></div>"
        )
    batch = "".join(
        f"<tr><td>{_e(field)}</td><td>{_e(','.join(n or '_' for n in names))}</td><td>"
        + _e(",".join("+".join(plan.activation.get(n, ()) or ("_",)) for n in names))
        + "</td></tr>"
        for field, names in plan.batch_axes.items()
    )
    table = (
        "<h3>Batch</h3><table><tr><th>field</th><th>logical</th><th>mesh axes</th></tr>"
        f"{batch}</table>"
        if batch
        else ""
    )
    return "".join(cards) + table


def _grid(mesh: Any, spec: Any, ndim: int, shape: Sequence[int], label: str) -> str:
    cells = layout_cells(mesh, spec, ndim)
    sizes = axis_sizes(mesh)
    down, across = grid_axes(mesh)
    nrows = max(c.row for c in cells) + 1
    ncols = max(c.col for c in cells) + 1
    size = 30 if len(cells) <= 64 else 14 if len(cells) <= 512 else 6
    top, left = 16, 4
    parts = [
        f'<text x="{left}" y="11" font-size="10">{_e(label)}: '
        f"{_e('×'.join(across) or '-')} across, {_e('×'.join(down) or '-')} down</text>"
    ]
    local = [n // max(math.prod(sizes[a] for a in _dim(spec, i)), 1) for i, n in enumerate(shape)]
    for c in cells:
        hue = 360 * c.block / c.blocks if c.blocks > 1 else 0
        fill = f"hsl({hue:.0f},55%,{70 if c.blocks > 1 else 88}%)"
        x, y = left + c.col * size, top + c.row * size
        tip = f"device {c.device}: shard {c.shard} of shape {tuple(local)}"
        parts.append(
            f'<rect x="{x}" y="{y}" width="{size - 1}" height="{size - 1}" fill="{fill}">'
            f"<title>{_e(tip)}</title></rect>"
        )
        if size >= 30 and ndim:
            parts.append(
                f'<text x="{x + size / 2 - 0.5}" y="{y + size / 2 + 3}" font-size="9" '
                f'text-anchor="middle">{_e(",".join(map(str, c.shard)))}</text>'
            )
    w = max(left + ncols * size, 200)
    h = top + nrows * size + 2
    return f'<svg width="{w}" height="{h}" role="img">{"".join(parts)}</svg><br>'


def _dim(spec: Any, i: int) -> tuple[str, ...]:
    entries = tuple(spec)
    e = entries[i] if i < len(entries) else None
    return () if e is None else (e,) if isinstance(e, str) else tuple(e)


def _spec_text(spec: Any) -> str:
    dims = [_dim(spec, i) for i in range(len(tuple(spec)))]
    return "[" + ",".join("_" if not d else "+".join(d) for d in dims) + "]"
