"""``sk.jit``: compile a step with a plan's shardings, donation and activation constraints.

:func:`jit` wraps ``jax.jit``. Each positional argument of the step has a *role*
that decides its shardings:

- ``"params"``: a params (or grads) pytree → the plan's param specs;
- ``"opt_state"``: an optax state → the plan's optimizer specs;
- ``"batch"``: a batch → the plan's batch specs (``Plan.batch_spec``), and the
  step's body starts with a sharding constraint on it (``with_sharding_constraint``
  under Auto axes, ``jax.sharding.reshard`` under Explicit axes);
- ``"state"``: the model's mutable state (batch statistics) → the plan's state
  specs (``Plan.state_specs``); an input and an output of a step, never
  differentiated;
- ``"grads"``: a gradients pytree → the plan's gradient specs
  (``Plan.grad_specs``: the param specs, or ZeRO-2's sharded ones); never
  inferred (a gradient tree looks like a params tree): pass it in ``out_roles``;
- ``"replicated"``: every leaf replicated.

Roles not given are inferred per argument on the first call: a tree whose leaf
paths are param paths is ``params``; one whose leaf paths are the plan's state
paths is ``state``; a tree whose leaf paths end with param paths
is ``opt_state``; otherwise ``batch`` (scalars replicated). Outputs get the same
treatment (grads and new params: param specs; new state: state specs; new
optimizer state: optimizer specs; scalars replicated).

By default the step is compiled on the plan's mesh with **Auto** axes: Shardy
propagates shardings between the annotated boundaries, so any model compiles.
A plan whose recipe is not the default (:class:`spmdkit.step.recipe.Recipe`:
recompute, compute dtype, micro-batches, optimizer offload) is never silently
ignored: the step is traced once to collect the recipes of the
:func:`spmdkit.step.grad.value_and_grad` gradients it takes, and a step that takes
none, or takes them with another recipe, is a :class:`~spmdkit.step.recipe.RecipeError`
telling to build the gradient with ``sk.value_and_grad(loss, plan)`` (or the
whole step with ``sk.train_step(loss, optimizer, plan)``). With
``offload_opt`` the ``opt_state`` arguments and outputs live in host memory
(``pinned_host``; the step moves them to the device for the update).

``axis_types="explicit"`` keeps Explicit axes (the model must then be written for
sharding-in-types: contracting a sharded dim needs ``out_sharding=``).

Under Auto axes the step is also **enforced** (``enforce=True``, the default):
the step is traced, propagated with spmdkit's rules
(:func:`spmdkit.propagation.propagate`), and compiled from a replay of its
equations with every operand and result pinned to the propagated layout
(:mod:`spmdkit.compile.enforce`). The compiled program then moves what the plan
predicts (``plan.verify``, which runs :meth:`PlannedFunction.verify`:
:mod:`spmdkit.verification.planned`); ``enforce=False`` leaves the choice to XLA.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.batch import as_traced, as_tree
from spmdkit.compile.enforce import enforced
from spmdkit.errors import SpmdError
from spmdkit.pipeline.schedule import PipelineError
from spmdkit.planner.logical import PlanError
from spmdkit.planner.plans import Plan
from spmdkit.propagation import Propagation, propagate
from spmdkit.step.fp8 import STATE_PREFIX
from spmdkit.step.grad import recipes_used
from spmdkit.step.loss import LossError, placeholder_keys
from spmdkit.step.offload import check_offload
from spmdkit.step.recipe import RecipeError
from spmdkit.topology import topology_for
from spmdkit.util import path_str
from spmdkit.verification.compiled import VerifyReport
from spmdkit.verification.planned import verify_plan

__all__ = ["ROLES", "STATE_ROLES", "PlannedFunction", "UnplannedBatchWarning", "infer_role", "jit"]

#: Argument roles, each with its own shardings (module docstring).
ROLES = ("params", "opt_state", "state", "grads", "batch", "replicated")
#: Roles that ``donate_state=True`` donates.
STATE_ROLES = ("params", "opt_state", "state")


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    return [(path_str(kp), x) for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def infer_role(plan: Plan, tree: Any) -> str:
    """The role of one argument tree (module docstring).

    Example::

        >>> infer_role(plan, params)
        'params'
    """
    leaves = [(p, x) for p, x in _leaves_with_paths(tree) if np.ndim(x) > 0]
    if not leaves:
        return "replicated"
    params = plan.params
    if all(p in params for p, _ in leaves):
        return "params"
    if plan.state and all(p in plan.state for p, _ in leaves):
        return "state"
    if plan.state and all(p in params or p in plan.state for p, _ in leaves):
        raise SpmdError(
            op="sk.jit",
            must="parameters and the model's mutable state are separate arguments",
            given="one argument holding both (e.g. linen's whole variables dict: params "
            "and batch_stats)",
            fix="pass params (info.init_fn()) and state (info.init_state_fn()) as two "
            "arguments, as info.loss_fn(params, batch, state) takes them",
        )
    if any(any(p.endswith("/" + q) for q in params) for p, _ in leaves):
        return "opt_state"
    if all(p.startswith(STATE_PREFIX) for p, _ in leaves):
        return "replicated"  # delayed float8 scaling's amax histories (spmdkit.step.fp8)
    return "batch"


def _specs(plan: Plan, role: str, tree: Any, *, output: bool = False) -> Any:
    if role == "params":
        return plan.param_specs(tree)
    if role == "opt_state":
        return plan.opt_specs(tree)
    if role == "state":
        return plan.state_specs(tree)
    if role == "grads":
        return plan.grad_specs(tree)
    if role == "batch":
        if not output:
            return plan.batch_specs(tree)

        def one(kp: tuple, x: Any) -> P:
            try:
                return plan.batch_spec(path_str(kp), np.shape(x))
            except PlanError:
                return P()

        return jax.tree_util.tree_map_with_path(one, tree)
    return jax.tree.map(lambda _: P(), tree)


def _run_mesh(plan: Plan, mesh: Mesh | None, axis_types: str) -> Mesh:
    target = mesh if mesh is not None else plan.mesh
    if not isinstance(target, Mesh):
        raise PlanError(
            op="sk.jit",
            must="the plan's mesh has devices (a jax Mesh)",
            given=f"{type(target).__name__} {tuple(target.axis_names)}",
            fix="pass mesh=sk.make_mesh(...) with the same axes, or plan.on(real_mesh)",
        )
    if axis_types not in ("auto", "explicit"):
        raise SpmdError(
            op="sk.jit",
            must="axis_types is 'auto' or 'explicit'",
            given=repr(axis_types),
            fix="pass axis_types='auto' (default) or 'explicit'",
        )
    kind = AxisType.Auto if axis_types == "auto" else AxisType.Explicit
    if all(t == kind for t in target.axis_types):
        return target
    return Mesh(target.devices, target.axis_names, axis_types=(kind,) * len(target.axis_names))


class _Jitted(NamedTuple):
    """One argument signature's ``jax.jit`` and the specs it was made with."""

    jitted: Callable
    in_specs: tuple
    out_specs: Any
    roles: tuple[str, ...]
    in_shardings: tuple


