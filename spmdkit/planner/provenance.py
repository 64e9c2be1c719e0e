"""A plan's provenance: what its cost is made of, tensor by tensor, kept with the plan.

:class:`Provenance` is plain data a :class:`~spmdkit.planner.plans.Plan` carries
(and writes to JSON) so that ``plan.explain`` and ``sk.diff`` can answer without
the model:

* per parameter group (parameters of one role in different layers, keyed by the
  path with layer numbers as ``*``): the equations that read, moved and updated
  its tensors in the propagated step (:class:`~spmdkit.propagation.provenance.Use`,
  from one member: the others are laid out alike), the collectives' bytes per
  kind and time that move them, and the bytes per device its parameters and
  optimizer state hold;
* the same bytes and time for what moves no parameter (:data:`ACTIVATIONS`), so
  the buckets add up to the plan's totals;
* per ``checkpoint_name`` in the model, how that activation's layout was decided;
* for ``auto``: per group, the layouts the search costed for it
  (:class:`LayoutOption`), the chosen one and the best others.

Built by :func:`from_propagation` when the plan's cost is propagated (the
analytic estimator leaves the equations out) and
:func:`~spmdkit.planner.candidates.group_choices`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax

from spmdkit.propagation.provenance import ACTIVATIONS, Move, Use, trails
from spmdkit.propagation.records import Propagation
from spmdkit.util import path_str

__all__ = [
    "ACTIVATIONS",
    "GroupChoice",
    "LayoutOption",
    "Provenance",
    "from_propagation",
    "group_key",
]

#: Most of a group's other costed layouts a plan keeps (the fastest).
MAX_OPTIONS = 8


def group_key(path: str) -> str:
    """A parameter's group: its path with layer numbers as ``*``.

    Example::

        >>> group_key("layers/3/mlp/up")
        'layers/*/mlp/up'
    """
    return re.sub(r"(^|/)\d+(?=/|$)", r"\1*", path)


@dataclass(frozen=True)
class LayoutOption:
    """One layout the search costed for a parameter group (the analytic model's
    figures for all its members together, as the search compared them).

    Attributes:
      params: the parameters' dims, one tuple of mesh axes per dim.
      opt: the optimizer state's dims.
      grads_sharded: the gradient kept at the optimizer state's dims (ZeRO-2).
      time_s: exposed communication plus compute of the group alone.
      comm_bytes: payload bytes of its collectives per device per step.
      memory_bytes: parameters, gradients and optimizer state per device.
    """

    params: tuple[tuple[str, ...], ...]
    opt: tuple[tuple[str, ...], ...]
    grads_sharded: bool
    time_s: float
    comm_bytes: int
    memory_bytes: int

    def spec_text(self) -> str:
        """E.g. ``[data,_] opt [data,model]``."""
        text = _dims_text(self.params)
        if self.opt != self.params:
            text += f" opt {_dims_text(self.opt)}"
        return text + (" grads like opt" if self.grads_sharded else "")

    def to_json(self) -> list:
        """JSON-able list."""
        return [
            [list(d) for d in self.params],
            [list(d) for d in self.opt],
            self.grads_sharded,
            self.time_s,
            self.comm_bytes,
            self.memory_bytes,
        ]

    @classmethod
    def from_json(cls, d: Sequence) -> LayoutOption:
        """Inverse of :meth:`to_json`."""
        dims = lambda x: tuple(tuple(a) for a in x)  # noqa: E731
        return cls(dims(d[0]), dims(d[1]), bool(d[2]), float(d[3]), int(d[4]), int(d[5]))


@dataclass(frozen=True)
class GroupChoice:
    """The search's choice for one parameter group.

    Attributes:
      chosen: the layout the plan has.
      others: the fastest other layouts costed (at most :data:`MAX_OPTIONS`).
      costed: how many layouts the search costed for the group.
      batch_axes: the batch axes they were costed with.
    """

    chosen: LayoutOption
    others: tuple[LayoutOption, ...]
    costed: int
    batch_axes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        """JSON-able dict."""
        return {
            "chosen": self.chosen.to_json(),
            "others": [o.to_json() for o in self.others],
            "costed": self.costed,
            "batch_axes": list(self.batch_axes),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> GroupChoice:
        """Inverse of :meth:`to_json`."""
        return cls(
            LayoutOption.from_json(d["chosen"]),
            tuple(LayoutOption.from_json(o) for o in d["others"]),
            int(d["costed"]),
            tuple(d.get("batch_axes", ())),
        )


@dataclass(frozen=True)
class Provenance:
    """Where a plan's layouts and costs come from, per parameter group (module docstring).

    Attributes:
      uses: group key → the equations that read, moved or updated one member.
      named: ``checkpoint_name`` → the equations that made and read it.
      comm_bytes: bucket (a group key, or :data:`ACTIVATIONS`) → collective kind →
        payload bytes per device per step; summed over buckets, the propagated
        step's bytes by kind.
      comm_time_s: bucket → modelled collective time per step.
      kind_time_s: collective kind → modelled time per step.
      memory: group key → bytes per device its parameters and optimizer state hold.
      groups: ``auto``: group key → the search's :class:`GroupChoice`.
      pinned: the groups whose layout the model pins in mesh axes.
    """

    uses: Mapping[str, tuple[Use, ...]] = field(default_factory=dict)
    named: Mapping[str, tuple[Use, ...]] = field(default_factory=dict)
    comm_bytes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    comm_time_s: Mapping[str, float] = field(default_factory=dict)
    kind_time_s: Mapping[str, float] = field(default_factory=dict)
    memory: Mapping[str, int] = field(default_factory=dict)
    groups: Mapping[str, GroupChoice] = field(default_factory=dict)
    pinned: tuple[str, ...] = ()

    def with_groups(self, groups: Mapping[str, GroupChoice]) -> Provenance:
        """The same provenance with the search's choices."""
        return replace(self, groups=dict(groups))

    def to_json(self) -> dict:
        """JSON-able dict."""
        return {
            "uses": {k: [_use_json(u) for u in v] for k, v in self.uses.items()},
            "named": {k: [_use_json(u) for u in v] for k, v in self.named.items()},
            "comm_bytes": {k: dict(v) for k, v in self.comm_bytes.items()},
            "comm_time_s": dict(self.comm_time_s),
            "kind_time_s": dict(self.kind_time_s),
            "memory": dict(self.memory),
            "groups": {k: g.to_json() for k, g in self.groups.items()},
            "pinned": list(self.pinned),
        }

    @classmethod
    def from_json(cls, d: Mapping | None) -> Provenance | None:
        """Inverse of :meth:`to_json` (None stays None)."""
        if d is None:
            return None
        return cls(
            uses={k: tuple(_use_from(u) for u in v) for k, v in d.get("uses", {}).items()},
            named={k: tuple(_use_from(u) for u in v) for k, v in d.get("named", {}).items()},
            comm_bytes={
                k: {kind: int(n) for kind, n in v.items()}
                for k, v in d.get("comm_bytes", {}).items()
            },
            comm_time_s={k: float(v) for k, v in d.get("comm_time_s", {}).items()},
            kind_time_s={k: float(v) for k, v in d.get("kind_time_s", {}).items()},
            memory={k: int(v) for k, v in d.get("memory", {}).items()},
            groups={k: GroupChoice.from_json(g) for k, g in d.get("groups", {}).items()},
            pinned=tuple(d.get("pinned", ())),
        )


