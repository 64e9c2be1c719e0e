"""Propagation: run the rule registry over a traced program.

:func:`trace` turns a function (a whole train step: forward, ``jax.grad`` and the
optimizer update) into a jaxpr from abstract inputs; nothing is computed.
:func:`propagate` walks that jaxpr once per equation: each primitive is mapped
to a registered rule (``dot_general``, ``add``, ``reduce_sum``…), the rule's
forward inference says which specs the operands must have and which specs the
results get, and every difference between what an operand has and what the
rule needs is a reshard, planned and priced by :func:`spmdkit.plan_reshard`
under a :class:`~spmdkit.topology.Topology`. Pending reductions (sum-partial
matmul outputs) travel as far as the rules let them and are paid for where a
consumer cannot take them: that is where the all-reduce (or reduce-scatter) of
a real program sits.

**Structure.** Calls that only group equations (``jit``, ``custom_jvp_call``,
``custom_vjp_call``, ``remat``) are inlined, so the walk sees one flat list and
memory liveness runs over it; results nobody uses are dropped first (as XLA
does). Loops and branches stay one node each: ``scan`` propagates its body and
counts its costs ``length`` times; the carry keeps its entry layout or takes the
fixed point the body reaches from it, whichever costs less over the loop (the
stacked dim of ``xs`` and ``ys`` stays unsharded); ``while`` does the same and
counts its body once (trip count unknown); ``cond`` propagates every branch,
costs the dearest and keeps outputs on which the branches agree. ``shard_map``
takes its in/out specs as given and counts the collectives its body calls.

**Choosing.** Where a rule's answer costs communication (operands disagree,
or the result is left sum-partial), the answers with one operand keeping a
contested axis alone, with one operand leading, and with the operands' hints
are priced too — operand reshards plus resolving the result's pending
reductions, payload bytes first — and the cheapest whose results are no
bigger per device wins; ties keep the rule's answer.

**Unknown primitives.** A primitive with no rule is never an error: its inputs
are made replicated (that reshard is priced), its outputs are replicated, one
warning is issued per primitive and the count is kept in
:attr:`Propagation.unknown`. :func:`register_primitive` maps a primitive to a
rule. Layout-only primitives (transpose, broadcast_in_dim, reshape, slice…),
scatter / scatter-add, cumulative ops, argmax/argmin, sort and a list of
elementwise primitives have small built-in fallbacks used only when the
registry has no rule of that name.

**Both directions.** A backward sweep (the rules' backward inference) carries
wanted layouts upstream as hints: the ``out_specs`` constraints, and the layouts
consumers slice free-made values to (a broadcast constant, a mask). The forward
sweep takes a hint where it costs no more than following the operands; the
sweeps repeat (four rounds at most) and the round with the lowest modelled
step time is kept. Outputs without a constraint keep what the forward sweep
gives them, with pending reductions resolved (a jitted function returns
reduced values). A value resharded once is not resharded again for another
consumer wanting the same layout.

**Costs.** ``comm_bytes`` are per-device payload bytes as XLA's HLO shows them
(:mod:`spmdkit.resharding` conventions). ``flops`` are per device: ``2·M·N·K``
of the local blocks for ``dot_general``, one per output element elsewhere;
compute time uses ``topology.peak_flops`` when the topology has it, else
:data:`DEFAULT_PEAK_FLOPS`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.extend.core
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdkit.errors import ShardingConflictError, SpecError, SpmdError
from spmdkit.factor import Notation
from spmdkit.inference import ArgReshard, infer_backward, infer_forward
from spmdkit.propagation.memory import MemoryEstimate, liveness
from spmdkit.registry import get_rule, registered_ops
from spmdkit.resharding import Collective, ReshardPlan, plan_reshard
from spmdkit.rule import FactorRule, RuleContext
from spmdkit.spec import MeshLike, TensorSpec, axis_sizes
from spmdkit.topology import DEFAULT_TOPOLOGY, Topology
from spmdkit.util import fmt_bytes

__all__ = [
    "EqnRecord",
    "Propagation",
    "propagate",
    "register_primitive",
    "trace",
    "DEFAULT_PEAK_FLOPS",
]

#: Per-device peak FLOP/s used for compute time when the topology has no
#: ``peak_flops`` field (H100 SXM dense bf16).
DEFAULT_PEAK_FLOPS = 989e12

# Parameters that say nothing about layouts, dropped before a rule sees them.
_IGNORED_PARAMS = frozenset(
    {
        "sharding",
        "out_sharding",
        "precision",
        "preferred_element_type",
        "out_dtype",
        "accumulation_type",
        "algorithm",
        "transpose_algorithm",
        "weak_type",
    }
)

# Inlined call-like primitives that must stay one unit when a program is replayed.
_REMAT_PRIMS = frozenset({"remat", "remat2", "checkpoint"})

# Call-like primitives whose body is inlined: (param holding the body).
_INLINE = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_INLINE_PRIMS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "remat",
        "remat2",
        "checkpoint",
        "custom_lin",
    }
)

# What a rule (or a built-in) may raise on an equation it does not fit: the
# equation then falls back to replicated, warned and counted, never a crash.
_RULE_ERRORS = (
    SpmdError,
    TypeError,
    ValueError,
    KeyError,
    IndexError,
    AttributeError,
    NotImplementedError,
)
_CONVERTERS: dict[str, Callable[[Any], tuple[str, dict] | None]] = {}
# (mesh, topology, op, attrs, specs, hints) -> chosen forward answer
_CHEAPEST: dict[tuple, Any] = {}
_WARNED: set[str] = set()


def register_primitive(name: str, to_rule: Callable[[Any], tuple[str, dict] | None]) -> None:
    """Map a jax primitive to a registered rule.

    Args:
      name: the primitive's name (``eqn.primitive.name``).
      to_rule: ``fn(eqn) -> (op name, attrs)``, or None to treat the equation as
        having no rule (replicated fallback).

    Example::

        >>> register_primitive("my_gelu", lambda eqn: ("tanh", {}))
    """
    if not isinstance(name, str) or not callable(to_rule):
        raise SpmdError(
            op="register_primitive",
            must="name is a primitive name and to_rule a callable",
            given=f"{name!r}, {type(to_rule).__name__}",
            fix="register_primitive('prim', lambda eqn: ('op', {...}))",
        )
    _CONVERTERS[name] = to_rule


# -- tracing --------------------------------------------------------------------


def _abstract(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    return x


def trace(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """The closed jaxpr of ``fn(*args, **kwargs)``, from abstract values only.

    Array leaves may be ``jax.Array`` or ``jax.ShapeDtypeStruct`` (shardings are
    dropped: propagation decides layouts). Keyword arguments are static.

    Example::

        >>> x = jax.ShapeDtypeStruct((8, 4), "float32")
        >>> trace(lambda x: x @ x.T, x).jaxpr.eqns[0].primitive.name
        'dot_general'
    """
    return trace_with_tree(fn, *args, **kwargs)[0]


def trace_with_tree(fn: Callable, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """:func:`trace`, plus the output pytree structure (pass it to
    ``propagate(closed, ..., out_tree=)`` to give ``out_specs`` as a pytree)."""
    return _trace(fn, args, kwargs)


def _trace(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    abstract = jax.tree.map(_abstract, args)
    f = functools.partial(fn, **kwargs) if kwargs else fn
    closed, shapes = jax.make_jaxpr(f, return_shape=True)(*abstract)
    return closed, jax.tree.structure(shapes)


# -- flattened program ----------------------------------------------------------


@dataclass
class _Node:
    prim: str
    eqn: Any
    ins: list[int]
    outs: list[int]
    backward: bool
    kind: str = "eqn"  # "eqn", "scan", "while", "cond", "shard_map"
    subs: list[_Graph] = field(default_factory=list)
    group: _Group | None = None  # the remat equation this node was inlined from


@dataclass(eq=False)
class _Group:
    """A remat (checkpoint) equation whose body was inlined: replayed whole."""

    eqn: Any
    ins: list[int]
    outs: list[int] = field(default_factory=list)


@dataclass
class _Graph:
    invars: list[int]
    outvars: list[int]
    nodes: list[_Node]
    all_nodes: list[_Node] = field(default_factory=list)  # before dead-code removal


class _Program:
    """Values (shape, dtype) and a flat node list; call-like eqns are inlined."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[np.dtype] = []
        self.const: list[bool] = []
        self.values: dict[int, Any] = {}  # constant id -> its value

    def new(self, aval: Any, const: bool = False) -> int:
        self.shapes.append(tuple(int(s) for s in getattr(aval, "shape", ())))
        dtype = getattr(aval, "dtype", None)
        try:
            dtype = np.dtype(dtype) if dtype is not None else np.dtype("float32")
        except TypeError:  # extended dtypes (PRNG keys): count 4 bytes per element
            dtype = np.dtype("uint32")
        self.dtypes.append(dtype)
        self.const.append(const)
        return len(self.shapes) - 1

    def graph(self, closed: Any, ins: Sequence[int] | None = None, backward: bool = False):
        jaxpr, _ = _open(closed)
        env: dict[Any, int] = {}
        for v, c in zip(jaxpr.constvars, _padded(_open(closed)[1], jaxpr.constvars), strict=True):
            env[v] = self.new(v.aval, const=True)
            if c is not None:
                self.values[env[v]] = c
        invars = []
        for i, v in enumerate(jaxpr.invars):
            vid = ins[i] if ins is not None else self.new(v.aval)
            env[v] = vid
            invars.append(vid)
        nodes: list[_Node] = []
        self._walk(jaxpr, env, nodes, backward)
        outvars = [self._read(env, v) for v in jaxpr.outvars]
        return _Graph(invars, outvars, nodes), env

    def _read(self, env: dict[Any, int], v: Any) -> int:
        if isinstance(v, jax.extend.core.Literal):
            vid = self.new(v.aval, const=True)
            self.values[vid] = v.val
            return vid
        return env[v]

    def _walk(
        self,
        jaxpr: Any,
        env: dict[Any, int],
        nodes: list[_Node],
        backward: bool,
        group: _Group | None = None,
    ):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            bwd = backward or "transpose(" in str(eqn.source_info.name_stack)
            ins = [self._read(env, v) for v in eqn.invars]
            body = _inline_body(eqn) if name in _INLINE_PRIMS else None
            if body is not None:
                inner, consts = _open(body)
                sub_env: dict[Any, int] = {}
                for v, c in zip(inner.constvars, _padded(consts, inner.constvars), strict=True):
                    sub_env[v] = self.new(v.aval, const=True)
                    if c is not None:
                        self.values[sub_env[v]] = c
                for v, vid in zip(inner.invars, ins, strict=True):
                    sub_env[v] = vid
                g = group
                if g is None and name in _REMAT_PRIMS:
                    g = _Group(eqn, ins)
                self._walk(inner, sub_env, nodes, bwd, g)
                for v, o in zip(eqn.outvars, inner.outvars, strict=True):
                    env[v] = self._read(sub_env, o)
                if g is not None and g is not group:
                    g.outs = [env[v] for v in eqn.outvars]
                continue
            outs = [self.new(v.aval) for v in eqn.outvars]
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
            node = _Node(name, eqn, ins, outs, bwd, group=group)
            if name == "scan":
                node.kind = "scan"
                node.subs = [self.graph(eqn.params["jaxpr"], backward=bwd)[0]]
            elif name == "while":
                node.kind = "while"
                node.subs = [
                    self.graph(eqn.params["cond_jaxpr"], backward=bwd)[0],
                    self.graph(eqn.params["body_jaxpr"], backward=bwd)[0],
                ]
            elif name == "cond":
                node.kind = "cond"
                node.subs = [self.graph(b, backward=bwd)[0] for b in eqn.params["branches"]]
            elif name == "shard_map":
                node.kind = "shard_map"
            nodes.append(node)


def _padded(consts: Sequence[Any], constvars: Sequence[Any]) -> list[Any]:
    """Constant values for ``constvars`` (None where an open jaxpr gives none)."""
    return [*consts, *[None] * (len(constvars) - len(consts))]


