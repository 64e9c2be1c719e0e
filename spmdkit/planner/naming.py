"""Logical names for every parameter: from the model, given by path, or inferred from the step.

A parameter's logical names come from, in order of priority:

1. ``names=`` given to :func:`spmdkit.plan`: ``{path glob: names}``
   (``{"*/attn/*/kernel": ("embed", "heads", "head_dim")}``; ``fnmatch`` globs,
   ``*`` crosses ``/``; a later glob overrides an earlier one; ``None`` leaves the
   parameter unnamed on purpose, so presets replicate it without a warning);
2. the model's own metadata (flax ``out_sharding`` / ``LogicallyPartitioned``);
3. its role in the traced loss, inferred here (:func:`infer_names`).

Inference reads the forward jaxpr of the loss once and follows each parameter
to the first equation that uses it as a weight:

- a ``dot_general``: whether its activation operand already carries a
  tensor-parallel feature dim (a value computed from a column-parallel matmul's
  output, not yet through a row-parallel one) decides the Megatron role: *column*
  (contracted dims ``embed``; one kept dim ``mlp``, or ``vocab`` for the last
  matmul of the step when its size is an embedding table's vocabulary; several
  kept dims ``heads, head_dim...``) or
  *row* (contracted ``mlp`` or ``heads, head_dim...``; kept ``embed``);
- a ``ragged_dot_general`` (a grouped GEMM, ``lax.ragged_dot``) whose grouped
  operand is a parameter: its group dim ``expert`` (the stacked experts of a
  mixture), the others named as a ``dot_general`` weight's;
- a ``gather`` (an embedding table): the indexed dim ``vocab``, the others ``embed``;
  so for an ``embedding`` region (``spmdkit.ops.embedding_lookup``);
- a ``conv_general_dilated`` kernel: ``conv_window...``, ``conv_in``, ``conv_out``
  from its dimension numbers;
- anything else (norm scales, biases, position embeddings, class tokens): the
  last dim ``norm``, the others unnamed.

Dtype casts, transposes and calls (``pjit``, ``custom_jvp_call``...) are
followed. Names are a proposal the plan table shows (``(inferred)``); give
``names=`` where they are wrong.
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax

from spmdkit import jaxprs
from spmdkit.engine.region import FORWARD
from spmdkit.introspect.model import ModelInfo, ParamInfo, unbound_axis_error
from spmdkit.planner.logical import PlanError, axis_roles
from spmdkit.planner.plans import Plan
from spmdkit.spec import axis_sizes
from spmdkit.util import path_str

__all__ = [
    "TP_PRESETS",
    "NameSource",
    "Role",
    "apply_names",
    "check_placement",
    "infer_names",
    "unplaced",
]

#: Where a parameter's names came from: ``"model"``, ``"given"``, ``"inferred"``.
NameSource = str

#: Names per dim, or None (unnamed).
Names = tuple[str | None, ...] | None


@dataclass(frozen=True)
class Role:
    """What the traced step does with one parameter.

    Attributes:
      kind: ``"dot"`` (a matmul weight), ``"gather"`` (an embedding table),
        ``"conv"`` (a convolution kernel) or ``"other"``.
      names: the logical names its role implies, one per dim.
    """

    kind: str
    names: tuple[str | None, ...]

    @property
    def is_weight(self) -> bool:
        """A matmul, lookup or convolution weight: tensor-parallel presets shard it."""
        return self.kind in ("dot", "gather", "conv")


_CASTS = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision", "rev"})


def _is_var(v: Any) -> bool:
    return not hasattr(v, "val")


def _is_lookup(eqn: Any) -> bool:
    """An embedding lookup traced as a region (:mod:`spmdkit.engine.region`)."""
    return eqn.primitive.name == FORWARD and eqn.params["op"] == "embedding"


def _sub_jaxpr(eqn: Any) -> Any:
    """The called jaxpr of a call-like equation whose invars map one to one
    (``scan``: its body, whose scanned operands lose their leading dim)."""
    if eqn.primitive.name in ("while", "cond"):
        return None
    for sub in jaxprs.sub_jaxprs(eqn):
        jaxpr = jaxprs.open_jaxpr(sub)[0]
        if len(jaxpr.invars) == len(eqn.invars):
            return jaxpr
    return None


class _Walk:
    """One pass over the loss's forward jaxpr (module docstring)."""

    def __init__(self, ranks: dict[str, int]) -> None:
        self.roles: dict[str, Role] = {}
        #: parameter path → its rank
        self.ranks = ranks
        self.vocab: set[int] = set()
        self.head: tuple[str, int] | None = None
        self.last_dot: str | None = None

    def name_head(self) -> None:
        """The output projection: the last matmul weight, when its kept dim is an
        embedding table's vocabulary, projects onto the vocabulary."""
        if self.head is None or self.head[0] != self.last_dot:
            return
        path, dim = self.head
        role = self.roles[path]
        names = list(role.names)
        names[dim] = "vocab"
        self.roles[path] = Role(role.kind, tuple(names))

    def run(self, jaxpr: Any, tracked: dict, tainted: set) -> set:
        """Walk ``jaxpr``; ``tracked``: var → (param path, param dim per dim);
        ``tainted``: vars carrying a tensor-parallel feature dim. Returns the
        tainted outvars' positions."""
        for eqn in jaxpr.eqns:
            ins = [v for v in eqn.invars if _is_var(v)]
            name = eqn.primitive.name
            # a gather's rows carry its operand's features, not its indices' (a
            # mixture's tokens picked by routes computed from the router's output)
            feeds = ins[:1] if name == "gather" else ins
            hot = any(v in tainted for v in feeds)
            params = [v for v in ins if v in tracked and tracked[v][0] not in self.roles]
            if name in _CASTS and params:
                path, dims = tracked[params[0]]
                tracked[eqn.outvars[0]] = (path, dims)
            elif name == "transpose" and params:
                path, dims = tracked[params[0]]
                tracked[eqn.outvars[0]] = (path, tuple(dims[i] for i in eqn.params["permutation"]))
            elif name == "dot_general" and params:
                hot = self.dot(eqn, tracked, tainted)
            elif name == "ragged_dot_general" and _grouped_weight(eqn, params):
                hot = self.ragged(eqn, tracked, tainted)
            elif name == "gather" and eqn.invars[0] in params:
                self.gather(eqn, tracked)
                hot = False
            elif _is_lookup(eqn) and eqn.invars[0] in params:
                self.lookup(eqn, tracked)
                hot = False
            elif name == "conv_general_dilated" and eqn.invars[1] in params:
                self.conv(eqn, tracked)
                hot = False
            else:
                sub = _sub_jaxpr(eqn)
                if sub is not None:
                    inner_t = {
                        s: _sliced(tracked[o], eqn, i)
                        for i, (o, s) in enumerate(zip(eqn.invars, sub.invars, strict=True))
                        if _is_var(o) and o in tracked
                    }
                    inner_h = {
                        s
                        for o, s in zip(eqn.invars, sub.invars, strict=True)
                        if _is_var(o) and o in tainted
                    }
                    hot_out = self.run(sub, inner_t, inner_h)
                    tainted.update(eqn.outvars[i] for i in hot_out)
                    continue
                for v in params:
                    self.other(*tracked[v])
            if hot:
                tainted.update(eqn.outvars)
        return {i for i, v in enumerate(jaxpr.outvars) if _is_var(v) and v in tainted}

    def dot(self, eqn: Any, tracked: dict, tainted: set) -> bool:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars
        side = 1 if _is_var(rhs) and rhs in tracked else 0
        w, x = (rhs, lhs) if side else (lhs, rhs)
        contract, batch = (rc, rb) if side else (lc, lb)
        return self.weight(w, x, contract, batch, tracked, tainted)

    def ragged(self, eqn: Any, tracked: dict, tainted: set) -> bool:
        """A grouped GEMM's weights (``lax.ragged_dot``'s ``rhs [g, in, out]``): the
        group dim ``expert``, the others named as a matmul weight's."""
        dn = eqn.params["ragged_dot_dimension_numbers"]
        (_, rc), (_, rb) = dn.dot_dimension_numbers
        groups = tuple(dn.rhs_group_dimensions)
        lhs, rhs = eqn.invars[:2]
        return self.weight(rhs, lhs, rc, (*rb, *groups), tracked, tainted, experts=groups)

    def weight(
        self,
        w: Any,
        x: Any,
        contract: Sequence[int],
        batch: Sequence[int],
        tracked: dict,
        tainted: set,
        *,
        experts: Sequence[int] = (),
    ) -> bool:
        """Name the weight ``w`` of a contraction with the activation ``x`` (its
        ``experts`` dims ``expert``); whether the result carries a feature dim."""
        path, dims = tracked[w]
        row = _is_var(x) and x in tainted
        shape = w.aval.shape
        # heads before head_dim in the parameter's own dim order (an einsum may
        # contract them in another order)
        contract = sorted(contract, key=lambda d: dims[d])
        kept = sorted(
            (d for d in range(len(shape)) if d not in contract and d not in batch),
            key=lambda d: dims[d],
        )
        names: list[str | None] = [None] * len(shape)
        if row:
            for d, n in zip(contract, _feature_names(len(contract)), strict=True):
                names[d] = n
            for d in kept:
                names[d] = "embed"
        else:
            for d in contract:
                names[d] = "embed"
            for d, n in zip(kept, _feature_names(len(kept)), strict=True):
                names[d] = n
            if len(kept) == 1 and shape[kept[0]] in self.vocab:
                self.head = (path, dims[kept[0]])
        for d in experts:
            names[d] = "expert"
        if path not in self.roles:
            self.last_dot = path
        self.set(path, dims, Role("dot", tuple(names)))
        return not row

    def gather(self, eqn: Any, tracked: dict) -> None:
        path, dims = tracked[eqn.invars[0]]
        dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
        shape = eqn.invars[0].aval.shape
        indexed = {d for d in dn.start_index_map if sizes[d] == 1}
        names = tuple("vocab" if d in indexed else "embed" for d in range(len(shape)))
        self.vocab.update(shape[d] for d in indexed)
        self.set(path, dims, Role("gather", names))

    def lookup(self, eqn: Any, tracked: dict) -> None:
        """An ``embedding`` region (``spmdkit.ops.embedding_lookup``): the table's
        rows are ``vocab``, its columns ``embed``."""
        path, dims = tracked[eqn.invars[0]]
        self.vocab.add(eqn.invars[0].aval.shape[0])
        self.set(path, dims, Role("gather", ("vocab", "embed")))

    def conv(self, eqn: Any, tracked: dict) -> None:
        path, dims = tracked[eqn.invars[1]]
        out, inp, *spatial = eqn.params["dimension_numbers"].rhs_spec
        names: list[str | None] = [None] * len(eqn.invars[1].aval.shape)
        names[out], names[inp] = "conv_out", "conv_in"
        for d in spatial:
            names[d] = "conv_window"
        self.set(path, dims, Role("conv", tuple(names)))

    def other(self, path: str, dims: tuple) -> None:
        n = len(dims)
        self.set(path, dims, Role("other", (None,) * (n - 1) + ("norm",) if n else ()))

    def set(self, path: str, dims: tuple, role: Role) -> None:
        """Record ``role`` (given per current dim) in the parameter's own dim order;
        a dim a ``scan`` slices off (stacked layers) is ``layers``."""
        names: list[str | None] = ["layers"] * self.ranks.get(path, len(dims))
        for cur, pd in enumerate(dims):
            names[pd] = role.names[cur]
        self.roles.setdefault(path, Role(role.kind, tuple(names)))


