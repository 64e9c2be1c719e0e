"""Plans: how every parameter, optimizer state and batch tensor is laid out on one mesh.

A :class:`Plan` is plain data: a mesh, a ``PartitionSpec`` per parameter path,
one per parameter for its optimizer state (they differ under ZeRO-1), and the
mesh axes of each logical activation dim of the batch (``batch``, ``seq``). It
hands out pytrees of ``NamedSharding`` / ``ShapeDtypeStruct`` that ``jax.jit``,
flax and orbax take directly, prints as a table, and round-trips through JSON.

Logical-axis rules
------------------
Models name dims logically (``"embed"``, ``"mlp"``, ``"heads"``); a
:class:`LogicalRules` table maps names to mesh axes. Entries are ordered
fallbacks, as in flax/MaxText tables: for each dim, the first entry for its name
whose mesh axes are all still free in that array *and* divide the dim wins; an
entry of ``None`` means replicated; if no entry fits, the dim is replicated. A
name with no entry at all raises :class:`UnknownLogicalAxisError` (flax's
``logical_to_mesh_sharding`` silently replicates it instead).

Presets and axis roles
----------------------
Presets are rule tables over four *roles*: ``data`` (batch), ``fsdp`` (parameter
sharding that also splits the batch), ``model`` (tensor parallel) and ``expert``.
Mesh axes are given roles by name when they are named ``data``/``dp``/``batch``,
``fsdp``, ``model``/``tensor``/``tp``, ``expert``/``ep`` (a missing ``fsdp`` role
falls back to the data axes, a missing ``expert`` role to the model axes, else the
last axis; a missing ``model`` role stays empty, so ``megatron`` on a mesh with only
a ``data`` axis is data parallel). When no axis has such a name, roles go by
position: one axis plays every role; two axes are ``(data=fsdp, model=expert)``;
three or more are ``(data, fsdp..., model=expert)``.

======== ===================================================================
preset   layout
======== ===================================================================
dp       batch over every axis; params, grads, optimizer state replicated
fsdp     batch over every axis; every param sharded over every axis (ZeRO-3)
zero1    as dp, but optimizer state sharded as in fsdp
megatron batch over data axes; column/row-parallel attention and MLP, vocab-
         parallel embedding and head over the model axes (Megatron-LM TP)
megatron_sp  megatron plus the sequence dim of activations over the model axes
tp_fsdp  megatron over the model axes + fsdp (embed dim) over the data axes
ep       batch over every axis; experts over the expert axes
======== ===================================================================

Cost model
----------
Two estimators. ``estimator="propagate"`` (the default) propagates a plan's specs
through the traced train step (forward, backward, optimizer update) with the rule
registry (:mod:`spmdkit.propagation`): per-equation reshards, collectives, bytes,
FLOPs and a liveness memory estimate. It is exact to the rules but costs a
propagation per candidate, so ``auto`` searches with the analytic model and
re-costs only the presets and its three best searched candidates with it.

``estimator="analytic"``: the train step is traced once (``jax.make_jaxpr`` of
the loss's value and grad, and the optimizer's state shapes); from it come total
FLOPs and the bytes of the residuals saved for the backward pass. A candidate
layout is then costed per parameter, which is what makes ``strategy="auto"`` fast:

- a param sharded over an axis that also splits the batch (FSDP) pays one
  all-gather and one reduce-scatter of its grad over that axis;
- its grad is all-reduced over the batch axes that do not shard it;
- a param sharded over an axis that does not split the batch (tensor
  parallelism) pays one all-reduce of an activation ``tokens × other dim``
  (Megatron's pair of all-reduces per column/row block); a sharded expert dim pays
  four all-to-alls of the tokens;
- optimizer state sharded over more axes than its param costs an all-gather of
  the updated param over the extra axes (ZeRO-1);
- compute is the param's share of the traced FLOPs divided by the batch and
  tensor shards, at ``peak_flops``; step time = compute + communication (no overlap);
- memory per device = params + grads + optimizer state at their shards +
  residual activations divided by the batch (and sequence) shards, and by the
  tensor shards for the fraction of activations tensor parallelism splits.

Collective times come from :class:`spmdkit.topology.Topology`.

Auto search
-----------
``strategy="auto"`` costs every preset, then, for every choice of batch axes,
picks per parameter group (parameters of the same role in different layers) the
layout — any assignment of mesh axes to its dims that divides — with the lowest
step time; if the total exceeds the per-device memory budget, it trades time for
memory group by group (best Δtime/Δbytes first, including ZeRO-1 optimizer
sharding). The fastest of the presets and these searched plans that fit the
budget wins; ties keep the earlier candidate, so the search is deterministic.
When none fits, the one needing the least memory is chosen, with a warning.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.errors import SpmdError
from spmdkit.flax import ModelInfo, ParamInfo, describe, path_str
from spmdkit.mesh import auto_mesh
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.topology import DEFAULT_TOPOLOGY, Topology

__all__ = [
    "BATCH_NAMES",
    "PARAM_NAMES",
    "PRESETS",
    "Cost",
    "LogicalRules",
    "Plan",
    "PlanError",
    "UnknownLogicalAxisError",
    "axis_roles",
    "plan",
    "preset_rules",
]

#: Logical names of parameter dims that every preset table covers.
PARAM_NAMES = (
    "vocab",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "head_dim",
    "expert",
    "layers",
    "norm",
    "pos",
    "conv_window",
    "conv_in",
    "conv_out",
    "classes",
)
#: Logical names of batch / activation dims that every preset table covers.
BATCH_NAMES = ("batch", "seq", "height", "width", "channels")

#: Preset strategies, in the order the planner tries them.
PRESETS = ("dp", "fsdp", "zero1", "megatron", "megatron_sp", "tp_fsdp", "ep")

#: Dense bf16 peak of one H100 SXM (FLOP/s); the compute term of the cost model.
H100_BF16_FLOPS = 989e12
#: Per-device memory of one H100 (bytes); the default memory budget.
H100_MEMORY = 80 * 2**30


class PlanError(SpmdError, ValueError):
    """A plan cannot be built or applied as asked.

    Broken example: ``sk.plan(spec, mesh, strategy="fdsp")`` (unknown preset).
    """


class UnknownLogicalAxisError(PlanError, LookupError):
    """A logical axis name has no entry in the rule table.

    Broken example: a param named ``("embed", "hidden")`` planned with a table that
    has no ``"hidden"`` entry; the plan refuses instead of replicating it.
    """


Entry = tuple[str, ...] | None


def _axes(value: Any) -> Entry:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclass(frozen=True)
class LogicalRules:
    """An ordered logical-name → mesh-axes table with fallbacks (module docstring).

    Args:
      entries: ``(logical name, mesh axes)`` pairs, in priority order; mesh axes are
        an axis name, a tuple of names (one dim over several axes), or None
        (replicated). A name may repeat: later entries are fallbacks.

    Example::

        >>> rules = LogicalRules((("embed", "fsdp"), ("mlp", "model"), ("mlp", None)))
        >>> rules.resolve(("embed", "mlp"), (64, 256), abstract_mesh(fsdp=2, model=4))
        PartitionSpec('fsdp', 'model')
    """

    entries: tuple[tuple[str, Entry], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple((str(k), _axes(v)) for k, v in self.entries))

    @classmethod
    def coerce(cls, value: Any) -> LogicalRules:
        """Accept a LogicalRules, a list of pairs, or a mapping name → axes (or list of)."""
        if isinstance(value, LogicalRules):
            return value
        if isinstance(value, Mapping):
            pairs: list[tuple[str, Any]] = []
            for k, v in value.items():
                if isinstance(v, list):
                    pairs.extend((k, e) for e in v)
                else:
                    pairs.append((k, v))
            return cls(tuple(pairs))
        if isinstance(value, Iterable) and not isinstance(value, str):
            return cls(tuple((k, v) for k, v in value))
        raise PlanError(
            op="LogicalRules",
            must="rules are a LogicalRules, pairs (name, axes), or a mapping name → axes",
            given=repr(value),
            fix='pass e.g. [("embed", "data"), ("mlp", "model"), ("mlp", None)]',
        )

    @property
    def names(self) -> tuple[str, ...]:
        """Logical names with at least one entry, in first-appearance order."""
        return tuple(dict.fromkeys(k for k, _ in self.entries))

    def prepend(self, other: Any) -> LogicalRules:
        """A table whose entries from ``other`` take priority over this one's."""
        return LogicalRules(LogicalRules.coerce(other).entries + self.entries)

    def resolve(
        self,
        names: Sequence[str | None] | None,
        shape: Sequence[int],
        mesh: MeshLike,
        *,
        where: str = "",
    ) -> P:
        """The PartitionSpec for a tensor whose dims carry ``names``.

        Args:
          names: logical name per dim (None: replicated dim); None: unannotated
            (replicated).
          shape: the tensor's global shape.
          mesh: the mesh (axis names and sizes).
          where: the tensor's path, for error messages.

        Raises:
          UnknownLogicalAxisError: a name has no entry.
          PlanError: an entry names an axis the mesh does not have, or names and
            shape differ in length.
        """
        if names is None:
            return P()
        names = tuple(names)
        if len(names) != len(shape):
            raise PlanError(
                op="LogicalRules.resolve",
                must="one logical name per dim",
                given=f"{names} for shape {tuple(shape)} at {where or '?'}",
                fix="fix the model's sharding metadata",
            )
        sizes = axis_sizes(mesh)
        known = self.names
        used: set[str] = set()
        out: list[Any] = []
        for name, dim in zip(names, shape, strict=True):
            if name is None:
                out.append(None)
                continue
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                raise UnknownLogicalAxisError(
                    op="LogicalRules.resolve",
                    must=f"every logical name has a rule (known: {', '.join(known)})",
                    given=f"{name!r} at {where or '?'}",
                    fix=(f"did you mean {near[0]!r}? " if near else "")
                    + f"add a rule, e.g. rules=[({name!r}, None)] to replicate it on purpose",
                )
            chosen: tuple[str, ...] = ()
            for key, axes in self.entries:
                if key != name:
                    continue
                if axes is None:
                    break
                missing = [a for a in axes if a not in sizes]
                if missing:
                    raise PlanError(
                        op="LogicalRules.resolve",
                        must=f"rule axes are mesh axes of {tuple(sizes)}",
                        given=f"{name!r} → {axes}",
                        fix="rename the rule's axes or build the mesh with them",
                    )
                if used.intersection(axes):
                    continue
                if dim % math.prod(sizes[a] for a in axes):
                    continue
                chosen = axes
                break
            used.update(chosen)
            out.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    def to_json(self) -> list:
        """JSON-able list of ``[name, axes or null]``."""
        return [[k, None if v is None else list(v)] for k, v in self.entries]


