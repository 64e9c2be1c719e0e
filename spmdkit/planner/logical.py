"""Logical-axis rules and presets: which mesh axes each logical dim name maps to.

Logical-axis rules
------------------
Models name dims logically (``"embed"``, ``"mlp"``, ``"heads"``); a
:class:`LogicalRules` table maps names to mesh axes. A table means what it means
to flax's ``logical_to_mesh_axes``: the entries are walked in order, and each
goes to the dim carrying its name unless that dim is already assigned or one of
its mesh axes is already held by another dim of the array; an entry of ``None``
assigns "replicated"; a dim no entry assigns is replicated. So where two dims
want one mesh axis, the name whose entry comes first in the table gets it, not
the earlier dim. spmdkit adds to flax's reading, never contradicting it on a
table that shards validly:

- an entry whose mesh axes do not divide the dim is passed over (flax has no
  shapes; jax would refuse the layout), so later entries are fallbacks;
- a name with no entry raises :class:`UnknownLogicalAxisError` (flax silently
  replicates it), a name that is not a string (``PartitionSpec.UNCONSTRAINED``)
  and an entry naming one mesh axis twice raise too (spmdkit plans every dim);
- a name repeated within one array (flax refuses it) goes entry by entry to the
  first of its dims still unassigned.

flax's tables and names
-----------------------
A flax rule table (``nn.logical_axis_rules``-style ``(name, axes)`` pairs, as
MaxText and T5X write them) is a rule table as is: pass it as ``rules=`` or as
the strategy. Metadata with fewer names than dims (linen's ``DenseGeneral``
gives its N-D kernels the flat initializer's names) names the leading dims, the
trailing ones unnamed, as flax pads a ``PartitionSpec``. flax's own names are in
every preset: ``kv`` (a head's feature dim, as ``head_dim``) and ``joined_kv``
(heads × head_dim flattened, sharded as ``heads``).

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
zero2    as zero1, and gradients sharded like the optimizer state
         (reduce-scattered, not all-reduced)
megatron batch over data axes; column/row-parallel attention and MLP, vocab-
         parallel embedding and head over the model axes (Megatron-LM TP)
megatron_sp  megatron plus the sequence dim of activations over the model axes
tp_fsdp  megatron over the model axes + fsdp (embed dim) over the data axes
ep       batch over every axis; experts over the expert axes
======== ===================================================================

``megatron+zero1`` and ``megatron_sp+zero1`` (:data:`SHARDED_OPT_PRESETS`, not
in :data:`PRESETS`): the tensor-parallel preset's parameters, their optimizer
state also sharded over the axes the parameter leaves free (the data and
context axes), as ``zero1`` shards it: Megatron-LM's distributed optimizer,
which the published NeMo and Megatron-Bridge pipelined runs use.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from jax.sharding import PartitionSpec as P

from spmdkit.errors import DuplicateAxisError, SpmdError
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.strategies import PRESETS, SHARDED_OPT_PRESETS, STRATEGIES, unknown_strategy

__all__ = [
    "ACTIVATION_ALIASES",
    "BATCH_NAMES",
    "PARAM_NAMES",
    "PRESETS",
    "SHARDED_OPT_PRESETS",
    "AxesLike",
    "Entry",
    "LogicalRules",
    "OverBudgetError",
    "PlanError",
    "ROLE_NAMES",
    "RuleStep",
    "RulesLike",
    "UnknownLogicalAxisError",
    "axis_roles",
    "check_aliases",
    "preset_rules",
]

#: Logical names of parameter dims that every preset table covers. ``q_lora`` and
#: ``kv_lora`` are the low-rank dims of MLA attention's down-projections: only
#: ``fsdp`` shards them (tensor parallelism keeps the down-projections whole and
#: splits the heads of the up-projections, as Megatron-LM's MLA does).
PARAM_NAMES = (
    "vocab",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "head_dim",
    "kv",
    "joined_kv",
    "q_lora",
    "kv_lora",
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

#: Activation names of other projects' rule tables (MaxText) treated as the
#: planner's own batch dims (:meth:`LogicalRules.aliased`).
ACTIVATION_ALIASES = {"activation_batch": "batch", "activation_length": "seq"}


class PlanError(SpmdError, ValueError):
    """A plan cannot be built or applied as asked.

    Broken example: ``sk.plan(spec, mesh, strategy="fdsp")`` (unknown preset).
    """


class OverBudgetError(PlanError):
    """No plan ``sk.plan(..., "auto")`` considered fits the per-device memory budget.

    The message names the closest candidates and their memory, and what would
    make one fit; ``candidates`` holds them as ``(label, Cost)`` pairs, closest
    first. Pass ``allow_over_budget=True`` to get the closest plan instead.

    Broken example: ``sk.plan(get_model("llama"), sk.abstract_mesh(data=8), "auto",
    config="70b", batch_size=64)``: 70B parameters with Adam need about 140 GB per
    device over 8 devices, before activations.
    """

    def __init__(self, *, op: str, must: str, given: str, fix: str, candidates: tuple = ()) -> None:
        super().__init__(op=op, must=must, given=given, fix=fix)
        self.candidates = tuple(candidates)


class UnknownLogicalAxisError(PlanError, LookupError):
    """A logical axis name has no entry in the rule table.

    Broken example: a param named ``("embed", "hidden")`` planned with a table that
    has no ``"hidden"`` entry; the plan refuses instead of replicating it.
    """


#: One rule entry's mesh axes: a tuple of axis names, or None (replicated).
Entry = tuple[str, ...] | None
#: Mesh axes as a rule table may give them: one axis, several, or None.
AxesLike = str | Sequence[str] | None
#: What :meth:`LogicalRules.coerce` accepts: a table, ``(name, axes)`` pairs, or a
#: mapping name → axes (or a list of fallback axes).
RulesLike = Union[
    "LogicalRules",
    Mapping[str, "AxesLike | list[AxesLike]"],
    Iterable[tuple[str, AxesLike]],
]


def _axes(value: AxesLike, name: Any = "?") -> Entry:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Iterable) and all(isinstance(a, str) for a in value):
        axes = tuple(value)
        twice = sorted({a for a in axes if axes.count(a) > 1})
        if twice:
            once = tuple(dict.fromkeys(axes))
            raise DuplicateAxisError(
                op="LogicalRules",
                must="an entry names each mesh axis at most once (a dim split over an "
                "axis twice would count its size twice)",
                given=f"{name!r}: {value!r} names {', '.join(map(repr, twice))} twice",
                fix=f"write each axis once: ({name!r}, {once!r})",
            )
        return axes
    raise PlanError(
        op="LogicalRules",
        must="an entry's mesh axes are an axis name, a tuple of names, or None",
        given=f"{name!r}: {value!r}",
        fix='write e.g. ("mlp", "model"), ("embed", ("data", "fsdp")) or ("mlp", None)',
    )


#: A dim no entry has assigned yet (``None`` in a result means "replicated").
_UNSET: Any = type("Unassigned", (), {"__repr__": lambda self: "Unassigned"})()


@dataclass(frozen=True)
class RuleStep:
    """One rule entry tried for one dim by :meth:`LogicalRules.resolve_steps`.

    Attributes:
      dim: the dim the entry went to (the first unassigned dim carrying its name).
      name: the entry's logical name.
      axes: the entry's mesh axes (None: the entry says replicated).
      outcome: ``"taken"`` (the dim got the axes), ``"replicated"`` (a ``None``
        entry), ``"held"`` (another dim already holds one of the axes) or
        ``"indivisible"`` (the axes do not divide the dim).
      holder: for ``"held"``, the dim that holds the axis.
    """

    dim: int
    name: str
    axes: Entry
    outcome: str
    holder: int | None = None


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
        entries = []
        for entry in self.entries:
            if not isinstance(entry, tuple | list) or len(entry) != 2:
                raise PlanError(
                    op="LogicalRules",
                    must="every entry is a (logical name, mesh axes) pair",
                    given=repr(entry),
                    fix='write e.g. ("mlp", "model")',
                )
            entries.append((str(entry[0]), _axes(entry[1], entry[0])))
        object.__setattr__(self, "entries", tuple(entries))

    @classmethod
    def coerce(cls, value: RulesLike) -> LogicalRules:
        """Accept a LogicalRules, a list of pairs, or a mapping name → axes (or list of)."""
        if isinstance(value, LogicalRules):
            return value
        if isinstance(value, Mapping):
            pairs: list[tuple[str, AxesLike]] = []
            for k, v in value.items():
                if isinstance(v, list):
                    pairs.extend((k, e) for e in v)
                else:
                    pairs.append((k, v))
            return cls(tuple(pairs))
        if isinstance(value, Iterable) and not isinstance(value, str):
            return cls(tuple(value))
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

    def prepend(self, other: RulesLike) -> LogicalRules:
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
        """The PartitionSpec for a tensor whose dims carry ``names``, read as flax's
        ``logical_to_mesh_axes`` reads the table (module docstring).

        Args:
          names: logical name per dim (None: replicated dim); None: unannotated
            (replicated). Fewer names than dims name the leading dims, the
            trailing ones unnamed, as flax pads a PartitionSpec (linen's
            ``DenseGeneral`` gives its N-D kernels the flat initializer's names).
          shape: the tensor's global shape.
          mesh: the mesh (axis names and sizes).
          where: the tensor's path, for error messages.

        Raises:
          UnknownLogicalAxisError: a name has no entry.
          PlanError: an entry names an axis the mesh does not have, a name is
            neither a string nor None, or there are more names than dims.
        """
        dims, _ = self.resolve_steps(names, shape, mesh, where=where)
        out: list[str | tuple[str, ...] | None] = [
            None if not d else d[0] if len(d) == 1 else d for d in dims
        ]
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    def resolve_steps(
        self,
        names: Sequence[str | None] | None,
        shape: Sequence[int],
        mesh: MeshLike,
        *,
        where: str = "",
    ) -> tuple[tuple[tuple[str, ...], ...], tuple[RuleStep, ...]]:
        """Per dim the mesh axes :meth:`resolve` gives it (``()``: replicated), and
        the entries it tried, in table order (what ``plan.explain`` prints).

        The entries are walked in order, as flax walks them: each entry goes to
        the first dim carrying its name that no earlier entry assigned; it
        assigns the dim its axes unless an axis is already held by another dim
        of the tensor (or, spmdkit's addition, the axes do not divide the dim),
        and ``None`` assigns "replicated". A dim no entry assigns is replicated.

        Args and raises: as :meth:`resolve`.

        Example::

            >>> rules = LogicalRules((("expert", "model"), ("embed", "model")))
            >>> rules.resolve_steps(("embed", "expert"), (8, 8), abstract_mesh(model=4))[0]
            ((), ('model',))
        """
        if names is None:
            return ((),) * len(shape), ()
        names = tuple(names)
        if len(names) > len(shape):
            raise PlanError(
                op="LogicalRules.resolve",
                must="at most one logical name per dim",
                given=f"{names} for shape {tuple(shape)} at {where or '?'}",
                fix="fix the model's sharding metadata, or give names by path "
                "(sk.plan(..., names={path_glob: names}))",
            )
        names = names + (None,) * (len(shape) - len(names))
        known = self.names
        for name in names:
            if name is None:
                continue
            if not isinstance(name, str):
                raise PlanError(
                    op="LogicalRules.resolve",
                    must="each dim's logical name is a string or None",
                    given=f"{name!r} in {names} at {where or '?'}",
                    fix="name the dim, or give None to replicate it (spmdkit plans every dim: "
                    "it has no unconstrained dim)",
                )
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                raise UnknownLogicalAxisError(
                    op="LogicalRules.resolve",
                    must=f"every logical name has a rule (known: {', '.join(known)})",
                    given=f"{name!r} at {where or '?'}",
                    fix=(f"did you mean {near[0]!r}? " if near else "")
                    + f"add a rule, e.g. rules=[({name!r}, None)] to replicate it on purpose, "
                    f"or treat it like a known name: sk.plan(..., aliases={{{name!r}: 'embed'}})",
                )
        sizes = axis_sizes(mesh)
        got: list[tuple[str, ...] | None] = [None if n is None else _UNSET for n in names]
        holder: dict[str, int] = {}
        steps: list[RuleStep] = []
        for key, axes in self.entries:
            dim = next((d for d, n in enumerate(names) if n == key and got[d] is _UNSET), None)
            if dim is None:
                continue
            if axes is None:
                got[dim] = ()
                steps.append(RuleStep(dim, key, None, "replicated"))
                continue
            missing = [a for a in axes if a not in sizes]
            if missing:
                raise PlanError(
                    op="LogicalRules.resolve",
                    must=f"rule axes are mesh axes of {tuple(sizes)}",
                    given=f"{key!r} → {axes}",
                    fix="rename the rule's axes or build the mesh with them",
                )
            held = [holder[a] for a in axes if a in holder]
            if held:
                steps.append(RuleStep(dim, key, axes, "held", held[0]))
                continue
            if shape[dim] % math.prod(sizes[a] for a in axes):
                steps.append(RuleStep(dim, key, axes, "indivisible"))
                continue
            got[dim] = axes
            holder.update(dict.fromkeys(axes, dim))
            steps.append(RuleStep(dim, key, axes, "taken"))
        dims = tuple(() if g is None or g is _UNSET else g for g in got)
        return dims, tuple(steps)

    def on_mesh(self, mesh: MeshLike) -> tuple[LogicalRules, dict[str, tuple[str, ...]]]:
        """The table with the mesh axes ``mesh`` lacks dropped from every entry, and
        each dropped axis → the logical names whose entries named it.

        An entry left with no axis shards nothing but still wins over later
        fallbacks, as if the mesh had the axis with size 1 (MaxText builds every
        mesh with all of its axes, unused ones of size 1).

        Example::

            >>> t, dropped = LogicalRules((("embed", ("fsdp", "data")),)).on_mesh(
            ...     abstract_mesh(data=2, model=4))
            >>> t.entries, dropped
            ((('embed', ('data',)),), {'fsdp': ('embed',)})
        """
        have = set(mesh.axis_names)
        dropped: dict[str, list[str]] = {}
        entries = []
        for name, axes in self.entries:
            for a in axes or ():
                if a not in have and name not in dropped.setdefault(a, []):
                    dropped[a].append(name)
            entries.append((name, None if axes is None else tuple(a for a in axes if a in have)))
        return LogicalRules(tuple(entries)), {a: tuple(n) for a, n in dropped.items()}

    def aliased(self, aliases: Mapping[str, str]) -> LogicalRules:
        """The table where each pair of ``aliases`` (logical name → logical name)
        is treated alike: a name of the pair with no entry takes the other's
        entries (a name with entries of its own keeps them).

        Example::

            >>> t = LogicalRules((("heads", "model"),)).aliased({"q_heads": "heads"})
            >>> t.resolve(("q_heads",), (8,), abstract_mesh(data=2, model=4))
            PartitionSpec('model',)
        """
        entries = list(self.entries)
        for _ in range(len(aliases)):  # chains (a → b → c) settle in len(aliases) rounds
            names = {k for k, _ in entries}
            added = False
            for a, b in aliases.items():
                for new, old in ((a, b), (b, a)):
                    if new not in names and old in names:
                        entries += [(new, axes) for k, axes in entries if k == old]
                        names.add(new)
                        added = True
            if not added:
                break
        return LogicalRules(tuple(entries))

    def to_json(self) -> list:
        """JSON-able list of ``[name, axes or null]``."""
        return [[k, None if v is None else list(v)] for k, v in self.entries]


def check_aliases(aliases: object) -> dict[str, str]:
    """``aliases`` as a dict of logical name → logical name (None: empty).

    Raises:
      PlanError: not a mapping of names to names.
    """
    if aliases is None:
        return {}
    if isinstance(aliases, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
    ):
        return dict(aliases)
    raise PlanError(
        op="plan",
        must="aliases map logical names to logical names",
        given=repr(aliases),
        fix='pass e.g. aliases={"q_heads": "heads", "embed_vocab": "vocab"}',
    )


# -- roles and presets -------------------------------------------------------------

#: Mesh axis names that give an axis a role in the presets (module docstring).
ROLE_NAMES = {
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
    by_name = {role: tuple(a for a in names if a in keys) for role, keys in ROLE_NAMES.items()}
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
        return {r: names for r in ROLE_NAMES}
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


#: The order of the names in a preset's table, which decides (as in flax) which
#: of two dims wanting one mesh axis gets it: :data:`PARAM_NAMES`' order with
#: ``expert`` moved up to follow ``embed``, so an expert weight is split over its
#: experts before within one (expert parallelism under ``megatron``) and ``fsdp``
#: splits a weight's ``embed`` dim when it divides (as MaxText's ``embed → fsdp``);
#: ``layers`` late (a scanned stack is split within a layer, not across layers);
#: then the batch names.
_TABLE_ORDER = (
    *PARAM_NAMES[: PARAM_NAMES.index("embed") + 1],
    "expert",
    *(n for n in PARAM_NAMES[PARAM_NAMES.index("embed") + 1 :] if n != "expert"),
    *BATCH_NAMES,
)


def _table(spec: Mapping[str, list[Entry]]) -> LogicalRules:
    pairs = []
    for name in _TABLE_ORDER:
        for entry in spec.get(name, [None]):
            pairs.append((name, entry))
    return LogicalRules(tuple(pairs))


# flax's names: ``kv`` is a head's feature dim (as ``head_dim``), ``joined_kv``
# heads × head_dim flattened (sharded as ``heads``).
_TP_NAMES = ("vocab", "mlp", "heads", "kv_heads", "joined_kv", "conv_out", "classes", "expert")


def preset_rules(name: str, mesh: MeshLike) -> LogicalRules:
    """The logical-rule table of a preset on ``mesh`` (module docstring).

    Raises:
      PlanError: unknown preset.

    Example::

        >>> preset_rules("megatron", abstract_mesh(data=2, model=4)).resolve(
        ...     ("embed", "mlp"), (64, 256), abstract_mesh(data=2, model=4))
        PartitionSpec(None, 'model')
    """
    if name in SHARDED_OPT_PRESETS:  # the parameters' table; zero1's for the state
        return preset_rules(name.removesuffix("+zero1"), mesh)
    roles = axis_roles(mesh)
    every = tuple(mesh.axis_names)
    model = roles["model"]
    dp_axes = tuple(a for a in every if a in roles["data"] or a in roles["fsdp"])
    dp_axes = tuple(a for a in dp_axes if a not in model) if model != every else ()
    table: dict[str, list[Entry]] = {}
    if name in ("dp", "zero1", "zero2"):
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
        raise PlanError(
            op="plan(strategy=...)",
            must=f"strategy is one of {STRATEGIES}, or a rule table",
            given=repr(name),
            fix=unknown_strategy(name) or "pick a listed strategy",
        )
    return _table(table)