def _grouped_weight(eqn: Any, params: Sequence[Any]) -> bool:
    """A ``ragged_dot_general`` whose grouped operand (rhs, with a group dim) is a
    parameter."""
    return bool(eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions) and (
        eqn.invars[1] in params
    )


def _sliced(entry: tuple[str, tuple], eqn: Any, i: int) -> tuple[str, tuple]:
    """A tracked parameter as a call's body sees operand ``i``: a ``scan`` hands
    its body one slice of each scanned operand (the leading dim dropped)."""
    path, dims = entry
    if eqn.primitive.name == "scan" and i >= jaxprs.scan(eqn).first_xs:
        return path, dims[1:]
    return path, dims


def _feature_names(n: int) -> tuple[str, ...]:
    if n == 1:
        return ("mlp",)
    return ("heads",) + ("head_dim",) * (n - 1) if n else ()


def infer_names(info: ModelInfo) -> dict[str, Role]:
    """Each parameter's :class:`Role` in the model's traced loss (module docstring).

    Traced once per model (``ModelInfo.memo``), abstractly.

    Example::

        >>> roles = infer_names(describe(lambda: MLP(rngs=nnx.Rngs(0)), loss=l, batch=b))
        >>> roles["w1/kernel"]
        Role(kind='dot', names=('embed', 'mlp'))
    """
    return info.memo(("planner.names",), lambda: _infer(info))