def _open(closed: Any) -> tuple[Any, list]:
    if hasattr(closed, "jaxpr") and hasattr(closed, "consts"):
        return closed.jaxpr, list(closed.consts)
    return closed, []


def _inline_body(eqn: Any) -> Any:
    for key in _INLINE:
        body = eqn.params.get(key)
        if body is not None and hasattr(_open(body)[0], "eqns"):
            return body
    return None


def _dce(graph: _Graph) -> None:
    """Drop nodes whose results nobody uses (XLA does the same)."""
    graph.all_nodes = list(graph.nodes)
    live = set(graph.outvars)
    keep = []
    for node in reversed(graph.nodes):
        effects = getattr(node.eqn, "effects", None)
        if effects or any(o in live for o in node.outs):
            keep.append(node)
            live.update(node.ins)
            for sub in node.subs:
                _dce(sub)
    graph.nodes = keep[::-1]


# -- records --------------------------------------------------------------------


@dataclass(frozen=True)
class EqnRecord:
    """What propagation decided for one equation.

    Attributes:
      index: position in the flattened program.
      primitive: the jax primitive name.
      op: the rule used (None: no rule, treated as replicated).
      attrs: the attributes the rule got.
      inputs: the specs the operands were given to the rule in (after reshards).
      outputs: the result specs.
      reshards: operands that had to move, with their plans.
      comm_bytes: per-device payload bytes of those reshards (× trip count in loops).
      comm_time_s: their modelled time.
      flops: per-device flops of the equation.
      strategy: the rule strategy used.
      source: ``file:line (function)`` of the user code that made the equation.
      backward: True for equations of the backward pass (``transpose(jvp(...))``).
      repeat: how many times ``body`` runs (scan length; 1 otherwise).
      body: records of a loop's or branch's equations (``carry``: the reshard of
        the carry back to its loop-entry layout).
    """

    index: int
    primitive: str
    op: str | None
    attrs: dict
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    reshards: tuple[ArgReshard, ...]
    comm_bytes: int
    comm_time_s: float
    flops: float
    strategy: str
    source: str
    backward: bool
    repeat: int = 1
    body: tuple[EqnRecord, ...] = ()

    def collectives(self) -> list[Collective]:
        """The communicating steps of this equation's reshards, then of its loop
        body (``repeat`` times)."""
        steps = [c for r in self.reshards for c in r.plan.collectives]
        inner = [c for r in self.body for c in r.collectives()]
        return steps + inner * self.repeat


@dataclass
class Propagation:
    """The result of :func:`propagate`: specs of every value, costs, memory.

    Attributes:
      mesh: the mesh.
      closed_jaxpr: the traced program.
      in_specs: flat input specs.
      out_specs: flat output specs (after resolving pending reductions or
        meeting the ``out_specs`` constraints).
      records: one per equation (flattened), plus ``output`` records for the
        reshards at the outputs.
      unknown: primitive → number of equations without a rule.
      comm_bytes_by_kind: collective kind → per-device payload bytes.
      comm_bytes: total per-device payload bytes.
      comm_time_s: modelled communication time.
      flops: per-device flops.
      compute_time_s: flops / peak flops.
      step_time_s: compute + communication (no overlap assumed).
      memory: per-device memory estimate, a cheap elementwise value recomputed
        inside each consumer's fusion (as XLA:GPU does, and XLA:CPU often): the
        planner's estimate and the low end of the predicted range.
      memory_materialized: the same with every value that several consumers read
        materialized once (never recomputed): the high end of the range.
        Which of the two XLA does for a given value is its fusion heuristic's
        choice, so ``plan.verify`` accepts a compiled peak anywhere in the range
        (widened by its tolerance).
      var_specs: top-level jaxpr variable → spec.
      program: what :func:`spmdkit.compile.enforce.replay` needs to run the traced
        program with every equation pinned to its propagated layouts.
    """

    mesh: MeshLike
    closed_jaxpr: Any
    in_specs: list[TensorSpec]
    out_specs: list[TensorSpec]
    records: list[EqnRecord]
    unknown: collections.Counter
    comm_bytes_by_kind: dict[str, int]
    comm_bytes: int
    comm_time_s: float
    flops: float
    compute_time_s: float
    step_time_s: float
    memory: MemoryEstimate
    var_specs: dict = field(default_factory=dict, repr=False)
    program: Any = field(default=None, repr=False, compare=False)
    memory_materialized: MemoryEstimate | None = field(default=None, repr=False)

    def collectives(self) -> list[Collective]:
        """Every predicted collective, in program order (loop bodies repeated)."""
        return [c for r in self.records for c in r.collectives()]

    def table(self, limit: int | None = None) -> str:
        """A text table of the equations that communicate, costliest first."""
        rows = sorted(
            (r for r in self.records if r.comm_bytes),
            key=lambda r: (-r.comm_bytes, r.index),
        )
        if limit is not None:
            rows = rows[:limit]
        lines = [
            f"{'#':>5}  {'primitive':<18} {'pass':<4} {'bytes':>10}  reshards",
        ]
        for r in rows:
            moves = "; ".join(str(a.plan) for a in r.reshards if a.plan.collectives)
            if r.body:
                per: dict[str, int] = {}
                for c in (c for b in r.body for c in b.collectives()):
                    per[c.kind] = per.get(c.kind, 0) + c.payload_bytes
                inner = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(per.items()))
                moves = (moves + "; " if moves else "") + f"body per iteration: {inner}"
            rep = f" ×{r.repeat}" if r.repeat > 1 else ""
            lines.append(
                f"{r.index:>5}  {r.primitive:<18} {'bwd' if r.backward else 'fwd':<4} "
                f"{fmt_bytes(r.comm_bytes):>10}  {moves}{rep}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.comm_bytes_by_kind.items())
        head = [
            f"propagation on mesh {dict(axis_sizes(self.mesh))}: {len(self.records)} equations",
            f"  communication: {fmt_bytes(self.comm_bytes)} per device ({kinds or 'none'}), "
            f"{self.comm_time_s * 1e3:.3f} ms",
            f"  compute: {self.flops:.3g} flops per device, {self.compute_time_s * 1e3:.3f} ms",
            f"  step time (model): {self.step_time_s * 1e3:.3f} ms",
            f"  memory: {self.memory}",
        ]
        if self.unknown:
            head.append(
                "  no rule (replicated): "
                + ", ".join(f"{k}×{n}" for k, n in sorted(self.unknown.items()))
            )
        table = self.table(limit=20)
        return "\n".join(head) + ("\n" + table if table.count("\n") else "")


# -- primitive → rule -----------------------------------------------------------

_REDUCERS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})
_RENAMES = {"add_any": "add"}


def _to_rule(eqn: Any) -> tuple[str, dict] | None:
    try:
        return _to_rule_unchecked(eqn)
    except _RULE_ERRORS:  # a converter that does not fit the equation: no rule
        return None


def _to_rule_unchecked(eqn: Any) -> tuple[str, dict] | None:
    name = eqn.primitive.name
    conv = _CONVERTERS.get(name)
    if conv is not None:
        return conv(eqn)
    params = eqn.params
    if name in _REDUCERS:
        return name, {"axis": tuple(params["axes"])}
    if name == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        dn = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
        return name, {"dimension_numbers": dn}
    if name == "convert_element_type":
        return name, {"new_dtype": np.dtype(params["new_dtype"]).name}
    if name == "integer_pow":
        return name, {"y": int(params["y"])}
    attrs = {k: v for k, v in params.items() if k not in _IGNORED_PARAMS}
    return _RENAMES.get(name, name), attrs


# -- built-in rules for primitives the library does not cover ---------------------


def _dummy(*xs: Any, **_: Any) -> Any:
    return xs[0]


def _eltwise_notation(shapes: Any, **_: Any) -> str:
    from spmdkit.rules.elementwise import broadcast_notation

    return broadcast_notation(shapes)


def _keep_notation(
    shapes: Any,
    *,
    replicate: tuple[int, ...] = (),
    drop: tuple[int, ...] = (),
    reduce: str | None = None,
    **_: Any,
) -> Notation:
    """All operands share one factor per dim; ``replicate`` dims unsharded; ``drop``
    dims vanish from the (single) output."""
    (rank,) = {len(s) for s in shapes}
    fs = tuple(f"d{i}" for i in range(rank))
    outs = tuple(f for i, f in enumerate(fs) if i not in drop)
    need = frozenset(fs[i] for i in (*replicate, *drop))
    return Notation(tuple(fs for _ in shapes), (outs,), need, reduce)


def _builtin(name: str, notation: Any, policy: str, **kw: Any) -> FactorRule:
    return FactorRule(name, notation, impl=_dummy, partial=policy, **kw)


_ELTWISE_NONE = frozenset(
    {
        "acos",
        "acosh",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "cbrt",
        "ceil",
        "clamp",
        "conj",
        "cosh",
        "digamma",
        "erf_inv",
        "erfc",
        "exp2",
        "floor",
        "igamma",
        "imag",
        "is_finite",
        "lgamma",
        "nextafter",
        "population_count",
        "real",
        "rem",
        "round",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "sinh",
        "tan",
        "xor",
        "square",
        "sign",
        "abs",
        "sqrt",
        "rsqrt",
        "cos",
        "sin",
        "tanh",
        "logistic",
        "exp",
        "log",
        "log1p",
        "expm1",
        "erf",
        "neg",
        "pow",
        "max",
        "min",
        "not",
        "and",
        "or",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "select_n",
        "add",
        "sub",
        "mul",
        "div",
        "threefry2x32",
        "bitcast_convert_type",
    }
)  # fallbacks only: a registered rule of the same name always wins
_IDENTITY = frozenset(
    {"copy", "copy_p", "stop_gradient", "reduce_precision", "pvary", "optimization_barrier"}
)
# Primitives that make new values from keys or nothing: any layout is as cheap.
_GENERATORS = frozenset(
    {
        "iota",
        "random_bits",
        "random_fold_in",
        "random_seed",
        "random_split",
        "random_unwrap",
        "random_wrap",
        "rng_bit_generator",
        "rng_uniform",
    }
)
_ELTWISE_RULE = _builtin("elementwise", _eltwise_notation, "NONE")
_IDENTITY_RULE = _builtin("identity", _eltwise_notation, "LINEAR")
_KEEP_RULE = _builtin("keep", _keep_notation, "NONE")
_KEEP_LINEAR_RULE = _builtin("keep_linear", _keep_notation, "LINEAR")
_REDUCE_RULE = _builtin("reduce", _keep_notation, "NONE", reduce=None)


def _builtin_for(name: str, eqn: Any, n_in: int) -> tuple[FactorRule, dict] | None:
    p = eqn.params
    if name in _IDENTITY and n_in == 1:
        return _IDENTITY_RULE, {}
    if name in _ELTWISE_NONE and len(eqn.outvars) == 1:
        return _ELTWISE_RULE, {}
    if name in ("cumsum", "cumlogsumexp", "cummax", "cummin", "cumprod"):
        rule = _KEEP_LINEAR_RULE if name == "cumsum" else _KEEP_RULE
        return rule, {"replicate": (int(p["axis"]),)}
    if name in ("argmax", "argmin"):
        return _REDUCE_RULE, {"drop": tuple(int(a) for a in p["axes"])}
    if name == "sort" and len(eqn.outvars) == n_in:
        return _KEEP_RULE, {"replicate": (int(p["dimension"]),), "_multi": True}
    if name == "top_k" and n_in == 1:
        # XLA partitions its TopK custom call by gathering the whole operand (even a
        # batch dim sharded elsewhere): predict exactly that
        rank = len(eqn.invars[0].aval.shape)
        return _KEEP_RULE, {"replicate": tuple(range(rank)), "_fan": True}
    if name == "rev" and n_in == 1:  # a reversed dim moves whole: keep it unsharded
        return _KEEP_LINEAR_RULE, {"replicate": tuple(int(d) for d in p["dimensions"])}
    return None