class PlannedFunction:
    """A step compiled with a plan (what :func:`jit` returns).

    Call it like the step. Attributes after the first call (or :meth:`shardings`):
    ``in_roles``, ``in_specs``, ``out_specs``. :meth:`lower` gives jax's
    ``Lowered`` for reports, :meth:`place` puts arguments where the plan wants
    them, :meth:`verify` compares the compiled step with its prediction; ``fn`` is
    the undecorated step.

    Args:
      fn: the step.
      plan: the plan.
      in_roles: as for :func:`jit`.
      out_roles: as for :func:`jit`.
      donate_argnums: as for :func:`jit`.
      mesh: as for :func:`jit`.
      axis_types: as for :func:`jit`.
      constrain: as for :func:`jit`.
      enforce: as for :func:`jit`.
      donate_state: also donate every argument whose role is ``params``,
        ``opt_state`` or ``state`` (:data:`STATE_ROLES`); :attr:`donate_argnums` includes them
        once the roles are known (first call, :meth:`program` or :meth:`lower`).
    """

    def __init__(
        self,
        fn: Callable,
        plan: Plan,
        *,
        in_roles: Sequence[str | None] | None,
        out_roles: Sequence[str | None] | str | None,
        donate_argnums: Sequence[int],
        mesh: Mesh | None,
        axis_types: str,
        constrain: bool,
        enforce: bool = True,
        donate_state: bool = False,
    ) -> None:
        self.fn = fn
        self.plan = plan
        self.mesh = _run_mesh(plan, mesh, axis_types)
        self.axis_types = axis_types
        self._in_roles = None if in_roles is None else tuple(in_roles)
        self._out_roles = out_roles
        self.donate_argnums = tuple(donate_argnums)
        self.donate_state = donate_state
        self.constrain = constrain
        self.enforce = enforce and axis_types == "auto"
        self._compiled: dict[Hashable, _Jitted] = {}
        self._out_role_cache: dict[Hashable, tuple[str, ...] | str] = {}
        self._programs: dict[Hashable, tuple[Callable, Propagation]] = {}
        # argument signature → shardings() (one trace of the step per signature)
        self._shardings: dict[Hashable, tuple[tuple, Any, tuple[str, ...]]] = {}
        self._executables: dict[Hashable, jax.stages.Compiled] = {}
        # pytree structure → (executable, (shape, dtype, sharding) of each placed leaf)
        self._fast: dict[Any, tuple[jax.stages.Compiled, tuple]] = {}
        self._warned_sizes: set[int] = set()  # batch sizes warned as unplanned
        self.__name__ = getattr(fn, "__name__", "step")
        self.__doc__ = getattr(fn, "__doc__", None)

    # -- shardings ---------------------------------------------------------------------
    def _roles(self, args: tuple) -> tuple[str, ...]:
        if self._in_roles is not None:
            if len(self._in_roles) != len(args):
                raise SpmdError(
                    op="sk.jit",
                    must=f"one role per positional argument ({len(args)})",
                    given=f"in_roles={self._in_roles}",
                    fix=f"pass in_roles with {len(args)} entries from {ROLES} or None",
                )
            return tuple(
                r or infer_role(self.plan, a) for r, a in zip(self._in_roles, args, strict=True)
            )
        return tuple(infer_role(self.plan, a) for a in args)

    def _donation(self, roles: tuple[str, ...]) -> tuple[int, ...]:
        """The donated arguments for these roles (with ``donate_state``, the state
        arguments join :attr:`donate_argnums`)."""
        if self.donate_state:
            state = {i for i, r in enumerate(roles) if r in STATE_ROLES}
            self.donate_argnums = tuple(sorted(set(self.donate_argnums) | state))
        return self.donate_argnums

    def shardings(self, *args: Any) -> tuple[tuple, Any, tuple[str, ...]]:
        """``(in_specs, out_specs, in_roles)`` for these arguments (abstract ones suffice)."""
        args = _abstract(_traced(args))
        key = self._key(args)
        hit = self._shardings.get(key)
        if hit is None:
            roles, in_specs = self._in_specs(args)
            with recipes_used() as seen, placeholder_keys() as fixed:
                out_shape = jax.eval_shape(self._body(roles, in_specs), *args)
            hit = self._outs(key, roles, in_specs, out_shape, seen, fixed)
        return hit

    def _in_specs(self, args: tuple) -> tuple[tuple[str, ...], tuple]:
        """The arguments' roles and in specs."""
        roles = self._roles(args)
        for r in roles:
            if r not in ROLES:
                raise SpmdError(
                    op="sk.jit",
                    must=f"roles are one of {ROLES}",
                    given=repr(r),
                    fix="fix in_roles",
                )
        return roles, tuple(_specs(self.plan, r, a) for r, a in zip(roles, args, strict=True))

    def _outs(
        self,
        key: Hashable,
        roles: tuple[str, ...],
        in_specs: tuple,
        out_shape: Any,
        seen: list,
        fixed: list,
    ) -> tuple[tuple, Any, tuple[str, ...]]:
        """The checks on one trace of the step (its recipe, its keys), then
        :meth:`shardings`' answer from its outputs, remembered per signature."""
        self._check_recipe(seen)
        if fixed:
            raise LossError(
                op="sk.jit",
                must="a step that draws random numbers takes a key per step",
                given=f"{self.__name__} runs {fixed[0]}, which draws from one fixed "
                "placeholder key (every step would reuse one dropout mask)",
                fix="build the step from the described model: sk.train_step(info, optimizer, "
                "plan) (or sk.value_and_grad(info, plan)) and pass a key per step",
            )
        self._out_role_cache[key] = self._out_role_list(out_shape)
        hit = (in_specs, self._out_specs(out_shape), roles)
        self._shardings[key] = hit
        return hit

    def _check_recipe(self, seen: list) -> None:
        """The step runs the plan's recipe (module docstring)."""
        recipe = self.plan.recipe
        if recipe.is_default and all(r == recipe for r in seen):
            return
        wrong = sorted({repr(r) for r in seen if r != recipe})
        if not seen or wrong:
            raise RecipeError(
                op="sk.jit",
                must=f"the step runs the plan's recipe {recipe!r}",
                given=f"a step taking gradients with {', '.join(wrong)}"
                if wrong
                else f"{self.__name__}: no sk.value_and_grad gradient in it",
                fix="build the step's gradient with sk.value_and_grad(loss, plan) (or the "
                "whole step with sk.train_step(loss, optimizer, plan)), or plan with the "
                "recipe the step runs",
            )
        check_offload(recipe, self.mesh.devices.flat[0])

    def _out_role_list(self, out: Any) -> tuple[str, ...] | str:
        """The role of each output (a tuple for a tuple output, else one role)."""
        roles = self._out_roles
        if isinstance(out, tuple) and not hasattr(out, "_fields"):
            given = (roles,) * len(out) if roles is None or isinstance(roles, str) else roles
            return tuple(r or infer_role(self.plan, o) for o, r in zip(out, given, strict=True))
        return (roles if isinstance(roles, str) else None) or infer_role(self.plan, out)

    def _out_specs(self, out: Any) -> Any:
        roles = self._out_role_list(out)
        if isinstance(roles, tuple):
            return tuple(
                _specs(self.plan, r, o, output=True) for o, r in zip(out, roles, strict=True)
            )
        return _specs(self.plan, roles, out, output=True)

    def _kind(self, role: str) -> str | None:
        """The memory kind of a role's arrays: optimizer state offloaded to the host
        when the plan's recipe says so, else the device's default."""
        return "pinned_host" if role == "opt_state" and self.plan.recipe.offload_opt else None

    def _placed(self, specs: Any, roles: tuple[str, ...] | str) -> Any:
        """NamedShardings for per-role spec trees (a tuple of them, or one)."""
        if isinstance(roles, tuple):
            return tuple(self._named(s, self._kind(r)) for s, r in zip(specs, roles, strict=True))
        return self._named(specs, self._kind(roles))

    def _constraint(self, x: jax.Array, spec: P) -> jax.Array:
        sharding = NamedSharding(self.mesh, spec)
        if self.axis_types == "explicit":
            return jax.sharding.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)

    def _body(self, roles: tuple[str, ...], in_specs: tuple) -> Callable:
        fn = self.fn

        def body(*args: Any) -> Any:
            if self.constrain:
                args = tuple(
                    jax.tree.map(self._constraint, a, s, is_leaf=lambda x: x is None)
                    if r == "batch"
                    else a
                    for a, s, r in zip(args, in_specs, roles, strict=True)
                )
            return fn(*(as_tree(a) for a in args))

        return body

    def _named(self, specs: Any, kind: str | None = None) -> Any:
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s, memory_kind=kind), specs, is_leaf=_is_spec
        )

    def _key(self, args: tuple) -> Hashable:
        return jax.tree.structure(args), tuple(
            (np.shape(x), str(getattr(x, "dtype", type(x)))) for x in jax.tree.leaves(args)
        )

    # -- programs and executables --------------------------------------------------------
    def program(self, *args: Any) -> tuple[Callable, Propagation]:
        """``(body, propagation)`` for these (abstract or concrete) arguments: the
        function that is compiled and the :class:`~spmdkit.propagation.Propagation`
        of the step (the body is pinned to it unless ``enforce=False`` or the axes
        are Explicit, where the body is the step itself)."""
        args = _abstract(_traced(args))
        key = self._key(args)
        hit = self._programs.get(key)
        if hit is None:
            with _building():
                hit = self._program(key, args)
        return hit

    def _program(self, key: Hashable, args: tuple) -> tuple[Callable, Propagation]:
        """:meth:`program` for arguments not seen yet (remembered under ``key``)."""
        # one trace of the step gives the output shapes (so the out specs) and
        # the jaxpr propagated (jax.jit traces once too; this used to trace it
        # for eval_shape, then for propagate, then eval_shape again in _jitted)
        with jax.set_mesh(self.mesh):
            roles, in_specs = self._in_specs(args)
        body = self._body(roles, in_specs)
        with recipes_used() as seen, placeholder_keys() as fixed:
            closed, out_shape = jax.make_jaxpr(body, return_shape=True)(
                *jax.tree.map(_unweak, args)  # as propagate traces a function
            )
        in_specs, out_specs, roles = self._outs(key, roles, in_specs, out_shape, seen, fixed)
        prop = propagate(
            closed,
            *args,
            out_tree=jax.tree.structure(out_shape),
            in_specs=in_specs,
            mesh=self.mesh,
            out_specs=out_specs,
            # priced on the devices it runs on, as sk.plan prices a plan for them
            topology=topology_for(self.mesh),
            donate_argnums=self._donation(roles),
            arg_roles=tuple(r if r in (*STATE_ROLES, "batch") else "other" for r in roles),
        )
        # the arguments arrive in their in specs (in_shardings), but the optimizer
        # state a recipe offloads, which is in host memory: that is pinned as before
        placed = [
            self._kind(r) is None
            for r, a in zip(roles, args, strict=True)
            for _ in jax.tree.leaves(a)
        ]
        hit = (enforced(prop, placed) if self.enforce else body, prop)
        self._programs[key] = hit
        return hit

    def _jitted(self, args: tuple) -> _Jitted:
        args = _traced(args)
        key = self._key(args)
        hit = self._compiled.get(key)
        if hit is None:
            # the program first: its trace of the step also gives the shardings
            program = self.program(*args)[0] if self.enforce else None
            with jax.set_mesh(self.mesh):
                in_specs, out_specs, roles = self.shardings(*args)
            donate = self._donation(roles)
            body = program if program is not None else self._body(roles, in_specs)
            with jax.set_mesh(self.mesh):
                out_roles = self._out_role_cache[key]
                in_sh = self._placed(in_specs, roles)
            _check_stack_split(self.plan, args, in_sh)
            with jax.set_mesh(self.mesh):
                jitted = jax.jit(
                    body,
                    in_shardings=in_sh,
                    out_shardings=self._placed(out_specs, out_roles),
                    donate_argnums=donate,
                )
            hit = _Jitted(jitted, in_specs, out_specs, roles, in_sh)
            self._compiled[key] = hit
            self._warn_unplanned(args, roles)
        return hit

    def _warn_unplanned(self, args: tuple, roles: tuple[str, ...]) -> None:
        """Warn (once per size) when compiling for a batch size the plan was not
        made for: its shardings still apply, but its costs, memory and verify
        table are for ``plan.batch_size``."""
        want = self.plan.batch_size
        sizes = {
            n
            for a, r in zip(args, roles, strict=True)
            if r == "batch"
            for n in _batch_dims(self.plan, a)
        }
        for got in sorted(sizes - {want} - self._warned_sizes) if want is not None else ():
            self._warned_sizes.add(got)
            warnings.warn(
                UnplannedBatchWarning(
                    f"sk.jit({self.__name__}): compiling another executable for a batch of "
                    f"{got}; the plan was made for batches of {want}, so this one runs the "
                    "plan's shardings at a size whose memory and collectives were not "
                    "costed or verified. A final short batch is fine (one extra compile); "
                    f"for many, plan with a batch of {got} (sk.plan(..., batch=...)) or keep "
                    f"the size ({want}: a loader's last_batch='drop' or 'pad')"
                ),
                stacklevel=4,
            )

    @property
    def in_specs(self) -> tuple | None:
        """In specs of the most recent compilation (None before the first call); a
        batch tree's specs in its own shape (its non-tensor leaves as they are)."""
        if not self._compiled:
            return None
        return tuple(as_tree(s) for s in next(reversed(self._compiled.values())).in_specs)

    @property
    def out_specs(self) -> Any:
        """Out specs of the most recent compilation (None before the first call)."""
        return next(reversed(self._compiled.values())).out_specs if self._compiled else None

    def jitted(self, *args: Any) -> Callable:
        """The underlying ``jax.jit`` object for these argument shapes."""
        return self._jitted(args).jitted

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """``jax.stages.Lowered`` for these (concrete or abstract) arguments."""
        args = _abstract(_traced(args))
        with _building():
            jitted = self._jitted(args).jitted
            with jax.set_mesh(self.mesh):
                return jitted.lower(*args)

    def compile(self, *args: Any) -> jax.stages.Compiled:
        """The ``jax.stages.Compiled`` executable for these (concrete or abstract)
        arguments, compiled once: calls of this function run it, and
        :meth:`verify` reads its HLO and memory, so checking a step never
        compiles it a second time."""
        args = _traced(args)
        key = self._key(args)
        hit = self._executables.get(key)
        if hit is None:
            with _building():
                hit = self._executables[key] = self.lower(*args).compile()
        return hit

    def verify(self, *args: Any, bytes_tol: float = 0.1, mem_tol: float = 0.2) -> VerifyReport:
        """Predicted vs compiled collectives and memory of this step for ``args``
        (:func:`spmdkit.verification.verify_plan`; what ``plan.verify(step, ...)``
        runs).

        Example::

            >>> step = sk.jit(jax.value_and_grad(loss), plan)
            >>> step.verify(params, batch).ok
            True
        """
        return verify_plan(self.plan, self, *args, bytes_tol=bytes_tol, mem_tol=mem_tol)

    # -- calls -------------------------------------------------------------------------
    def place(self, *args: Any) -> tuple:
        """The arguments where the plan puts them: every leaf on the
        ``NamedSharding`` of its in spec (:meth:`shardings`) on :attr:`mesh`; leaves
        already placed so are kept, others (numpy arrays, other layouts) are
        ``jax.device_put``.

        Example::

            >>> params, batch = step.place(params, numpy_batch)
        """
        args = _traced(args)
        in_shardings = self._jitted(args).in_shardings
        return tuple(
            jax.tree.map(self._place, a, sh, is_leaf=lambda x: x is None)
            for a, sh in zip(args, in_shardings, strict=True)
        )

    @property
    def executables(self) -> dict[Hashable, jax.stages.Compiled]:
        """The executables compiled so far, one per argument signature (what calls
        run and :meth:`verify` reads)."""
        return dict(self._executables)

    def __call__(self, *args: Any) -> Any:
        args = _traced(args)
        leaves, tree = jax.tree.flatten(args)
        fast = self._fast.get(tree)
        if fast is not None and _placed_as(leaves, fast[1]):
            # the steady state of a training loop: arrays already where the plan puts
            # them (the previous step's outputs), so no spec lookup or placement
            with jax.set_mesh(self.mesh):
                return fast[0](*args)
        placed = self.place(*args)
        executable = self.compile(*placed)
        self._fast[tree] = (
            executable,
            tuple(
                (x.shape, x.dtype, getattr(x, "sharding", None))
                for x in jax.tree.leaves(tuple(placed))
            ),
        )
        with jax.set_mesh(self.mesh):
            return executable(*placed)

    def _place(self, x: Any, target: NamedSharding) -> Any:
        current = getattr(x, "sharding", None)
        if current is not None and _same_place(current, target, np.ndim(x)):
            return x
        return jax.device_put(x, target)