def _infer(info: ModelInfo) -> dict[str, Role]:
    try:
        closed = jax.make_jaxpr(info.scalar_loss)(*info.trace_args())
    except NameError as e:
        raise (unbound_axis_error(e, "plan") or e) from e
    leaves = jax.tree_util.tree_flatten_with_path(info.abstract_params)[0]
    tracked = {
        v: (path_str(kp), tuple(range(len(leaf.shape))))
        for (kp, leaf), v in zip(leaves, closed.jaxpr.invars, strict=False)
    }
    walk = _Walk({p.path: len(p.shape) for p in info.params})
    walk.run(closed.jaxpr, dict(tracked), set())
    walk.name_head()
    for p in info.params:
        if p.path not in walk.roles:
            walk.other(p.path, tuple(range(len(p.shape))))
    return walk.roles


def _pad(names: Sequence[str | None], ndim: int, where: str) -> tuple[str | None, ...]:
    """Fewer names than dims: the trailing dims unnamed, as flax pads a
    PartitionSpec (DenseGeneral's kernels get the flat initializer's names)."""
    names = tuple(names)
    if len(names) > ndim:
        raise PlanError(
            op="plan(names=...)",
            must="at most one logical name per dim",
            given=f"{names} for a rank-{ndim} parameter at {where}",
            fix="give one name (or None) per dim",
        )
    return names + (None,) * (ndim - len(names))