def _use_json(u: Use) -> list:
    moves = [[m.kind, list(m.axes), m.payload_bytes, m.time_s, m.runs] for m in u.moves]
    return [u.primitive, u.op, u.strategy, u.phase, u.decided, u.source, u.spec, moves, u.runs]


def _use_from(d: Sequence) -> Use:
    moves = tuple(Move(m[0], tuple(m[1]), int(m[2]), float(m[3]), int(m[4])) for m in d[7])
    return Use(d[0], d[1], d[2], d[3], d[4], d[5], d[6], moves, int(d[8]))


def _dims_text(dims: Sequence[Sequence[str]]) -> str:
    parts = ["_" if not d else d[0] if len(d) == 1 else "(" + ",".join(d) + ")" for d in dims]
    return "[" + ",".join(parts) + "]"


# -- building ---------------------------------------------------------------------------


def from_propagation(
    prop: Propagation, params: Any, opt_state: Any, *, opt_position: int
) -> Provenance:
    """The provenance of a propagated train step whose flat inputs start with
    ``params``' leaves and whose flat outputs start with the updated ones;
    ``opt_state``'s leaves start at flat input ``opt_position``.

    The step's buckets are per group: one member's uses are kept (its
    siblings are laid out alike), every member's bytes are summed.
    """
    paths = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    labels = dict(enumerate(paths))
    t = trails(prop, labels, labels)
    first: dict[str, str] = {}
    for p in paths:
        first.setdefault(group_key(p), p)
    uses = {k: t.uses.get(p, ()) for k, p in first.items()}
    comm: dict[str, dict[str, int]] = {}
    time: dict[str, float] = {}
    for bucket, per in t.bytes.items():
        key = bucket if bucket == ACTIVATIONS else group_key(bucket)
        into = comm.setdefault(key, {})
        for kind, n in per.items():
            into[kind] = into.get(kind, 0) + n
        time[key] = time.get(key, 0.0) + t.time_s.get(bucket, 0.0)
    memory = _held(prop, paths, opt_state, opt_position)
    return Provenance(uses, t.named, comm, time, dict(t.kind_time_s), memory)


def _held(prop: Propagation, paths: list[str], opt_state: Any, at: int) -> dict[str, int]:
    """Per group, the bytes per device of its parameters and of the optimizer
    state leaves that end with one of its members' paths (and have its shape)."""
    mesh = prop.mesh
    out: dict[str, int] = {}
    shapes: dict[str, tuple] = {}
    for i, p in enumerate(paths):
        spec = prop.in_specs[i]
        shapes[p] = spec.shape
        out[group_key(p)] = out.get(group_key(p), 0) + spec.local_bytes(mesh)
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    by_len = sorted(paths, key=len, reverse=True)
    for j, (kp, _) in enumerate(leaves):
        spec = prop.in_specs[at + j]
        path = path_str(kp)
        ends = (p for p in by_len if path == p or path.endswith("/" + p))
        owner = next((p for p in ends if shapes[p] == spec.shape), None)
        if owner is not None:
            out[group_key(owner)] += spec.local_bytes(mesh)
    return out