def _check_stack_split(plan: Plan, args: tuple, in_sh: Any) -> None:
    """An uneven pipeline layout's stacked parameters split over the pipe axis only
    where it divides them: jax places no array on a sharding that does not divide
    it. The plan stores a stack whose layer count the pipe axis does not divide
    split on another dim (:mod:`spmdkit.pipeline.stored`); one with no dim the
    axis divides (a per-layer scalar) keeps the split on its layers and cannot
    be placed.

    Raises:
      PipelineError: a stacked parameter with a dim the pipe axis does not divide.
    """
    pipe = plan.pipeline
    if pipe is None or not pipe.uneven:
        return
    sizes = dict(plan.mesh.shape)
    shardings = jax.tree.leaves(in_sh, is_leaf=lambda s: s is None or isinstance(s, NamedSharding))
    leaves = jax.tree.leaves_with_path(args)
    for (path, x), sh in zip(leaves, shardings, strict=True):
        if not isinstance(sh, NamedSharding):
            continue
        for n, part in zip(np.shape(x), sh.spec, strict=False):
            axes = () if part is None else (part,) if isinstance(part, str) else tuple(part)
            if pipe.axis in axes and n % int(np.prod([sizes[a] for a in axes])):
                raise PipelineError(
                    op="sk.jit",
                    must="under an uneven layout the axes that split a stacked parameter "
                    "divide its dim (jax places no array on an uneven split; a stack "
                    "whose layers the pipe axis does not divide is stored split on "
                    "another dim, where one takes it)",
                    given=f"{path_str(path[1:])}: shape {np.shape(x)}, {n} over {axes}, "
                    f"layout {pipe.layout}",
                    fix=f"plan with a pipe axis that divides {n} (its size or a layout "
                    "over fewer stages), or give the parameter a dim it divides; the "
                    "plan is priced as given but cannot be placed",
                )