def apply_names(
    info: ModelInfo,
    names: Mapping[str, Names] | None,
    roles: Mapping[str, Role] | Callable[[], Mapping[str, Role]],
) -> tuple[ModelInfo, dict[str, NameSource]]:
    """``info`` with every parameter named (module docstring), and where each
    parameter's names came from.

    Args:
      info: the model.
      names: path glob → names (None: unnamed on purpose).
      roles: the inferred roles (or a function computing them on demand).

    Raises:
      PlanError: a glob matches no parameter, or gives more names than dims.
    """
    given: dict[str, Names] = {}
    for glob, value in (names or {}).items():
        hits = [p for p in info.params if fnmatch.fnmatchcase(p.path, glob)]
        if not hits:
            near = [p.path for p in info.params][:3]
            raise PlanError(
                op="plan(names=...)",
                must="every path glob matches a parameter",
                given=f"{glob!r} matches none",
                fix=f"globs match '/'-joined paths such as {near}; '*' crosses '/'",
            )
        for p in hits:
            given[p.path] = None if value is None else _pad(value, len(p.shape), p.path)
    out: list[ParamInfo] = []
    source: dict[str, NameSource] = {}
    resolved = None
    for p in info.params:
        if p.path in given:
            out.append(replace(p, logical=given[p.path], pinned=None))
            source[p.path] = "given"
        elif p.pinned is not None or p.logical is not None:
            logical = None if p.logical is None else _pad(p.logical, len(p.shape), p.path)
            out.append(replace(p, logical=logical))
            source[p.path] = "model"
        else:
            resolved = resolved if resolved is not None else (roles() if callable(roles) else roles)
            out.append(replace(p, logical=resolved[p.path].names))
            source[p.path] = "inferred"
    return replace(info, params=out), source


#: Presets that put weights on the ``model`` axes (tensor parallel).
TP_PRESETS = ("megatron", "megatron_sp", "tp_fsdp")


def unplaced(plan: Plan, roles: Mapping[str, Role] | Callable[[], Mapping[str, Role]]) -> list[str]:
    """Weights a tensor-parallel preset leaves off every ``model`` axis (a matmul,
    lookup or conv weight of rank ≥ 2 not named unplaced on purpose), one line
    each: path, names, spec, why (a dim whose name goes on the model axes but
    whose size does not divide by them) and the roles' names. ``roles`` may be a
    function: it is called only when some parameter of rank ≥ 2 has no model axis."""
    return [line for line, _ in _unplaced(plan, roles)]


def _unplaced(
    plan: Plan, roles: Mapping[str, Role] | Callable[[], Mapping[str, Role]]
) -> list[tuple[str, str]]:
    """``(line, fix)`` per weight :func:`unplaced` reports; the fix names its path."""
    sizes = axis_sizes(plan.mesh)
    model = {a for a in axis_roles(plan.mesh)["model"] if sizes[a] > 1}
    if plan.pipeline is not None:  # the pipe axis splits the layers, not a matmul
        model.discard(plan.pipeline.axis)
    if plan.strategy.removesuffix("+zero1") not in TP_PRESETS or not model:
        return []
    suspects = []
    for path, spec in plan.params.items():
        shape, _, logical = plan.info[path]
        if len(shape) < 2 or (plan.names_from.get(path) == "given" and logical is None):
            continue  # a vector, or names={glob: None}: replicated on purpose
        used = {a for d in spec for a in ((d,) if isinstance(d, str) else d or ())}
        if not used & model:
            suspects.append((path, spec, tuple(shape), logical))
    if not suspects:
        return []
    known = roles() if callable(roles) else roles
    out = []
    for path, spec, shape, logical in suspects:
        role = known.get(path)
        if role is None or not role.is_weight:
            continue
        hint = role.names if role.names != logical else None
        why, fix = _why_unplaced(plan, model, path, shape, logical)
        line = f"{path} {shape} named {logical} → {spec}" + (f": {why}" if why else "")
        out.append((line + (f"; its role in the step says {hint}" if hint else ""), fix))
    return out