def _builtin_forward(
    rule: FactorRule,
    attrs: dict,
    specs: tuple[TensorSpec, ...],
    mesh: MeshLike,
    out_dtypes: list,
    out_shapes: list,
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """``_multi``: output i takes input i's layout (sort); ``_fan``: every output
    takes the single input's layout with its own shape (top_k)."""
    attrs = dict(attrs)
    multi = attrs.pop("_multi", False)
    fan = attrs.pop("_fan", False)
    ctx = RuleContext(op=rule.name, axis_sizes=axis_sizes(mesh), attrs=attrs)
    ans = rule.forward(ctx, specs)
    outs = ans.outputs
    if multi:
        outs = tuple(s.without_partial() for s in ans.inputs)
    if fan:
        base = ans.inputs[0].without_partial()
        outs = tuple(base.replace(shape=tuple(shape)) for shape in out_shapes)
    outs = tuple(o.replace(dtype=d) for o, d in zip(outs, out_dtypes, strict=True))
    return ans.inputs, outs


# Layout-only primitives (shape rules may not be registered yet): hand-written
# fallbacks that keep what is safe to keep. Each returns (required input dims,
# output dims); pending reductions pass (these ops are linear in their operand).

_Dims = tuple[tuple[str, ...], ...]


def _lay_transpose(p: Mapping, ins: list[TensorSpec], outs: list[tuple], sizes: Mapping):
    x = ins[0]
    return [x.dims], [tuple(x.dims[d] for d in p["permutation"])]


def _lay_broadcast(p: Mapping, ins: list[TensorSpec], outs: list[tuple], sizes: Mapping):
    x = ins[0]
    shape = outs[0]
    req = list(x.dims)
    out: list[tuple[str, ...]] = [() for _ in shape]
    for i, d in enumerate(p["broadcast_dimensions"]):
        if x.shape[i] == shape[d]:
            out[d] = x.dims[i]
        else:
            req[i] = ()
    return [tuple(req), *(() for _ in ins[1:])], [tuple(out)]


def _lay_squeeze(p: Mapping, ins: list[TensorSpec], outs: list[tuple], sizes: Mapping):
    x = ins[0]
    drop = {d % x.ndim for d in p["dimensions"]}
    req = tuple(() if d in drop else a for d, a in enumerate(x.dims))
    return [req], [tuple(a for d, a in enumerate(x.dims) if d not in drop)]


def _lay_reshape(p: Mapping, ins: list[TensorSpec], outs: list[tuple], sizes: Mapping):
    x = ins[0]
    if p.get("dimensions") is not None:
        return [tuple(() for _ in x.shape)], [tuple(() for _ in outs[0])]
    src, dst = x.shape, outs[0]
    req: list[tuple[str, ...]] = [() for _ in src]
    out: list[tuple[str, ...]] = [() for _ in dst]
    i = j = 0
    while i < len(src) or j < len(dst):
        # the smallest groups src[i:i2], dst[j:j2] with equal products
        i2, j2 = i, j
        a = b = 1
        while True:
            if a == b and (i2 > i or j2 > j) and (a != 1 or i2 == len(src) or j2 == len(dst)):
                break
            if a <= b and i2 < len(src):
                a *= src[i2]
                i2 += 1
            elif j2 < len(dst):
                b *= dst[j2]
                j2 += 1
            else:
                i2, j2 = len(src), len(dst)
                break
        major_in = next((k for k in range(i, i2) if src[k] != 1), None)
        major_out = next((k for k in range(j, j2) if dst[k] != 1), None)
        if major_in is not None and major_out is not None and x.dims[major_in]:
            axes = x.dims[major_in]
            n = math.prod(sizes[ax] for ax in axes)
            others = all(not x.dims[k] for k in range(i, i2) if k != major_in)
            if others and src[major_in] % n == 0 and dst[major_out] % n == 0:
                req[major_in] = axes
                out[major_out] = axes
        i, j = i2, j2
    return [tuple(req)], [tuple(out)]


def _lay_slice(p: Mapping, ins: list[TensorSpec], outs: list[tuple], sizes: Mapping):
    x = ins[0]
    keep = tuple(a if n == m else () for a, n, m in zip(x.dims, x.shape, outs[0], strict=True))
    return [keep, *(() for _ in ins[1:])], [keep]


def _lay_concat(p: Mapping, ins: list[TensorSpec], outs: list[tuple], sizes: Mapping):
    dim = int(p["dimension"])
    first = ins[0]
    dims = tuple(() if d == dim else a for d, a in enumerate(first.dims))
    return [dims for _ in ins], [dims]


def _lay_pad(p: Mapping, ins: list[TensorSpec], outs: list[tuple], sizes: Mapping):
    x = ins[0]
    dims = tuple(
        a if tuple(cfg) == (0, 0, 0) else ()
        for a, cfg in zip(x.dims, p["padding_config"], strict=True)
    )
    return [dims, ()], [dims]


def _scatter(
    name: str, p: Mapping, specs: tuple[TensorSpec, ...], out_dtype: Any
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """scatter / scatter-add (operand, indices, updates): the indexed operand dims
    replicated; window dims and batching dims (``take_along_axis``) shared by
    operand, updates (and indices), taking the operand's axes, else the updates',
    else (batching dims) the indices'; the updates' other scatter dims keep their
    axes — for scatter-add each device adds its own updates, so the result is
    sum-partial over those axes (the operand joins as partial for free); plain
    scatter gathers them instead."""
    dn = p["dimension_numbers"]
    if len(specs) != 3:
        raise ValueError("scatter takes operand, indices, updates")
    o, idx, u = specs
    indexed = set(dn.scatter_dims_to_operand_dims)
    o_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    i_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    windowed = [
        d for d in range(o.ndim) if d not in set(dn.inserted_window_dims) and d not in o_batch
    ]
    link = dict(zip(windowed, dn.update_window_dims, strict=True))  # operand dim -> update dim
    scatter_dims = [k for k in range(u.ndim) if k not in set(dn.update_window_dims)]
    idx_dims = list(range(idx.ndim - 1))  # the last indices dim holds the index vectors
    upd_of_idx = dict(zip(idx_dims, scatter_dims, strict=True))
    idx_of_upd = {k: i for i, k in upd_of_idx.items()}
    idx_of_batch = dict(zip(o_batch, i_batch, strict=True))
    for od, idim in idx_of_batch.items():
        link[od] = upd_of_idx[idim]
    out_dims: list[tuple[str, ...]] = []
    used: set[str] = set()
    for d in range(o.ndim):
        axes: tuple[str, ...] = ()
        w = link.get(d)
        if d not in indexed:
            if o.dims[d]:
                axes = o.dims[d]
            elif w is not None and u.shape[w] == o.shape[d] and u.dims[w]:
                axes = u.dims[w]
            elif d in idx_of_batch and idx.shape[idx_of_batch[d]] == o.shape[d]:
                axes = idx.dims[idx_of_batch[d]]  # sharded labels: scatter locally
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out_dims.append(axes)
    u_dims: list[tuple[str, ...]] = [() for _ in range(u.ndim)]
    i_dims: list[tuple[str, ...]] = [() for _ in range(idx.ndim)]
    for d, w in link.items():
        if u.shape[w] == o.shape[d]:
            u_dims[w] = out_dims[d]
            if w in idx_of_upd:
                i_dims[idx_of_upd[w]] = out_dims[d]
    partial: dict[str, str] = {}
    if name == "scatter-add":
        linked = set(link.values())
        for k in scatter_dims:
            if k in linked:
                continue
            axes = tuple(a for a in u.dims[k] if a not in used)
            used.update(axes)
            u_dims[k] = axes
            if k in idx_of_upd:
                i_dims[idx_of_upd[k]] = axes
            partial.update({a: "sum" for a in axes})
    req = (
        TensorSpec(o.shape, out_dims, partial=partial, dtype=o.dtype),
        TensorSpec(idx.shape, i_dims, dtype=idx.dtype),
        TensorSpec(u.shape, u_dims, dtype=u.dtype),
    )
    out = TensorSpec(o.shape, out_dims, partial=partial, dtype=out_dtype)
    return req, (out,)


def _conv(
    p: Mapping, specs: tuple[TensorSpec, ...], out_shape: tuple, out_dtype: Any
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """conv_general_dilated like a matmul: the lhs batch dim and the rhs output-feature
    dim pass to the output, the input-feature dims contract (sum-partial when both
    operands shard them alike); spatial dims replicated (halos are not modelled);
    grouped convolutions keep features replicated."""
    lhs, rhs = specs
    dn = p["dimension_numbers"]
    lb, lf = dn.lhs_spec[:2]
    ro, ri = dn.rhs_spec[:2]
    ob, of = dn.out_spec[:2]
    grouped = p.get("feature_group_count", 1) != 1 or p.get("batch_group_count", 1) != 1
    used: set[str] = set()

    def take(axes: tuple[str, ...]) -> tuple[str, ...]:
        got = tuple(a for a in axes if a not in used)
        used.update(got)
        return got

    b = take(lhs.dims[lb])
    k = () if grouped else take(lhs.dims[lf] or rhs.dims[ri])
    o = () if grouped else take(rhs.dims[ro])
    ld = [() for _ in lhs.shape]
    rd = [() for _ in rhs.shape]
    od = [() for _ in out_shape]
    ld[lb], ld[lf], rd[ri], rd[ro] = b, k, k, o
    od[ob], od[of] = b, o
    req = (
        TensorSpec(lhs.shape, ld, dtype=lhs.dtype),
        TensorSpec(rhs.shape, rd, dtype=rhs.dtype),
    )
    out = TensorSpec(out_shape, od, partial={a: "sum" for a in k}, dtype=out_dtype)
    return req, (out,)


_LAYOUT = {
    "broadcast_in_dim": _lay_broadcast,
    "concatenate": _lay_concat,
    "dynamic_slice": _lay_slice,
    "pad": _lay_pad,
    "reshape": _lay_reshape,
    "slice": _lay_slice,
    "squeeze": _lay_squeeze,
    "transpose": _lay_transpose,
}


def _layout_forward(
    name: str,
    p: Mapping,
    specs: tuple[TensorSpec, ...],
    out_shapes: list,
    out_dtypes: list,
    mesh: MeshLike,
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    sizes = axis_sizes(mesh)
    req_dims, out_dims = _LAYOUT[name](p, list(specs), out_shapes, sizes)
    linear = name != "pad" and all(not s.partial for s in specs[1:])
    partial = dict(specs[0].partial) if linear else {}
    req = tuple(
        TensorSpec(s.shape, d, partial=partial if i == 0 else {}, dtype=s.dtype)
        for i, (s, d) in enumerate(zip(specs, req_dims, strict=True))
    )
    outs = tuple(
        TensorSpec(shape, d, partial=partial, dtype=dt)
        for shape, d, dt in zip(out_shapes, out_dims, out_dtypes, strict=True)
    )
    return req, outs


# -- the propagation engine -------------------------------------------------------


class _Engine:
    def __init__(self, prog: _Program, mesh: MeshLike, topology: Topology, strategies: Mapping):
        self.prog = prog
        self.mesh = mesh
        self.topology = topology
        self.strategies = dict(strategies or {})
        self.ops = frozenset(registered_ops())
        self.unknown: collections.Counter = collections.Counter()
        self.hints: dict[int, TensorSpec] = {}
        self.stationary: frozenset[int] = frozenset()
        self.uses: dict[int, int] = {}
        self.producer: dict[int, str] = {}
        self._sizes = axis_sizes(mesh)
        self._key = (tuple(self._sizes.items()), topology)
        self._plans: dict[tuple, ArgReshard | None] = {}

    # specs
    def const_ids(self) -> set[int]:
        """Ids of literals and constants (their layout is free to choose)."""
        return {i for i, c in enumerate(self.prog.const) if c}

    def replicated(self, vid: int) -> TensorSpec:
        return TensorSpec(self.prog.shapes[vid], dtype=self.prog.dtypes[vid])

    def reshard(
        self, label: str, src: TensorSpec, dst: TensorSpec, vid: int | None = None
    ) -> ArgReshard | None:
        if src.dims == dst.dims and src.partial == dst.partial:
            return None
        strict = vid is not None and self.producer.get(vid) in _REDUCE_IN_PLACE
        key = (label, src, dst, strict)
        hit = self._plans.get(key, 0)
        if hit != 0:
            return hit
        src_t = src if src.dtype == dst.dtype else src.replace(dtype=dst.dtype)
        plan = plan_reshard(src_t, dst, self.mesh, topology=self.topology)
        if strict and not _reduces_first(plan):
            plan = _reduce_then_move(src_t, dst, self)
        plan = _one_group(plan, self)
        out = ArgReshard(label, src, dst, plan, in_place=strict)
        self._plans[key] = out
        return out

    def warn(self, prim: str, why: str) -> None:
        self.unknown[prim] += 1
        if prim not in _WARNED:
            _WARNED.add(prim)
            warnings.warn(
                f"spmdkit.propagation: no sharding rule for primitive {prim!r} ({why}); "
                "its operands are made replicated and the cost counted. "
                "Register one with spmdkit.propagation.register_primitive.",
                stacklevel=4,
            )

    # one equation
    def _price(
        self, given: Sequence[TensorSpec], required: Sequence[TensorSpec], outs: Sequence
    ) -> tuple[int, float]:
        """(payload bytes, time) of the operand reshards plus resolving the outputs'
        pending reductions (most are paid later, so alternatives are compared with
        them included). Bytes come first: under the latency term a plan that adds
        small collectives to save hops looks cheaper than what XLA does."""
        pairs = list(zip(given, required, strict=True))
        pairs += [(o, o.without_partial()) for o in outs if o.partial]
        nbytes, t = 0, 0.0
        for i, (s, r) in enumerate(pairs):
            a = self.reshard(f"arg {i}", s, r)
            if a is not None:
                nbytes += a.payload_bytes
                t += a.plan.time_s
        return nbytes, t

    def _forward_cheapest(
        self, op: str, attrs: dict, specs: tuple[TensorSpec, ...], ins: Sequence[int] = ()
    ):
        """The rule's answer; where that costs communication, also the answers led
        by each sharded operand alone and the one with the operands' backward hints
        (the layouts later equations want); the cheapest whose outputs are no bigger
        per device wins (ties keep the rule's own answer)."""
        hinted = None
        if self.hints and ins:
            hinted = tuple(
                h if (h := self.hints.get(v)) is not None and h.shape == x.shape else x
                for v, x in zip(ins, specs, strict=True)
            )
        try:
            still = tuple(v in self.stationary for v in ins) if ins else ()
            key = (
                self._key,
                op,
                id(get_rule(op)),
                tuple(sorted(attrs.items())),
                specs,
                hinted,
                still,
            )
            hit = _CHEAPEST.get(key)
        except TypeError:  # unhashable attributes: no caching
            key, hit = None, None
        if hit is not None:
            return hit
        still = tuple(v in self.stationary for v in ins) if ins else ()
        best = self._cheapest_uncached(op, attrs, specs, hinted, still)
        if key is not None:
            if len(_CHEAPEST) > 65536:
                _CHEAPEST.clear()
            _CHEAPEST[key] = best
        return best

    def _cheapest_uncached(self, op, attrs, specs, hinted, still=()):
        res = infer_forward(op, *specs, mesh=self.mesh, **attrs)
        if not any(a.plan.collectives for a in res.reshards) and not any(
            o.partial and not any(s.partial for s in specs) for o in res.outputs
        ):
            return res
        # activations stay put: where an activation (a value computed from the batch)
        # and a weight contest a mesh axis, the weight gives it up (it is all-gathered,
        # as in FSDP) rather than the activation being moved or left sum-partial
        act = [i for i, m in enumerate(still) if m]
        keeps = functools.partial(_keeps, specs, act)
        if act and len(act) < len(specs) and not keeps(res):
            axes = {a for i in act for d in specs[i].dims for a in d}
            alt = tuple(x if still[j] else _drop_axes(x, axes) for j, x in enumerate(specs))
            try:
                cand = infer_forward(op, *alt, mesh=self.mesh, **attrs)
            except _RULE_ERRORS:
                cand = None
            if cand is not None and keeps(cand):
                return cand
        kept = bool(act) and keeps(res)
        best, best_t = res, self._price(specs, res.inputs, res.outputs)
        size = sum(o.local_bytes(self.mesh) for o in res.outputs)
        alts = []
        if len(specs) > 1:
            # an axis sharding several operands: let each of them keep it alone
            owners: dict[str, list[int]] = {}
            for i, x in enumerate(specs):
                for a in x.sharding_axes:
                    owners.setdefault(a, []).append(i)
            for a, who in sorted(owners.items()):
                for i in who if len(who) > 1 else ():
                    alts.append(
                        tuple(x if j == i else _drop_axes(x, {a}) for j, x in enumerate(specs))
                    )
            for i, lead in enumerate(specs):  # one operand leads, the others replicated
                if lead.sharding_axes:
                    alts.append(
                        tuple(x if j == i else _drop_axes(x, None) for j, x in enumerate(specs))
                    )
        if hinted is not None:
            alts.append(hinted)
        for alt in alts:
            if alt == specs:
                continue
            try:
                cand = infer_forward(op, *alt, mesh=self.mesh, **attrs)
            except _RULE_ERRORS:
                continue
            if kept and not keeps(cand):
                continue
            t = self._price(specs, cand.inputs, cand.outputs)
            smaller = sum(o.local_bytes(self.mesh) for o in cand.outputs) <= size
            if smaller and t < best_t:
                best, best_t = cand, t
        return best

    def infer(self, node: _Node, specs: tuple[TensorSpec, ...]):
        """(op, attrs, required inputs, outputs) for a plain equation."""
        eqn = node.eqn
        name = node.prim
        out_shapes = [self.prog.shapes[o] for o in node.outs]
        out_dtypes = [self.prog.dtypes[o] for o in node.outs]
        if not node.ins and name not in ("shard_map",) and name not in _GENERATORS:
            return None, {}, (), tuple(self.replicated(o) for o in node.outs)
        if name in _GENERATORS:  # fresh values: replicated, or the layout consumers want
            outs = tuple(
                h if (h := self.hints.get(o)) is not None else self.replicated(o) for o in node.outs
            )
            return name, {}, tuple(s.without_partial().replace(dims=()) for s in specs), outs
        if name == "optimization_barrier" and len(specs) == len(node.outs):
            return name, {}, specs, specs  # identity on every operand, layouts kept
        if name in ("sharding_constraint", "reshard", "mesh_cast"):
            got = self._constraint(node, specs[0])
            if got is not None:
                return name, {}, (got,), (got,)
        conv = _to_rule(eqn)
        if conv is not None and conv[0] in self.ops:
            op, attrs = conv
            strategy = self.strategies.get(op)
            if strategy is not None:
                attrs = {**attrs, "strategy": strategy}
            try:
                local = _index_parallel(eqn, specs) if op == "gather" else None
                if local is not None:
                    res = self._forward_cheapest(op, attrs, local[0], node.ins)
                    res = _with_masked_lookup(res, specs[0], local[1])
                else:
                    res = self._forward_cheapest(op, attrs, specs, node.ins)
                outs = res.outputs
                if [o.shape for o in outs] == out_shapes:
                    outs = tuple(
                        o if o.dtype == d else o.replace(dtype=d)
                        for o, d in zip(outs, out_dtypes, strict=True)
                    )
                    return op, attrs, res.inputs, outs
                why = f"rule {op!r} gave output shapes {[o.shape for o in outs]}"
            except _RULE_ERRORS as e:
                why = f"rule {op!r} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            self.warn(name, why)
            return (
                None,
                {},
                tuple(s.without_partial().replace(dims=()) for s in specs),
                tuple(self.replicated(o) for o in node.outs),
            )
        if name == "conv_general_dilated" and len(specs) == 2:
            try:
                req, outs = _conv(eqn.params, specs, out_shapes[0], out_dtypes[0])
                return name, {}, req, outs
            except _RULE_ERRORS:
                pass
        if name in ("scatter-add", "scatter"):
            try:
                req, outs = _scatter(name, eqn.params, specs, out_dtypes[0])
                return name, {}, req, outs
            except _RULE_ERRORS:
                pass
        if name in _LAYOUT:
            try:
                req, outs = _layout_forward(
                    name, eqn.params, specs, out_shapes, out_dtypes, self.mesh
                )
                return name, {}, req, outs
            except _RULE_ERRORS:
                pass
        built = _builtin_for(name, eqn, len(specs))
        if built is not None:
            rule, attrs = built
            try:
                req, outs = _builtin_forward(rule, attrs, specs, self.mesh, out_dtypes, out_shapes)
                if [o.shape for o in outs] == out_shapes:
                    return rule.name, {k: v for k, v in attrs.items() if k[0] != "_"}, req, outs
            except _RULE_ERRORS:
                pass
        self.warn(name, "no rule registered")
        req = tuple(TensorSpec(s.shape, dtype=s.dtype) for s in specs)
        return None, {}, req, tuple(self.replicated(o) for o in node.outs)

    def _constraint(self, node: _Node, spec: TensorSpec) -> TensorSpec | None:
        p = node.eqn.params
        sharding = p.get("sharding", p.get("dst_sharding"))
        pspec = getattr(sharding, "spec", sharding)
        if not isinstance(pspec, P) or any(e is P.UNCONSTRAINED for e in pspec):
            return None
        try:
            return TensorSpec(spec.shape, pspec, dtype=spec.dtype, mesh=self.mesh)
        except SpmdError:
            return None

    def hinted(self, node: _Node, specs, op, attrs, req, outs):
        """Take the backward hint on the outputs when it costs no more than the
        forward answer plus resharding to the hint."""
        hints = [self.hints.get(o) for o in node.outs]
        if (
            op is None
            or op not in self.ops
            or all(h is None or h == o for h, o in zip(hints, outs, strict=True))
        ):
            return req, outs
        want = tuple(h if h is not None else o for h, o in zip(hints, outs, strict=True))
        try:
            res = infer_backward(op, *specs, outputs=want, mesh=self.mesh, **attrs)
        except _RULE_ERRORS:
            return req, outs
        if tuple(o.dims for o in res.outputs) != tuple(w.dims for w in want):
            return req, outs

        def cost(required, produced):
            t = 0.0
            for i, (s, r) in enumerate(zip(specs, required, strict=True)):
                a = self.reshard(f"input {i}", s, r)
                t += a.plan.time_s if a else 0.0
            for i, (o, w) in enumerate(zip(produced, want, strict=True)):
                a = self.reshard(f"output {i}", o, w)
                t += a.plan.time_s if a else 0.0
            return t

        # candidate inputs: backward's layout, keeping operands' partials out
        cand_in = res.inputs
        try:
            fwd = infer_forward(op, *cand_in, mesh=self.mesh, **attrs)
        except _RULE_ERRORS:
            return req, outs
        cand_in, cand_out = fwd.inputs, fwd.outputs
        if tuple(o.dims for o in cand_out) != tuple(w.dims for w in want):
            # forward cannot recreate it (dims new in the output): backward's own answer
            cand_in, cand_out = res.inputs, res.outputs
        cand_out = tuple(o.replace(dtype=w.dtype) for o, w in zip(cand_out, want, strict=True))
        act = [i for i, v in enumerate(node.ins) if v in self.stationary]
        moved = [i for i in act if not _kept(specs[i], cand_in[i])]
        if moved and all(_kept(specs[i], req[i]) for i in moved):
            return req, outs  # activations stay put (see _cheapest_uncached)
        if cost(cand_in, cand_out) <= cost(req, outs):
            return cand_in, cand_out
        return req, outs

    # whole graphs
    def run(
        self,
        graph: _Graph,
        in_specs: Sequence[TensorSpec],
        spec: dict[int, TensorSpec],
        collect: list | None,
        repeat: int = 1,
    ) -> None:
        for vid, s in zip(graph.invars, in_specs, strict=True):
            spec[vid] = s
        for node in graph.nodes:
            for v in node.ins:
                if v not in spec:
                    spec[v] = self.replicated(v)
            specs = tuple(spec[v] for v in node.ins)
            if node.kind == "eqn" and any(s.partial for s in specs):
                # a pending reduction read by several equations is reduced once, where
                # it is made (XLA all-reduces a dot's result), not once per reader
                # and so are pending reductions that meet (XLA reduces each one)
                # and so is one a broadcast would enlarge (reducing first moves fewer
                # bytes, and XLA does so)
                meet = sum(1 for s in specs if s.partial) > 1
                grows = node.prim == "broadcast_in_dim" and math.prod(
                    self.prog.shapes[node.outs[0]]
                ) > math.prod(self.prog.shapes[node.ins[0]])
                eff = tuple(
                    s.without_partial()
                    if s.partial and (meet or grows or self.uses.get(v, 0) > 1)
                    else s
                    for v, s in zip(node.ins, specs, strict=True)
                )
                if eff != specs:
                    op, attrs, req, outs = self.infer(node, eff)
                    if self.hints:
                        req, outs = self.hinted(node, eff, op, attrs, req, outs)
                    for o, s in zip(node.outs, outs, strict=True):
                        spec[o] = s
                    if collect is not None:
                        collect.append((node, op, attrs, specs, req, outs, repeat, None))
                    continue
            if node.kind == "scan":
                self._scan(node, specs, spec, collect, repeat)
                continue
            if node.kind in ("while", "cond"):
                self._control(node, specs, spec, collect, repeat)
                continue
            if node.kind == "shard_map":
                op, attrs, req, outs = self._shard_map(node, specs)
            else:
                op, attrs, req, outs = self.infer(node, specs)
                if self.hints:
                    req, outs = self.hinted(node, specs, op, attrs, req, outs)
            for o, s in zip(node.outs, outs, strict=True):
                spec[o] = s
            if collect is not None:
                collect.append((node, op, attrs, specs, req, outs, repeat, None))

    def _shard_map(self, node: _Node, specs):
        p = node.eqn.params
        try:
            req = tuple(
                TensorSpec(s.shape, ps, dtype=s.dtype, mesh=self.mesh)
                for s, ps in zip(specs, p["in_specs"], strict=True)
            )
            outs = tuple(
                TensorSpec(self.prog.shapes[o], ps, dtype=self.prog.dtypes[o], mesh=self.mesh)
                for o, ps in zip(node.outs, p["out_specs"], strict=True)
            )
            return "shard_map", {}, req, outs
        except (SpmdError, KeyError, TypeError):
            self.warn("shard_map", "in/out specs not understood")
            return (
                None,
                {},
                tuple(TensorSpec(s.shape, dtype=s.dtype) for s in specs),
                tuple(self.replicated(o) for o in node.outs),
            )

    def _body(self, graph: _Graph, in_specs, spec, collect, repeat):
        self.run(graph, in_specs, spec, collect, repeat)
        return [spec.get(v) or self.replicated(v) for v in graph.outvars]

    def _items_time(self, items: list) -> float:
        """Modelled reshard time of collected equations (loops: body × trip count)."""
        t = 0.0
        for _node, _, _, specs, req, _, _, extra in items:
            for s, r in zip(specs, req, strict=True):
                a = self.reshard("input", s, r)
                t += a.plan.time_s if a else 0.0
            if extra is not None:
                inner, back, n = extra
                t += n * (self._items_time(inner) + sum(a.plan.time_s for a in back))
        return t

    def _carry(self, body: _Graph, init: list, length: int, inputs, carry_out: slice) -> list:
        """The loop-carry layouts: the entry layouts, or the fixed point the body
        reaches from them, whichever costs less over the whole loop."""
        cands = [init]
        carry = init
        for _ in range(4):
            outs = self._body(body, inputs(carry), {}, None, 1)
            new = [o.without_partial() for o in outs[carry_out]]
            if new == carry:
                break
            carry = new
        else:
            carry = [TensorSpec(s.shape, dtype=s.dtype) for s in carry]
        if carry != init:
            cands.append(carry)
        if len(cands) == 1:
            return init

        def cost(c: list) -> float:
            items: list = []
            outs = self._body(body, inputs(c), {}, items, 1)
            t = sum(
                a.plan.time_s
                for s, d in zip(init, c, strict=True)
                if (a := self.reshard("carry", s, d)) is not None
            )
            back = sum(
                a.plan.time_s
                for o, d in zip(outs[carry_out], c, strict=True)
                if (a := self.reshard("carry", o, d)) is not None
            )
            return t + length * (self._items_time(items) + back)

        return min(cands, key=cost)

    def _scan(self, node: _Node, specs, spec, collect, repeat):
        p = node.eqn.params
        nc, nk, length = int(p["num_consts"]), int(p["num_carry"]), int(p["length"])
        body = node.subs[0]
        consts = [s.without_partial() for s in specs[:nc]]
        carry = [s.without_partial() for s in specs[nc : nc + nk]]
        xs = [_unstack(s.without_partial()) for s in specs[nc + nk :]]
        carry = self._carry(
            body, carry, length, lambda c: [*consts, *c, *(x for x, _ in xs)], slice(0, nk)
        )
        inner: list = []
        outs = self._body(body, [*consts, *carry, *(x for x, _ in xs)], spec, inner, repeat)
        req = (*consts, *carry, *(stacked for _, stacked in xs))
        # a result the body already reduced leaves the loop reduced (no second
        # reduction after it); others leave stacked with their pending reduction, which
        # their consumers resolve (same bytes as a reduction per iteration, fewer hops)
        ys = [
            _stack(
                o.without_partial() if o.partial and _reduced_inside(inner, bo, o) else o, length
            )
            for bo, o in zip(body.outvars[nk:], outs[nk:], strict=True)
        ]
        # the carry coming back each iteration must have the carry-in layout
        back = []
        for i, (o, c) in enumerate(zip(outs[:nk], carry, strict=True)):
            a = self.reshard(f"carry {i}", o, c)
            if a is not None:
                back.append(a)
        node_outs = (*carry, *ys)
        for o, s in zip(node.outs, node_outs, strict=True):
            spec[o] = s
        if collect is not None:
            collect.append(
                (
                    node,
                    "scan",
                    {"length": length},
                    specs,
                    req,
                    tuple(node_outs),
                    repeat,
                    (inner, back, length),
                )
            )

    def _control(self, node: _Node, specs, spec, collect, repeat):
        if node.kind == "while":
            p = node.eqn.params
            cn, bn = int(p["cond_nconsts"]), int(p["body_nconsts"])
            cconsts = [s.without_partial() for s in specs[:cn]]
            bconsts = [s.without_partial() for s in specs[cn : cn + bn]]
            carry = [s.without_partial() for s in specs[cn + bn :]]
            body = node.subs[1]
            carry = self._carry(body, carry, 1, lambda c: [*bconsts, *c], slice(0, None))
            inner: list = []
            self._body(node.subs[0], [*cconsts, *carry], spec, inner, repeat)
            outs = self._body(body, [*bconsts, *carry], spec, inner, repeat)
            back = [
                a
                for i, (o, c) in enumerate(zip(outs, carry, strict=True))
                if (a := self.reshard(f"carry {i}", o, c)) is not None
            ]
            req = (*cconsts, *bconsts, *carry)
            node_outs = tuple(carry)
            extra = (inner, back, 1)
        else:  # cond: index, then operands
            ops = [s.without_partial() for s in specs[1:]]
            branches = []
            for g in node.subs:
                items: list = []
                branches.append((self._body(g, ops, spec, items, repeat), items))
            node_outs = []
            for j, o in enumerate(node.outs):
                cands = {r[j].without_partial() for r, _ in branches}
                node_outs.append(cands.pop() if len(cands) == 1 else self.replicated(o))
            costed = []
            for results, items in branches:
                back = [
                    a
                    for j, (r, want) in enumerate(zip(results, node_outs, strict=True))
                    if (a := self.reshard(f"output {j}", r, want)) is not None
                ]
                t = self._items_time(items) + sum(a.plan.time_s for a in back)
                costed.append((t, items, back))
            # one branch runs: cost the dearest (first among equals)
            _, inner, back = max(costed, key=lambda c: c[0])
            req = (TensorSpec(specs[0].shape, dtype=specs[0].dtype), *ops)
            node_outs = tuple(node_outs)
            extra = (inner, back, 1)
        for o, s in zip(node.outs, node_outs, strict=True):
            spec[o] = s
        if collect is not None:
            collect.append((node, node.prim, {}, specs, req, node_outs, repeat, extra))

    # backward sweep: hints from wanted output layouts
    def backward_hints(
        self,
        graph: _Graph,
        spec: dict[int, TensorSpec],
        wanted: dict[int, TensorSpec],
        fixed: set[int],
    ) -> dict[int, TensorSpec]:
        hints = dict(wanted)
        for node in reversed(graph.nodes):
            if node.kind == "scan":
                self._scan_hints(node, spec, hints, fixed)
                continue
            if node.kind != "eqn":
                continue
            want = [hints.get(o) for o in node.outs]
            if all(w is None for w in want):
                continue
            conv = _to_rule(node.eqn)
            if conv is None or conv[0] not in self.ops:
                continue
            op, attrs = conv
            outs = tuple(
                w if w is not None else spec[o] for w, o in zip(want, node.outs, strict=True)
            )
            ins = tuple(spec[v] for v in node.ins)
            try:
                res = infer_backward(op, *ins, outputs=outs, mesh=self.mesh, **attrs)
            except _RULE_ERRORS:
                continue
            for v, s in zip(node.ins, res.inputs, strict=True):
                if v in fixed or self.prog.const[v] or v in hints:
                    continue
                if s.sharding_axes and s.dims != spec[v].dims:
                    hints[v] = s
        return hints

    def _scan_hints(self, node: _Node, spec, hints: dict, fixed: set[int]) -> None:
        """Carry the hints on a scan's results into its body and back out to its
        operands (the stacked dim stays unsharded)."""
        p = node.eqn.params
        nc, nk = int(p["num_consts"]), int(p["num_carry"])
        body = node.subs[0]
        inner: dict[int, TensorSpec] = {v: h for v, h in hints.items() if v in _vids(body)}
        for j, (o, bo) in enumerate(zip(node.outs, body.outvars, strict=True)):
            h = hints.get(o)
            if h is None or bo in inner:
                continue
            if j < nk:
                inner[bo] = h
            elif not h.dims[0]:
                inner[bo] = TensorSpec(h.shape[1:], h.dims[1:], dtype=h.dtype)
        if not inner:
            return
        got = self.backward_hints(body, spec, inner, set())
        for v, h in got.items():
            hints.setdefault(v, h)
        for j, (v, bi) in enumerate(zip(node.ins, body.invars, strict=True)):
            h = got.get(bi)
            if h is None or v in fixed or self.prog.const[v] or v in hints:
                continue
            if j >= nc + nk:
                h = _stack(h, self.prog.shapes[v][0])
            if h.shape == self.prog.shapes[v]:
                hints[v] = h


def _vids(graph: _Graph) -> frozenset[int]:
    """Every value id a graph defines (inputs and results, nested bodies included)."""
    cached = getattr(graph, "_vids", None)
    if cached is None:
        ids = set(graph.invars)
        for node in graph.nodes:
            ids.update(node.outs)
            for sub in node.subs:
                ids |= _vids(sub)
        cached = frozenset(ids)
        graph._vids = cached
    return cached


# Producers of sum-partial values that XLA reduces at the layout they were made in:
# it computes a dot's or a reduction's result directly in a sliced layout, but
# not a scatter's (an embedding's gradient is all-reduced whole, then sliced).
_REDUCE_IN_PLACE = frozenset({"scatter-add", "scatter_add", "scatter", "gather"})


def _reduces_first(plan: ReshardPlan) -> bool:
    """Whether every pending reduction of ``plan.src`` that ``plan.dst`` does not
    keep happens before any other step (a reduce-scatter straight into a dim
    counts as such a reduction): see :data:`_REDUCE_IN_PLACE`."""
    keep = dict(plan.dst.partial)
    pending = {a for a, op in plan.src.partial if keep.get(a) != op}
    for c in plan.steps:
        if not pending:
            return True
        if c.kind in ("all_reduce", "reduce_scatter"):
            pending -= set(c.axes)
        elif c.kind != "to_partial":
            return False
    return True


def _reduce_then_move(src: TensorSpec, dst: TensorSpec, engine: _Engine) -> ReshardPlan:
    """Reduce the pending axes ``dst`` does not keep at ``src``'s layout, then move."""
    keep = dict(dst.partial)
    mid = src.replace(partial={a: op for a, op in src.partial if keep.get(a) == op})
    first = plan_reshard(src, mid, engine.mesh, topology=engine.topology)
    then = plan_reshard(mid, dst, engine.mesh, topology=engine.topology)
    return ReshardPlan(src, dst, first.steps + then.steps)


def _one_group(plan: ReshardPlan, engine: _Engine) -> ReshardPlan:
    """Staged gathers (or reduce-scatters) of one dim as the one collective over
    all their axes that XLA's partitioner emits (its payload: the full gathered
    block, or the whole reduce-scatter input)."""
    steps: list[Collective] = []
    merged = False
    for c in plan.steps:
        last = steps[-1] if steps else None
        if (
            last is not None
            and c.kind == last.kind
            and c.kind in ("all_gather", "reduce_scatter")
            and c.dim == last.dim
            and c.reduce_op == last.reduce_op
            and not c.is_local
            and not last.is_local
        ):
            axes = c.axes + last.axes if c.kind == "all_gather" else last.axes + c.axes
            n = last.group_size * c.group_size
            payload = max(c.payload_bytes, last.payload_bytes)
            wire = payload * (n - 1) // n
            t = engine.topology.collective_time(c.kind, wire, n, axes, engine.mesh)
            steps[-1] = Collective(
                kind=c.kind,
                axes=axes,
                group_size=n,
                dim=c.dim,
                reduce_op=c.reduce_op,
                payload_bytes=payload,
                wire_bytes=wire,
                time_s=t,
            )
            merged = True
        else:
            steps.append(c)
    return ReshardPlan(plan.src, plan.dst, tuple(steps)) if merged else plan


def _index_parallel(eqn: Any, specs: Sequence[TensorSpec]):
    """For a gather whose operand is sharded on a dim it indexes point-wise (an
    embedding table over the vocabulary): (the specs with those axes taken off the
    operand, the axes). XLA looks up locally with a mask and leaves the result
    sum-partial over those axes; None when the operand is not so sharded."""
    if len(specs) != 2:
        return None
    x = specs[0]
    dn = eqn.params["dimension_numbers"]
    sizes = eqn.params["slice_sizes"]
    axes: set[str] = set()
    for d in dn.start_index_map:
        if sizes[d] == 1 and d < len(x.dims):
            axes.update(x.dims[d])
    if not axes or any(a in specs[1].sharding_axes for a in axes):
        return None
    return (_drop_axes(x, axes), specs[1]), axes


def _with_masked_lookup(res: Any, x: TensorSpec, axes: set[str]) -> Any:
    """``res`` (a gather's rule answer without ``axes`` on the operand) as the
    masked local lookup: the operand keeps ``axes`` and the result is sum-partial
    over them; the rule's answer when the result is sharded over them already."""
    out = res.outputs[0]
    if any(a in out.sharding_axes for a in axes) or any(a in dict(x.partial) for a in axes):
        return res
    req_x = res.inputs[0]
    kept = req_x.replace(
        dims=tuple(
            tuple(a for a in g if a in axes) + tuple(r)
            for g, r in zip(x.dims, req_x.dims, strict=True)
        )
    )
    try:
        new_out = out.replace(partial={**dict(out.partial), **dict.fromkeys(sorted(axes), "sum")})
    except SpmdError:
        return res
    return dataclasses.replace(res, inputs=(kept, *res.inputs[1:]), outputs=(new_out,))


def _uses(graph: _Graph, out: dict[int, int] | None = None) -> dict[int, int]:
    """Value id → number of equations (and graph results) reading it, bodies included."""
    out = {} if out is None else out
    for node in graph.nodes:
        for v in set(node.ins):
            out[v] = out.get(v, 0) + 1
        for sub in node.subs:
            _uses(sub, out)
    for v in set(graph.outvars):
        out[v] = out.get(v, 0) + 1
    return out


def _reduced_inside(items: list, vid: int, have: TensorSpec) -> bool:
    """Whether some equation of a loop body already reads ``vid`` reduced, in its layout."""
    for node, _, _, _, req, _, _, _ in items:
        for v, r in zip(node.ins, req, strict=True):
            if v == vid and r.dims == have.dims and not r.partial:
                return True
    return False


def _keeps(specs: Sequence[TensorSpec], which: Sequence[int], res: Any) -> bool:
    """Whether a rule's answer leaves the listed operands' dim shardings in place
    (further sharding, a free slice, is fine)."""
    return all(_kept(specs[i], res.inputs[i]) for i in which)


def _kept(given: TensorSpec, required: TensorSpec) -> bool:
    """Whether ``required`` still shards each dim of ``given`` over its axes."""
    got = required.dims + ((),) * (len(given.dims) - len(required.dims))
    return all(set(d) <= set(r) for d, r in zip(given.dims, got, strict=False))


def _stationary(graph: _Graph, seeds: set[int]) -> set[int]:
    """Values computed from ``seeds`` (the batch): activations and their gradients."""
    out = set(seeds)
    for node in graph.nodes:
        hit = [v in out for v in node.ins]
        if not any(hit):
            continue
        out.update(node.outs)
        subs = node.subs
        if node.kind == "scan":
            body = subs[0]
            nc, nk = int(node.eqn.params["num_consts"]), int(node.eqn.params["num_carry"])
            ins = {b for b, h in zip(body.invars, hit, strict=True) if h}
            for _ in range(2):  # a carry fed by the batch is an activation next time round
                got = _stationary(body, ins)
                ins |= {body.invars[nc + k] for k in range(nk) if body.outvars[k] in got}
            out |= _stationary(body, ins)
        elif node.kind == "cond":
            for b in subs:
                out |= _stationary(b, {v for v, h in zip(b.invars, hit[1:], strict=False) if h})
        else:
            for b in subs:
                out |= _stationary(b, set(b.invars))
    return out


def _drop_axes(s: TensorSpec, axes: set[str] | None) -> TensorSpec:
    """``s`` without the given sharding axes (None: all of them); partials stay."""
    if axes is None:
        return s.replace(dims=())
    return s.replace(dims=tuple(tuple(a for a in d if a not in axes) for d in s.dims))


def _unstack(s: TensorSpec) -> tuple[TensorSpec, TensorSpec]:
    """(slice spec seen by the body, stacked spec with dim 0 unsharded)."""
    stacked = s.replace(dims=((), *s.dims[1:])) if s.dims and s.dims[0] else s
    return TensorSpec(s.shape[1:], s.dims[1:], dtype=s.dtype), stacked


def _stack(s: TensorSpec, length: int) -> TensorSpec:
    return TensorSpec((length, *s.shape), ((), *s.dims), partial=dict(s.partial), dtype=s.dtype)


# -- input specs ------------------------------------------------------------------


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (TensorSpec, P))


def _flat_in_specs(in_specs: Any, args: tuple, mesh: MeshLike, what: str) -> list[TensorSpec]:
    leaves, treedef = jax.tree.flatten(in_specs, is_leaf=_is_spec_leaf)
    try:
        groups = treedef.flatten_up_to(args)
    except (ValueError, TypeError) as e:
        raise SpecError(
            op="propagate",
            must=f"{what} is a pytree prefix of the arguments",
            given=f"{treedef} for arguments {jax.tree.structure(args)}",
            fix="give one spec (TensorSpec, PartitionSpec or None) per array, or one per subtree",
        ) from e
    out: list[TensorSpec] = []
    for leaf, group in zip(leaves, groups, strict=True):
        for x in jax.tree.leaves(group):
            shape = tuple(getattr(x, "shape", ()))
            dtype = getattr(x, "dtype", None)
            if dtype is None:
                dtype = np.asarray(x).dtype
            try:
                dtype = np.dtype(dtype)
            except TypeError:
                dtype = np.dtype("uint32")
            if isinstance(leaf, TensorSpec):
                if leaf.shape != shape:
                    raise SpecError(
                        op="propagate",
                        must=f"each {what} TensorSpec has its argument's shape",
                        given=f"{leaf} for an argument of shape {shape}",
                        fix="build the spec with the argument's shape, or pass a PartitionSpec",
                    )
                s = leaf if leaf.dtype is not None else leaf.replace(dtype=dtype)
            elif leaf is None:
                s = TensorSpec(shape, dtype=dtype)
            else:
                s = TensorSpec(shape, leaf, dtype=dtype)
            out.append(s.validate(mesh, op="propagate"))
    return out


# -- the public entry point -----------------------------------------------------------


def _source(eqn: Any) -> str:
    try:
        from jax._src import source_info_util  # no public equivalent

        return source_info_util.summarize(eqn.source_info)
    except Exception:
        return ""


def _flops(
    node: _Node, req: Sequence[TensorSpec], outs: Sequence[TensorSpec], mesh: MeshLike
) -> float:
    if node.prim == "dot_general" and req:
        (lc, _), _ = node.eqn.params["dimension_numbers"]
        k = math.prod(req[0].local_shape(mesh)[d] for d in lc)
        return 2.0 * math.prod(outs[0].local_shape(mesh)) * k
    if node.prim == "conv_general_dilated" and len(req) == 2:
        dn = node.eqn.params["dimension_numbers"]
        rhs = req[1].local_shape(mesh)
        per_out = math.prod(rhs[d] for d in dn.rhs_spec[1:])  # in-features x window
        return 2.0 * math.prod(outs[0].local_shape(mesh)) * per_out
    if node.prim in _REDUCERS or node.prim in ("argmax", "argmin"):
        return float(math.prod(req[0].local_shape(mesh))) if req else 0.0
    if node.kind != "eqn" or not outs:
        return 0.0
    return float(sum(math.prod(o.local_shape(mesh)) for o in outs))


def propagate(
    fn_or_closed_jaxpr: Any,
    *args: Any,
    in_specs: Any,
    mesh: MeshLike,
    out_specs: Any = None,
    strategies: Mapping[str, str] | None = None,
    topology: Topology = DEFAULT_TOPOLOGY,
    donate_argnums: Sequence[int] | int = (),
    arg_roles: Any = None,
    out_tree: Any = None,
    **kwargs: Any,
) -> Propagation:
    """Propagate specs through ``fn(*args, **kwargs)`` and price every reshard.

    Args:
      fn_or_closed_jaxpr: a function (traced with :func:`trace`) or a closed jaxpr.
      *args: the arguments (arrays or ``jax.ShapeDtypeStruct`` pytrees). With a
        closed jaxpr, its input avals (flat) unless given.
      in_specs: a pytree prefix of ``args`` with ``TensorSpec``, ``PartitionSpec``
        or None (replicated) leaves.
      mesh: a ``Mesh`` or ``AbstractMesh`` (no devices are needed).
      out_specs: optional constraints on the outputs (a pytree prefix of the
        outputs; None leaves are unconstrained).
      strategies: op name → strategy name, for rules with alternatives.
      topology: link model for reshard costs; ``peak_flops`` if it has one.
      donate_argnums: donated positional arguments (memory only).
      arg_roles: a pytree prefix of ``args`` with role strings (``"params"``,
        ``"opt_state"``, ``"batch"``…) for the memory breakdown.
      out_tree: with a closed jaxpr, the output treedef (:func:`trace_with_tree`)
        so ``out_specs`` can be a pytree; without it they are a flat list.
      **kwargs: static keyword arguments of ``fn``.

    Returns:
      A :class:`Propagation`.

    Example::

        >>> mesh = sk.abstract_mesh(data=8)
        >>> prop = propagate(train_step, params, batch, mesh=mesh,
        ...                  in_specs=(None, P("data")))
        >>> prop.comm_bytes_by_kind
        {'all_reduce': 8392704}
    """
    if hasattr(fn_or_closed_jaxpr, "jaxpr") and hasattr(fn_or_closed_jaxpr, "consts"):
        closed, out_treedef = fn_or_closed_jaxpr, out_tree
        if not args:
            args = tuple(
                jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars
            )
    else:
        closed, out_treedef = _trace(fn_or_closed_jaxpr, args, kwargs)
    flat_in = _flat_in_specs(in_specs, args, mesh, "in_specs")
    n_in = len(closed.jaxpr.invars)
    if len(flat_in) != n_in:
        raise SpecError(
            op="propagate",
            must="one input spec per traced input",
            given=f"{len(flat_in)} specs for {n_in} inputs",
            fix="pass in_specs as a pytree prefix of the positional arguments",
        )
    prog = _Program()
    graph, env = prog.graph(closed)
    _dce(graph)
    for vid, s in zip(graph.invars, flat_in, strict=True):
        if s.shape != prog.shapes[vid]:
            raise SpecError(
                op="propagate",
                must="each input spec has its input's shape",
                given=f"{s} for an input of shape {prog.shapes[vid]}",
                fix="pass specs matching the arguments",
            )
    out_avals = [jax.ShapeDtypeStruct(prog.shapes[v], prog.dtypes[v]) for v in graph.outvars]
    wanted: dict[int, TensorSpec] = {}
    out_req: list[TensorSpec | None] = [None] * len(graph.outvars)
    if out_specs is not None:
        out_tree = jax.tree.unflatten(out_treedef, out_avals) if out_treedef else out_avals
        leaves, treedef = jax.tree.flatten(out_specs, is_leaf=_is_spec_leaf)
        groups = treedef.flatten_up_to(out_tree)
        flat_req = []
        for leaf, group in zip(leaves, groups, strict=True):
            for x in jax.tree.leaves(group):
                if leaf is None:
                    flat_req.append(None)
                elif isinstance(leaf, TensorSpec):
                    flat_req.append(leaf if leaf.dtype else leaf.replace(dtype=x.dtype))
                else:
                    flat_req.append(TensorSpec(x.shape, leaf, dtype=x.dtype, mesh=mesh))
        out_req = flat_req
        for v, r in zip(graph.outvars, out_req, strict=True):
            if r is not None:
                wanted[v] = r

    _check_strategies(strategies or {})
    engine = _Engine(prog, mesh, topology, strategies or {})
    roles = _roles(arg_roles, args, graph.invars)
    engine.uses = _uses(graph)
    engine.producer = _producers(graph, {})
    engine.stationary = frozenset(_stationary(graph, {v for v, r in roles.items() if r == "batch"}))
    fixed = set(graph.invars)
    peak = float(getattr(topology, "peak_flops", DEFAULT_PEAK_FLOPS))
    best: tuple | None = None
    for _ in range(4):
        spec: dict[int, TensorSpec] = {}
        collect: list = []
        engine.unknown = collections.Counter()
        engine.run(graph, flat_in, spec, collect)
        t = engine._items_time(collect) + _items_flops(collect, mesh) / peak
        for v, r in zip(graph.outvars, out_req, strict=True):
            have = spec.get(v) or engine.replicated(v)
            a = engine.reshard("output", have, r if r is not None else have.without_partial())
            t += a.plan.time_s if a else 0.0
        if best is None or t < best[0]:  # hints are heuristics: keep the cheapest round
            best = (t, spec, collect, engine.unknown)
        asked = {**_consumer_hints(engine, collect, fixed | engine.const_ids()), **wanted}
        if not asked:
            break
        hints = engine.backward_hints(graph, spec, asked, fixed)
        if hints == engine.hints:
            break
        engine.hints = hints
    _, spec, collect, engine.unknown = best

    avail: dict[int, list[TensorSpec]] = {}
    held: dict = {}
    records = [_record(engine, item, avail, mesh, i, held) for i, item in enumerate(collect)]
    final_out = []
    for i, (v, r) in enumerate(zip(graph.outvars, out_req, strict=True)):
        have = spec.get(v) or engine.replicated(v)
        want = r if r is not None else have.without_partial()
        final_out.append(want)
        a = _reshard_once(engine, avail, v, f"output {i}", have, want)
        if a is not None:
            records.append(
                EqnRecord(
                    index=len(records),
                    primitive="output",
                    op=None,
                    attrs={"output": i},
                    inputs=(have,),
                    outputs=(want,),
                    reshards=(a,),
                    comm_bytes=a.payload_bytes,
                    comm_time_s=a.plan.time_s,
                    flops=0.0,
                    strategy="default",
                    source="",
                    backward=False,
                )
            )
    by_kind: dict[str, int] = {}
    for r in records:
        for c in r.collectives():
            by_kind[c.kind] = by_kind.get(c.kind, 0) + c.payload_bytes
    comm_bytes = sum(r.comm_bytes for r in records)
    comm_time = sum(r.comm_time_s for r in records)
    flops = sum(r.flops for r in records)
    peak = float(getattr(topology, "peak_flops", DEFAULT_PEAK_FLOPS))
    compute_time = flops / peak

    donated = _donated_ids(donate_argnums, args, graph.invars)
    # a resharded copy lives from the equation that makes it to its last reuse
    transient = [0] * len(graph.nodes)
    for first, last, nbytes in held.values():
        for i in range(first, min(last, len(transient) - 1) + 1):
            transient[i] += nbytes
    memory = liveness(
        graph, spec, final_out, mesh, prog, donated=donated, roles=roles, transient=transient
    )
    memory_materialized = liveness(
        graph,
        spec,
        final_out,
        mesh,
        prog,
        donated=donated,
        roles=roles,
        transient=transient,
        duplicate=False,
    )
    var_specs = {}
    for v, vid in env.items():
        if vid in spec:
            var_specs[v] = spec[vid]
    program = Program(
        graph,
        prog.values,
        _node_specs(collect, engine, _returned(graph, final_out), _body_outvars(graph)),
        out_treedef,
    )
    return Propagation(
        mesh=mesh,
        closed_jaxpr=closed,
        in_specs=list(flat_in),
        out_specs=final_out,
        records=records,
        unknown=engine.unknown,
        comm_bytes_by_kind=dict(sorted(by_kind.items())),
        comm_bytes=int(comm_bytes),
        comm_time_s=comm_time,
        flops=flops,
        compute_time_s=compute_time,
        step_time_s=compute_time + comm_time,
        memory=memory,
        var_specs=var_specs,
        program=program,
        memory_materialized=memory_materialized,
    )


@dataclass(frozen=True, eq=False)
class Program:
    """The flattened traced program with the layouts propagation chose.

    Attributes:
      graph: the flattened program (call-like equations inlined).
      values: constant value id → value.
      specs: ``id(node)`` → ``(input specs after reshards, output specs, steps,
        fused, runs)``; ``steps[i]`` is the :class:`~spmdkit.resharding.ReshardPlan`
        that moves input ``i`` when the replay runs it with its own collectives
        (no partial layout on the way, even blocks), else the layouts it passes
        through when its reshard takes several collectives (partial ones left
        out); ``fused`` is the reshard plan that reduces a contraction's
        sum-partial result to the layout all its readers (and the step's outputs)
        slice from (None when the result is not partial, a loop body returns it,
        its readers differ, or a block would be uneven); the transposes, reshapes
        and casts it passes on the way carry reduced layouts; ``runs`` is how
        many times the equation runs per step (loop trip counts).
      out_tree: the output treedef (None when propagating a closed jaxpr
        without one).
    """

    graph: Any
    values: dict[int, Any]
    specs: dict[int, tuple]
    out_tree: Any


def _producers(graph: _Graph, out: dict[int, str]) -> dict[int, str]:
    for node in graph.nodes:
        for o in node.outs:
            out[o] = node.prim
        for sub in node.subs:
            _producers(sub, out)
    return out


#: Contractions whose sum-partial result the replay reduces itself (see Program).
_FUSED_REDUCE = frozenset({"dot_general", "conv_general_dilated"})


def _returned(graph: _Graph, final_out: Sequence[TensorSpec | None]) -> dict:
    """Returned value → the layout it leaves in (None: returned twice, left alone)."""
    out: dict[int, TensorSpec | None] = {}
    for v, s in zip(graph.outvars, final_out, strict=True):
        out[v] = None if v in out else s
    return out


def _body_outvars(graph: _Graph, out: set[int] | None = None) -> set[int]:
    """Values that loop or branch bodies return (their layout is the loop's)."""
    out = set() if out is None else out
    for node in graph.all_nodes or graph.nodes:
        for sub in node.subs:
            out.update(sub.outvars)
            _body_outvars(sub, out)
    return out


def _explicit_move(plan: Any, mesh: Any) -> bool:
    """Whether the replay runs this reshard with its own collectives under
    ``shard_map``: no partial layout on the way (a pending sum cannot cross a
    shard_map boundary under Auto axes) and even blocks all the way."""
    return all(not x.partial and x.is_even(mesh) for x in plan.specs)


def _node_specs(
    items: list,
    engine: _Engine,
    returned: dict[int, TensorSpec | None],
    blocked: set[int],
    out: dict | None = None,
    runs: int = 1,
) -> dict:
    out = {} if out is None else out
    # value → (reading node, None for the step's output; the layout it wants)
    readers: dict[int, list[tuple[_Node | None, TensorSpec | None]]] = collections.defaultdict(list)
    made: dict[int, TensorSpec | None] = {}
    for v, r in returned.items():
        readers[v].append((None, r))
    for node, _, _, _, req, outs, _, _ in items:
        for v, r in zip(node.ins, req, strict=True):
            readers[v].append((node, r))
        made.update(zip(node.outs, outs, strict=True))
    settled: dict[int, tuple[TensorSpec, TensorSpec]] = {}  # reduced before they run
    for node, _, _, specs, req, outs, _, extra in items:
        if id(node) in settled:
            before, after = settled[id(node)]
            out[id(node)] = ((before,), (after,), ((),), None, runs)
            continue
        chains = []
        for v, s, r in zip(node.ins, specs, req, strict=True):
            a = engine.reshard("input", s, r, v) if s is not None and r is not None else None
            if a is not None and a.plan.collectives and _explicit_move(a.plan, engine.mesh):
                chains.append(a.plan)
                continue
            steps = a.plan.specs[1:-1] if a is not None and len(a.plan.collectives) > 1 else ()
            chains.append(tuple(x for x in steps if not x.partial))
        fused = None
        if (
            node.prim in _FUSED_REDUCE
            and len(outs) == 1
            and outs[0] is not None
            and outs[0].partial
            and all(r is not None and not r.partial for r in req)
            and node.outs[0] not in blocked
        ):
            fused, layouts = _fused_reduction(node, outs[0], req, engine, readers, made, blocked)
            settled.update(layouts)
        out[id(node)] = (tuple(req), tuple(outs), tuple(chains), fused, runs)
        if extra is not None:
            _node_specs(extra[0], engine, {}, blocked, out, runs * extra[2])
    return out


#: Ops a pending sum passes through unchanged in size: a contraction's partial
#: result may be transposed or reshaped before its readers reduce it.
_PARTIAL_PASS = frozenset(
    {"transpose", "reshape", "convert_element_type", "copy", "squeeze", "expand_dims"}
)


def _coarsest(want: Sequence[TensorSpec | None]) -> TensorSpec | None:
    """The one non-partial layout every reader's can be sliced from (no
    communication), when there is one among them."""
    if not want or any(w is None or w.partial for w in want):
        return None
    for t in want:
        if all(
            all(wd[: len(td)] == td for wd, td in zip(w.dims, t.dims, strict=True)) for w in want
        ):
            return t
    return None


def _fused_reduction(
    node: _Node,
    spec: TensorSpec,
    req: Sequence[TensorSpec],
    engine: _Engine,
    readers: Mapping[int, list[tuple[_Node | None, TensorSpec | None]]],
    made: Mapping[int, TensorSpec | None],
    blocked: set[int],
) -> tuple[Any, dict[int, tuple[TensorSpec, TensorSpec]]]:
    """The plan by which the replay reduces a contraction's sum-partial result
    right where it is computed (None: leave it to XLA), and the layouts (input,
    output) of the layout-only nodes the partial passes through on its way to
    its readers, which then move reduced values.

    The readers (or the step's output) must all want non-partial layouts that
    slice (locally) from one of them, the layout it is reduced to. A partial may
    pass transposes (the target is permuted back) and, when its readers keep its
    layout (an all-reduce), reshapes and casts.
    """
    if any(op != "sum" for _, op in spec.partial):
        return None, {}
    v, passed = node.outs[0], []
    while True:
        nxt = readers.get(v, [])
        n = nxt[0][0] if len(nxt) == 1 else None
        if n is None or n.prim not in _PARTIAL_PASS:
            break
        s = made.get(n.outs[0]) if len(n.outs) == 1 and len(n.ins) == 1 else None
        if s is None or s.partial != spec.partial or n.outs[0] in blocked:
            break
        passed.append((n, made[v], s))
        v = n.outs[0]
    target = _coarsest([r for _, r in readers.get(v, [])])
    if target is None:
        return None, {}
    layouts: dict[int, tuple[TensorSpec, TensorSpec]] = {}
    for n, before, after in reversed(passed):
        if n.prim == "transpose":
            dims: list[tuple[str, ...]] = [()] * len(target.dims)
            for i, d in enumerate(n.eqn.params["permutation"]):
                dims[d] = target.dims[i]
            back = TensorSpec(before.shape, [d or None for d in dims], dtype=before.dtype)
        elif target.dims == after.without_partial().dims:
            back = before.without_partial()
        else:
            return None, {}
        layouts[id(n)] = (back, target)
        target = back
    a = engine.reshard("input", spec, target, node.outs[0])
    # shard_map takes even blocks only
    specs = (*req, *a.plan.specs, *(x for pair in layouts.values() for x in pair)) if a else ()
    if a is None or not all(x.is_even(engine.mesh) for x in specs):
        return None, {}
    return a.plan, layouts


def _consumer_hints(
    engine: _Engine, items: list, skip: set[int], free_in: frozenset[int] = frozenset()
) -> dict[int, TensorSpec]:
    """Values made from replicated operands (broadcast constants, masks) that a
    consumer slices (no communication) to a more sharded layout: their producer may
    as well make that layout (less compute and memory)."""
    out: dict[int, TensorSpec] = {}
    free = set(free_in) | {  # made from replicated operands: sharding them costs nothing
        o
        for node, _, _, specs, _, _, _, extra in items
        if extra is None and all(x.is_replicated for x in specs)
        for o in node.outs
    }
    for node, _, _, specs, req, _, _, extra in items:
        for v, s, r in zip(node.ins, specs, req, strict=True):
            if v in skip or v in out or v not in free or r.dims == s.dims:
                continue
            if len(r.sharding_axes) <= len(s.sharding_axes) or r.partial != s.partial:
                continue
            a = engine.reshard("input", s, r)
            if a is not None and not a.plan.collectives:
                out[v] = r
        if extra is not None:
            inner_free: frozenset[int] = frozenset()
            if node.kind == "scan":  # operands reach the body as its inputs, in order
                body = node.subs[0]
                inner_free = frozenset(
                    b for v, b in zip(node.ins, body.invars, strict=True) if v in free
                )
            for v, h in _consumer_hints(engine, extra[0], skip, inner_free).items():
                out.setdefault(v, h)
    return out


def _items_flops(items: list, mesh: MeshLike) -> float:
    total = 0.0
    for node, _, _, _, req, outs, _, extra in items:
        total += _flops(node, req, outs, mesh)
        if extra is not None:
            total += extra[2] * _items_flops(extra[0], mesh)
    return total


def _check_strategies(strategies: Mapping[str, str]) -> None:
    for op, name in strategies.items():
        rule = get_rule(op)  # unknown op: NoRuleError naming near matches
        if name not in rule.strategies:
            raise ShardingConflictError(
                op=op,
                must=f"strategy is one of {rule.strategies}",
                given=repr(name),
                fix=f"pass strategies={{{op!r}: one of {rule.strategies}}}",
            )


def _reshard_once(
    engine: _Engine,
    avail: dict[int, list[TensorSpec]],
    vid: int,
    label: str,
    src: TensorSpec,
    dst: TensorSpec,
    held: dict | None = None,
    at: int = 0,
) -> ArgReshard | None:
    """The reshard of value ``vid`` to ``dst``, from the cheapest layout it already has.

    A value resharded once for one consumer is not resharded again for the
    next one that needs the same layout (XLA computes it once and keeps the copy:
    ``held[(vid, layout)]`` is ``[first use, last use, bytes]`` over top-level
    equation indices ``at``)."""
    if src.dims == dst.dims and src.partial == dst.partial:
        return None
    have = avail.setdefault(vid, [src])
    if src not in have:
        have.insert(0, src)
    for h in have:
        if h.dims == dst.dims and h.partial == dst.partial:
            if held is not None and (vid, h) in held:
                held[(vid, h)][1] = at
            return None
    best = None
    for h in have:
        a = engine.reshard(label, h, dst, vid)
        if a is not None and (
            best is None
            or (a.plan.time_s, a.payload_bytes) < (best.plan.time_s, best.payload_bytes)
        ):
            best = a
    have.append(dst)
    if held is not None and best is not None and best.plan.collectives:
        held[(vid, dst)] = [at, at, dst.local_bytes(engine.mesh)]
    return best


_MANUAL = {
    "psum": ("all_reduce", "in", "sum"),
    "psum_invariant": ("all_reduce", "in", "sum"),
    "pmax": ("all_reduce", "in", "max"),
    "pmin": ("all_reduce", "in", "min"),
    "all_gather": ("all_gather", "out", None),
    "reduce_scatter": ("reduce_scatter", "in", "sum"),
    "all_to_all": ("all_to_all", "in", None),
}


def _manual_collectives(jaxpr: Any, engine: _Engine) -> list[ArgReshard]:
    """The collectives a shard_map body calls (psum, all_gather, psum_scatter,
    all_to_all, pmax, pmin), with per-device payload bytes from the body's local
    shapes; wrapped as one-step reshards so records treat them like any other."""
    from spmdkit.resharding import ReshardPlan

    out: list[ArgReshard] = []
    sizes = axis_sizes(engine.mesh)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        body = _inline_body(eqn)
        if body is not None:
            out += _manual_collectives(_open(body)[0], engine)
            continue
        if name not in _MANUAL:
            continue
        kind, side, op = _MANUAL[name]
        axes = eqn.params.get("axes", eqn.params.get("axis_name"))
        axes = (axes,) if isinstance(axes, str) else tuple(a for a in axes if isinstance(a, str))
        if not axes or any(a not in sizes for a in axes):
            continue
        n = math.prod(sizes[a] for a in axes)
        for v in eqn.invars if side == "in" else eqn.outvars:
            aval = v.aval
            local = TensorSpec(aval.shape, dtype=np.dtype(aval.dtype))
            payload = local.local_bytes(engine.mesh)
            wire = payload * (n - 1) // n * (2 if kind == "all_reduce" else 1)
            c = Collective(
                kind,
                axes,
                n,
                reduce_op=op,
                payload_bytes=payload,
                wire_bytes=wire,
                time_s=engine.topology.collective_time(kind, wire, n, axes, engine.mesh),
            )
            out.append(
                ArgReshard(f"{name} in shard_map", local, local, ReshardPlan(local, local, (c,)))
            )
    return out


def _own_collectives(
    engine: _Engine, op: str | None, attrs: dict, req: Sequence[TensorSpec]
) -> list[ArgReshard]:
    """The op's own collectives (a rule strategy's statistic all-reduce…), wrapped
    as one-step reshards like the shard_map ones."""
    from spmdkit.resharding import ReshardPlan

    if op is None or op not in engine.ops or not req:
        return []
    try:
        res = infer_forward(op, *req, mesh=engine.mesh, **attrs)
    except _RULE_ERRORS:
        return []
    out = []
    for c in res.collectives:
        spec = res.outputs[0] if res.outputs else req[0]
        out.append(ArgReshard(f"{op} (own)", spec, spec, ReshardPlan(spec, spec, (c,))))
    return out


def _record(
    engine: _Engine,
    item: tuple,
    avail: dict[int, list[TensorSpec]],
    mesh: MeshLike,
    index: int,
    held: dict | None = None,
    at: int | None = None,
) -> EqnRecord:
    node, op, attrs, specs, req, outs, _, extra = item
    at = index if at is None else at
    reshards = tuple(
        a
        for i, (v, s, r) in enumerate(zip(node.ins, specs, req, strict=True))
        if (a := _reshard_once(engine, avail, v, f"input {i}", s, r, held, at)) is not None
    )
    if node.kind == "shard_map":
        reshards += tuple(_manual_collectives(node.eqn.params["jaxpr"], engine))
    reshards += tuple(_own_collectives(engine, op, attrs, req))
    comm = sum(a.payload_bytes for a in reshards)
    ctime = sum(a.plan.time_s for a in reshards)
    flops = _flops(node, req, outs, mesh)
    body: tuple[EqnRecord, ...] = ()
    repeat = 1
    if extra is not None:
        inner, back, repeat = extra
        body = tuple(_record(engine, x, avail, mesh, j, held, at) for j, x in enumerate(inner))
        if back:
            body += (
                EqnRecord(
                    len(body),
                    "carry",
                    None,
                    {},
                    (),
                    (),
                    tuple(back),
                    sum(a.payload_bytes for a in back),
                    sum(a.plan.time_s for a in back),
                    0.0,
                    "default",
                    "",
                    node.backward,
                ),
            )
        comm += repeat * sum(r.comm_bytes for r in body)
        ctime += repeat * sum(r.comm_time_s for r in body)
        flops += repeat * sum(r.flops for r in body)
    return EqnRecord(
        index=index,
        primitive=node.prim,
        op=op,
        attrs=dict(attrs),
        inputs=tuple(req),
        outputs=tuple(outs),
        reshards=reshards,
        comm_bytes=int(comm),
        comm_time_s=ctime,
        flops=flops,
        strategy=str(attrs.get("strategy", "default")),
        source=_source(node.eqn),
        backward=node.backward,
        repeat=repeat,
        body=body,
    )


def _donated_ids(donate_argnums: Sequence[int] | int, args: tuple, invars: list[int]) -> set[int]:
    nums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    out: set[int] = set()
    pos = 0
    for i, a in enumerate(args):
        n = len(jax.tree.leaves(a))
        if i in nums:
            out.update(invars[pos : pos + n])
        pos += n
    return out


def _roles(arg_roles: Any, args: tuple, invars: list[int]) -> dict[int, str]:
    if arg_roles is None:
        return {}
    leaves, treedef = jax.tree.flatten(arg_roles, is_leaf=lambda x: x is None or isinstance(x, str))
    groups = treedef.flatten_up_to(args)
    out: dict[int, str] = {}
    pos = 0
    for role, group in zip(leaves, groups, strict=True):
        for _ in jax.tree.leaves(group):
            if role is not None:
                out[invars[pos]] = role
            pos += 1
    return out
