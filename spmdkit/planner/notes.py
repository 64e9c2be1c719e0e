"""Plan notes: what a plan does that nobody asked for, said in words.

A plan can be valid and still waste devices or differ from what its author
wrote: a mesh axis whose devices all compute the same thing, a batch that went
to other axes than the rules ask for because its size does not divide them, a
recipe auto chose instead of the plain step, candidates auto dropped. Each such
choice is a :class:`PlanNote` (kind, message, fix) in ``plan.notes``, printed
under the plan's table and saved in its JSON. ``sk.plan`` also warns each note
of the plan it returns as a :class:`PlanNoteWarning` (once, blamed on the
caller's line), so a script sees it without printing the plan: filter the
category to silence notes, or turn it into errors; ``sk.plan(..., strict=True)``
raises :class:`PlanNoteError` instead. Callers that print the plan themselves
(the command line, ``train`` planning for itself) plan under
:func:`quiet_notes`.

A rule table's mesh axis the mesh lacks is dropped with an ``absent_axes`` note
(another project's table names axes this mesh does without), unless it is a
near miss of an axis the mesh has (``"modle"`` on a mesh with ``"model"``): a
typo would silently replicate what its rules shard, so
:func:`refuse_typod_axes` raises :class:`~spmdkit.errors.UnknownAxisError`.

======================  =============================================================
kind                    when
======================  =============================================================
``idle_axis``           a mesh axis (size > 1) carries neither the batch, nor any
                        parameter, optimizer state or activation dim
``batch_axes``          the batch's size does not divide the axes its rule asks for;
                        it went to other axes (or none)
``batch_replicated``    a rule table with no ``batch`` entry, or a batch field dim
                        named with a name no activation rule covers
``recipe``              auto chose a recipe other than the plain step
``dropped``             auto left presets out of its runner-up list; asked for
                        pipelines, it costed none or left refused ones out
``absent_axes``         a rule table names mesh axes the mesh lacks (dropped)
``mesh_split``          the planner split a mesh axis into two (``data`` into ``pipe × data``
                        for a pipeline, ``data × context`` for context parallelism,
                        or ``data × expert`` for expert parallelism): the plan runs
                        on ``plan.mesh``, not the mesh given
``replicated``          auto kept every parameter and the batch replicated on a mesh
                        of several devices: its step beside the best sharded plan's
``priced_only``         the plan's routed-expert exchanges were priced as a form
                        spmdkit's executor does not run (the topology's
                        ``expert_exchange`` ``"routed"`` or ``"node_dedup"``, or
                        ``expert_overlap``)
``measured``            auto timed its candidates on the mesh's devices (a step
                        timer, :func:`spmdkit.tune`): each one's price and measured
                        step, and which it kept
======================  =============================================================
"""

from __future__ import annotations

import contextlib
import difflib
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spmdkit.errors import UnknownAxisError
from spmdkit.planner.logical import BATCH_NAMES, PRESETS, ROLE_NAMES, PlanError, axis_roles
from spmdkit.spec import MeshLike, axis_sizes
from spmdkit.util import fmt_bytes, fmt_time

if TYPE_CHECKING:
    from spmdkit.step.recipe import Recipe

__all__ = [
    "FOREIGN_AXES",
    "NEAR_MISS",
    "NOTE_KINDS",
    "RECOST_OVER_BUDGET",
    "absent_axes_note",
    "PlanNote",
    "PlanNoteError",
    "PlanNoteWarning",
    "asked_batch_axes",
    "batch_field_notes",
    "batch_notes",
    "dropped_note",
    "floored_reasons",
    "idle_axis_notes",
    "mesh_split_note",
    "no_batch_rule_note",
    "not_recosted",
    "priced_only_note",
    "quiet_notes",
    "raise_if_strict",
    "recipe_note",
    "refuse_typod_axes",
    "warn_notes",
    "replicated_note",
]

#: The kinds of :class:`PlanNote` (module docstring).
NOTE_KINDS = (
    "idle_axis",
    "batch_axes",
    "batch_replicated",
    "recipe",
    "dropped",
    "absent_axes",
    "mesh_split",
    "replicated",
    "priced_only",
    "measured",
)


class PlanNoteError(PlanError):
    """``sk.plan(..., strict=True)`` made a plan with notes.

    Broken example: ``sk.plan(model, sk.abstract_mesh(dat=2, model=4), "megatron",
    strict=True)``: the typo'd axis ``dat`` carries nothing.
    """


