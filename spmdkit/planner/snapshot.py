"""``plan.snapshot(path)``: a plan's shardings as JSON, to pin layouts in tests.

The layout follows MaxText's golden sharding dumps
(``tests/utils/sharding_info/<model>/<topology>/*.json``), all three in one file:

* ``named_shardings``: per tensor path (``params/<path>``, ``opt/<path>``,
  ``state/<path>``) its ``partition_spec`` (per dim: null, an axis, or a list of
  axes), ``shape`` and ``mesh`` (``axis_names``, ``shape`` per axis);
* ``logical_shardings``: per tensor path its logical axes (``partition_spec`` of
  logical names, null for an unnamed dim) and ``shape``;
* ``input_shardings``: the step's batch inputs: per batch field
  (``batch/<field>``) its logical axes and ``partition_spec``.

:func:`snapshot_diff` compares two snapshots tensor by tensor;
:func:`spmdkit.testing.assert_plan_matches` raises with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from jax.sharding import PartitionSpec as P

__all__ = ["FORMAT", "snapshot_diff", "snapshot_dict", "write_snapshot"]

#: The ``format`` field of a snapshot.
FORMAT = "spmdkit-plan-snapshot/1"


def _spec_json(spec: P) -> list:
    return [e if e is None or isinstance(e, str) else list(e) for e in tuple(spec)]


def _batch_spec(names: tuple, activation: Mapping[str, tuple[str, ...]]) -> P:
    """A batch field's spec from its logical names (``Plan.batch_spec`` without
    the shape: an axis an earlier dim took is dropped)."""
    used: set[str] = set()
    out: list[Any] = []
    for name in names:
        axes = tuple(a for a in activation.get(name, ()) if a not in used) if name else ()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def snapshot_dict(plan: Any) -> dict:
    """The snapshot of ``plan`` (a :class:`~spmdkit.planner.plans.Plan`) as a dict
    (module docstring)."""
    mesh = {"axis_names": list(plan.mesh.axis_names), "shape": dict(plan.mesh.shape)}
    named: dict[str, dict] = {}
    logical: dict[str, dict] = {}
    for kind, table in (("params", plan.params), ("opt", plan.opt), ("state", plan.state)):
        for path, spec in sorted(table.items()):
            shape, _, names = plan.info.get(path, ((), "float32", None))
            key = f"{kind}/{path}"
            named[key] = {"mesh": mesh, "partition_spec": _spec_json(spec), "shape": list(shape)}
            logical[key] = {
                "partition_spec": None if names is None else list(names),
                "shape": list(shape),
            }
    inputs = {
        f"batch/{field}": {
            "logical_axes": list(names),
            "partition_spec": _spec_json(_batch_spec(tuple(names), plan.activation)),
        }
        for field, names in sorted(plan.batch_axes.items())
    }
    return {
        "format": FORMAT,
        "strategy": plan.strategy,
        "mesh": mesh,
        "activation": {k: list(v) for k, v in plan.activation.items()},
        "named_shardings": named,
        "logical_shardings": logical,
        "input_shardings": inputs,
    }


def write_snapshot(plan: Any, path: str | os.PathLike) -> None:
    """Write :func:`snapshot_dict` of ``plan`` to ``path`` as indented JSON (its
    folder made if missing)."""
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(snapshot_dict(plan), f, indent=1, sort_keys=False)
        f.write("\n")


def _text(spec: Any) -> str:
    if spec is None:
        return "-"
    return (
        "["
        + ",".join(
            "_" if e is None else e if isinstance(e, str) else "(" + ",".join(e) + ")" for e in spec
        )
        + "]"
    )


def snapshot_diff(stored: Mapping, new: Mapping) -> list[str]:
    """What differs between two snapshots, one line per tensor (``tensor: stored
    spec -> new spec``), the mesh and tensors only one of them has; empty: they
    match. Layouts, logical axes and shapes are compared; the strategy is not
    (an auto plan may pick another candidate with the same layouts)."""
    lines: list[str] = []
    if stored.get("mesh") != new.get("mesh"):
        lines.append(f"mesh: stored {stored.get('mesh')} -> new {new.get('mesh')}")
    sections = (
        ("named_shardings", "spec"),
        ("logical_shardings", "logical axes"),
        ("input_shardings", "input"),
    )
    for section, what in sections:
        old_t, new_t = stored.get(section, {}), new.get(section, {})
        for key in sorted(set(old_t) | set(new_t)):
            if key not in new_t:
                lines.append(f"{key}: stored, not in the new plan")
                continue
            if key not in old_t:
                lines.append(f"{key}: new, not in the stored snapshot")
                continue
            a, b = old_t[key], new_t[key]
            if a.get("shape") != b.get("shape"):
                lines.append(f"{key}: shape stored {a.get('shape')} -> new {b.get('shape')}")
            if a.get("partition_spec") != b.get("partition_spec"):
                lines.append(
                    f"{key}: {what} stored {_text(a.get('partition_spec'))} "
                    f"-> new {_text(b.get('partition_spec'))}"
                )
            if a.get("logical_axes") != b.get("logical_axes"):
                lines.append(
                    f"{key}: logical axes stored {a.get('logical_axes')} "
                    f"-> new {b.get('logical_axes')}"
                )
    return lines
