"""Plans as plain data: specs for every parameter, optimizer state and batch dim, and their cost.

A :class:`Plan` is plain data: a mesh, a ``PartitionSpec`` per parameter path,
one per parameter for its optimizer state (they differ under ZeRO-1), and the
mesh axes of each logical activation dim of the batch (``batch``, ``seq``). It
hands out pytrees of ``NamedSharding`` / ``ShapeDtypeStruct`` that ``jax.jit``,
flax and orbax take directly, prints as a table, and round-trips through JSON.
A :class:`Cost` is the estimated per-device cost of one train step under it.

Plans are made by :func:`spmdkit.planner.plans` (:mod:`spmdkit.planner.search`)
from the rule tables of :mod:`spmdkit.planner.logical`.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar, runtime_checkable

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.mesh import auto_mesh
from spmdkit.pipeline import Pipeline
from spmdkit.planner.context_parallel import causal_shares
from spmdkit.planner.explain import Explanation, explain
from spmdkit.planner.logical import PRESETS, SHARDED_OPT_PRESETS, LogicalRules, PlanError
from spmdkit.planner.notes import (
    PlanNote,
    asked_batch_axes,
    batch_field_notes,
    batch_notes,
    idle_axis_notes,
    no_batch_rule_note,
    raise_if_strict,
    warn_notes,
)
from spmdkit.planner.picture import to_html
from spmdkit.planner.plan_table import axes_text, plan_table
from spmdkit.planner.plot import PlanFigures, plot
from spmdkit.planner.provenance import Provenance
from spmdkit.planner.rule_export import RuleTable, to_rules
from spmdkit.planner.snapshot import write_snapshot
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.step.recipe import Recipe
from spmdkit.util import fmt_bytes, fmt_time, path_str

__all__ = [
    "ContextParallel",
    "Cost",
    "Dims",
    "Plan",
    "PlannedStep",
    "PyTree",
    "dims_spec",
    "layout_notes",
    "noted",
    "spec_dims",
]

#: A pytree (params, optimizer state, batch) whose structure the caller chooses.
PyTree = Any

# -- specs -----------------------------------------------------------------------------

#: Per dim, the mesh axes that shard it (major to minor): a spec in the form the
#: search builds and costs.
Dims = tuple[tuple[str, ...], ...]


def spec_dims(spec: P, ndim: int) -> Dims:
    """The :data:`Dims` of a ``PartitionSpec`` for a tensor of ``ndim`` dims.

    Example::

        >>> spec_dims(P(("data", "model")), 2)
        (('data', 'model'), ())
    """
    out: list[tuple[str, ...]] = []
    for e in tuple(spec):
        out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    out += [()] * (ndim - len(out))
    return tuple(out[:ndim]) if ndim else ()


def dims_spec(dims: Dims) -> P:
    """The ``PartitionSpec`` of :data:`Dims` (trailing replicated dims dropped).

    Example::

        >>> dims_spec((("data", "model"), ()))
        PartitionSpec(('data', 'model'),)
    """
    out = [None if not d else d[0] if len(d) == 1 else d for d in dims]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _spec_json(spec: P) -> list:
    return [e if e is None or isinstance(e, str) else list(e) for e in tuple(spec)]


def _spec_from_json(entries: list) -> P:
    return P(*[e if e is None or isinstance(e, str) else tuple(e) for e in entries])


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
      hidden_comm_s: the part of ``comm_time_s`` that overlaps with compute;
        ``step_time_s = compute + comm - hidden`` (hidden is at most the
        topology's overlap share of compute).
      stage_memory: pipelined plans: per-device memory of each device on the
        pipe axis (``memory`` is the fullest one's); empty otherwise.
      bubble_s: pipelined plans: the idle time the schedule adds to
        ``compute_time_s`` (included in it).
      ops: the propagate estimator's strategy per composite op (the step's
        :mod:`spmdkit.engine.region` regions): op (``"<op>:grad"`` for its grad region)
        → strategy → regions in the traced step; empty otherwise.
    """

    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    comm_bytes: Mapping[str, int]
    memory: Mapping[str, int]
    estimator: str = "analytic"
    hidden_comm_s: float = 0.0
    stage_memory: tuple[int, ...] = ()
    bubble_s: float = 0.0
    ops: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

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
        out = {
            "step_time_s": self.step_time_s,
            "compute_time_s": self.compute_time_s,
            "comm_time_s": self.comm_time_s,
            "comm_bytes": dict(self.comm_bytes),
            "memory": dict(self.memory),
            "estimator": self.estimator,
            "hidden_comm_s": self.hidden_comm_s,
        }
        if self.stage_memory:
            out["stage_memory"] = list(self.stage_memory)
            out["bubble_s"] = self.bubble_s
        if self.ops:
            out["ops"] = {op: dict(per) for op, per in self.ops.items()}
        return out

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
            float(d.get("hidden_comm_s", 0.0)),
            tuple(int(v) for v in d.get("stage_memory", ())),
            float(d.get("bubble_s", 0.0)),
            ops={op: {k: int(n) for k, n in per.items()} for op, per in d.get("ops", {}).items()},
        )

    def summary(self) -> str:
        """One line: step time, comm bytes, memory."""
        return (
            f"step {fmt_time(self.step_time_s)} (compute {fmt_time(self.compute_time_s)}, "
            f"comm {fmt_time(self.comm_time_s)}), comm {fmt_bytes(self.total_comm_bytes)}, "
            f"memory {fmt_bytes(self.peak_bytes)}"
        )