class UnplannedBatchWarning(UserWarning):
    """``sk.jit`` compiled a step for a batch size the plan was not made for
    (``plan.batch_size``): one more executable, whose memory and collectives the
    plan did not cost.

    Broken example: a plan made for batches of 8, a step called on a batch of 5.
    """


@contextlib.contextmanager
def _building() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a step's executable is built
    (traced, propagated, replayed, lowered, compiled), and resumed after (left
    as it was when the caller had paused it). A build allocates tens of
    thousands of short-lived objects (tracers, jaxprs, specs) that reference
    counting frees; their allocations alone set off full collections, each a
    walk of every object of a jax process (hundreds of thousands), for a build
    whose cycles the next collection after it frees anyway."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _batch_dims(plan: Plan, batch: Any) -> set[int]:
    """The sizes of the ``batch`` dims of a batch argument's arrays (by the
    plan's batch axes; a field it does not name has the batch dim first)."""
    sizes = set()
    for kp, leaf in jax.tree_util.tree_flatten_with_path(as_tree(batch))[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        names = tuple(plan.batch_axes.get(path_str(kp)) or ("batch",))
        if shape and "batch" in names and names.index("batch") < len(shape):
            sizes.add(int(shape[names.index("batch")]))
    return sizes


def _traced(args: tuple) -> tuple:
    """The arguments as the compiled step takes them: a batch tree with non-tensor
    leaves (ids, strings) as one :class:`spmdkit.batch.Batch` node, whose static
    part never enters the cache key by value (the body hands the step the tree)."""
    return tuple(as_traced(a) for a in args)


def _unweak(x: Any) -> Any:
    """An array leaf as a plain ``ShapeDtypeStruct`` (no weak type, no sharding)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    return x


def _abstract(args: tuple) -> tuple:
    """Shapes and dtypes of the arrays among ``args``, without their shardings:
    what the step is traced and lowered from (``in_shardings`` place them), so an
    array on the user's Explicit mesh traces as the plan's Auto layout would."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray):
            weak = bool(getattr(x, "weak_type", False))
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=weak)
        return x

    return jax.tree.map(one, args)