# -- roles and presets -------------------------------------------------------------

_ROLE_NAMES = {
    "data": {"data", "dp", "batch", "replica"},
    "fsdp": {"fsdp", "zero"},
    "model": {"model", "tensor", "tp", "mp"},
    "expert": {"expert", "ep", "experts"},
}


def axis_roles(mesh: MeshLike) -> dict[str, tuple[str, ...]]:
    """Mesh axes per role (``data``, ``fsdp``, ``model``, ``expert``); module docstring.

    Example::

        >>> axis_roles(abstract_mesh(a=2, b=4))
        {'data': ('a',), 'fsdp': ('a',), 'model': ('b',), 'expert': ('b',)}
    """
    names = tuple(mesh.axis_names)
    by_name = {role: tuple(a for a in names if a in keys) for role, keys in _ROLE_NAMES.items()}
    if any(by_name.values()):
        roles = dict(by_name)
        if not roles["fsdp"]:
            roles["fsdp"] = roles["data"]
        if not roles["data"]:
            roles["data"] = roles["fsdp"]
        if not roles["expert"]:
            roles["expert"] = roles["model"] or names[-1:]
        return roles
    if len(names) == 1:
        return {r: names for r in _ROLE_NAMES}
    if len(names) == 2:
        return {
            "data": names[:1],
            "fsdp": names[:1],
            "model": names[1:],
            "expert": names[1:],
        }
    return {
        "data": names[:1],
        "fsdp": names[1:-1],
        "model": names[-1:],
        "expert": names[-1:],
    }


def _fallbacks(axes: tuple[str, ...]) -> list[Entry]:
    """All axes together, then each axis alone, then replicated."""
    out: list[Entry] = []
    if axes:
        out.append(axes)
        if len(axes) > 1:
            out.extend((a,) for a in axes)
    out.append(None)
    return out


def _table(spec: Mapping[str, list[Entry]]) -> LogicalRules:
    pairs = []
    for name in PARAM_NAMES + BATCH_NAMES:
        for entry in spec.get(name, [None]):
            pairs.append((name, entry))
    return LogicalRules(tuple(pairs))


_TP_NAMES = ("vocab", "mlp", "heads", "kv_heads", "conv_out", "classes", "expert")


def preset_rules(name: str, mesh: MeshLike) -> LogicalRules:
    """The logical-rule table of a preset on ``mesh`` (module docstring).

    Raises:
      PlanError: unknown preset.

    Example::

        >>> preset_rules("megatron", abstract_mesh(data=2, model=4)).resolve(
        ...     ("embed", "mlp"), (64, 256), abstract_mesh(data=2, model=4))
        PartitionSpec(None, 'model')
    """
    roles = axis_roles(mesh)
    every = tuple(mesh.axis_names)
    model = roles["model"]
    dp_axes = tuple(a for a in every if a in roles["data"] or a in roles["fsdp"])
    dp_axes = tuple(a for a in dp_axes if a not in model) if model != every else ()
    table: dict[str, list[Entry]] = {}
    if name in ("dp", "zero1"):
        table["batch"] = _fallbacks(every)
    elif name == "fsdp":
        table["batch"] = _fallbacks(every)
        for n in PARAM_NAMES:
            table[n] = _fallbacks(every)
    elif name in ("megatron", "megatron_sp", "tp_fsdp"):
        table["batch"] = _fallbacks(dp_axes)
        for n in _TP_NAMES:
            table[n] = _fallbacks(model)
        if name == "megatron_sp":
            table["seq"] = _fallbacks(model)
        if name == "tp_fsdp":
            fsdp = tuple(a for a in roles["fsdp"] if a not in model) or dp_axes
            table["embed"] = _fallbacks(fsdp)
            table["conv_in"] = _fallbacks(fsdp)
            for n in _TP_NAMES:
                table[n] = [*_fallbacks(model)[:-1], *_fallbacks(fsdp)]
    elif name == "ep":
        table["batch"] = _fallbacks(every)
        table["expert"] = _fallbacks(roles["expert"])
    else:
        near = difflib.get_close_matches(name, PRESETS, n=1)
        raise PlanError(
            op="preset_rules",
            must=f"strategy is 'auto', one of {PRESETS}, or a rule table",
            given=repr(name),
            fix=(f"did you mean {near[0]!r}? " if near else "") + "pick a listed preset",
        )
    return _table(table)


# -- specs -----------------------------------------------------------------------------

Dims = tuple[tuple[str, ...], ...]


def _dims(spec: P, ndim: int) -> Dims:
    out: list[tuple[str, ...]] = []
    for e in tuple(spec):
        out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    out += [()] * (ndim - len(out))
    return tuple(out[:ndim]) if ndim else ()


def _spec(dims: Dims) -> P:
    out = [None if not d else d[0] if len(d) == 1 else d for d in dims]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _spec_json(spec: P) -> list:
    return [e if e is None or isinstance(e, str) else list(e) for e in tuple(spec)]