# -- context parallelism ------------------------------------------------------------------


@dataclass(frozen=True)
class ContextParallel:
    """A plan's context parallelism (:mod:`spmdkit.planner.context_parallel`): the ``seq``
    dim of the activations split over ``axes`` (``degree`` devices that hold
    different tokens of the same sequences).

    Attributes:
      axes: the mesh axes the sequence is split over (``plan.activation["seq"]``).
      degree: the devices one sequence is split over (the axes' sizes' product).
      attention: how attention gets every earlier key: ``"ring"`` (K/V blocks
        passed around the context axes, overlapped with the blocks' compute) or
        ``"gather_kv"`` (K/V all-gathered), as the plan's cost priced it.
      load_balanced: the sequence is cut into ``2 × degree`` chunks and device
        ``i`` holds chunks ``i`` and ``2 × degree − 1 − i``, so causal attention's
        unmasked work is even across the devices. Always True: the planner prices
        that order, and contiguous shards (False) leave the last device
        ``(2 × degree − 1) / degree²`` of the causal work
        (:func:`~spmdkit.planner.context_parallel.causal_shares`), a step the plan's cost
        does not describe, so they are refused.

    Raises:
      PlanError: ``load_balanced=False`` with a degree above 1 (constructed,
        set by ``dataclasses.replace`` or read from JSON).
    """

    axes: tuple[str, ...]
    degree: int
    attention: str = "ring"
    load_balanced: bool = True

    def __post_init__(self) -> None:
        if self.load_balanced or self.degree <= 1:
            return
        n = self.degree
        last = causal_shares(n, balanced=False)[-1]
        raise PlanError(
            op="ContextParallel",
            must="load_balanced=True: plans price causal attention evenly split over the "
            "context shards (each holds chunks i and 2n-1-i)",
            given=f"load_balanced=False on {n} shards: the last holds {last:.1%} of the "
            f"causal work, {n * last:.2f}x a balanced shard's, and the step waits for it",
            fix="keep load_balanced=True (the step puts the batch in the balanced order "
            "itself); to measure contiguous shards, call sk.ops.attention(..., balanced=1) "
            "outside a plan",
        )

    def short(self) -> str:
        """E.g. ``context: 4 (ring, load-balanced)``."""
        balance = ", load-balanced" if self.load_balanced else ""
        return f"{axes_text(self.axes)}: {self.degree} ({self.attention}{balance})"

    def to_json(self) -> dict:
        """JSON-able dict."""
        return {
            "axes": list(self.axes),
            "degree": self.degree,
            "attention": self.attention,
            "load_balanced": self.load_balanced,
        }

    @classmethod
    def from_json(cls, d: Mapping | None) -> ContextParallel | None:
        """Inverse of :meth:`to_json` (None stays None)."""
        if d is None:
            return None
        return cls(tuple(d["axes"]), int(d["degree"]), d["attention"], bool(d["load_balanced"]))