def _placed_as(leaves: list, want: tuple) -> bool:
    """Whether every leaf is a device array with the shape, dtype and sharding
    its placed counterpart had (a numpy array or scalar never is)."""
    if len(leaves) != len(want):
        return False
    for x, (shape, dtype, sharding) in zip(leaves, want, strict=True):
        got = getattr(x, "sharding", None)
        if got is None or sharding is None:
            return False
        if x.shape != shape or x.dtype != dtype or not _same_place(got, sharding, len(shape)):
            return False
    return True


def _same_place(got: Any, want: Any, ndim: int) -> bool:
    """Whether an array placed by ``got`` is where ``want`` puts it: the same
    sharding, or one that differs only in its mesh's axis types (the user's
    Explicit mesh and sk.jit's Auto view of it: the executable takes it as is)."""
    return got is want or got == want or got.is_equivalent_to(want, ndim)


def jit(
    fn: Callable | None = None,
    plan: Plan | None = None,
    *,
    in_roles: Sequence[str | None] | None = None,
    out_roles: Sequence[str | None] | str | None = None,
    donate_argnums: Sequence[int] = (),
    donate_state: bool = False,
    mesh: Mesh | None = None,
    axis_types: str = "auto",
    constrain: bool = True,
    enforce: bool = True,
) -> PlannedFunction | Callable[[Callable], PlannedFunction]:
    """``jax.jit`` with the plan's in/out shardings, donation and batch constraints.

    Args:
      fn: the step (positional pytree arguments). Omit it to use as a decorator:
        ``@sk.jit(plan=plan)``.
      plan: the :class:`spmdkit.planner.Plan`.
      in_roles: role per positional argument (module docstring); None entries
        (or None) are inferred.
      out_roles: role per output element, one role for all, or None to infer.
      donate_argnums: arguments whose buffers XLA may reuse.
      donate_state: also donate every ``params`` / ``opt_state`` / ``state``
        argument (for a step returning the new state).
      mesh: the device mesh (default: the plan's; needed when the plan was made
        on an abstract mesh).
      axis_types: ``"auto"`` (default) or ``"explicit"`` (module docstring).
      constrain: put sharding constraints on batch arguments inside the step.
      enforce: under Auto axes, pin every equation to the layouts spmdkit's
        propagation chose (module docstring); False lets XLA choose.

    Returns:
      A :class:`PlannedFunction`.

    Example::

        >>> step = sk.jit(train_step, plan, donate_state=True)
        >>> params, opt_state, loss = step(params, opt_state, batch)
    """
    if plan is None:
        raise SpmdError(
            op="sk.jit",
            must="a plan is given",
            given="plan=None",
            fix="pass sk.jit(step, plan) or @sk.jit(plan=plan)",
        )

    def wrap(f: Callable) -> PlannedFunction:
        return PlannedFunction(
            f,
            plan,
            in_roles=in_roles,
            out_roles=out_roles,
            donate_argnums=donate_argnums,
            mesh=mesh,
            axis_types=axis_types,
            constrain=constrain,
            enforce=enforce,
            donate_state=donate_state,
        )

    return wrap if fn is None else wrap(fn)