class PlanNoteWarning(UserWarning):
    """A plan note (:class:`PlanNote`), warned by ``sk.plan`` as it returns the plan.

    One warning per note of the returned plan, its text the note's
    (``[kind] message Fix: fix``), blamed on the line that called ``sk.plan``.
    ``warnings.filterwarnings("ignore", category=sk.PlanNoteWarning)`` silences
    them (the notes stay in ``plan.notes``); ``"error"`` makes the first one
    raise (``strict=True`` raises :class:`PlanNoteError` with all of them).

    Broken example: ``sk.plan(model, sk.abstract_mesh(dat=2, model=4), "megatron")``
    warns that the typo'd axis ``dat`` carries nothing.
    """


@dataclass(frozen=True)
class PlanNote:
    """One thing a plan does that its author did not ask for (module docstring).

    Attributes:
      kind: one of :data:`NOTE_KINDS`.
      message: what the plan does, with the sizes involved.
      fix: how to get what was probably meant.

    Example::

        >>> str(PlanNote("idle_axis", "mesh axis 'dat' (2 devices) carries nothing.",
        ...              "rename it 'data'"))
        "[idle_axis] mesh axis 'dat' (2 devices) carries nothing. Fix: rename it 'data'"
    """

    kind: str
    message: str
    fix: str

    def __post_init__(self) -> None:
        if self.kind not in NOTE_KINDS:
            raise PlanError(
                op="PlanNote",
                must=f"kind is one of {NOTE_KINDS}",
                given=repr(self.kind),
                fix="use a listed kind",
            )

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message} Fix: {self.fix}"

    def to_json(self) -> dict:
        """JSON-able dict."""
        return {"kind": self.kind, "message": self.message, "fix": self.fix}

    @classmethod
    def from_json(cls, d: Mapping) -> PlanNote:
        """Inverse of :meth:`to_json`."""
        return cls(str(d["kind"]), str(d["message"]), str(d["fix"]))


def raise_if_strict(notes: Sequence[PlanNote], strategy: str, *, strict: bool) -> None:
    """With ``strict``, a plan with notes raises instead of being returned.

    Raises:
      PlanNoteError: ``strict`` and ``notes`` is not empty.
    """
    if not strict or not notes:
        return
    raise PlanNoteError(
        op=f"plan(strategy={strategy!r}, strict=True)",
        must="the plan makes no choice it would only note (strict turns notes into errors)",
        given=" ".join(f"[{n.kind}] {n.message}" for n in notes),
        fix=" / ".join(dict.fromkeys(n.fix for n in notes)),
    )


def warn_notes(notes: Sequence[PlanNote], *, stacklevel: int) -> None:
    """Warn each note as a :class:`PlanNoteWarning` (``stacklevel`` as
    ``warnings.warn`` counts it from the caller of this function)."""
    for note in notes:
        warnings.warn(str(note), PlanNoteWarning, stacklevel=stacklevel + 1)


@contextlib.contextmanager
def quiet_notes() -> Iterator[None]:
    """Plans made inside warn no notes: for callers that print the plan's notes
    themselves (the command line, ``train`` when it plans), so that none is
    said twice. Other warnings pass as before.

    Example::

        >>> with quiet_notes():
        ...     p = sk.plan(model, sk.abstract_mesh(dat=2, model=4), "megatron")
        >>> print(p)  # the notes under the table
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanNoteWarning)
        yield


# -- layout notes ---------------------------------------------------------------------------


def _axes_text(axes: Sequence[str], sizes: Mapping[str, int]) -> str:
    if not axes:
        return "no axis"
    n = math.prod(sizes[a] for a in axes)
    return "×".join(axes) + f" ({n} device{'s' if n != 1 else ''})"


def _used_axes(specs: Iterable, activation: Mapping[str, Sequence[str]]) -> set[str]:
    used: set[str] = set()
    for spec in specs:
        for e in tuple(spec):
            if e is not None:
                used.update((e,) if isinstance(e, str) else e)
    for axes in activation.values():
        used.update(axes)
    return used


def _idle_fix(axis: str, mesh: MeshLike, by_role: bool) -> str:
    """The fix for an idle axis: a typo'd role name, or the generic choices."""
    if by_role:
        known = sorted(set().union(*ROLE_NAMES.values()))
        if axis == "context":
            return (
                "the presets leave a 'context' axis to context parallelism, which only "
                "auto plans: plan with strategy='auto' (the sequence split over it), "
                "or build the mesh without it"
            )
        if axis not in known:
            near = difflib.get_close_matches(axis, known, n=1)
            return (
                (f"did you mean {near[0]!r}? " if near else "")
                + "the presets give mesh axes roles by name (data/dp/batch, fsdp, "
                f"model/tensor/tp, expert/ep) and {axis!r} is none of them: rename it, "
                "or build the mesh without it"
            )
    return (
        f"shard something over {axis!r} (a batch size it divides, a rule naming it, "
        "another strategy), or build the mesh without it"
    )