def _spec_from_json(entries: list) -> P:
    return P(*[e if e is None or isinstance(e, str) else tuple(e) for e in entries])


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _fmt_time(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    if t >= 1e-6:
        return f"{t * 1e6:.1f} µs"
    return f"{t * 1e9:.1f} ns"


# -- cost ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """Estimated cost of one train step under a plan, per device.

    Attributes:
      step_time_s: compute + communication time.
      compute_time_s: FLOPs / peak FLOP/s.
      comm_time_s: alpha-beta time of every collective.
      comm_bytes: collective kind → payload bytes per device per step (as XLA's
        HLO shows buffers: all-gather output, all-reduce operand, ...).
      memory: ``params``, ``grads``, ``opt_state``, ``activations`` → bytes per device.
      estimator: ``"analytic"`` or ``"propagate"``.
    """

    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    comm_bytes: Mapping[str, int]
    memory: Mapping[str, int]
    estimator: str = "analytic"

    @property
    def peak_bytes(self) -> int:
        """Per-device memory: the sum of :attr:`memory`."""
        return int(sum(self.memory.values()))

    @property
    def total_comm_bytes(self) -> int:
        """Payload bytes of all collectives per device per step."""
        return int(sum(self.comm_bytes.values()))

    def to_json(self) -> dict:
        """JSON-able dict."""
        return {
            "step_time_s": self.step_time_s,
            "compute_time_s": self.compute_time_s,
            "comm_time_s": self.comm_time_s,
            "comm_bytes": dict(self.comm_bytes),
            "memory": dict(self.memory),
            "estimator": self.estimator,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> Cost:
        """Inverse of :meth:`to_json`."""
        return cls(
            float(d["step_time_s"]),
            float(d["compute_time_s"]),
            float(d["comm_time_s"]),
            {k: int(v) for k, v in d["comm_bytes"].items()},
            {k: int(v) for k, v in d["memory"].items()},
            d.get("estimator", "analytic"),
        )

    def summary(self) -> str:
        """One line: step time, comm bytes, memory."""
        return (
            f"step {_fmt_time(self.step_time_s)} (compute {_fmt_time(self.compute_time_s)}, "
            f"comm {_fmt_time(self.comm_time_s)}), comm {_fmt_bytes(self.total_comm_bytes)}, "
            f"memory {_fmt_bytes(self.peak_bytes)}"
        )


# -- the plan ---------------------------------------------------------------------------


def _mesh_json(mesh: MeshLike) -> dict:
    types = [str(t).split(".")[-1].lower() for t in getattr(mesh, "axis_types", ())]
    return {
        "axis_names": list(mesh.axis_names),
        "axis_sizes": [int(s) for s in mesh.axis_sizes],
        "axis_types": types,
    }


@dataclass(frozen=True, eq=False)
class Plan:
    """Specs for every parameter, optimizer state and batch dim on one mesh.

    Attributes:
      mesh: the mesh (``Mesh`` to run, ``AbstractMesh`` to plan).
      params: param path → PartitionSpec.
      opt: param path → PartitionSpec of that param's optimizer state.
      activation: batch logical name (``"batch"``, ``"seq"``, ...) → mesh axes.
      strategy: the preset name, ``"auto"``, or ``"rules"``.
      rules: the logical-rule table the specs came from (None for auto's per-group
        choices).
      info: param path → ``(shape, dtype, logical names)``, for printing and costs.
      batch_axes: batch field → logical names per dim.
      cost: the estimated cost (None when not costed).
      alternatives: ``(strategy, Cost)`` of the other candidates, best first.
      chosen: for auto, the candidate that won (``"auto"`` or a preset name).

    Example::

        >>> plan = sk.plan(spec, mesh, strategy="fsdp", config="tiny")
        >>> plan.params["embed/embedding"]
        PartitionSpec(('data', 'model'),)
    """

    mesh: MeshLike
    params: Mapping[str, P]
    opt: Mapping[str, P]
    activation: Mapping[str, tuple[str, ...]]
    strategy: str = "rules"
    rules: LogicalRules | None = None
    info: Mapping[str, tuple[tuple[int, ...], str, tuple | None]] = field(default_factory=dict)
    batch_axes: Mapping[str, tuple] = field(default_factory=dict)
    cost: Cost | None = None
    alternatives: tuple[tuple[str, Cost], ...] = ()
    chosen: str | None = None

    # -- shardings ------------------------------------------------------------------
    def _lookup(self, table: Mapping[str, P], path: str, shape: tuple[int, ...]) -> P | None:
        if path in table:
            return table[path]
        best = None
        for p in table:
            if (path.endswith("/" + p)) and (best is None or len(p) > len(best)):
                info = self.info.get(p)
                if info is None or tuple(info[0]) == tuple(shape):
                    best = p
        return None if best is None else table[best]

    @property
    def sharding_mesh(self) -> MeshLike:
        """The mesh of the shardings the plan hands out: for a device ``Mesh``, its
        Auto-axes view (``sk.jit`` compiles under Auto axes, so arrays placed with
        these shardings enter it without a copy); an ``AbstractMesh`` as is."""

        return auto_mesh(self.mesh)

    def _named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.sharding_mesh, spec)

    def spec_for(self, path: str, shape: Sequence[int] = ()) -> P:
        """The param spec for ``path`` (exact, or the longest param path it ends with).

        Raises:
          PlanError: no param matches.
        """
        spec = self._lookup(self.params, path, tuple(shape))
        if spec is None:
            near = difflib.get_close_matches(path, list(self.params), n=1)
            raise PlanError(
                op="Plan.spec_for",
                must="the path is a param path of the plan",
                given=repr(path),
                fix=(f"did you mean {near[0]!r}? " if near else "")
                + "plan the model whose params you pass",
            )
        return spec

    def param_specs(self, abstract_params: Any) -> Any:
        """PartitionSpec tree matching ``abstract_params`` (params, or grads).

        Raises:
          PlanError: a leaf matches no param of the plan.
        """
        return jax.tree_util.tree_map_with_path(
            lambda kp, x: self.spec_for(path_str(kp), np.shape(x)), abstract_params
        )

    def param_shardings(self, abstract_params: Any) -> Any:
        """NamedSharding tree matching ``abstract_params``.

        Example::

            >>> params = jax.jit(init, out_shardings=plan.param_shardings(abstract))()
        """
        return jax.tree.map(
            self._named, self.param_specs(abstract_params), is_leaf=lambda x: isinstance(x, P)
        )

    def opt_specs(self, abstract_opt_state: Any) -> Any:
        """PartitionSpec tree for an optimizer state: each leaf whose path ends with a
        param path (and has its shape) gets that param's optimizer spec; other leaves
        (step counts, scalars) are replicated."""

        def one(kp: tuple, x: Any) -> P:
            shape = tuple(np.shape(x))
            spec = self._lookup(self.opt, path_str(kp), shape) if shape else None
            return P() if spec is None else spec

        return jax.tree_util.tree_map_with_path(one, abstract_opt_state)

    def opt_shardings(self, abstract_opt_state: Any) -> Any:
        """NamedSharding tree for an optimizer state (see :meth:`opt_specs`)."""
        return jax.tree.map(
            self._named, self.opt_specs(abstract_opt_state), is_leaf=lambda x: isinstance(x, P)
        )

    def state_shardings(self, abstract_params: Any, abstract_opt_state: Any) -> tuple[Any, Any]:
        """``(param_shardings, opt_shardings)``, e.g. for an orbax restore target."""
        return self.param_shardings(abstract_params), self.opt_shardings(abstract_opt_state)

    def batch_spec(self, path: str, shape: Sequence[int]) -> P:
        """The spec of one batch field: its dims' logical names through :attr:`activation`.

        Fields without recorded names shard dim 0 as ``batch``.

        Raises:
          PlanError: a sharded dim does not divide its axes (never silently replicated).
        """
        shape = tuple(shape)
        names = self.batch_axes.get(path)
        if names is None or len(names) != len(shape):
            names = ("batch",) + (None,) * (len(shape) - 1) if shape else ()
        sizes = axis_sizes(self.mesh)
        dims: list[tuple[str, ...]] = []
        used: set[str] = set()
        for name, dim in zip(names, shape, strict=True):
            axes = tuple(a for a in self.activation.get(name, ()) if a not in used) if name else ()
            n = math.prod(sizes[a] for a in axes)
            if dim % n:
                raise PlanError(
                    op="Plan.batch_sharding",
                    must=f"the {name!r} dim divides its mesh axes {axes} ({n} devices)",
                    given=f"field {path!r} of shape {shape}",
                    fix=f"use a {name} size that is a multiple of {n}, or another plan",
                )
            used.update(axes)
            dims.append(axes)
        return _spec(tuple(dims))

    def batch_specs(self, abstract_batch: Any) -> Any:
        """PartitionSpec tree for a batch (see :meth:`batch_spec`)."""
        return jax.tree_util.tree_map_with_path(
            lambda kp, x: self.batch_spec(path_str(kp), np.shape(x)), abstract_batch
        )

    def batch_sharding(self, abstract_batch: Any) -> Any:
        """NamedSharding tree for a batch (see :meth:`batch_spec`)."""
        return jax.tree.map(
            self._named, self.batch_specs(abstract_batch), is_leaf=lambda x: isinstance(x, P)
        )

    def abstract(self, abstract_params: Any, abstract_opt_state: Any = None) -> Any:
        """``ShapeDtypeStruct`` trees with shardings: ``params`` or ``(params, opt)``."""

        def with_sharding(tree: Any, shardings: Any) -> Any:
            return jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                tree,
                shardings,
            )

        params = with_sharding(abstract_params, self.param_shardings(abstract_params))
        if abstract_opt_state is None:
            return params
        return params, with_sharding(abstract_opt_state, self.opt_shardings(abstract_opt_state))

    def on(self, mesh: MeshLike) -> Plan:
        """The same plan on another mesh with the same axis names and sizes (e.g. the
        real devices for a plan made on an abstract mesh).

        Raises:
          PlanError: axis names or sizes differ.
        """
        if axis_sizes(mesh) != axis_sizes(self.mesh):
            raise PlanError(
                op="Plan.on",
                must=f"the mesh has axes {axis_sizes(self.mesh)}",
                given=str(axis_sizes(mesh)),
                fix="re-plan for the new mesh (sk.plan(model, mesh, strategy=...))",
            )
        return replace(self, mesh=mesh)

    # -- serialization ------------------------------------------------------------
    def to_json(self) -> str:
        """The plan as JSON (mesh by axis names/sizes/types; specs as lists)."""
        return json.dumps(
            {
                "version": 1,
                "strategy": self.strategy,
                "chosen": self.chosen,
                "mesh": _mesh_json(self.mesh),
                "params": {k: _spec_json(v) for k, v in self.params.items()},
                "opt": {k: _spec_json(v) for k, v in self.opt.items()},
                "activation": {k: list(v) for k, v in self.activation.items()},
                "rules": None if self.rules is None else self.rules.to_json(),
                "info": {
                    k: [list(s), d, None if n is None else list(n)]
                    for k, (s, d, n) in self.info.items()
                },
                "batch_axes": {k: list(v) for k, v in self.batch_axes.items()},
                "cost": None if self.cost is None else self.cost.to_json(),
                "alternatives": [[n, c.to_json()] for n, c in self.alternatives],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, *, mesh: MeshLike | None = None) -> Plan:
        """Rebuild a plan from :meth:`to_json`.

        Args:
          text: the JSON text.
          mesh: the mesh to attach (must match the saved axes); default: an
            ``AbstractMesh`` with the saved axes.
        """
        d = json.loads(text)
        m = d["mesh"]
        saved = AbstractMesh(
            tuple(m["axis_sizes"]),
            tuple(m["axis_names"]),
            axis_types=tuple(
                getattr(jax.sharding.AxisType, t.capitalize()) for t in m["axis_types"]
            )
            if m.get("axis_types")
            else None,
        )
        out = cls(
            mesh=saved,
            params={k: _spec_from_json(v) for k, v in d["params"].items()},
            opt={k: _spec_from_json(v) for k, v in d["opt"].items()},
            activation={k: tuple(v) for k, v in d["activation"].items()},
            strategy=d["strategy"],
            rules=None if d["rules"] is None else LogicalRules(tuple(map(tuple, d["rules"]))),
            info={
                k: (tuple(s), dt, None if n is None else tuple(n))
                for k, (s, dt, n) in d["info"].items()
            },
            batch_axes={k: tuple(v) for k, v in d["batch_axes"].items()},
            cost=None if d["cost"] is None else Cost.from_json(d["cost"]),
            alternatives=tuple((n, Cost.from_json(c)) for n, c in d["alternatives"]),
            chosen=d.get("chosen"),
        )
        return out if mesh is None else out.on(mesh)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]

    # -- printing -------------------------------------------------------------------
    def table(self, *, max_rows: int = 60) -> str:
        """A readable table (what ``print(plan)`` shows).

        Params of the same role in different layers (paths that differ only in layer
        numbers) share a row, with their count.
        """
        sizes = axis_sizes(self.mesh)
        mesh_text = " × ".join(f"{k}={v}" for k, v in sizes.items())
        head = f"Plan {self.strategy!r}"
        if self.chosen and self.chosen != self.strategy:
            head += f" (chose {self.chosen})"
        lines = [f"{head} on mesh {mesh_text} ({math.prod(sizes.values())} devices)"]
        rows: dict[tuple, list] = {}
        for path, spec in self.params.items():
            shape, dtype, logical = self.info.get(path, ((), "float32", None))
            key = (re.sub(r"(^|/)\d+(?=/|$)", r"\1*", path), spec, self.opt.get(path, spec))
            if key in rows:
                rows[key][0] += 1
                continue
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            shards = math.prod(sizes[a] for a in _flat(spec))
            rows[key] = [1, shape, logical, nbytes // max(shards, 1)]
        header = ("param", "n", "shape", "logical", "spec", "opt spec", "bytes/dev")
        body = []
        for (path, spec, ospec), (count, shape, logical, per_dev) in rows.items():
            body.append(
                (
                    path,
                    str(count),
                    "×".join(map(str, shape)) or "scalar",
                    "-" if logical is None else ",".join(n or "_" for n in logical),
                    _spec_text(spec),
                    "=" if ospec == spec else _spec_text(ospec),
                    _fmt_bytes(per_dev),
                )
            )
        shown = body[:max_rows]
        widths = [max(len(r[i]) for r in [header, *shown]) for i in range(len(header))]
        for r in [header, *shown]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if len(body) > max_rows:
            lines.append(f"  ... {len(body) - max_rows} more rows")
        if self.activation:
            acts = ", ".join(f"{k}→{_axes_text(v)}" for k, v in self.activation.items() if v)
            lines.append(f"activations: {acts or 'replicated'}")
        if self.cost is not None:
            c = self.cost
            mem = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in c.memory.items())
            lines.append(f"memory/device: {_fmt_bytes(c.peak_bytes)} ({mem})")
            comm = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in sorted(c.comm_bytes.items()) if v)
            lines.append(f"comm/step/device: {comm or 'none'}")
            lines.append(
                f"estimated step: {_fmt_time(c.step_time_s)} = compute "
                f"{_fmt_time(c.compute_time_s)} + comm {_fmt_time(c.comm_time_s)} "
                f"({c.estimator})"
            )
        if self.alternatives:
            lines.append("runner-up plans:")
            for name, cost in self.alternatives:
                lines.append(f"  {name:<12} {cost.summary()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        sizes = axis_sizes(self.mesh)
        return f"Plan({self.strategy!r}, mesh={sizes}, params={len(self.params)})"

    # -- verification -----------------------------------------------------------------
    def verify(self, fn: Callable, *args: Any, bytes_tol: float = 0.1, mem_tol: float = 0.2) -> Any:
        """Predicted vs compiled collectives and memory of ``fn(*args)``.

        ``fn`` is typically the result of :func:`spmdkit.compile.jit`; the
        prediction propagates the plan's specs through ``fn``'s jaxpr
        (``spmdkit.propagation``) and the compiled side reads the HLO
        (``spmdkit.verification.report``).

        Returns:
          A ``spmdkit.verification.report.VerifyReport`` (``.ok``, ``.mismatches``).
        """
        from spmdkit.compile import verify_plan

        return verify_plan(self, fn, *args, bytes_tol=bytes_tol, mem_tol=mem_tol)


def _flat(spec: P) -> tuple[str, ...]:
    out: list[str] = []
    for e in tuple(spec):
        if e is None:
            continue
        out.extend((e,) if isinstance(e, str) else e)
    return tuple(out)


def _axes_text(axes: tuple[str, ...]) -> str:
    return axes[0] if len(axes) == 1 else "(" + ",".join(axes) + ")"


def _spec_text(spec: P) -> str:
    parts = []
    for e in tuple(spec):
        parts.append("_" if e is None else e if isinstance(e, str) else "(" + ",".join(e) + ")")
    return "[" + ",".join(parts) + "]" if parts else "[]"


# -- tracing (once per model) -------------------------------------------------------------


def _eqn_flops(eqn: Any) -> float:
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        out = eqn.outvars[0].aval.shape
        return 2.0 * math.prod(out) * math.prod(lhs[d] for d in lc)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out = eqn.outvars[0].aval.shape
        dn = eqn.params["dimension_numbers"]
        spec = dn.rhs_spec
        out_feat = rhs[spec[0]]
        return 2.0 * math.prod(out) * math.prod(rhs) / max(out_feat, 1)
    return 0.0


def _jaxpr_flops(jaxpr: Any) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        total += _eqn_flops(eqn)
        mult = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in _sub_jaxprs(eqn.params):
            total += mult * _jaxpr_flops(sub)
    return total


def _sub_jaxprs(params: Mapping[str, Any]) -> Iterable[Any]:
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr


@dataclass
class _Trace:
    flops: float
    resid_bytes: int
    opt_bytes: dict[str, int]
    opt_other_bytes: int
    tokens: int
    batch_size: int
    seq_len: int
    act_itemsize: int
    abstract_opt: Any


def _default_optimizer() -> Any:
    import optax

    return optax.adam(1e-3)


def _batch_dims(info: ModelInfo) -> tuple[int, int, int]:
    """``(batch size, seq length, tokens)`` from the first batch field's logical names."""
    leaves = jax.tree_util.tree_flatten_with_path(info.batch)[0]
    if not leaves:
        return 1, 1, 1
    kp, leaf = leaves[0]
    names = info.batch_axes.get(path_str(kp)) or ("batch",)
    shape = tuple(leaf.shape)
    batch = seq = 1
    tokens = 1
    for n, s in zip(names, shape, strict=False):
        if n == "batch":
            batch = s
        if n == "seq":
            seq = s
        if n in ("batch", "seq", "height", "width"):
            tokens *= s
    return batch, seq, max(tokens, 1)


def _trace(info: ModelInfo, optimizer: Any) -> _Trace:
    key = ("trace", id(optimizer))
    if key in info._cache:
        return info._cache[key]
    opt = optimizer if optimizer is not None else _default_optimizer()
    grad_fn = jax.value_and_grad(info.loss_fn)
    closed = jax.make_jaxpr(grad_fn)(info.abstract_params, info.batch)
    flops = _jaxpr_flops(closed.jaxpr)

    def residuals(p: Any, b: Any) -> Any:
        return jax.vjp(info.loss_fn, p, b)[1]

    resid = jax.eval_shape(residuals, info.abstract_params, info.batch)
    resid_bytes = sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(resid)
    )
    param_bytes = sum(p.nbytes for p in info.params)
    batch_bytes = sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(info.batch)
    )
    resid_bytes = max(resid_bytes - param_bytes - batch_bytes, 0)
    abstract_opt = jax.eval_shape(opt.init, info.abstract_params)
    paths = [p.path for p in info.params]
    shapes = {p.path: p.shape for p in info.params}
    opt_bytes: dict[str, int] = dict.fromkeys(paths, 0)
    other = 0
    for kp, leaf in jax.tree_util.tree_flatten_with_path(abstract_opt)[0]:
        lp = path_str(kp)
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        match = None
        for p in paths:
            hit = (lp == p or lp.endswith("/" + p)) and shapes[p] == tuple(leaf.shape)
            if hit and (match is None or len(p) > len(match)):
                match = p
        if match is None:
            other += nbytes
        else:
            opt_bytes[match] += nbytes
    batch, seq, tokens = _batch_dims(info)
    dtypes = [np.dtype(p.dtype).itemsize for p in info.params if len(p.shape) >= 2]
    out = _Trace(
        flops=flops,
        resid_bytes=int(resid_bytes),
        opt_bytes=opt_bytes,
        opt_other_bytes=other,
        tokens=tokens,
        batch_size=batch,
        seq_len=seq,
        act_itemsize=min(dtypes) if dtypes else 4,
        abstract_opt=abstract_opt,
    )
    info._cache[key] = out
    return out