# -- the plan ---------------------------------------------------------------------------


def _mesh_json(mesh: MeshLike) -> dict:
    types = [str(t).split(".")[-1].lower() for t in getattr(mesh, "axis_types", ())]
    return {
        "axis_names": list(mesh.axis_names),
        "axis_sizes": [int(s) for s in mesh.axis_sizes],
        "axis_types": types,
    }


R_co = TypeVar("R_co", covariant=True)


@runtime_checkable
class PlannedStep(Protocol[R_co]):
    """What :meth:`Plan.verify` needs of a step: one compiled for a plan that can
    verify itself (``sk.jit``'s :class:`~spmdkit.compile.PlannedFunction`, whose
    ``verify`` returns a :class:`~spmdkit.verification.compiled.VerifyReport`).

    The planner names this shape instead of importing :mod:`spmdkit.compile`,
    which imports the planner.
    """

    plan: Plan

    def verify(self, *args: Any, bytes_tol: float = 0.1, mem_tol: float = 0.2) -> R_co:
        """Predicted vs compiled collectives and memory for ``args``."""
        ...


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
      recipe: the step's levers besides layouts: recompute, compute dtype,
        micro-batches, optimizer offload (:class:`~spmdkit.step.recipe.Recipe`).
      grads: param path → PartitionSpec of its gradient where it differs from the
        param's (ZeRO-2: gradients sharded like the optimizer state); empty: as params.
      names_from: param path → where its logical names came from (``"model"``,
        ``"given"`` by ``names=``, ``"inferred"`` from the traced step); the table
        marks inferred and given names.
      pipeline: how the stacked layers are pipelined over a mesh axis
        (:class:`~spmdkit.pipeline.Pipeline`: stages, virtual stages,
        micro-batches, schedule); ``None``: not pipelined.
      state: state path → PartitionSpec of the model's mutable state (batch
        statistics): an input and an output of the step, not differentiated,
        no optimizer state. Their shapes are in :attr:`info` too.
      state_from: state path → where its layout came from (``"like <param
        path>"``: the parameter of its module with its shape, ``"rules"``: its
        own logical names, ``"replicated"``: neither); the table shows it.
      notes: what the plan does that nobody asked for (an idle mesh axis, a
        batch off the axes its rule asks for, a recipe auto chose, ...): one
        :class:`~spmdkit.planner.notes.PlanNote` each, printed under the table.
      batch_size: the global batch size the plan was made for (None: unknown);
        ``train`` refuses batches of another size.
      memory_budget: the per-device memory budget the plan was made under (the
        table marks runner-ups over it); None: not recorded.
      context: the plan's context parallelism (:class:`ContextParallel`: the
        sequence split over ``activation["seq"]``, the attention strategy, the
        load-balanced chunks); None: none.
      topology: the name of the :class:`~spmdkit.topology.Topology` its cost was
        priced on (``"h100 (8 GPUs a node)"``, ``"cpu: 8 devices on 2 cores"``);
        None: not recorded.
      provenance: where its layouts and cost come from, per parameter group (the
        equations that read and moved each, the bytes and time of the
        collectives per group, the layouts auto's search costed):
        :class:`~spmdkit.planner.provenance.Provenance`, read by :meth:`explain`
        and ``sk.diff``; None: not recorded (a plan from older JSON).

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
    recipe: Recipe = field(default_factory=Recipe)
    grads: Mapping[str, P] = field(default_factory=dict)
    names_from: Mapping[str, str] = field(default_factory=dict)
    pipeline: Pipeline | None = None
    state: Mapping[str, P] = field(default_factory=dict)
    state_from: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[PlanNote, ...] = ()
    batch_size: int | None = None
    memory_budget: float | None = None
    context: ContextParallel | None = None
    topology: str | None = None
    provenance: Provenance | None = None

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

    def param_specs(self, abstract_params: PyTree) -> PyTree:
        """PartitionSpec tree matching ``abstract_params`` (params, or grads).

        Raises:
          PlanError: a leaf matches no param of the plan.
        """
        return jax.tree_util.tree_map_with_path(
            lambda kp, x: self.spec_for(path_str(kp), np.shape(x)), abstract_params
        )

    def grad_specs(self, abstract_params: PyTree) -> PyTree:
        """PartitionSpec tree of the gradients of ``abstract_params``: the param's
        spec, or its entry in :attr:`grads` (ZeRO-2 shards gradients like the
        optimizer state while the parameters stay replicated)."""

        def one(kp: tuple, x: Any) -> P:
            path = path_str(kp)
            spec = self._lookup(self.grads, path, np.shape(x)) if self.grads else None
            return spec if spec is not None else self.spec_for(path, np.shape(x))

        return jax.tree_util.tree_map_with_path(one, abstract_params)

    def param_shardings(self, abstract_params: PyTree) -> PyTree:
        """NamedSharding tree matching ``abstract_params``.

        Example::

            >>> params = jax.jit(init, out_shardings=plan.param_shardings(abstract))()
        """
        return jax.tree.map(
            self._named, self.param_specs(abstract_params), is_leaf=lambda x: isinstance(x, P)
        )

    def opt_specs(self, abstract_opt_state: PyTree) -> PyTree:
        """PartitionSpec tree for an optimizer state: each leaf whose path ends with a
        param path (and has its shape) gets that param's optimizer spec; other leaves
        (step counts, scalars) are replicated."""

        def one(kp: tuple, x: jax.Array | jax.ShapeDtypeStruct) -> P:
            shape = tuple(np.shape(x))
            spec = self._lookup(self.opt, path_str(kp), shape) if shape else None
            return P() if spec is None else spec

        return jax.tree_util.tree_map_with_path(one, abstract_opt_state)

    def opt_shardings(self, abstract_opt_state: PyTree) -> PyTree:
        """NamedSharding tree for an optimizer state (see :meth:`opt_specs`)."""
        return jax.tree.map(
            self._named, self.opt_specs(abstract_opt_state), is_leaf=lambda x: isinstance(x, P)
        )

    def state_shardings(
        self, abstract_params: PyTree, abstract_opt_state: PyTree
    ) -> tuple[PyTree, PyTree]:
        """``(param_shardings, opt_shardings)``, e.g. for an orbax restore target."""
        return self.param_shardings(abstract_params), self.opt_shardings(abstract_opt_state)

    def state_specs(self, abstract_state: PyTree) -> PyTree:
        """PartitionSpec tree for the model's mutable state (:attr:`state`).

        Raises:
          PlanError: a leaf matches no state path of the plan.
        """

        def one(kp: tuple, x: Any) -> P:
            path = path_str(kp)
            spec = self._lookup(self.state, path, tuple(np.shape(x)))
            if spec is None:
                near = difflib.get_close_matches(path, list(self.state), n=1)
                raise PlanError(
                    op="Plan.state_specs",
                    must="the path is a state path of the plan",
                    given=repr(path) + ("" if self.state else " (the plan has no state)"),
                    fix=(f"did you mean {near[0]!r}? " if near else "")
                    + "plan the model whose state you pass",
                )
            return spec

        return jax.tree_util.tree_map_with_path(one, abstract_state)

    def state_sharding(self, abstract_state: PyTree) -> PyTree:
        """NamedSharding tree for the model's mutable state (see :meth:`state_specs`)."""
        return jax.tree.map(
            self._named, self.state_specs(abstract_state), is_leaf=lambda x: isinstance(x, P)
        )

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
        return dims_spec(tuple(dims))

    def batch_specs(self, abstract_batch: PyTree) -> PyTree:
        """PartitionSpec tree for a batch (see :meth:`batch_spec`)."""
        return jax.tree_util.tree_map_with_path(
            lambda kp, x: self.batch_spec(path_str(kp), np.shape(x)), abstract_batch
        )

    def batch_sharding(self, abstract_batch: PyTree) -> PyTree:
        """NamedSharding tree for a batch (see :meth:`batch_spec`)."""
        return jax.tree.map(
            self._named, self.batch_specs(abstract_batch), is_leaf=lambda x: isinstance(x, P)
        )

    def abstract(self, abstract_params: PyTree, abstract_opt_state: PyTree | None = None) -> PyTree:
        """``ShapeDtypeStruct`` trees with shardings: ``params`` or ``(params, opt)``."""

        def with_sharding(tree: PyTree, shardings: PyTree) -> PyTree:
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
                "recipe": self.recipe.to_json(),
                "grads": {k: _spec_json(v) for k, v in self.grads.items()},
                "names_from": dict(self.names_from),
                "pipeline": None if self.pipeline is None else self.pipeline.to_json(),
                "state": {k: _spec_json(v) for k, v in self.state.items()},
                "state_from": dict(self.state_from),
                "notes": [n.to_json() for n in self.notes],
                "batch_size": self.batch_size,
                "memory_budget": self.memory_budget,
                "context": None if self.context is None else self.context.to_json(),
                "topology": self.topology,
                "provenance": None if self.provenance is None else self.provenance.to_json(),
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
            else (jax.sharding.AxisType.Auto,) * len(m["axis_names"]),
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
            recipe=Recipe.from_json(d.get("recipe")),
            grads={k: _spec_from_json(v) for k, v in d.get("grads", {}).items()},
            names_from=d.get("names_from", {}),
            pipeline=Pipeline.from_json(d.get("pipeline")),
            state={k: _spec_from_json(v) for k, v in d.get("state", {}).items()},
            state_from=d.get("state_from", {}),
            notes=tuple(PlanNote.from_json(n) for n in d.get("notes", ())),
            batch_size=d.get("batch_size"),
            memory_budget=d.get("memory_budget"),
            context=ContextParallel.from_json(d.get("context")),
            topology=d.get("topology"),
            provenance=Provenance.from_json(d.get("provenance")),
        )
        return out if mesh is None else out.on(mesh)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]

    # -- printing -------------------------------------------------------------------
    def table(self, *, max_rows: int = 60, notes: bool = True) -> str:
        """A readable table (what ``print(plan)`` shows).

        Params of the same role in different layers (paths that differ only in layer
        numbers) share a row, with their count. ``notes=False`` leaves the notes
        out (for a caller that says them elsewhere: ``train`` prints a given plan's).
        """
        return plan_table(self, max_rows=max_rows, notes=notes)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        sizes = axis_sizes(self.mesh)
        return f"Plan({self.strategy!r}, mesh={sizes}, params={len(self.params)})"

    def explain(self, name: str) -> Explanation:
        """Why a tensor has its layout: a parameter (path or group, ``layers/*/mlp/up``),
        a logical name (``"embed"``, ``"batch"``) or a ``checkpoint_name`` of an
        activation. Returns its spec, the chain that decided it (a constraint, a
        rule-table entry or the search's choice, then the equations that read,
        moved and updated it), the layouts the search costed instead, and the
        collectives it causes (:mod:`spmdkit.planner.explain`); ``print`` it.

        Raises:
          PlanError: ``name`` names no parameter, logical name or activation.

        Example::

            >>> print(plan.explain("layers/*/mlp/up"))  # doctest: +SKIP
        """
        return explain(self, name)

    # -- export -----------------------------------------------------------------------
    def to_rules(self) -> RuleTable:
        """The plan as a logical-axis rule table in flax's ``logical_axis_rules``
        form (``.rules``) and MaxText's YAML (``.to_yaml()``), with per-parameter
        ``.overrides`` (and the tensors in conflict) where one table cannot give
        every layout (:mod:`spmdkit.planner.rule_export`); ``print`` it."""
        return to_rules(self)

    def snapshot(self, path: str | os.PathLike) -> None:
        """Write the plan's shardings as JSON to ``path`` (per tensor path its
        logical axes, ``PartitionSpec``, shape and the mesh; MaxText's golden
        sharding dump), for :func:`spmdkit.testing.assert_plan_matches`
        (:mod:`spmdkit.planner.snapshot`)."""
        write_snapshot(self, path)

    def to_html(self, path: str | os.PathLike | None = None, *, report: Any = None) -> str:
        """The plan as one self-contained HTML page (each tensor's layout over the
        mesh, memory per device by kind, the collectives of one step on a timeline;
        a verify ``report``'s compiled figures beside them), written to ``path``
        when given and returned (:mod:`spmdkit.planner.picture`).

        Raises:
          PlanError: ``path`` is a directory or in no existing directory.
        """
        return to_html(self, path, report=report)

    def plot(self, *, max_groups: int = 24) -> PlanFigures:
        """The page of :meth:`to_html` as matplotlib figures (``.memory``,
        ``.collectives``, ``.layouts``; :mod:`spmdkit.planner.plot`).

        Raises:
          MissingDependencyError: matplotlib is not installed.
        """
        return plot(self, max_groups=max_groups)

    # -- verification -----------------------------------------------------------------
    def verify(
        self, step: PlannedStep[R_co], *args: Any, bytes_tol: float = 0.1, mem_tol: float = 0.2
    ) -> R_co:
        """Predicted vs compiled collectives and memory of ``step(*args)``.

        ``step`` is what ``sk.jit(fn, plan)`` returns; this runs its own
        ``step.verify(*args)``: the prediction propagates the plan's specs through
        the step's jaxpr (``spmdkit.propagation``) and the compiled side reads the
        HLO of the executable the step runs (``spmdkit.verification``).

        Returns:
          A ``spmdkit.verification.compiled.VerifyReport`` (``.ok``, ``.mismatches``).

        Raises:
          PlanError: ``step`` is not compiled for a plan (a plain function, or a
            ``jax.jit`` one).

        Example::

            >>> step = sk.jit(jax.value_and_grad(loss), plan)
            >>> plan.verify(step, params, batch).ok
            True
        """
        if not isinstance(step, PlannedStep):
            raise PlanError(
                op="Plan.verify",
                must="the step is compiled for the plan by sk.jit",
                given=f"{type(step).__name__} {getattr(step, '__name__', '')}".rstrip(),
                fix="wrap with sk.jit(step, plan) and pass what it returns: "
                "plan.verify(sk.jit(step, plan), *args)",
            )
        return step.verify(*args, bytes_tol=bytes_tol, mem_tol=mem_tol)