def _model_axes_of(plan: Plan, name: str | None, model: set[str]) -> tuple[str, ...]:
    """The model axes the plan's rule table gives logical ``name`` first, or ()."""
    if name is None or plan.rules is None:
        return ()
    for key, axes in plan.rules.entries:
        if key == name and axes and model.intersection(axes):
            return tuple(a for a in axes if a in model)
    return ()


def _why_unplaced(
    plan: Plan, model: set[str], path: str, shape: tuple[int, ...], logical: tuple | None
) -> tuple[str, str]:
    """Why a weight got no model axis, and a fix that names its path: a dim whose
    name goes on the model axes but does not divide by them gets "make it a
    multiple" or "shard dim j instead" (a dim that divides, given that name)."""
    sizes = axis_sizes(plan.mesh)
    names = tuple(logical or ()) + (None,) * (len(shape) - len(logical or ()))
    replicate = f"names={{{path!r}: None}} to replicate it on purpose"
    for i, name in enumerate(names):
        axes = _model_axes_of(plan, name, model)
        n = math.prod(sizes[a] for a in axes) if axes else 1
        if not axes or shape[i] % n == 0:
            continue
        axes_text = " × ".join(f"{a}={sizes[a]}" for a in axes)
        why = (
            f"dim {i} ({name!r}, size {shape[i]}) goes on {axes_text} but {shape[i]} "
            f"does not divide by {n}"
        )
        fixes = [f"make dim {i} of {path} a multiple of {n} (e.g. {-(-shape[i] // n) * n})"]
        other = [j for j in range(len(shape)) if j != i and shape[j] % n == 0]
        if other:
            moved = tuple(name if j == other[0] else None for j in range(len(shape)))
            fixes.append(f"shard dim {other[0]} instead: sk.plan(..., names={{{path!r}: {moved}}})")
        return why, "; ".join([*fixes, f"or pass {replicate}"])
    sharded = sorted(_names_on(plan, model))
    example = sharded[0] if sharded else "mlp"
    return "", (
        f"name a dim of {path} with a logical name the preset puts on the model axes "
        f"({', '.join(sharded) or 'none'}): sk.plan(..., names={{{path!r}: "
        f"{tuple(example if j == len(shape) - 1 else None for j in range(len(shape)))}}}), "
        f"map its names with rules=[(name, 'model')], or pass {replicate}"
    )


def _names_on(plan: Plan, model: set[str]) -> set[str]:
    """Logical names the plan's rule table puts on a model axis."""
    if plan.rules is None:
        return set()
    return {k for k, axes in plan.rules.entries if axes and model.intersection(axes)}


def check_placement(
    plan: Plan, roles: Mapping[str, Role] | Callable[[], Mapping[str, Role]], *, strict: bool
) -> None:
    """Warn (``strict=True``: raise :class:`PlanError`) when a tensor-parallel
    preset replicates weights over its ``model`` axes (:func:`unplaced`); the
    message says why for each (a dim that does not divide by the model axes) and
    the fix names the weight's path.

    Raises:
      PlanError: with ``strict=True``, a weight left off the ``model`` axes.
    """
    found = _unplaced(plan, roles)
    if not found:
        return
    lines = [line for line, _ in found]
    fixes = list(dict.fromkeys(fix for _, fix in found))
    fix = " | ".join(fixes[:3]) + (f" | ... {len(fixes) - 3} more" if len(fixes) > 3 else "")
    head = (
        f"plan(strategy={plan.strategy!r}): {len(lines)} weight(s) get no "
        f"'model' axis and are replicated over it"
    )
    if strict:
        raise PlanError(
            op="plan",
            must="a tensor-parallel preset shards every weight over the model axes",
            given=head + ": " + "; ".join(lines[:6]),
            fix=fix,
        )
    shown = "\n  ".join(lines[:8]) + (f"\n  ... {len(lines) - 8} more" if len(lines) > 8 else "")
    warnings.warn(f"{head}:\n  {shown}\nFix: {fix}.", stacklevel=3)
