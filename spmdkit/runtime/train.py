"""The training loop: a loop around the planned step.

:func:`train` runs ``steps`` optimizer steps of exactly the step ``plan.verify``
checks: ``sk.jit(sk.train_step(info, optimizer, plan), plan, donate_state=True)``
(the plan's shardings and donation, under Auto axes the enforced replay, and the
recipe's recompute, compute dtype and micro-batches inside the step).
``verify=True`` prints that step's verify table before it first runs.

One loss per model kind (:mod:`spmdkit.introspect.losses`), the same one ``describe``
and ``sk.plan`` take:

- an NNX module with ``loss(model, batch)``: its ``nnx.Param`` s are trained, its
  other variables (``nnx.BatchStat``) carried as state, its RNG streams
  (``nnx.Dropout`` 's) drawn from the step's key; all written back into it;
- a linen variables dict with ``loss(variables, batch)`` returning the loss or
  ``(loss, updates)`` as ``apply(..., mutable=[...])`` hands them out: ``params``
  is trained, the other collections are carried as state;
- a params pytree with ``loss(params, batch)``.

Any of them may return ``(loss, aux)`` (the aux values are logged) and take the
step's key as ``rng=``.

The plan is given (``plan=``), built from given shardings (``shardings=``), or,
with neither, planned here over every device and printed once: ``auto`` on the
mesh of the data's sharding, data parallel over all devices when the data has no
mesh. A given plan's notes (``plan.notes``: what it does that nobody asked for)
are printed before the first step. ``accum_steps`` is the plan's micro-batch count.

Randomness is a step input: step ``t`` gets ``fold_in(key(rng), t)`` (micro-batch
``i`` folds in ``i`` inside the step); the seed is checkpointed, so a resumed run
continues the stream: N steps, a restore, then M steps are bit-identical to N+M
uninterrupted ones on the same mesh (within float reduction-order tolerance on
another mesh).

Resume (``resume=True`` with ``ckpt=``) restores the latest checkpoint onto this
run's plan, whatever mesh it was saved on, and says what it restored (or that
there was nothing). The data continues where it stopped: a
:class:`~spmdkit.runtime.data.ShardedLoader` from its saved position, a sequence
of batches at its index, another re-iterable by replaying the consumed batches; a
one-shot iterator cannot be positioned and is refused.

Batches are trees (:mod:`spmdkit.batch`): non-tensor fields (ids, strings) ride
in the compiled step's static part, compared by structure, so they never cause a
recompile (``TrainResult.compiles`` counts the compiled steps).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmdkit.batch import is_tensor
from spmdkit.compile import PlannedFunction, jit
from spmdkit.compile.place import StateLayout, place_state, state_layout
from spmdkit.errors import CheckpointMismatchError, TrainError
from spmdkit.introspect import ModelInfo
from spmdkit.mesh import make_mesh
from spmdkit.planner import Plan
from spmdkit.planner import plan as make_plan
from spmdkit.planner.notes import quiet_notes
from spmdkit.runtime.checkpoint import Manager, Restored, tree_paths
from spmdkit.runtime.train_data import Source
from spmdkit.runtime.train_model import Parts, model_parts, with_fp8_state
from spmdkit.runtime.train_options import Checkpointing, Reporting, given
from spmdkit.step.grad import train_step
from spmdkit.step.loss import is_key
from spmdkit.step.recipe import Recipe
from spmdkit.util import path_str

__all__ = ["Checkpointing", "Reporting", "TrainError", "TrainResult", "train"]


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
      params: the trained model as it was given: the NNX module (updated in
        place), the linen variables dict (state included), or the params pytree.
      opt_state: the final optimizer state, its parameter-shaped parts (moments,
        master) in the form the parameters were given in (an ``nnx.State``'s for
        ``sk.init_sharded``'s; pure dicts for a module), as ``optimizer.init``
        makes it: the step ``planned`` takes ``params`` and ``opt_state`` together.
      step: the number of optimizer steps done in total (including restored ones).
      history: one dict per step run here: ``{"step", "loss", ...aux}``.
      start_step: the step training started from (the restored step, or 0).
      compiles: how many executables the step compiled (one per batch shape).
      model_state: the final mutable model state (batch statistics), or None for
        a model without any.
      plan: the plan the step ran (given, from ``shardings=``, or planned here).
      planned: the step that ran (``sk.jit``'s :class:`PlannedFunction`; its
        ``executables`` are what ran, ``verify`` checks them).
    """

    params: Any
    opt_state: Any
    step: int
    history: list[dict[str, Any]]
    start_step: int = 0
    compiles: int = 0
    model_state: Any = None
    plan: Plan | None = None
    planned: PlannedFunction | None = None

    @property
    def losses(self) -> list[float]:
        """The loss of every step run here, in order."""
        return [h["loss"] for h in self.history]