# -- the analytic cost model -----------------------------------------------------------------

_SKIP_OTHER = {"head_dim", "conv_window", "layers", "expert"}


@dataclass(frozen=True)
class _Group:
    key: str
    paths: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    logical: tuple | None
    pinned: P | None
    opt_bytes: int  # per param

    @property
    def count(self) -> int:
        return len(self.paths)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _groups(info: ModelInfo, trace: _Trace) -> list[_Group]:
    by: dict[tuple, list[ParamInfo]] = {}
    for p in info.params:
        k = (re.sub(r"(^|/)\d+(?=/|$)", r"\1*", p.path), p.shape, p.dtype, p.logical, p.pinned)
        by.setdefault(k, []).append(p)
    out = []
    for (k, shape, dtype, logical, pinned), ps in by.items():
        ob = max(trace.opt_bytes.get(p.path, 0) for p in ps)
        out.append(_Group(k, tuple(p.path for p in ps), shape, dtype, logical, pinned, ob))
    return out


@dataclass
class _Ctx:
    mesh: MeshLike
    sizes: dict[str, int]
    topology: Topology
    trace: _Trace
    peak_flops: float
    flops_scale: float
    cache: dict = field(default_factory=dict)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _param_flops(g: _Group, tokens: int) -> float:
    if len(g.shape) < 2:
        return 0.0
    n = _numel(g.shape)
    logical = g.logical or ()
    if "expert" in logical:
        e = g.shape[logical.index("expert")]
        n = n * 2 / max(e, 1)  # top-2 routing: two experts' weights touch each token
    return 6.0 * tokens * n