def idle_axis_notes(
    mesh: MeshLike,
    specs: Iterable,
    activation: Mapping[str, Sequence[str]],
    *,
    by_role: bool,
) -> list[PlanNote]:
    """An ``idle_axis`` note per mesh axis (size > 1) that nothing in ``specs``
    (params, optimizer state, gradients, model state) or ``activation`` uses.
    ``by_role``: the layout came from a preset (roles by axis name)."""
    sizes = axis_sizes(mesh)
    used = _used_axes(specs, activation)
    out = []
    for a, n in sizes.items():
        if n > 1 and a not in used:
            out.append(
                PlanNote(
                    "idle_axis",
                    f"mesh axis {a!r} ({n} devices) carries neither the batch nor any "
                    f"parameter: its {n} slices of the mesh all compute the same thing.",
                    _idle_fix(a, mesh, by_role),
                )
            )
    return out


def asked_batch_axes(rules: object, mesh: MeshLike) -> tuple[tuple[str, ...] | None, str]:
    """The mesh axes the batch is asked to go on, and who asks: a rule table's
    first ``batch`` entry (None when its first entry replicates on purpose), or,
    with no table (auto's searched layouts), the mesh's data axes."""
    entries = getattr(rules, "entries", None)
    if entries is not None:
        for key, axes in entries:
            if key == "batch":
                return axes, "its rule"
        return None, ""
    roles = axis_roles(mesh)
    data = tuple(a for a in mesh.axis_names if a in roles["data"] and a not in roles["model"])
    return (data or None), "the mesh's data axes"


def batch_notes(
    mesh: MeshLike,
    batch_size: int | None,
    chosen: Sequence[str],
    asked: Sequence[str] | None,
    who: str,
) -> list[PlanNote]:
    """A ``batch_axes`` note when the batch's size does not divide the axes it is
    asked to go on (``asked``, by ``who``) and went to ``chosen`` instead."""
    sizes = axis_sizes(mesh)
    # a pipelined plan's table was made on the mesh without the pipe axis
    asked = tuple(a for a in asked or () if a in sizes)
    if not asked or batch_size is None or tuple(chosen) == asked:
        return []
    n = math.prod(sizes[a] for a in asked)
    if batch_size % n == 0:
        return []
    left = [a for a in asked if a not in chosen and sizes[a] > 1]
    copies = f"; {_axes_text(left, sizes)} hold{'s' if len(left) == 1 else ''} copies of it"
    return [
        PlanNote(
            "batch_axes",
            f"the batch of {batch_size} does not divide {_axes_text(asked, sizes)}, the axes "
            f"{who} asks for; it went on {_axes_text(tuple(chosen), sizes)} instead"
            + (copies if left else "")
            + ".",
            f"use a global batch that is a multiple of {n} (e.g. "
            f"{-(-batch_size // n) * n}), or a mesh whose batch axes divide {batch_size}",
        )
    ]


def batch_field_notes(
    batch_axes: Mapping[str, Sequence[str | None]], activation: Mapping[str, Sequence[str]]
) -> list[PlanNote]:
    """A ``batch_replicated`` note per batch-field dim whose logical name no
    activation rule covers (its dim would be replicated)."""
    out = []
    for path, names in batch_axes.items():
        for i, name in enumerate(names):
            if name is not None and name not in activation:
                out.append(
                    PlanNote(
                        "batch_replicated",
                        f"batch field {path!r} names dim {i} {name!r}, which no activation "
                        f"rule covers (known: {', '.join(BATCH_NAMES)}): that dim is "
                        "replicated.",
                        f"name it as the planner does (batch_axes={{{path!r}: ('batch', "
                        f"...)}}), or alias it: sk.plan(..., aliases={{{name!r}: 'batch'}})",
                    )
                )
    return out