def train(
    loss_fn: ModelInfo | Callable[..., Any],
    model: Any,
    optimizer: optax.GradientTransformation,
    data: Any,
    *,
    steps: int,
    plan: Plan | None = None,
    shardings: tuple[Any, Any] | None = None,
    accum_steps: int = 1,
    rng: jax.Array | int = 0,
    ckpt: Manager | None = None,
    resume: bool = False,
    save_opt_state: bool = True,
    restore_opt_state: bool | None = None,
    repeat: bool = False,
    config: Any | None = None,
    verify: bool = False,
    log_every: int = 10,
    progress: bool = True,
    out: TextIO | None = None,
    checkpointing: Checkpointing | None = None,
    reporting: Reporting | None = None,
) -> TrainResult:
    """Train for ``steps`` optimizer steps (in total, counting restored ones).

    Args:
      loss_fn: the described model (``sk.describe``; its ``train_loss`` runs,
        state and RNG included), or the model's loss, one per model kind (module
        docstring): ``loss(model, batch)``, ``loss(variables, batch)`` or
        ``loss(params, batch)``; may return ``(loss, aux)`` and take the step's
        key as ``rng=``.
      model: with a described model, its values: ``sk.init_sharded(info,
        plan)``'s parameters (the state from ``info.init_state_fn()``), a linen
        variables dict, or an NNX module; with a loss, an ``nnx.Module``, a
        linen variables dict, or a params pytree. Arrays are donated: use the
        result.
      optimizer: an optax transformation.
      data: a :class:`spmdkit.runtime.data.ShardedLoader` (its position is
        checkpointed; epoch after epoch), a sequence or re-iterable of global
        batches (each once unless ``repeat``), or an iterator (not resumable).
      steps: the total number of optimizer steps to reach.
      plan: the plan (``sk.plan``); ``plan.mesh`` and ``plan.to_json()`` are
        saved in checkpoints.
      shardings: ``(param_shardings, opt_state_shardings)`` pytrees instead of a
        plan (``opt_state_shardings=None``: the optimizer state follows the
        parameters; the model state is replicated; the batch is split over the
        axes that split the data's leading dim).
      accum_steps: micro-batches per step (the plan's recipe micro-batches; a plan
        with none gets this many).
      rng: the seed (or a PRNG key) of the per-step keys, for a loss that draws
        random numbers.
      ckpt: a :class:`spmdkit.runtime.checkpoint.Manager`; saves on its interval
        and at the end.
      resume: continue from ``ckpt``'s latest complete checkpoint, if any.
      save_opt_state: checkpoints hold the optimizer state (``False``:
        parameters, RNG and data position only — for export and inference).
      restore_opt_state: on resume, restore the optimizer state (``True``: it must
        be there), start a fresh one from the restored parameters (``False``), or
        restore it when the checkpoint has one (``None``, the default).
      repeat: start a sequence or re-iterable of batches over when it runs out
        (``False``: a sequence shorter than ``steps`` is refused up front).
      config: the model config (dataclass or dict), saved in every checkpoint.
      verify: print the step's verify table (``plan.verify``) before it runs.
      log_every: steps between progress lines (and metric fetches).
      progress: print the plan made here (or a given plan's notes, before the
        first step), the restore line and progress lines (process 0 only).
      out: stream for those lines (default stderr).
      checkpointing: ``ckpt``, ``resume``, ``save_opt_state``,
        ``restore_opt_state`` and ``config`` as one value
        (:class:`~spmdkit.runtime.train_options.Checkpointing`), instead of those
        keywords.
      reporting: ``verify``, ``log_every``, ``progress`` and ``out`` as one value
        (:class:`~spmdkit.runtime.train_options.Reporting`), instead of those
        keywords.

    Returns:
      :class:`TrainResult`.

    Raises:
      TrainError: inconsistent options (one given both in ``checkpointing`` or
        ``reporting`` and as a keyword), an empty data source or one too short
        for ``steps``, a one-shot iterator to resume, a batch whose size is not
        the plan's (``plan.batch_size``), or a loss and model that cannot train
        together (``info.loss_fn`` of a model with dropout or state: pass
        ``info``).

    Example::

        >>> info = sk.describe(build, loss=loss, batch=batch)
        >>> params = sk.init_sharded(info, plan)
        >>> res = train(info, params, optax.adam(1e-3), loader, steps=100, plan=plan,
        ...             ckpt=Manager("/tmp/run", save_interval_steps=50), resume=True)
        >>> res.losses[-1]
    """
    ck = given(
        checkpointing, Checkpointing(ckpt, resume, save_opt_state, restore_opt_state, config)
    )
    report = given(reporting, Reporting(verify, log_every, progress, out))
    _check_args(steps, accum_steps, plan=plan, shardings=shardings)
    ckpt = ck.ckpt
    out = report.out if report.out is not None else sys.stderr
    show = report.progress and jax.process_index() == 0
    resume_from = ckpt if ck.resume and ckpt.latest_step() is not None else None
    source = Source(data, resuming=resume_from is not None, repeat=repeat)
    source.check_length(resume_from.latest_step() if resume_from else 0, steps)
    parts = model_parts(loss_fn, model, source.example)
    plan = _run_plan(
        parts.info, plan, shardings, accum_steps, source, optimizer, out if show else None
    )
    check_batch = functools.partial(_check_batch_size, plan)
    check_batch(source.example)
    parts = with_fp8_state(parts, plan, source.example)
    step_fn = jit(train_step(parts.info, optimizer, plan), plan, donate_state=True)
    with jax.set_mesh(step_fn.mesh):
        key = _base_key(rng, step_fn.mesh) if parts.info.rng else None
        layout = state_layout(plan, parts.params, optimizer, model_state=parts.state)
        state, restored = _initial_state(
            parts, optimizer, key, resume_from, (plan, layout), restore_opt=ck.restore_opt_state
        )
        start = restored.step if restored is not None else 0
        batches, where = source.batches(start, restored.data_state if restored else None)
        if ck.resume and show:
            out.write(_restore_line(ckpt, restored, where))
            if start >= steps:
                out.write(f"train: nothing to train: checkpoint at step {start} >= steps {steps}\n")
        batches = map(check_batch, batches)
        loop = _Loop(step_fn, batches, state, start=start, show=show, out=out)
        items = None if ck.save_opt_state else tuple(k for k in state if k != "opt_state")
        save = _saver(ckpt, plan, data, config=ck.config, items=items)
        loop.run(steps, log_every=report.log_every, ckpt=ckpt, save=save, verify=report.verify)
    # on the mesh as the user made it (as sk.init_sharded hands them out)
    final = _on_mesh(loop.state, plan.mesh)
    params, final_state = final["params"], final.get("model_state")
    return TrainResult(
        params=parts.write_back(params, final_state),
        opt_state=parts.opt_back(final["opt_state"]),
        step=loop.step,
        history=loop.history,
        start_step=loop.start,
        compiles=len(step_fn.executables),
        model_state=final_state,
        plan=plan,
        planned=step_fn,
    )