# -- a finished plan's notes ----------------------------------------------------------


def noted(out: Plan, notes: list[PlanNote], *, strict: bool) -> Plan:
    """The plan with its notes (``notes`` and its layout's,
    :func:`layout_notes`), each warned on the caller of :func:`plan`;
    ``strict``: raise instead."""
    notes = [*notes, *layout_notes(out)]
    raise_if_strict(notes, out.strategy, strict=strict)
    warn_notes(notes, stacklevel=3)  # noted, plan, its caller
    return replace(out, notes=tuple(notes))


def layout_notes(plan: Plan) -> list[PlanNote]:
    """The notes a finished plan's layout calls for (:mod:`spmdkit.planner.notes`):
    idle mesh axes, a batch off the axes its rule asks for, a batch no rule places."""
    name = plan.chosen or plan.strategy
    specs = [s for table in (plan.params, plan.opt, plan.grads, plan.state) for s in table.values()]
    activation = dict(plan.activation)
    if plan.pipeline is not None:
        activation["<pipeline>"] = (plan.pipeline.axis,)
    preset = name in PRESETS or name in SHARDED_OPT_PRESETS
    out = idle_axis_notes(plan.mesh, specs, activation, by_role=preset)
    asked, who = asked_batch_axes(plan.rules, plan.mesh)
    if plan.rules is not None:
        who = f"the {name!r} rule table" if preset else "the rule table"
    chosen = plan.activation.get("batch", ())
    out += batch_notes(plan.mesh, plan.batch_size, chosen, asked, who)
    if not chosen:
        out += no_batch_rule_note(plan.rules, plan.batch_size)
    if plan.activation:
        out += batch_field_notes(plan.batch_axes, plan.activation)
    return out
