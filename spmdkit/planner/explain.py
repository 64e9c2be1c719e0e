"""``plan.explain(name)``: why a tensor has its layout, as data and as text.

An :class:`Explanation` answers for a parameter (its path, or its group with
layer numbers as ``*``), a logical name, a batch field or a ``checkpoint_name``
of an activation:

* its **spec** (and its optimizer state's);
* the **chain** that decided it (:class:`Link` s), first what put the layout
  on the tensor: a constraint (a layout the model pins in mesh axes), a rule
  (the rule-table entry that matched each named dim, and which earlier entries
  did not and why), or the search's choice (``auto``: the fastest layout of
  those it costed for the group); then the equations of the propagated step
  that read, moved and updated it: the op rule, forward or backward pass, how
  that equation's layouts were decided (forward rule, backward hint,
  constraint), the source line;
* the **alternatives** the search costed for its group, with the memory,
  communication and step-time differences from the chosen layout (the analytic
  model's figures, as the search compared them);
* the **collectives** it causes per step (from the plan's
  :class:`~spmdkit.planner.provenance.Provenance`).

The plan is read as data: nothing is traced or propagated again.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spmdkit.planner.logical import BATCH_NAMES, LogicalRules, PlanError
from spmdkit.planner.provenance import GroupChoice, LayoutOption, Provenance, group_key
from spmdkit.propagation.provenance import Use
from spmdkit.spec import axis_sizes
from spmdkit.util import fmt_bytes, fmt_time

__all__ = ["Alternative", "Explanation", "Link", "explain"]

#: What the first link of a parameter's chain may be: what put its layout on it.
DECIDERS = ("constraint", "rule", "search")


@dataclass(frozen=True)
class Link:
    """One link of the chain that decided a layout.

    Attributes:
      kind: ``"constraint"``, ``"rule"``, ``"search"`` (what put the layout on
        the tensor), ``"names"`` (where its logical names came from),
        ``"choice"`` (auto's pick among whole plans), ``"equation"`` (an
        equation of the propagated step that read, moved or updated it).
      text: the link in words.
      use: for an equation, what propagation recorded of it.
    """

    kind: str
    text: str
    use: Use | None = None


@dataclass(frozen=True)
class Alternative:
    """A layout the search costed for the tensor's group, against the chosen one.

    Attributes:
      spec: the layout, e.g. ``[data,_] opt [data,model]``.
      memory_delta: bytes per device more (negative: less) than the chosen layout.
      comm_delta: payload bytes per step more than the chosen layout.
      time_delta_s: step time more than the chosen layout (the group alone).
    """

    spec: str
    memory_delta: int
    comm_delta: int
    time_delta_s: float


@dataclass(frozen=True)
class Explanation:
    """Why a tensor (or a logical name) has its layout: see the module docstring.

    Attributes:
      name: what was asked.
      kind: ``"parameter"``, ``"state"``, ``"logical"``, ``"batch"`` or ``"activation"``.
      tensors: the parameter paths it covers (a group's members; a logical
        name's carriers).
      spec: the layout, as text.
      opt_spec: the optimizer state's layout where it differs; else None.
      chain: what decided it, first what put the layout on the tensor.
      alternatives: the layouts the search costed for its group, fastest first.
      costed: how many layouts the search costed for the group (0: not searched).
      collectives: collective kind → payload bytes per device per step moving
        these tensors (or their gradients, optimizer update).
      comm_time_s: those collectives' modelled time per step.
    """

    name: str
    kind: str
    tensors: tuple[str, ...]
    spec: str
    opt_spec: str | None = None
    chain: tuple[Link, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    costed: int = 0
    collectives: Mapping[str, int] = field(default_factory=dict)
    comm_time_s: float = 0.0

    @property
    def decided_by(self) -> Link | None:
        """The first link that put the layout on the tensor (a constraint, a rule
        or the search's choice)."""
        return next((link for link in self.chain if link.kind in DECIDERS), None)

    def __str__(self) -> str:
        many = f", {len(self.tensors)} tensors" if len(self.tensors) > 1 else ""
        lines = [f"{self.name} ({self.kind}{many})", f"  spec: {self.spec}"]
        if self.opt_spec is not None:
            lines.append(f"  optimizer state: {self.opt_spec}")
        if self.chain:
            lines.append("  decided by:")
            width = max(len(link.kind) for link in self.chain)
            for i, link in enumerate(self.chain, 1):
                lines.append(f"    {i:>2}. {link.kind:<{width}}  {link.text}")
        if self.alternatives:
            lines.append(
                f"  alternatives the search costed ({self.costed} layouts; Δ vs the chosen one):"
            )
            rows = [("layout", "Δmemory/device", "Δcomm/step", "Δstep time")]
            for a in self.alternatives:
                rows.append(
                    (
                        a.spec,
                        _signed(a.memory_delta, fmt_bytes),
                        _signed(a.comm_delta, fmt_bytes),
                        _signed(a.time_delta_s, fmt_time),
                    )
                )
            widths = [max(len(r[i]) for r in rows) for i in range(4)]
            for r in rows:
                lines.append("    " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        elif self.kind == "parameter":
            lines.append("  alternatives: none costed (strategy fixed; 'auto' costs them)")
        if self.kind in ("parameter", "logical"):
            moved = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(self.collectives.items()))
            lines.append(
                f"  collectives it causes per step: {moved or 'none'}"
                + (f" ({fmt_time(self.comm_time_s)})" if self.comm_time_s else "")
            )
        return "\n".join(lines)


def _signed(x: float, fmt: Any) -> str:
    return ("+" if x > 0 else "-" if x < 0 else "±") + fmt(abs(x))


# -- the entry ----------------------------------------------------------------------------


def explain(plan: Any, name: str) -> Explanation:
    """Why ``name`` has its layout in ``plan`` (what ``Plan.explain`` returns).

    Args:
      plan: a :class:`~spmdkit.planner.plans.Plan`.
      name: a parameter path (or a suffix of one, or its group:
        ``layers/*/mlp/up``), a state path, a logical name, a batch field, or a
        ``checkpoint_name`` of an activation.

    Raises:
      PlanError: ``name`` is none of these (the message names near matches).

    Example::

        >>> e = explain(plan, "layers/*/mlp/up")
        >>> e.decided_by.kind
        'rule'
    """
    prov = plan.provenance if plan.provenance is not None else Provenance()
    path = _param_path(plan, name)
    if path is not None:
        return _parameter(plan, prov, name, path)
    if name in plan.state:
        return _state(plan, name)
    names = _logical_names(plan)
    if name in names:
        return _logical(plan, prov, name)
    if name in plan.batch_axes:
        return _batch_field(plan, name)
    if name in prov.named:
        return _activation(name, prov.named[name])
    known = [*plan.params, *{group_key(p) for p in plan.params}, *names, *prov.named]
    near = difflib.get_close_matches(name, known, n=3)
    raise PlanError(
        op="Plan.explain",
        must="the name is a parameter path or group, a state path, a logical name, "
        "a batch field or a checkpoint_name of the step",
        given=repr(name),
        fix=(f"did you mean {', '.join(map(repr, near))}? " if near else "")
        + "see the paths in print(plan)",
    )


def _param_path(plan: Any, name: str) -> str | None:
    """The parameter ``name`` is: its path, the first member of a group, or the
    longest path it ends with."""
    if name in plan.params:
        return name
    members = [p for p in plan.params if group_key(p) == name]
    if members:
        return members[0]
    ends = [p for p in plan.params if p.endswith("/" + name)]
    return min(ends, key=len) if len(ends) == 1 else None


def _logical_names(plan: Any) -> list[str]:
    out: dict[str, None] = {}
    if plan.rules is not None:
        out.update(dict.fromkeys(plan.rules.names))
    for _, _, logical in plan.info.values():
        out.update(dict.fromkeys(n for n in logical or () if n))
    out.update(dict.fromkeys(plan.activation))
    return list(out)


# -- a parameter ---------------------------------------------------------------------------


def _parameter(plan: Any, prov: Provenance, name: str, path: str) -> Explanation:
    key = group_key(path)
    members = tuple(p for p in plan.params if group_key(p) == key)
    spec, opt = plan.params[path], plan.opt.get(path, plan.params[path])
    chain = _decision(plan, prov, path, key)
    chain += [_equation_link(u) for u in prov.uses.get(key, ())]
    alts, costed = _alternatives(prov.groups.get(key))
    return Explanation(
        name=name,
        kind="parameter",
        tensors=members,
        spec=_spec_text(spec),
        opt_spec=None if opt == spec else _spec_text(opt),
        chain=tuple(chain),
        alternatives=alts,
        costed=costed,
        collectives=dict(prov.comm_bytes.get(key, {})),
        comm_time_s=float(prov.comm_time_s.get(key, 0.0)),
    )


def _decision(plan: Any, prov: Provenance, path: str, key: str) -> list[Link]:
    """What put the layout on the parameter: a pin, the search, or the rule table."""
    shape, _, logical = plan.info.get(path, ((), "float32", None))
    chain: list[Link] = []
    chosen = plan.chosen or plan.strategy
    if plan.strategy == "auto":
        others = len(plan.alternatives)
        chain.append(Link("choice", f"auto chose {chosen!r}, the best of {others + 1} plans shown"))
    if key in prov.pinned:
        pin = _spec_text(plan.params[path])
        chain.append(Link("constraint", f"the model pins it in mesh axes: {pin}"))
        return chain
    if plan.rules is None or chosen.startswith("searched"):
        choice = prov.groups.get(key)
        costed = f" of {choice.costed} it costed" if choice is not None else ""
        batch = f" (batch over {','.join(choice.batch_axes) or 'no axis'})" if choice else ""
        chain.append(
            Link("search", f"the search picked the fastest layout for {key}{costed}{batch}")
        )
        return chain
    source = plan.names_from.get(path, "model")
    if logical is None:
        how = (
            "sharded over every axis on its largest dim that divides"
            if _flat(plan.params[path])
            else "replicated"
        )
        chain.append(Link("rule", f"no logical names: the {chosen!r} preset's default, {how}"))
        return chain
    chain.append(Link("names", f"logical names {tuple(logical)} (from the {source})"))
    chain += _rule_links(plan.rules, tuple(logical), tuple(shape), plan.mesh, table=chosen)
    resolved = plan.rules.resolve(logical, shape, plan.mesh, where=path)
    if _spec_text(resolved) != _spec_text(plan.params[path]):
        chain.append(
            Link(
                "rule",
                f"the plan then lays it out as {_spec_text(plan.params[path])} "
                f"(the table gives {_spec_text(resolved)}: {_why_differs(plan)})",
            )
        )
    opt = plan.opt.get(path)
    if opt is not None and opt != plan.params[path]:
        grads = " and its gradient" if path in plan.grads else ""
        chain.append(
            Link(
                "rule",
                f"the optimizer state{grads} sharded further as {_spec_text(opt)} "
                f"({chosen!r} shards the optimizer state over the axes the parameter leaves free)",
            )
        )
    return chain


def _why_differs(plan: Any) -> str:
    if plan.pipeline is not None:
        return f"the layers dim on the pipe axis {plan.pipeline.axis!r}"
    if plan.strategy == "rules":
        return "a per-parameter override of the table, or the table fitted to the mesh"
    return "the planner's layout for this preset"


def _rule_links(
    rules: LogicalRules, logical: tuple, shape: tuple, mesh: Any, *, table: str
) -> list[Link]:
    """Per named dim, the entries tried for it in table order and the one that
    decided it (as :meth:`~spmdkit.planner.logical.LogicalRules.resolve` decides,
    flax's reading: an entry earlier in the table takes a mesh axis first)."""
    sizes = axis_sizes(mesh)
    dims, steps = rules.resolve_steps(logical, shape, mesh)
    names = logical + (None,) * (len(shape) - len(logical))
    out = []
    for d, (name, n) in enumerate(zip(names, shape, strict=False)):
        if name is None:
            continue
        tried = []
        for s in steps:
            if s.dim != d or s.outcome == "taken":
                continue
            if s.outcome == "replicated":
                tried.append("None: replicated")
            elif s.outcome == "held":
                other = names[s.holder] if s.holder is not None else None
                tried.append(
                    f"{_axes(s.axes)} skipped: dim {s.holder} ({other!r}) took it by an "
                    "earlier entry"
                )
            else:
                devices = math.prod(sizes.get(a, 1) for a in s.axes or ())
                tried.append(f"{_axes(s.axes)} skipped: {n} does not divide over {devices}")
        got = dims[d]
        result = "replicated" if not got else _axes(got)
        detail = "; ".join(tried)
        out.append(
            Link(
                "rule",
                f"dim {d} {name!r} ({n}): the {table!r} table's rule ({name!r}, "
                f"{_axes(got) if got else 'None'}) → {result}" + (f" [{detail}]" if detail else ""),
            )
        )
    return out


def _equation_link(u: Use, verb: str = "reads") -> Link:
    what = u.op or u.primitive
    strategy = f", {u.strategy}" if u.strategy != "default" else ""
    runs = f" ×{u.runs}" if u.runs > 1 else ""
    moves = ""
    if u.moves:
        moves = "; collectives: " + ", ".join(
            f"{m.kind}({','.join(m.axes)}) {fmt_bytes(m.payload_bytes)}" for m in u.moves
        )
    where = f" at {_short(u.source)}" if u.source else ""
    text = f"{u.phase} pass: {what} by its {u.decided}{strategy}{where}, {verb} {u.spec}"
    text += runs + moves
    return Link("equation", text, u)


def _alternatives(choice: GroupChoice | None) -> tuple[tuple[Alternative, ...], int]:
    if choice is None:
        return (), 0
    base = choice.chosen

    def alt(o: LayoutOption) -> Alternative:
        return Alternative(
            o.spec_text(),
            o.memory_bytes - base.memory_bytes,
            o.comm_bytes - base.comm_bytes,
            o.time_s - base.time_s,
        )

    return tuple(alt(o) for o in choice.others), choice.costed


# -- logical names, state, batch fields, activations ----------------------------------------


def _logical(plan: Any, prov: Provenance, name: str) -> Explanation:
    carriers = []
    for path, (_, _, logical) in plan.info.items():
        if path in plan.params and logical and name in logical:
            carriers.append(path)
    chain: list[Link] = []
    if plan.rules is not None:
        entries = [a for k, a in plan.rules.entries if k == name]
        table = plan.chosen or plan.strategy
        text = ", ".join("None" if a is None else _axes(a) for a in entries) or "no entry"
        chain.append(Link("rule", f"the {table!r} table's entries for {name!r}, in order: {text}"))
    else:
        text = f"no rule table: the search laid out each group (names such as {name!r} unread)"
        chain.append(Link("search", text))
    spec = ""
    if name in plan.activation:
        axes = plan.activation[name]
        spec = _axes(axes) if axes else "replicated"
        chain.append(Link("rule", f"activations' {name!r} dim over {spec}"))
    groups: dict[str, str] = {}
    for path in carriers:
        shape, _, logical = plan.info[path]
        dim = list(logical).index(name)
        dims = _dims(plan.params[path], len(shape))
        groups.setdefault(group_key(path), _axes(dims[dim]) if dims[dim] else "replicated")
    kind = "rule" if plan.rules is not None else "search"
    for key, got in groups.items():
        chain.append(Link(kind, f"{key}: its {name!r} dim over {got}"))
    kinds: dict[str, int] = {}
    time = 0.0
    for key in groups:
        for kind, n in prov.comm_bytes.get(key, {}).items():
            kinds[kind] = kinds.get(kind, 0) + n
        time += prov.comm_time_s.get(key, 0.0)
    spec = spec or ", ".join(sorted(set(groups.values()))) or "unused"
    return Explanation(
        name, "logical", tuple(carriers), spec, None, tuple(chain), (), 0, kinds, time
    )


def _state(plan: Any, path: str) -> Explanation:
    how = plan.state_from.get(path, "given")
    chain = (Link("rule", f"laid out {how} (the model's state follows its module's parameter)"),)
    return Explanation(path, "state", (path,), _spec_text(plan.state[path]), None, chain)


def _batch_field(plan: Any, path: str) -> Explanation:
    names = tuple(plan.batch_axes[path])
    parts = []
    for n in names:
        axes = plan.activation.get(n, ()) if n in BATCH_NAMES or n in plan.activation else ()
        parts.append(_axes(axes) if axes else "_")
    chain = [Link("names", f"batch field {path!r} dims named {names}")]
    for n in names:
        if n and n in plan.activation:
            got = plan.activation[n]
            chain.append(Link("rule", f"{n!r} over {_axes(got) if got else 'no axis'}"))
    return Explanation(path, "batch", (path,), "[" + ",".join(parts) + "]", None, tuple(chain))


def _activation(name: str, uses: Sequence[Use]) -> Explanation:
    made = next((u for u in uses if u.phase == "forward"), uses[0])
    chain = tuple(_equation_link(u, "makes it as") for u in uses)
    return Explanation(name, "activation", (name,), made.spec, None, chain)


# -- text ----------------------------------------------------------------------------------


def _short(source: str) -> str:
    """A source location without its directories up to the package
    (``optax/tree_utils/_tree_math.py:398:37 (...)``, ``models/llama.py:137:37 (...)``)."""
    for mark in ("site-packages/", "dist-packages/"):
        if mark in source:
            return source.split(mark, 1)[1]
    cwd = os.getcwd().rstrip("/") + "/"
    return source[len(cwd) :] if source.startswith(cwd) else source


def _dims(spec: Any, ndim: int) -> list[tuple[str, ...]]:
    out = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in tuple(spec)]
    return out + [()] * (ndim - len(out))


def _flat(spec: Any) -> tuple[str, ...]:
    return tuple(a for d in _dims(spec, 0) for a in d)


def _axes(axes: Sequence[str]) -> str:
    return axes[0] if len(axes) == 1 else "(" + ",".join(axes) + ")"


def _spec_text(spec: Any) -> str:
    parts = ["_" if not d else _axes(d) for d in _dims(spec, 0)]
    return "[" + ",".join(parts) + "]"