def _check_args(steps: Any, accum_steps: Any, *, plan: Any, shardings: Any) -> None:
    op = "train"
    if not isinstance(steps, int) or steps < 0:
        raise TrainError(op=op, must="steps is an int >= 0", given=repr(steps), fix="steps=100")
    if not isinstance(accum_steps, int) or accum_steps < 1:
        raise TrainError(
            op=op, must="accum_steps is a positive int", given=repr(accum_steps), fix="1 or more"
        )
    if plan is not None and shardings is not None:
        raise TrainError(
            op=op,
            must="shardings come from a plan or are given, not both",
            given="plan= and shardings=",
            fix="drop one of them",
        )
    if plan is not None and not isinstance(plan, Plan):
        raise TrainError(
            op=op,
            must="plan is an sk.plan Plan (the step sk.jit compiles for it is what runs)",
            given=type(plan).__name__,
            fix="pass sk.plan(model, mesh, ...), or shardings=(param_shardings, opt_shardings)",
        )


# -- the plan ----------------------------------------------------------------------------


def _run_plan(
    info: ModelInfo,
    plan: Plan | None,
    shardings: Any,
    accum_steps: int,
    source: Source,
    optimizer: optax.GradientTransformation,
    out: TextIO | None,
) -> Plan:
    """The plan the step runs: given (with ``accum_steps`` micro-batches), made
    from given shardings, or planned here over every device (module docstring)."""
    if plan is not None:
        if out is not None and plan.notes:
            out.write(_notes_text(plan))
        return _with_microbatches(plan, accum_steps)
    if shardings is not None:
        return _given_plan(info, shardings, source.batch_axes(), accum_steps)
    mesh = source.mesh()
    strategy = "auto" if mesh is not None else "dp"
    if mesh is None:
        mesh = make_mesh(data=jax.device_count())
    with quiet_notes():  # printed with the table below, not warned too
        made = make_plan(
            info, mesh, strategy, optimizer=optimizer, recipe=Recipe(microbatches=accum_steps)
        )
    if out is not None:
        axes = ", ".join(f"{a}={n}" for a, n in mesh.shape.items())
        out.write(
            f"train: no plan given; planned {strategy!r} over the {mesh.size} devices of "
            f"mesh ({axes}) (pass plan= to choose):\n{made.table()}\n"
        )
    return made