def _coll(ctx: _Ctx, kind: str, payload: float, axes: tuple[str, ...]) -> tuple[float, str, float]:
    n = math.prod(ctx.sizes[a] for a in axes)
    if n <= 1 or payload <= 0:
        return 0.0, kind, 0.0
    wire = payload * (n - 1) / n * (2 if kind == "all_reduce" else 1)
    t = ctx.topology.collective_time(kind, int(wire), n, axes, ctx.mesh)
    return t, kind, payload


@dataclass(frozen=True)
class _GroupCost:
    comm_s: float
    compute_s: float
    comm_bytes: tuple[tuple[str, float], ...]
    params: float
    grads: float
    opt: float
    tp_weight: float  # param flops share that tensor parallelism splits, × (1 - 1/n)

    @property
    def time(self) -> float:
        return self.comm_s + self.compute_s

    @property
    def memory(self) -> float:
        return self.params + self.grads + self.opt


def _group_cost(
    ctx: _Ctx,
    g: _Group,
    dims: Dims,
    odims: Dims,
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> _GroupCost:
    key = (g.key, g.shape, dims, odims, batch_axes, seq_axes)
    hit = ctx.cache.get(key)
    if hit is not None:
        return hit
    sizes = ctx.sizes
    trace = ctx.trace
    used = tuple(a for d in dims for a in d)
    shards = math.prod(sizes[a] for a in used)
    local = g.nbytes / shards
    logical = g.logical or (None,) * len(g.shape)
    # Axes on a stacked-layers dim: each scan step gathers its layer's weights,
    # like FSDP, and they split no compute.
    layer_axes = tuple(a for d, n in zip(dims, logical, strict=True) if n == "layers" for a in d)
    fsdp = tuple(a for a in used if a in batch_axes or a in layer_axes)
    tp = tuple(a for a in used if a not in fsdp)
    n_fsdp = math.prod(sizes[a] for a in fsdp)
    n_tp = math.prod(sizes[a] for a in tp)
    batch_shards = math.prod(sizes[a] for a in batch_axes)
    # Sequence sharding over the tensor axes (Megatron-SP) turns each all-reduce
    # into a reduce-scatter + all-gather of the same bytes; over other axes it
    # splits the tokens (context parallelism).
    context = tuple(a for a in seq_axes if a not in tp and a not in batch_axes)
    tokens_local = trace.tokens / batch_shards / math.prod(sizes[a] for a in context)
    # grads are partial sums over every axis that splits the tokens but not the param
    grad_sync = tuple(a for a in (*batch_axes, *context) if a not in used)
    colls: list[tuple[float, str, float]] = []
    if fsdp:
        colls.append(_coll(ctx, "all_gather", local * n_fsdp, fsdp))
        colls.append(_coll(ctx, "reduce_scatter", local * n_fsdp, fsdp))
    if grad_sync:
        colls.append(_coll(ctx, "all_reduce", local, grad_sync))
    layers = 1
    if "layers" in logical and not dims[logical.index("layers")]:
        layers = g.shape[logical.index("layers")]
    if tp:
        tp_dims = [i for i, d in enumerate(dims) if any(a in tp for a in d)]
        if len(g.shape) < 2:
            colls.append(_coll(ctx, "all_gather", local * n_tp, tp))
            colls.append(_coll(ctx, "all_gather", local * n_tp, tp))
        elif any(logical[i] == "expert" for i in tp_dims):
            embed = next(
                (s for s, n in zip(g.shape, logical, strict=True) if n == "embed"), g.shape[-1]
            )
            payload = tokens_local * embed * trace.act_itemsize * layers
            for _ in range(4):
                colls.append(_coll(ctx, "all_to_all", payload, tp))
        else:
            keep = [
                i for i in range(len(g.shape)) if i not in tp_dims and logical[i] not in _SKIP_OTHER
            ]
            if "embed" in [logical[i] for i in keep]:
                keep = [i for i in keep if logical[i] == "embed"]
            if keep:
                other = math.prod(g.shape[i] for i in keep)
            else:  # every dim sharded (2-D TP): one activation per sharded dim moves
                other = sum(g.shape[i] for i in tp_dims if logical[i] not in _SKIP_OTHER)
            payload = tokens_local * other * trace.act_itemsize * layers
            colls.append(_coll(ctx, "all_reduce", payload, tp))
    oused = tuple(a for d in odims for a in d)
    extra = tuple(a for a in oused if a not in used)
    if extra:
        colls.append(_coll(ctx, "all_gather", local, extra))
    oshards = math.prod(sizes[a] for a in oused)
    flops = _param_flops(g, trace.tokens) * ctx.flops_scale * g.count
    splits = set(batch_axes) | set(tp) | set(context)
    compute = flops / math.prod(sizes[a] for a in splits) / ctx.peak_flops
    by_kind: dict[str, float] = {}
    comm_s = 0.0
    for t, kind, payload in colls:
        comm_s += t * g.count
        by_kind[kind] = by_kind.get(kind, 0.0) + payload * g.count
    out = _GroupCost(
        comm_s=comm_s,
        compute_s=compute,
        comm_bytes=tuple(sorted(by_kind.items())),
        params=local * g.count,
        grads=local * g.count,
        opt=g.opt_bytes / oshards * g.count,
        tp_weight=flops * (1 - 1 / n_tp),
    )
    ctx.cache[key] = out
    return out


def _total(
    ctx: _Ctx,
    groups: list[_Group],
    choice: Sequence[tuple[Dims, Dims]],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
) -> Cost:
    sizes = ctx.sizes
    seq_shards = math.prod(sizes[a] for a in seq_axes)
    comm_s = compute_s = 0.0
    comm: dict[str, float] = {}
    params = grads = opt = tp_weight = 0.0
    total_flops = 0.0
    for g, (dims, odims) in zip(groups, choice, strict=True):
        c = _group_cost(ctx, g, dims, odims, batch_axes, seq_axes)
        comm_s += c.comm_s
        compute_s += c.compute_s
        for k, v in c.comm_bytes:
            comm[k] = comm.get(k, 0.0) + v
        params += c.params
        grads += c.grads
        opt += c.opt
        tp_weight += c.tp_weight
        total_flops += _param_flops(g, ctx.trace.tokens) * ctx.flops_scale * g.count
    batch_shards = math.prod(sizes[a] for a in batch_axes)
    # Residuals split by batch/seq shards; tensor parallelism splits about half of
    # them (the mlp/heads-wide ones), in proportion to the FLOPs it splits.
    tp_frac = tp_weight / total_flops if total_flops else 0.0
    tp_split = 1.0 if seq_axes else 1 - 0.5 * tp_frac  # SP splits the rest as well
    acts = ctx.trace.resid_bytes / batch_shards / seq_shards * tp_split
    if not total_flops and ctx.trace.flops:
        compute_s = ctx.trace.flops / batch_shards / ctx.peak_flops
    return Cost(
        step_time_s=compute_s + comm_s,
        compute_time_s=compute_s,
        comm_time_s=comm_s,
        comm_bytes={k: int(v) for k, v in sorted(comm.items())},
        memory={
            "params": int(params),
            "grads": int(grads),
            "opt_state": int(opt + ctx.trace.opt_other_bytes),
            "activations": int(acts),
        },
    )


def _train_step(info: ModelInfo, optimizer: Any) -> Callable:
    key = ("step", id(optimizer))
    if key not in info._cache:
        import optax

        opt = optimizer if optimizer is not None else _default_optimizer()

        def train_step(params: Any, opt_state: Any, batch: Any) -> Any:
            loss, grads = jax.value_and_grad(info.loss_fn)(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        info._cache[key] = train_step
    return info._cache[key]


def _propagate_cost(info: ModelInfo, optimizer: Any, candidate: Plan, ctx: _Ctx) -> Cost:
    """Cost of a plan by propagating its specs through the whole train step
    (forward, backward, optimizer update; params and optimizer state donated)."""
    from spmdkit.propagation import propagate

    trace = ctx.trace
    step = _train_step(info, optimizer)
    in_specs = (
        candidate.param_specs(info.abstract_params),
        candidate.opt_specs(trace.abstract_opt),
        candidate.batch_specs(info.batch),
    )
    # The step hands back parameters and optimizer state in the layouts it took them
    # in (the next step's inputs, and what sk.jit's out_shardings ask for): ZeRO-1's
    # all-gather of the updated parameters is part of its cost.
    out_specs = (in_specs[0], in_specs[1], P())
    prop = propagate(
        step,
        info.abstract_params,
        trace.abstract_opt,
        info.batch,
        in_specs=in_specs,
        out_specs=out_specs,
        mesh=ctx.mesh,
        topology=ctx.topology,
        donate_argnums=(0, 1),
        arg_roles=("params", "opt_state", "batch"),
    )
    compute = prop.compute_time_s or (prop.flops / ctx.peak_flops)
    mem = prop.memory
    return Cost(
        step_time_s=compute + prop.comm_time_s,
        compute_time_s=compute,
        comm_time_s=prop.comm_time_s,
        comm_bytes={k: int(v) for k, v in sorted(prop.comm_bytes_by_kind.items())},
        memory={
            "arguments": int(mem.argument_bytes),
            "outputs": int(mem.output_bytes - mem.alias_bytes),
            "temporaries": int(mem.temp_bytes),
        },
        estimator="propagate",
    )


# -- candidates --------------------------------------------------------------------------------


def _candidates(g: _Group, sizes: dict[str, int], limit: int = 400) -> list[Dims]:
    if g.pinned is not None:
        return [_dims(g.pinned, len(g.shape))]
    ndim = len(g.shape)
    axes = [a for a, s in sizes.items() if s > 1]
    out: list[Dims] = []
    for assign in itertools.product(range(-1, ndim), repeat=len(axes)):
        dims: list[tuple[str, ...]] = [()] * ndim
        for a, d in zip(axes, assign, strict=True):
            if d >= 0:
                dims[d] = (*dims[d], a)
        if all(g.shape[i] % math.prod(sizes[a] for a in dims[i]) == 0 for i in range(ndim)):
            out.append(tuple(dims))
        if len(out) >= limit:
            break
    return out or [((),) * ndim]


def _zero1(dims: Dims, shape: tuple[int, ...], batch_axes: tuple[str, ...], sizes: dict) -> Dims:
    """Optimizer dims: the param's dims plus the free batch axes on the largest dim they divide."""
    used = {a for d in dims for a in d}
    extra = tuple(a for a in batch_axes if a not in used and sizes[a] > 1)
    if not extra or not shape:
        return dims
    n_extra = math.prod(sizes[a] for a in extra)
    order = sorted(range(len(shape)), key=lambda i: -shape[i])
    for i in order:
        cur = math.prod(sizes[a] for a in dims[i])
        if shape[i] % (cur * n_extra) == 0:
            out = list(dims)
            out[i] = dims[i] + extra
            return tuple(out)
    return dims


# -- building plans ----------------------------------------------------------------------------


def _activation(rules: LogicalRules, mesh: MeshLike, trace: _Trace) -> dict[str, tuple[str, ...]]:
    sizes = axis_sizes(mesh)
    out: dict[str, tuple[str, ...]] = {}
    dims = {"batch": trace.batch_size, "seq": trace.seq_len if trace.seq_len > 1 else None}
    for name in BATCH_NAMES:
        chosen: tuple[str, ...] = ()
        for key, axes in rules.entries:
            if key != name:
                continue
            if axes is None:
                break
            if any(a in v for v in out.values() for a in axes):
                continue
            if dims.get(name) and dims[name] % math.prod(sizes[a] for a in axes):
                continue
            chosen = axes
            break
        out[name] = chosen
    return out


def _rules_choice(
    rules: LogicalRules,
    opt_rules: LogicalRules,
    groups: list[_Group],
    mesh: MeshLike,
    preset: str | None,
) -> list[tuple[Dims, Dims]]:
    sizes = axis_sizes(mesh)
    every = tuple(a for a in mesh.axis_names if sizes[a] > 1)
    out = []
    for g in groups:
        if g.pinned is not None:
            d = _dims(g.pinned, len(g.shape))
            out.append((d, d))
            continue
        if g.logical is None:
            dims = _unannotated(g.shape, every if preset == "fsdp" else (), sizes)
            odims = _unannotated(g.shape, every if preset in ("fsdp", "zero1") else (), sizes)
        else:
            dims = _dims(rules.resolve(g.logical, g.shape, mesh, where=g.paths[0]), len(g.shape))
            odims = _dims(
                opt_rules.resolve(g.logical, g.shape, mesh, where=g.paths[0]), len(g.shape)
            )
            if preset == "zero1":
                odims = _merge(dims, odims)
        out.append((dims, odims))
    return out


def _merge(dims: Dims, odims: Dims) -> Dims:
    used = {a for d in dims for a in d}
    return tuple(d + tuple(a for a in o if a not in used) for d, o in zip(dims, odims, strict=True))


def _unannotated(shape: tuple[int, ...], axes: tuple[str, ...], sizes: dict) -> Dims:
    """fsdp for a param without names: every axis on its largest dim that divides."""
    dims: list[tuple[str, ...]] = [()] * len(shape)
    if not axes:
        return tuple(dims)
    for cand in (axes, *((a,) for a in axes)):
        n = math.prod(sizes[a] for a in cand)
        for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
            if shape[i] % n == 0:
                dims[i] = cand
                return tuple(dims)
    return tuple(dims)


def _make_plan(
    strategy: str,
    mesh: MeshLike,
    info: ModelInfo,
    groups: list[_Group],
    choice: Sequence[tuple[Dims, Dims]],
    activation: dict[str, tuple[str, ...]],
    rules: LogicalRules | None,
    cost: Cost | None,
) -> Plan:
    params: dict[str, P] = {}
    opt: dict[str, P] = {}
    for g, (dims, odims) in zip(groups, choice, strict=True):
        for path in g.paths:
            params[path] = _spec(dims)
            opt[path] = _spec(odims)
    order = [p.path for p in info.params]
    return Plan(
        mesh=mesh,
        params={p: params[p] for p in order},
        opt={p: opt[p] for p in order},
        activation=activation,
        strategy=strategy,
        rules=rules,
        info={p.path: (p.shape, p.dtype, p.logical) for p in info.params},
        batch_axes=dict(info.batch_axes),
        cost=cost,
    )


def _check_mesh(mesh: Any) -> MeshLike:
    if not hasattr(mesh, "axis_names") or not hasattr(mesh, "axis_sizes"):
        raise PlanError(
            op="plan",
            must="mesh is a jax Mesh or AbstractMesh",
            given=type(mesh).__name__,
            fix="pass sk.make_mesh(data=2, model=4) or sk.abstract_mesh(data=64, model=8)",
        )
    return mesh


def _preset_candidate(
    name: str, mesh: MeshLike, ctx: _Ctx, info: ModelInfo, groups: list[_Group], extra: Any
) -> tuple[list[tuple[Dims, Dims]], dict, LogicalRules, Cost]:
    rules = preset_rules(name, mesh)
    if extra is not None:
        rules = rules.prepend(extra)
    opt_rules = preset_rules("fsdp", mesh) if name == "zero1" else rules
    if extra is not None and name == "zero1":
        opt_rules = opt_rules.prepend(extra)
    choice = _rules_choice(rules, opt_rules, groups, mesh, name)
    act = _activation(rules, mesh, ctx.trace)
    cost = _total(ctx, groups, choice, act.get("batch", ()), act.get("seq", ()))
    return choice, act, rules, cost


def _batch_axis_choices(sizes: dict[str, int], batch_size: int) -> list[tuple[str, ...]]:
    axes = [a for a, s in sizes.items() if s > 1]
    out = []
    for r in range(len(axes), -1, -1):
        for combo in itertools.combinations(axes, r):
            if batch_size % math.prod(sizes[a] for a in combo) == 0:
                out.append(combo)
    return out


def _search(
    ctx: _Ctx,
    groups: list[_Group],
    batch_axes: tuple[str, ...],
    seq_axes: tuple[str, ...],
    budget: float,
) -> tuple[list[tuple[Dims, Dims]], Cost]:
    sizes = ctx.sizes
    options: list[list[tuple[Dims, Dims]]] = []
    for g in groups:
        opts = []
        for dims in _candidates(g, sizes):
            opts.append((dims, dims))
            z = _zero1(dims, g.shape, batch_axes, sizes)
            if z != dims:
                opts.append((dims, z))
        options.append(opts)

    def gcost(i: int, o: tuple[Dims, Dims]) -> _GroupCost:
        return _group_cost(ctx, groups[i], o[0], o[1], batch_axes, seq_axes)

    pick = []
    for i, opts in enumerate(options):
        best = min(
            range(len(opts)), key=lambda j: (gcost(i, opts[j]).time, gcost(i, opts[j]).memory, j)
        )
        pick.append(best)
    choice = [options[i][j] for i, j in enumerate(pick)]
    cost = _total(ctx, groups, choice, batch_axes, seq_axes)
    # Over budget: trade time for memory, best Δtime per byte saved first.
    for _ in range(4 * len(groups) * 8):
        if cost.peak_bytes <= budget:
            break
        best_move = None
        for i, opts in enumerate(options):
            cur = gcost(i, opts[pick[i]])
            for j, o in enumerate(opts):
                c = gcost(i, o)
                saved = cur.memory - c.memory
                if saved <= 0:
                    continue
                ratio = (c.time - cur.time) / saved
                if best_move is None or ratio < best_move[0]:
                    best_move = (ratio, i, j)
        if best_move is None:
            break
        _, i, j = best_move
        pick[i] = j
        choice[i] = options[i][j]
        cost = _total(ctx, groups, choice, batch_axes, seq_axes)
    return choice, cost


def plan(
    model: Any,
    mesh: MeshLike,
    strategy: str | LogicalRules | Sequence | Mapping = "auto",
    *,
    config: Any = None,
    batch: Any = None,
    batch_size: int = 8,
    loss: Callable | None = None,
    batch_axes: Mapping[str, tuple] | None = None,
    optimizer: Any = None,
    rules: Any = None,
    memory_budget: float | None = None,
    topology: Topology = DEFAULT_TOPOLOGY,
    peak_flops: float = H100_BF16_FLOPS,
    init_args: tuple = (),
    estimator: str = "propagate",
) -> Plan:
    """Plan a model's train step on a mesh.

    Traces forward + backward + optimizer state abstractly (once per model; no
    FLOPs, no device memory), then costs the strategy (module docstring).

    Args:
      model: a model spec (``spmdkit.models.get_model(name)``), an NNX module, a
        function returning one, a linen module, or a ``ModelInfo``.
      mesh: a ``Mesh`` (to run) or ``AbstractMesh`` (to plan).
      strategy: ``"auto"``, a preset name (:data:`PRESETS`), or a logical-rule
        table (``LogicalRules``, pairs, or a mapping).
      config: model spec config name or object.
      batch: example or abstract batch (required unless ``model`` is a spec).
      batch_size: batch size for a model spec.
      loss: ``loss(model, batch)`` (required unless ``model`` is a spec).
      batch_axes: batch field → logical names per dim.
      optimizer: an optax optimizer (default ``optax.adam``), for optimizer-state sizes.
      rules: extra logical rules that take priority over the preset's (e.g. for
        logical names outside :data:`PARAM_NAMES`).
      memory_budget: per-device bytes (default: 80 GiB, one H100).
      topology: link model for collectives.
      peak_flops: per-device FLOP/s for the compute term.
      init_args: linen only, ``module.init`` arguments after the rng.
      estimator: ``"propagate"`` (default): the plan's cost (and auto's final
        ranking of the presets and its best searched candidates) comes from
        propagating the specs through the traced train step
        (``spmdkit.propagation``); ``"analytic"``: the per-parameter model only
        (module docstring), fastest.

    Returns:
      The :class:`Plan`.

    Raises:
      PlanError: unknown strategy; UnknownLogicalAxisError: a logical name has no rule.

    Example::

        >>> mesh = sk.abstract_mesh(data=64, model=8)
        >>> p = sk.plan(get_model("llama"), mesh, config="llama3_8b", batch_size=512)
        >>> print(p)  # doctest: +SKIP
    """
    mesh = _check_mesh(mesh)
    info = describe(
        model,
        config=config,
        batch=batch,
        batch_size=batch_size,
        loss=loss,
        batch_axes=batch_axes,
        init_args=init_args,
    )
    trace = _trace(info, optimizer)
    groups = _groups(info, trace)
    sizes = axis_sizes(mesh)
    tokens = trace.tokens
    raw = sum(_param_flops(g, tokens) * g.count for g in groups)
    ctx = _Ctx(
        mesh=mesh,
        sizes=sizes,
        topology=topology,
        trace=trace,
        peak_flops=float(peak_flops),
        flops_scale=(trace.flops / raw) if raw and trace.flops else 1.0,
    )
    budget = float(memory_budget) if memory_budget is not None else float(H100_MEMORY)
    if estimator not in ("propagate", "analytic"):
        raise PlanError(
            op="plan",
            must="estimator is 'propagate' or 'analytic'",
            given=repr(estimator),
            fix="pass estimator='propagate' (default) or 'analytic'",
        )

    def recost(p: Plan) -> Plan:
        if estimator == "analytic":
            return p
        return replace(p, cost=_propagate_cost(info, optimizer, p, ctx))

    if isinstance(strategy, str) and strategy != "auto":
        choice, act, table, cost = _preset_candidate(strategy, mesh, ctx, info, groups, rules)
        return recost(_make_plan(strategy, mesh, info, groups, choice, act, table, cost))
    if not isinstance(strategy, str):
        table = LogicalRules.coerce(strategy)
        if rules is not None:
            table = table.prepend(rules)
        choice = _rules_choice(table, table, groups, mesh, None)
        act = _activation(table, mesh, ctx.trace)
        cost = _total(ctx, groups, choice, act.get("batch", ()), act.get("seq", ()))
        return recost(_make_plan("rules", mesh, info, groups, choice, act, table, cost))
    # auto
    candidates: list[tuple[str, list, dict, LogicalRules | None, Cost]] = []
    for name in PRESETS:
        try:
            choice, act, table, cost = _preset_candidate(name, mesh, ctx, info, groups, rules)
        except UnknownLogicalAxisError:
            continue
        candidates.append((name, choice, act, table, cost))
    for batch_ax in _batch_axis_choices(sizes, trace.batch_size):
        choice, cost = _search(ctx, groups, batch_ax, (), budget)
        act = {n: () for n in BATCH_NAMES}
        act["batch"] = batch_ax
        label = f"searched[batch={','.join(batch_ax) or '-'}]"
        candidates.append((label, choice, act, None, cost))

    def rank(c: tuple) -> tuple:
        # plans that fit: fastest first; none fits: the one nearest to fitting (the
        # fastest of plans that cannot run is no answer)
        cost = c[4]
        over = cost.peak_bytes > budget
        return (over, cost.peak_bytes if over else cost.step_time_s, cost.step_time_s)

    if estimator == "propagate":
        # The presets and the best searched candidates, re-costed on the traced step.
        searched = sorted(
            (i for i, c in enumerate(candidates) if c[0].startswith("searched")),
            key=lambda i: (*rank(candidates[i]), i),
        )
        keep = [i for i, c in enumerate(candidates) if not c[0].startswith("searched")]
        keep += searched[:3]
        recosted = []
        for i in sorted(keep):
            name, choice, act, table, _ = candidates[i]
            p = _make_plan(name, mesh, info, groups, choice, act, table, None)
            recosted.append((name, choice, act, table, _propagate_cost(info, optimizer, p, ctx)))
        candidates = recosted

    ranked = sorted(range(len(candidates)), key=lambda i: (*rank(candidates[i]), i))
    best = candidates[ranked[0]]
    seen = {best[0]}
    alternatives = []
    for i in ranked[1:]:
        name = candidates[i][0]
        if name in seen:
            continue
        seen.add(name)
        alternatives.append((name, candidates[i][4]))
    if best[4].peak_bytes > budget:
        warnings.warn(
            f"plan(strategy='auto'): no candidate fits the memory budget of "
            f"{_fmt_bytes(budget)} per device; chose {best[0]!r}, the smallest "
            f"({_fmt_bytes(best[4].peak_bytes)}). Add devices, shard more axes, or lower the "
            "activation memory (remat, smaller batch per device).",
            stacklevel=2,
        )
    out = _make_plan("auto", mesh, info, groups, best[1], best[2], best[3], best[4])
    return replace(out, alternatives=tuple(alternatives[:12]), chosen=best[0])