def no_batch_rule_note(rules: object, batch_size: int | None) -> list[PlanNote]:
    """A ``batch_replicated`` note for a rule table that never mentions the batch."""
    entries = getattr(rules, "entries", None)
    if entries is None or batch_size is None or any(k == "batch" for k, _ in entries):
        return []
    return [
        PlanNote(
            "batch_replicated",
            "the rule table has no 'batch' entry (nor an activation-batch name such as "
            "'activation_batch'): the batch is replicated on every device.",
            "add a batch rule (rules=[('batch', 'data')]) or alias the table's batch name "
            "(sk.plan(..., aliases={'my_batch': 'batch'}))",
        )
    ]


def recipe_note(
    chosen: Recipe, step_s: float, plain_step_s: float | None, plain_floor_s: float | None = None
) -> list[PlanNote]:
    """A ``recipe`` note when auto chose ``chosen`` over the plain step (whose
    best plan takes ``plain_step_s``, None when none could run or none was
    propagated; ``plain_floor_s``: the least step the plain-step plans auto did
    not propagate can take, :func:`~spmdkit.planner.candidates.step_floor`)."""
    if chosen.is_default:
        return []
    if plain_step_s is not None:
        gain = (
            f" (estimated step {fmt_time(step_s)}; the best plain-step plan: "
            f"{fmt_time(plain_step_s)})"
        )
    elif plain_floor_s is not None:
        gain = (
            f" (estimated step {fmt_time(step_s)}; the plain-step plans auto did not "
            f"propagate take {fmt_time(plain_floor_s)} or more)"
        )
    else:
        gain = " (no plain-step plan fits)"
    return [
        PlanNote(
            "recipe",
            f"auto chose the recipe '{chosen.short()}' instead of the plain step{gain}: a "
            "step written by hand (jax.value_and_grad) runs the plain step, and sk.jit "
            "refuses it for this plan.",
            "build the step from the plan (sk.train_step(info, optimizer, plan) or "
            "sk.value_and_grad(loss, plan)), or fix the recipe: "
            "sk.plan(..., recipe=sk.Recipe())",
        )
    ]


def replicated_note(
    devices: int,
    step_s: float,
    sharded: tuple[str, float] | None,
    topology: str,
) -> list[PlanNote]:
    """A ``replicated`` note: auto's plan replicates everything on ``devices``
    devices, its step ``step_s`` against the best sharded plan's ``(label,
    step)`` (None: no sharded plan could be costed), priced on ``topology``."""
    if devices <= 1:
        return []
    preset = "dp"
    if sharded is None:
        versus = "no sharded plan could be costed (no layout divides the mesh)"
    else:
        preset = sharded[0].split("+")[0] if sharded[0].split("+")[0] in PRESETS else preset
        label, sharded_s = sharded
        versus = (
            f"on {topology} the replicated step ({fmt_time(step_s)}) is estimated faster "
            f"than the best sharded plan, {label!r} ({fmt_time(sharded_s)})"
        )
    return [
        PlanNote(
            "replicated",
            f"auto keeps every parameter and the batch replicated: all {devices} devices "
            f"compute the same step; {versus}, so splitting this step's work over "
            f"{devices} devices does not pay for its collectives.",
            "run the step on fewer devices (one device does the same work: "
            "sk.make_mesh(data=1)), or give each device more work (a larger batch or "
            f"model); to run sharded anyway, plan a preset by name "
            f"(sk.plan(..., strategy={preset!r}))",
        )
    ]


def dropped_note(reasons: Mapping[str, tuple[str, str]]) -> list[PlanNote]:
    """A ``dropped`` note naming each preset auto left out of its runner-up list
    and why (``reasons``: preset → (why, a figure for it or "")), presets that
    share a reason together."""
    if not reasons:
        return []
    by_why: dict[str, list[str]] = {}
    for name, (why, figure) in reasons.items():
        by_why.setdefault(why, []).append(f"{name} ({figure})" if figure else name)
    text = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_why.items())
    return [
        PlanNote(
            "dropped",
            f"auto left {len(reasons)} preset(s) out of its runner-up list: {text}.",
            "plan a preset by name to see its table and cost (sk.plan(..., strategy=name))",
        )
    ]


#: Why a new mesh axis was split off (:func:`mesh_split_note`).
_SPLIT_FOR = {
    "pipe": " for a pipeline",
    "context": " for context parallelism",
    "expert": " for expert parallelism",
}