def _notes_text(plan: Plan) -> str:
    """The given plan's notes (``plan.notes``), as the plan's table lists them."""
    lines = [f"  - {n}" for n in plan.notes]
    return f"train: the plan has {len(lines)} note(s):\n" + "\n".join(lines) + "\n"


def _check_batch_size(plan: Plan, batch: Any) -> Any:
    """``batch``, when its ``batch`` dims have the size the plan was made for
    (a plan without a recorded size takes any)."""
    want = plan.batch_size
    if want is None:
        return batch
    for kp, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if not is_tensor(leaf) or not np.ndim(leaf):
            continue
        path = path_str(kp)
        names = tuple(plan.batch_axes.get(path) or ("batch",))
        if "batch" not in names or names.index("batch") >= np.ndim(leaf):
            continue
        got = np.shape(leaf)[names.index("batch")]
        if got != want:
            raise TrainError(
                op="train",
                must=f"every batch has the global batch size the plan was made for ({want})",
                given=f"field {path!r} of shape {tuple(np.shape(leaf))}: a batch of {got}",
                fix=f"feed batches of {want} (a loader's last_batch='drop' or 'pad' keeps "
                f"the size), or plan for batches of {got}: sk.plan(..., batch=<one of them>)",
            )
    return batch


def _with_microbatches(plan: Plan, accum_steps: int) -> Plan:
    """The plan with ``accum_steps`` micro-batches (a plan without micro-batches
    takes them; one with another count is a conflict)."""
    have = plan.recipe.microbatches
    if accum_steps in (1, have):
        return plan
    if have != 1:
        raise TrainError(
            op="train",
            must="accum_steps is 1 or the plan's micro-batch count",
            given=f"accum_steps={accum_steps}, plan.recipe.microbatches={have}",
            fix=f"drop accum_steps (the plan splits each batch into {have} micro-batches), "
            "or plan with the count you want",
        )
    recipe = dataclasses.replace(plan.recipe, microbatches=accum_steps)
    return dataclasses.replace(plan, recipe=recipe)


def _given_plan(
    info: ModelInfo, shardings: Any, batch_axes: tuple[str, ...], accum_steps: int
) -> Plan:
    """A plan holding the given parameter (and optimizer-state) shardings; the
    model state replicated, the batch over ``batch_axes``."""
    param_sh, opt_sh = shardings
    named = [s for s in jax.tree.leaves(param_sh) if isinstance(s, NamedSharding)]
    if not named:
        raise TrainError(
            op="train",
            must="shardings=(param_shardings, opt_shardings) holds NamedShardings",
            given=f"param shardings {jax.tree.structure(param_sh)}",
            fix="pass a pytree like the params of NamedSharding(mesh, P(...))",
        )
    flat = jax.tree_util.tree_flatten_with_path(param_sh)[0]
    params = {path_str(kp): s.spec for kp, s in flat}
    opt = dict(params)
    for kp, s in jax.tree_util.tree_flatten_with_path(opt_sh)[0] if opt_sh is not None else ():
        path = path_str(kp)
        for p in params:
            if (path == p or path.endswith("/" + p)) and isinstance(s, NamedSharding):
                opt[p] = s.spec
    shapes = {p.path: (p.shape, p.dtype, p.logical) for p in (*info.params, *info.state)}
    return Plan(
        named[0].mesh,
        params,
        opt,
        {"batch": batch_axes} if batch_axes else {},
        strategy="given",
        info=shapes,
        batch_axes=info.batch_axes,
        recipe=Recipe(microbatches=accum_steps),
        state={s.path: PartitionSpec() for s in info.state},
    )


