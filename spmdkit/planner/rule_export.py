"""``plan.to_rules()``: a plan as a logical-axis rule table other tools read.

Any plan (a preset's, a rule table's, ``auto``'s per-group choices) is written
back as ``(logical name, mesh axes)`` pairs in flax's ``logical_axis_rules``
form (pass :attr:`RuleTable.rules` to ``flax.linen.logical_to_mesh_sharding``
or ``nn.logical_axis_rules``) and as MaxText's ``logical_axis_rules:`` YAML
(:meth:`RuleTable.to_yaml`).

The table is read by flax's semantics, not spmdkit's: flax walks the rules in
order and gives each rule's mesh axes to the first dim carrying its name,
unless the dim is already assigned or one of the axes is already used by the
array (an entry of ``None`` assigns "replicated"); it checks no divisibility.
So the export builds a candidate table from the layouts each logical name has
in the plan (the most common first, others as fallbacks), orders and prunes it
until the fewest tensors resolve differently under flax's reading, and writes
every tensor that still does as a per-parameter **override** (its path → the
plan's ``PartitionSpec``): two tensors with one logical name laid out
differently (a :class:`Conflict`), a sharded dim with no logical name, a name
repeated within one tensor (flax refuses those).

The optimizer state gets a table of its own where its layouts differ from the
parameters' (``zero1``, ``zero2``, a distributed optimizer): ``opt_rules`` and
``opt_overrides``. Batch dims (``batch``, ``seq``) come from the plan's
activation layout and lead the table.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import PartitionSpec as P

__all__ = ["Conflict", "RuleTable", "flax_resolve", "to_rules"]

#: One dim's mesh axes, major to minor (``()``: replicated).
Axes = tuple[str, ...]
#: A flax rule's mesh axes: one axis, several, or None (replicated).
FlaxAxes = str | tuple[str, ...] | None
#: A flax rule table: ``(logical name, mesh axes)`` pairs in priority order.
FlaxRules = tuple[tuple[str, FlaxAxes], ...]

#: How many rounds of reordering and pruning the table gets (each round tries
#: every entry at every position; two suffice on the reference models).
ROUNDS = 3


@dataclass(frozen=True)
class Conflict:
    """A logical name whose tensors are laid out differently in the plan.

    Attributes:
      name: the logical name.
      layouts: ``(spec text, tensor paths)`` per layout the name has, most
        common first (``"_"``: replicated).
    """

    name: str
    layouts: tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class RuleTable:
    """A plan written as a logical-axis rule table (module docstring).

    Attributes:
      rules: flax's ``logical_axis_rules`` form, for the parameters and the
        batch: ``(("batch", ("data", "model")), ("embed", "data"), ("mlp", None), ...)``.
      overrides: param (and state) path → the plan's ``PartitionSpec`` where
        :attr:`rules` read by flax gives another layout.
      opt_rules: the optimizer state's table; None: the same as :attr:`rules`.
      opt_overrides: param path → its optimizer state's ``PartitionSpec`` where
        the optimizer table gives another layout.
      conflicts: the logical names behind overrides whose tensors the plan lays
        out differently, with which tensors.
      mesh_axes: the mesh's axis names, in order.
      strategy: the plan's strategy.
      grads_sharded: the gradients are kept in the optimizer state's layout
        (``zero2``) rather than the parameters'.
    """

    rules: FlaxRules
    overrides: Mapping[str, P] = field(default_factory=dict)
    opt_rules: FlaxRules | None = None
    opt_overrides: Mapping[str, P] = field(default_factory=dict)
    conflicts: tuple[Conflict, ...] = ()
    mesh_axes: tuple[str, ...] = ()
    strategy: str = "rules"
    grads_sharded: bool = False

    @property
    def exact(self) -> bool:
        """Whether the tables alone give every layout (no override)."""
        return not self.overrides and not self.opt_overrides

    def spec(self, names: Sequence[str | None] | None, *, opt: bool = False) -> P:
        """The ``PartitionSpec`` flax gives a tensor whose dims carry ``names``
        under this table (the optimizer table with ``opt=True``); overrides are
        not applied (they are keyed by path)."""
        rules = self.opt_rules if opt and self.opt_rules is not None else self.rules
        return _dims_spec(flax_resolve(rules, names, len(names or ())))

    def to_yaml(self) -> str:
        """MaxText's form: ``mesh_axes:`` and ``logical_axis_rules:`` (replicated
        as ``[]``); the optimizer table and the overrides, which MaxText has no
        key for, follow as comments."""
        lines = [f"# spmdkit plan {self.strategy!r} as a logical-axis rule table"]
        lines.append(f"mesh_axes: [{', '.join(_q(a) for a in self.mesh_axes)}]")
        lines += _yaml_rules("logical_axis_rules", self.rules, comment=False)
        if self.opt_rules is not None:
            lines.append("# the optimizer state's layouts differ from the parameters':")
            lines += _yaml_rules("opt_state_logical_axis_rules", self.opt_rules, comment=True)
        if self.grads_sharded:
            lines.append("# gradients kept in the optimizer state's layout (ZeRO-2)")
        for title, table in (("parameter", self.overrides), ("optimizer", self.opt_overrides)):
            if table:
                lines.append(f"# {title} overrides (path: mesh axes per dim), not in one table:")
                lines += [f"#   {path}: {_spec_yaml(spec)}" for path, spec in table.items()]
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        width = max((len(n) for n, _ in self.rules), default=4)
        out = [f"rule table of plan {self.strategy!r} (mesh axes {', '.join(self.mesh_axes)}):"]
        out += [f"  {n:<{width}}  {_axes_text(a)}" for n, a in self.rules]
        if self.opt_rules is not None:
            out.append("optimizer state:")
            out += [f"  {n:<{width}}  {_axes_text(a)}" for n, a in self.opt_rules]
        for c in self.conflicts:
            ways = "; ".join(f"{s} in {', '.join(ts)}" for s, ts in c.layouts)
            out.append(f"conflict: {c.name!r} is laid out differently: {ways}")
        for title, table in (("override", self.overrides), ("opt override", self.opt_overrides)):
            out += [f"{title}: {path} -> {_spec_text(spec)}" for path, spec in table.items()]
        if self.exact:
            out.append("exact: the table gives every layout of the plan")
        return "\n".join(out)


# -- flax's reading -----------------------------------------------------------------


def _norm(axes: FlaxAxes) -> Axes:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _flax_axes(axes: Axes) -> FlaxAxes:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def flax_resolve(
    rules: Iterable[tuple[str, FlaxAxes]], names: Sequence[str | None] | None, ndim: int
) -> tuple[Axes, ...] | None:
    """The per-dim mesh axes flax's ``logical_to_mesh_axes`` gives ``names`` under
    ``rules`` (padded to ``ndim`` dims); None where flax refuses the names (one
    repeated within the tensor).

    Example::

        >>> flax_resolve((("embed", "data"), ("mlp", ("data", "model"))), ("embed", "mlp"), 2)
        (('data',), ())
    """
    if names is None:
        return ((),) * ndim
    names = tuple(names)
    strs = [n for n in names if isinstance(n, str)]
    if len(set(strs)) != len(strs):
        return None
    unset = object()
    result: list[Any] = [unset if isinstance(n, str) else () for n in names]
    for name, axes in rules:
        if name not in names:
            continue
        pos = names.index(name)
        new = set(_norm(axes))
        used = {a for r in result if r is not unset for a in r}
        if result[pos] is unset and not used & new:
            result[pos] = _norm(axes)
    dims = tuple(() if r is unset else r for r in result)
    return (dims + ((),) * ndim)[:ndim]


def _dims_spec(dims: tuple[Axes, ...] | None) -> P:
    out = [_flax_axes(d) for d in dims or ()]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _spec_dims(spec: P, ndim: int) -> tuple[Axes, ...]:
    dims = [_norm(e) for e in tuple(spec)]
    return tuple((dims + [()] * ndim)[:ndim])


# -- building the table -------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    """Tensors with one (names, layout): resolved once."""

    names: tuple[str | None, ...] | None
    dims: tuple[Axes, ...]
    paths: tuple[str, ...]


def _groups(tensors: Sequence[tuple[str, tuple | None, tuple[Axes, ...]]]) -> list[_Group]:
    by: dict[tuple, list[str]] = {}
    for path, names, dims in tensors:
        by.setdefault((names, dims), []).append(path)
    return [_Group(n, d, tuple(ps)) for (n, d), ps in by.items()]


def _misses(rules: FlaxRules, groups: Sequence[_Group]) -> list[_Group]:
    return [g for g in groups if flax_resolve(rules, g.names, len(g.dims)) != g.dims]


def _weight(groups: Sequence[_Group]) -> int:
    return sum(len(g.paths) for g in groups)


def _layouts(groups: Sequence[_Group]) -> dict[str, Counter]:
    """Logical name → Counter of its layouts (weighted by tensors)."""
    out: dict[str, Counter] = {}
    for g in groups:
        for name, axes in zip(g.names or (), g.dims, strict=False):
            if isinstance(name, str):
                out.setdefault(name, Counter())[axes] += len(g.paths)
    return out


def _table(groups: Sequence[_Group], lead: FlaxRules) -> FlaxRules:
    """The table with the fewest tensors flax resolves differently: ``lead`` (the
    batch entries) first, then each name's layouts (most common first, ``None``
    last), reordered and pruned by local search."""
    counts = _layouts(groups)
    sharded = [(n, axes, c) for n, ctr in counts.items() for axes, c in ctr.most_common() if axes]
    sharded.sort(key=lambda e: -e[2])  # stable: names keep their first-seen order on ties
    entries: list[tuple[str, FlaxAxes]] = [(n, _flax_axes(a)) for n, a, _ in sharded]
    entries += [(n, None) for n, ctr in counts.items() if ctr[()]]
    entries = [e for e in entries if e[0] not in {n for n, _ in lead}]

    def cost(es: list) -> tuple[int, int]:
        return _weight(_misses(lead + tuple(es), groups)), len(es)

    best = cost(entries)
    for _ in range(ROUNDS):
        improved = False
        for entry in list(entries):
            if entry not in entries:
                continue
            rest = [e for e in entries if e != entry]
            tries = [rest] + [[*rest[:j], entry, *rest[j:]] for j in range(len(rest) + 1)]
            for t in tries:
                c = cost(t)
                if c < best:
                    entries, best, improved = t, c, True
        if not improved:
            break
    return lead + tuple(entries)


def _batch_lead(plan: Any) -> FlaxRules:
    return tuple((name, _flax_axes(tuple(axes))) for name, axes in plan.activation.items())


def _conflicts(
    rules: FlaxRules, groups: Sequence[_Group], missed: Sequence[_Group]
) -> tuple[Conflict, ...]:
    """The logical names of the dims flax lays out otherwise in ``missed``, each
    with every layout its tensors have in the plan."""
    names: set[str] = set()
    for g in missed:
        got = flax_resolve(rules, g.names, len(g.dims)) or ((None,),) * len(g.dims)
        for name, want, have in zip(g.names or (), g.dims, got, strict=False):
            if isinstance(name, str) and want != have:
                names.add(name)
    per: dict[str, dict[Axes, list[str]]] = {}
    for g in groups:
        for name, axes in zip(g.names or (), g.dims, strict=False):
            if name in names:
                per.setdefault(name, {}).setdefault(axes, []).extend(g.paths)
    out = []
    for name, ways in per.items():
        if len(ways) > 1:
            ordered = sorted(ways.items(), key=lambda kv: -len(kv[1]))
            layouts = tuple((_axes_text(_flax_axes(a)), tuple(sorted(ps))) for a, ps in ordered)
            out.append(Conflict(name, layouts))
    return tuple(out)


def to_rules(plan: Any) -> RuleTable:
    """``plan`` (a :class:`~spmdkit.planner.plans.Plan`) as a :class:`RuleTable`:
    the flax/MaxText rule table that gives its layouts, with per-parameter
    overrides where one table cannot (module docstring).

    Example::

        >>> table = sk.plan(info, mesh, "megatron").to_rules()
        >>> with nn.logical_axis_rules(table.rules): ...
        >>> shardings = nn.logical_to_mesh_sharding(logical_specs, mesh, table.rules)
    """

    def tensors(specs: Mapping[str, P]) -> list:
        out = []
        for path, spec in specs.items():
            shape, _, names = plan.info.get(path, ((), "float32", None))
            ndim = len(shape) or len(tuple(spec))
            out.append((path, None if names is None else tuple(names), _spec_dims(spec, ndim)))
        return out

    lead = _batch_lead(plan)
    params = _groups(tensors({**plan.params, **plan.state}))
    rules = _table(params, lead)
    missed = _misses(rules, params)
    opt = _groups(tensors(plan.opt))
    opt_missed = _misses(rules, opt)
    opt_rules = None
    if opt_missed:
        own = _table(opt, lead)
        if _weight(_misses(own, opt)) < _weight(opt_missed):
            opt_rules, opt_missed = own, _misses(own, opt)
    conflicts = _conflicts(rules, params, missed)
    opt_table = rules if opt_rules is None else opt_rules
    overrides = {p: _dims_spec(g.dims) for g in missed for p in g.paths}
    opt_overrides = {p: _dims_spec(g.dims) for g in opt_missed for p in g.paths}
    return RuleTable(
        rules=rules,
        overrides=dict(sorted(overrides.items())),
        opt_rules=opt_rules,
        opt_overrides=dict(sorted(opt_overrides.items())),
        conflicts=tuple(dict.fromkeys(conflicts + _conflicts(opt_table, opt, opt_missed))),
        mesh_axes=tuple(plan.mesh.axis_names),
        strategy=plan.strategy,
        grads_sharded=bool(plan.grads),
    )


# -- text ---------------------------------------------------------------------------


def _q(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _axes_text(axes: FlaxAxes) -> str:
    a = _norm(axes)
    return "_" if not a else a[0] if len(a) == 1 else "(" + ",".join(a) + ")"


def _spec_text(spec: P) -> str:
    return "[" + ",".join(_axes_text(e) for e in tuple(spec)) + "]"


def _spec_yaml(spec: P) -> str:
    dims = ", ".join("[" + ", ".join(_q(a) for a in _norm(e)) + "]" for e in tuple(spec))
    return f"[{dims}]"


def _yaml_rules(key: str, rules: FlaxRules, *, comment: bool) -> list[str]:
    mark = "# " if comment else ""
    rows = [f"{mark}  [{_q(n)}, [{', '.join(_q(a) for a in _norm(ax))}]]," for n, ax in rules]
    if rows:
        rows[-1] = rows[-1].rstrip(",")
    return [f"{mark}{key}: [", *rows, f"{mark}]"]