def mesh_split_note(given: MeshLike, planned: MeshLike) -> list[PlanNote]:
    """A ``mesh_split`` note when the plan's mesh ``planned`` has other axes than
    the mesh ``given`` to :func:`sk.plan <spmdkit.plan>` (split an axis for a
    pipeline, context or expert parallelism); none when they are the same."""
    before, after = axis_sizes(given), axis_sizes(planned)
    if before == after:
        return []
    new = [a for a in after if a not in before]
    split = [a for a in before if after.get(a) != before[a]]
    old = ", ".join(f"{a}={before[a]}" for a in split) or "the mesh"
    into = " × ".join(f"{a}={n}" for a, n in after.items() if a in new or a in split)
    reason = "".join(_SPLIT_FOR.get(a, "") for a in new)
    return [
        PlanNote(
            "mesh_split",
            f"the planner split {old} into {into}{reason}: the plan runs on its own "
            "mesh, not the one given; sk.jit, sk.init_sharded and train use plan.mesh.",
            "to keep the mesh as given, plan a rule table on it (or a preset: ep "
            "splits it only where the experts would be replicated); to plan "
            "on the split mesh yourself, pass it: "
            f"sk.make_mesh({', '.join(f'{a}={n}' for a, n in after.items())})",
        )
    ]


def absent_axes_note(dropped: Mapping[str, Sequence[str]], mesh: MeshLike) -> list[PlanNote]:
    """An ``absent_axes`` note for the mesh axes a rule table names that ``mesh``
    lacks (``dropped``: axis → the logical names whose rules named it)."""
    if not dropped:
        return []
    have = list(mesh.axis_names)
    parts, near = [], []
    for axis, names in dropped.items():
        parts.append(f"{axis!r} (in the rules for {', '.join(names)})")
        close = difflib.get_close_matches(axis, have, n=1)
        if close:
            near.append(f"{axis!r} → {close[0]!r}?")
    return [
        PlanNote(
            "absent_axes",
            f"the rule table names mesh axes the mesh ({', '.join(have)}) does not have: "
            f"{'; '.join(parts)}. They are dropped from its rules, as if the mesh had "
            "them with size 1 (as MaxText builds every mesh with all of its axes).",
            (f"did you mean {' '.join(near)} " if near else "")
            + "build the mesh with those axes, or rename them in the table to this "
            "mesh's axes",
        )
    ]


#: Mesh axis names other projects' rule tables use (MaxText's mesh axes, the role
#: names the presets know): one the mesh lacks is dropped, never taken for a typo.
FOREIGN_AXES = frozenset(
    {
        "data",
        "stage",
        "pipe",
        "fsdp",
        "fsdp_transpose",
        "sequence",
        "context",
        "context_autoregressive",
        "tensor",
        "tensor_transpose",
        "tensor_sequence",
        "expert",
        "autoregressive",
    }
).union(*ROLE_NAMES.values())

#: How alike (``difflib``'s ratio) a rule's absent axis and a mesh axis must be for
#: the one to be taken for a typo of the other (``modle``/``model`` are, ``fsdp``/
#: ``dp`` are not).
NEAR_MISS = 0.75


def refuse_typod_axes(dropped: Mapping[str, Sequence[str]], mesh: MeshLike) -> None:
    """Refuse a rule table's mesh axis that ``mesh`` lacks (``dropped``: axis → the
    logical names whose rules named it) when it is a near miss of an axis the mesh
    has and no axis name other projects use (:data:`FOREIGN_AXES`): dropping a
    typo would replicate what its rules shard.

    Raises:
      UnknownAxisError: a dropped axis is a near miss of one of ``mesh``'s axes.

    Example::

        >>> refuse_typod_axes({"modle": ("mlp",)}, sk.abstract_mesh(data=2, model=4))
        Traceback (most recent call last):
        UnknownAxisError: plan: ...; given the rule for 'mlp' names mesh axis 'modle' ...
    """
    have = list(mesh.axis_names)
    for axis, names in dropped.items():
        close = difflib.get_close_matches(axis, have, n=1, cutoff=NEAR_MISS)
        if axis in FOREIGN_AXES or not close:
            continue
        rules = ", ".join(repr(n) for n in names)
        raise UnknownAxisError(
            op="plan",
            must="the mesh axes a rule table names are axes of the mesh (one it lacks is "
            "dropped, as flax drops it, unless it looks like a typo of one it has: "
            "dropping a typo would replicate what its rules shard)",
            given=f"the rule{'s' if len(names) > 1 else ''} for {rules} name"
            f"{'' if len(names) > 1 else 's'} mesh axis {axis!r}; the mesh's axes are "
            f"{', '.join(map(repr, have))}",
            fix=f"did you mean {close[0]!r}? rename it in the rule table "
            f"(({names[0]!r}, {close[0]!r})), or build the mesh with an axis {axis!r}",
        )