# -- state, checkpoints ----------------------------------------------------------------------


def _base_key(rng: Any, mesh: Any) -> jax.Array:
    """The seed's key, one replicated copy on the mesh (a global array every
    process can save)."""
    if rng is None:
        raise TrainError(
            op="train",
            must="a loss that draws random numbers gets a seed for its per-step keys",
            given="rng=None",
            fix="pass rng=0 (or any int seed, or a jax.random.key)",
        )
    key = rng if is_key(rng) else jax.random.key(int(rng))
    return jax.device_put(key, NamedSharding(mesh, PartitionSpec()))


def _initial_state(
    parts: Parts,
    optimizer: optax.GradientTransformation,
    key: jax.Array | None,
    ckpt: Manager | None,
    where: tuple[Plan, StateLayout],
    *,
    restore_opt: bool | None = None,
) -> tuple[dict[str, Any], Restored | None]:
    """The state to start from (params, opt_state, model_state, rng) and the
    checkpoint it was restored from (None when fresh).

    With ``ckpt``: its latest checkpoint, restored onto the plan's layout
    (``where``: the plan and its :func:`~spmdkit.compile.place.state_layout`; the
    optimizer state as ``restore_opt`` says). Otherwise the given values placed
    and the optimizer state initialised (:func:`~spmdkit.compile.place.place_state`)."""
    plan, layout = where
    if ckpt is None:
        state = place_state(plan, parts.params, optimizer, model_state=parts.state, layout=layout)
        if key is not None:
            state["rng"] = key
        return state, None
    target = layout.target()
    if key is not None:
        target["rng"] = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=key.sharding)
    saved = ckpt.saved_shapes()
    if restore_opt is None:
        restore_opt = any(p.startswith("opt_state/") or p == "opt_state" for p in saved)
    if restore_opt:
        _check_opt_state(ckpt, saved, target["opt_state"], optimizer)
    items = tuple(k for k in target if restore_opt or k != "opt_state")
    restored = ckpt.restore(target=target, items=items)
    state = dict(restored.state)
    if not restore_opt:  # the restored parameters go into a fresh optimizer state
        state.update(place_state(plan, state["params"], optimizer, layout=layout))
    return state, restored


def _check_opt_state(ckpt: Manager, saved: Mapping[str, Any], target: Any, optimizer: Any) -> None:
    """Raise, in one line, when the checkpoint's optimizer state is not this
    optimizer's (another optax transformation, or another parameter set)."""
    want = {"opt_state/" + k: tuple(np.shape(v)) for k, v in tree_paths(target).items()}
    have = {k: tuple(v.shape) for k, v in saved.items() if k.startswith("opt_state/")}
    if want == have:
        return
    only_saved = sorted(set(have) - set(want))
    only_here = sorted(set(want) - set(have))
    shapes = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    diff = "; ".join(
        f"{what} {len(ks)} (e.g. {ks[0]})"
        for what, ks in (
            ("only in the checkpoint:", only_saved),
            ("only in this optimizer's:", only_here),
            ("other shapes:", shapes),
        )
        if ks
    )
    raise CheckpointMismatchError(
        op="train(resume=True)",
        must="the checkpoint's optimizer state is this optimizer's (same transformation, "
        "same parameters)",
        given=f"a checkpoint in {ckpt.directory} with {len(have)} optimizer-state arrays, "
        f"this optimizer ({type(optimizer).__name__}) has {len(want)}: {diff}",
        fix="train(..., resume=True, restore_opt_state=False) restores the parameters into "
        "a fresh optimizer state; or resume with the optimizer the checkpoint was saved with",
    )


def _restore_line(ckpt: Manager, restored: Restored | None, where: str) -> str:
    if restored is None:
        return f"train: nothing to restore in {ckpt.directory}; starting at step 0\n"
    axes = (restored.metadata.get("mesh") or {}).get("axes") or {}
    mesh = ", ".join(f"{a}={n}" for a, n in axes.items()) or "an unrecorded mesh"
    return (
        f"train: restored step {restored.step} from {ckpt.directory} "
        f"(saved on mesh ({mesh})); {where}\n"
    )


def _saver(
    ckpt: Manager | None,
    plan: Plan,
    data: Any,
    *,
    config: Any = None,
    items: tuple[str, ...] | None = None,
) -> Callable[..., Any] | None:
    """``save(step, state, force=...)`` recording the plan, its mesh, the loader
    position and the model config; with ``items``, only those top-level keys."""
    if ckpt is None:
        return None
    return functools.partial(
        ckpt.save,
        plan=plan,
        mesh=plan.mesh,
        data=data if hasattr(data, "state") else None,
        config=config,
        items=items,
    )


# -- the loop ---------------------------------------------------------------------------------


class _Loop:
    """The step loop: runs the compiled step, keeps the metric history (fetched
    every ``log_every`` steps), prints progress and saves on the manager's interval."""

    def __init__(
        self,
        step_fn: PlannedFunction,
        batches: Iterator[Any],
        state: dict[str, Any],
        *,
        start: int,
        show: bool,
        out: TextIO,
    ) -> None:
        self.step_fn, self.batches, self.state = step_fn, batches, state
        self.start = self.step = start
        self.saved: int | None = start if start else None  # the restored step counts as saved
        self.show, self.out = show, out
        self.history: list[dict[str, Any]] = []
        self.pending: list[tuple[int, Any]] = []

    def args(self, batch: Any) -> tuple:
        """The step's arguments: ``(params, opt_state[, state], batch[, key])``,
        the key ``fold_in(seed key, step)``."""
        s = self.state
        args = (s["params"], s["opt_state"])
        if "model_state" in s:
            args += (s["model_state"],)
        args += (batch,)
        if "rng" in s:
            args += (jax.random.fold_in(s["rng"], self.step),)
        return args

    def flush(self) -> None:
        for step, value in self.pending:
            loss, aux = value if isinstance(value, tuple) else (value, {})
            metrics = {"loss": loss, **(aux if isinstance(aux, Mapping) else {"aux": aux})}
            self.history.append({"step": step, **{k: _host(v) for k, v in metrics.items()}})
        self.pending.clear()

    def log(self, steps: int, t0: float) -> None:
        h = self.history[-1]
        rate = (self.step - self.start) / max(time.perf_counter() - t0, 1e-9)
        extra = "  ".join(f"{k} {v:.4g}" for k, v in h.items() if k != "step" and np.ndim(v) == 0)
        self.out.write(
            f"{_bar(self.step, steps)} step {self.step}/{steps}  {extra}  {rate:.2f} step/s\n"
        )
        self.out.flush()

    def run(
        self,
        steps: int,
        *,
        log_every: int,
        ckpt: Manager | None,
        save: Callable[..., Any] | None,
        verify: bool = False,
    ) -> None:
        t0 = time.perf_counter()
        while self.step < steps:
            args = self.args(next(self.batches))
            if verify and self.step == self.start:
                report = self.step_fn.verify(*args)
                if self.show:
                    self.out.write(f"train: the step about to run, verified:\n{report}\n")
            *new, value = self.step_fn(*args)
            self.state.update(params=new[0], opt_state=new[1])
            if len(new) == 3:
                self.state["model_state"] = new[2]
            self.step += 1
            self.pending.append((self.step, value))
            if ckpt is not None and ckpt.should_save(self.step):
                save(self.step, dict(self.state), force=False)
                self.saved = self.step
            if self.step % log_every == 0 or self.step == steps:
                self.flush()
                if self.show:
                    self.log(steps, t0)
        self.flush()
        if ckpt is not None and self.step > self.start:
            if self.saved != self.step:
                save(self.step, dict(self.state), force=True)
            ckpt.wait()


def _on_mesh(state: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """The step's outputs (on its Auto view of the plan's mesh) relabelled onto
    ``mesh`` itself, so an Explicit mesh's arrays run under ``jax.set_mesh(mesh)``
    as ``sk.init_sharded``'s do; the same devices and specs (no data moves)."""
    if not isinstance(mesh, Mesh):
        return state

    def one(x: Any) -> Any:
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh == mesh:
            return x
        if sharding.mesh.axis_names != mesh.axis_names:
            return x
        target = NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
        return jax.device_put(x, target)

    return {k: jax.tree.map(one, v) if k != "rng" else v for k, v in state.items()}


def _host(v: Any) -> Any:
    """A metric on the host: a python float for a scalar, a numpy array otherwise."""
    a = np.asarray(v)
    return float(a) if a.ndim == 0 and is_tensor(a) else a


def _bar(step: int, total: int, width: int = 20) -> str:
    filled = int(width * step / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"