#: A preset whose analytic peak is over this many budgets is not re-costed by
#: propagation in auto (the two estimates differ by far less than that).
RECOST_OVER_BUDGET = 2.0


def not_recosted(
    before: Sequence[Any], after: Sequence[Any], budget: float, base: Recipe
) -> dict[str, tuple[str, str]]:
    """Presets auto's analytic pass costed but did not re-cost by propagation
    (so they leave the runner-up list): preset → (why, its figure). ``before``
    and ``after``: the candidates (:class:`~spmdkit.planner.candidates.Candidate`)
    before and after re-costing; ``base``: the recipe the presets are re-costed
    with."""
    kept = {c.name for c in after}
    out = {}
    for name in PRESETS:
        peaks = [c.cost.peak_bytes for c in before if c.name == name and c.recipe == base]
        if name in kept or not any(c.name == name for c in before):
            continue
        if peaks and min(peaks) > RECOST_OVER_BUDGET * budget:
            out[name] = (
                f"by the analytic estimate with the '{base.short()}' step they need over "
                f"{RECOST_OVER_BUDGET:g}× the memory budget per device, and none of their "
                "other recipes ranked among the best, so they were not re-costed",
                fmt_bytes(min(peaks)),
            )
        else:
            out[name] = ("their recipes ranked below the candidates re-costed by propagation", "")
    return out


def floored_reasons(floors: Mapping[str, float]) -> dict[str, tuple[str, str]]:
    """Reasons for the ``dropped`` note of presets auto did not propagate because
    their step floor (preset → seconds, :func:`~spmdkit.planner.candidates.step_floor`)
    was above a plan it had re-costed: preset → (why, the floor)."""
    why = (
        "their step takes at least its compute time plus one collective (the batch is "
        "split over devices), above a plan re-costed by propagation, so they were not "
        "re-costed"
    )
    return {name: (why, f"≥ {fmt_time(floor)}") for name, floor in floors.items()}


def priced_only_note(topology: Any, cost: Any) -> list[PlanNote]:
    """The ``priced_only`` note of a plan priced on ``topology`` at ``cost`` (a
    :class:`~spmdkit.planner.plans.Cost` or None): one when the topology prices the
    routed experts' exchange as a form the executor does not run
    (:attr:`~spmdkit.topology.Topology.expert_exchange` ``"routed"`` or ``"node_dedup"``,
    :attr:`~spmdkit.topology.Topology.expert_overlap`), the analytic estimator
    priced it (the propagated estimate prices the all-to-alls it propagates) and
    the step has all-to-alls; none otherwise."""
    if topology is None or cost is None or not cost.comm_bytes.get("all_to_all"):
        return []
    if not cost.estimator.startswith("analytic"):
        return []
    forms = []
    if topology.expert_exchange == "routed":
        forms.append(
            "buffers of the rows routed, sized once the counts are exchanged (Megatron-LM's "
            "alltoall dispatcher)"
        )
    if topology.expert_exchange == "node_dedup":
        forms.append(
            "each token crossing the network once per node holding its experts and fanned "
            "out inside it, into buffers of the rows routed (DeepEP's normal kernels)"
        )
    if topology.expert_overlap:
        forms.append("hidden under another micro-batch's compute (1F1B all-to-all overlap)")
    if not forms:
        return []
    return [
        PlanNote(
            "priced_only",
            "the routed experts' token exchanges are priced as "
            + " and ".join(forms)
            + ", which spmdkit's executor does not run: it sends every (token, expert) copy "
            "in an all-to-all on each micro-batch's critical path, from buffers padded for "
            "the worst case, so plan.run's step is slower than this price"
            + (" and holds more memory" if topology.expert_exchange != "all_to_all" else "")
            + ".",
            "plan with a topology whose expert_exchange is 'all_to_all' and expert_overlap "
            "False (the defaults) for the price of the step spmdkit runs",
        )
    ]
