"""Recipes: the training levers a plan carries besides its layouts.

A layout says where every tensor lives; a :class:`Recipe` says how the step
uses memory and time around it, as the published large-model recipes do
(torchtitan, MaxText, Megatron-LM, PaddlePaddle's auto-parallel):

- ``remat``: activation recomputation per layer (per scanned block):
  ``"none"``; ``"full"`` (keep each layer's input, recompute the layer in the
  backward pass); ``"dots"`` (selective: keep only the outputs of weight
  matmuls, ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``; the
  attention scores and elementwise temporaries are recomputed); MaxText's
  named policies (:data:`NAMED_POLICIES`: ``"minimal"``,
  ``"save_dot_except_mlpwi"``, ``"save_dot_except_mlp"``, ``"save_qkv_proj"``,
  ``"save_out_proj"``), which keep the projections tagged with
  ``jax.ad_checkpoint.checkpoint_name`` under MaxText's names (the reference
  models tag them); ``"names"`` (keep the tags in :attr:`Recipe.save_names`).
- ``remat_every``: recompute one layer in ``k`` only (the first ``L/k``
  layers of the stack run under the policy, the others keep everything):
  memory and recompute time between the policy's and ``none``'s.
- ``remat_offload``: what the policy keeps goes to host memory
  (``pinned_host``) in the forward pass and comes back for the backward,
  instead of staying on the device
  (``jax.checkpoint_policies.save_and_offload_only_these_names``,
  ``offload_dot_with_no_batch_dims``).
- ``compute_dtype``: mixed precision. ``None`` computes in the parameters'
  dtype; ``"bfloat16"`` casts the (fp32 master) parameters to bf16 inside the
  step, so matmuls and activations run in bf16 while parameters, gradients and
  optimizer state stay fp32 (torchtitan's ``MixedPrecisionPolicy``, MaxText's
  ``weight_dtype`` vs ``dtype``).
- ``master_weights``: where the fp32 master copy lives: ``"params"`` (the
  parameters are it) or ``"optimizer"`` (parameters stored in bf16, the master
  in the optimizer state, sharded with it: Megatron's distributed optimizer;
  :mod:`spmdkit.step.master`).
- ``microbatches``: gradient accumulation: the batch is split along its batch
  dim into this many micro-batches, run one after another, gradients summed;
  activation memory is that of one micro-batch.
- ``offload_opt``: optimizer state lives in host memory (``pinned_host``) and
  moves over the host link each step.

Recipes are frozen, hashable, validate themselves and round-trip through JSON.

:func:`value_and_grad` makes a recipe run: it is ``jax.value_and_grad`` of the
user's loss with the levers applied to it, without editing the model:

- recompute: the loss is traced to a jaxpr and every outermost ``scan``
  equation (the scanned layers: ``nnx.scan``, ``jax.lax.scan``; also inside
  ``jit`` / closed calls) gets its body wrapped in ``jax.checkpoint`` with the
  policy, so each layer keeps only what the policy saves and is recomputed in
  the backward pass. (A ``jax.checkpoint`` around the whole loss saves nothing
  at the peak: the backward recomputes the whole forward and holds all of it.)
  A loss with no scan has no layer boundary to recompute at: a
  :class:`RecipeError` says to scan the layers (``scan_layers=True``,
  ``nnx.scan``).
- compute dtype: floating parameter leaves are cast inside the differentiated
  function, so gradients come back in the parameters' dtype.
- micro-batches: the batch is split by :func:`spmdkit.batch.microbatches` (the
  one split: rows ``i, i+n, ...``; the pipeline executor splits the same way),
  a ``lax.scan`` runs one micro-batch per step (a python loop when a non-tensor
  field is split per example), PRNG keys after the batch are folded with the
  micro-batch index, and the gradients accumulate in the parameters' dtype
  (constrained to ``grad_specs`` when given: ZeRO-2).

:func:`train_step` builds the whole step (gradients and optimizer update); the
planner traces it, ``sk.jit`` compiles it and ``train`` runs what ``sk.jit``
compiled, so what is planned is what runs. Both take a described model
(``sk.describe``) or its :class:`~spmdkit.step.loss.Loss`, which says whether the
loss carries state, returns aux or draws random numbers (then the step takes a
key last: ``step(params, opt_state, batch, key)``), or a plain function.

Mutable state (``has_state=True``): a model with batch statistics has a loss
``loss_fn(params, batch, state) -> (loss, new_state)``. The state is an input
and an output of the step, never differentiated and never seen by the
optimizer; with micro-batches it is threaded through them in order (micro-batch
``i`` reads what ``i - 1`` wrote), as consecutive steps would.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from spmdkit import jaxprs
from spmdkit.batch import as_traced, as_tree, microbatches
from spmdkit.context_parallel import ContextShard, context_parallel_loss, plan_context
from spmdkit.errors import RecipeError
from spmdkit.pipeline.execute import pipelined_value_and_grad
from spmdkit.pipeline.layer_scan import find_layer_scan
from spmdkit.pipeline.layouts import update_specs
from spmdkit.pipeline.split import CALLS
from spmdkit.spec import axis_sizes
from spmdkit.state import register_context
from spmdkit.step.fp8 import FP8_EXCLUDE, HISTORY, SCALINGS, check_exclude, fp8_loss, fp8_state
from spmdkit.step.loss import Loss, as_loss
from spmdkit.step.master import check_master_weights, check_stored, master_update
from spmdkit.step.offload import check_offload, host_memory_kinds, to_memory
from spmdkit.step.remat_scan import rematted_scan, rewrite
from spmdkit.util import path_str

__all__ = [
    "NAMED_POLICIES",
    "PLAIN",
    "REMAT_POLICIES",
    "Recipe",
    "RecipeError",
    "check_offload",
    "checkpoint_policy",
    "host_memory_kinds",
    "init_fp8_state",
    "recipe_of",
    "recipes_used",
    "remat_loss",
    "to_memory",
    "train_step",
    "value_and_grad",
]

_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")

#: MaxText's recompute policies by name (its ``remat_policy``): the
#: ``checkpoint_name`` tags each keeps, most kept first. ``minimal`` is MaxText's
#: *minimal recomputation*: every projection kept, only attention's inner
#: products and the elementwise work recomputed.
NAMED_POLICIES: dict[str, tuple[str, ...]] = {
    "minimal": (*_QKV, "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo"),
    "save_dot_except_mlpwi": (*_QKV, "out_proj", "mlpwo"),
    "save_dot_except_mlp": (*_QKV, "out_proj"),
    "save_qkv_proj": _QKV,
    "save_out_proj": ("out_proj",),
}

#: The per-layer recomputation policies (module docstring), most kept first.
REMAT_POLICIES = ("none", "dots", *NAMED_POLICIES, "full", "names")

#: Compute dtypes a recipe may ask for (``None``: the parameters' own dtype).
#: ``"float8"``: weight matmuls on float8 operands, the rest in bfloat16 (:mod:`spmdkit.step.fp8`).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float8")


@dataclass(frozen=True)
class Recipe:
    """The levers of a train step besides layouts (module docstring).

    Attributes:
      remat: one of :data:`REMAT_POLICIES`.
      save_names: for ``remat="names"``, the ``checkpoint_name`` tags to keep.
      remat_offload: what the remat policy keeps lives in host memory
        (``pinned_host``) between the forward and the backward pass.
      remat_every: recompute one layer in this many only (1: every layer); the
        layer count must divide by it, leaving two or more recomputed layers.
      compute_dtype: ``None`` (the parameters' dtype) or a floating dtype name;
        parameters stay in their own dtype (fp32 master weights).
      fp8_scaling: under ``compute_dtype="float8"``, how operands are scaled:
        ``"current"`` (each by its own amax) or ``"delayed"`` (by the amax
        history of previous steps, kept as state the step carries:
        :func:`init_fp8_state`).
      microbatches: gradient-accumulation steps per train step (>= 1).
      offload_opt: keep optimizer state in host memory (``pinned_host``).
      fp8_exclude: under ``compute_dtype="float8"``, the weight matmuls kept in
        bfloat16 (``spmdkit.step.fp8.EXCLUDABLE``): by default the LM head
        (``spmdkit.step.fp8.lm_heads``), as published recipes do; ``()``: none.
      master_weights: ``"params"`` (fp32 parameters are the master) or
        ``"optimizer"`` (parameters in bf16, the fp32 master in the optimizer
        state: :mod:`spmdkit.step.master`).

    Example::

        >>> Recipe(remat="full", compute_dtype="bfloat16", microbatches=2)
        Recipe(remat=full, bf16, microbatches=2)
    """

    remat: str = "none"
    save_names: tuple[str, ...] = ()
    remat_offload: bool = False
    remat_every: int = 1
    compute_dtype: str | None = None
    fp8_scaling: str = "current"
    microbatches: int = 1
    offload_opt: bool = False
    fp8_exclude: tuple[str, ...] = FP8_EXCLUDE
    master_weights: str = "params"

    def __post_init__(self) -> None:
        if self.remat not in REMAT_POLICIES:
            raise RecipeError(
                op="Recipe",
                must=f"remat is one of {REMAT_POLICIES}",
                given=repr(self.remat),
                fix="pass remat='full' (keep layer inputs), 'dots' (keep weight-matmul "
                "outputs), a MaxText policy (" + ", ".join(NAMED_POLICIES) + ") or 'names' "
                "with save_names=",
            )
        object.__setattr__(self, "save_names", tuple(self.save_names))
        if self.remat == "names" and not self.save_names:
            raise RecipeError(
                op="Recipe",
                must="remat='names' names the checkpoint_name tags to keep",
                given="save_names=()",
                fix="pass save_names=('attn_out', ...) or use remat='full'",
            )
        if self.save_names and self.remat != "names":
            raise RecipeError(
                op="Recipe",
                must="save_names is given only with remat='names'",
                given=f"remat={self.remat!r}, save_names={self.save_names}",
                fix="pass remat='names' or drop save_names",
            )
        object.__setattr__(self, "remat_offload", bool(self.remat_offload))
        if self.remat_offload and self.remat in ("none", "full"):
            raise RecipeError(
                op="Recipe",
                must="remat_offload is given with a policy that keeps values besides the "
                "layer input (remat='full' keeps only the input, 'none' recomputes nothing)",
                given=f"remat={self.remat!r}, remat_offload=True",
                fix="pass remat='save_qkv_proj' (or another of REMAT_POLICIES) with "
                "remat_offload=True, or drop remat_offload",
            )
        _check_every(self.remat, self.remat_every)
        if self.compute_dtype is not None:
            name = "float8" if self.compute_dtype == "float8" else None
            if name is None and _is_dtype(self.compute_dtype):
                name = jnp.dtype(self.compute_dtype).name
            if name not in COMPUTE_DTYPES:
                raise RecipeError(
                    op="Recipe",
                    must=f"compute_dtype is None or one of {COMPUTE_DTYPES}",
                    given=repr(self.compute_dtype),
                    fix="pass compute_dtype='bfloat16' for bf16 compute with fp32 master weights "
                    "('float8' for float8 weight matmuls)",
                )
            object.__setattr__(self, "compute_dtype", name)
        if self.fp8_scaling not in SCALINGS or (
            self.fp8_scaling != "current" and self.compute_dtype != "float8"
        ):
            raise RecipeError(
                op="Recipe",
                must=f"fp8_scaling is one of {SCALINGS}, and other than 'current' only "
                "with compute_dtype='float8'",
                given=f"fp8_scaling={self.fp8_scaling!r}, compute_dtype={self.compute_dtype!r}",
                fix="pass compute_dtype='float8', fp8_scaling='delayed' (or drop fp8_scaling)",
            )
        float8 = self.compute_dtype == "float8"
        exclude = check_exclude(self.fp8_exclude, "Recipe", RecipeError, float8=float8)
        object.__setattr__(self, "fp8_exclude", exclude)
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int):
            raise RecipeError(
                op="Recipe",
                must="microbatches is an int >= 1",
                given=repr(self.microbatches),
                fix="pass microbatches=1 (no accumulation) or more",
            )
        if self.microbatches < 1:
            raise RecipeError(
                op="Recipe",
                must="microbatches >= 1",
                given=str(self.microbatches),
                fix="pass microbatches=1 (no accumulation) or more",
            )
        object.__setattr__(self, "offload_opt", bool(self.offload_opt))
        check_master_weights(self.master_weights, self.compute_dtype)

    @property
    def saved_names(self) -> tuple[str, ...]:
        """The ``checkpoint_name`` tags the remat policy keeps (empty for
        ``none``, ``full`` and ``dots``, which select by primitive)."""
        return NAMED_POLICIES.get(self.remat, self.save_names)

    @property
    def is_default(self) -> bool:
        """True when the recipe changes nothing (plain step)."""
        return self == Recipe()

    @property
    def activation_dtype(self) -> str | None:
        """The dtype the step computes in besides weight matmuls: the compute dtype,
        bfloat16 under ``"float8"``, None for the parameters' own."""
        return "bfloat16" if self.compute_dtype == "float8" else self.compute_dtype

    def compute_itemsize(self, param_itemsize: int) -> int:
        """Bytes per activation element: the compute dtype's (bfloat16's under
        float8), else the params'."""
        if self.activation_dtype is None:
            return param_itemsize
        return jnp.dtype(self.activation_dtype).itemsize

    def weight_itemsize(self, param_itemsize: int) -> int:
        """Bytes per element of the copy of a weight the matmuls read (and an FSDP
        all-gather moves): 1 under float8, else :meth:`compute_itemsize`."""
        return 1 if self.compute_dtype == "float8" else self.compute_itemsize(param_itemsize)

    def short(self) -> str:
        """Compact text, e.g. ``remat=full, bf16, microbatches=2`` (``plain`` when default)."""
        parts = []
        if self.remat != "none":
            parts.append(f"remat={self.remat}" + ("→host" if self.remat_offload else ""))
            if self.remat_every > 1:
                parts.append(f"1 in {self.remat_every} layers")
            if self.save_names:
                parts.append("save=" + "+".join(self.save_names))
        if self.compute_dtype is not None:
            parts.append(_DTYPE_SHORT.get(self.compute_dtype, self.compute_dtype))
            if self.fp8_scaling == "delayed":
                parts[-1] += "(delayed)"
            if self.compute_dtype == "float8" and not self.fp8_exclude:
                parts[-1] += "(lm_head too)"
            if self.master_weights == "optimizer":
                parts.append("master→opt")
        if self.microbatches > 1:
            parts.append(f"microbatches={self.microbatches}")
        if self.offload_opt:
            parts.append("opt→host")
        return ", ".join(parts) or "plain"

    def __repr__(self) -> str:
        return f"Recipe({self.short()})"

    def to_json(self) -> dict:
        """JSON-able dict."""
        return {
            "remat": self.remat,
            "save_names": list(self.save_names),
            "remat_offload": self.remat_offload,
            "remat_every": self.remat_every,
            "compute_dtype": self.compute_dtype,
            "fp8_scaling": self.fp8_scaling,
            "microbatches": self.microbatches,
            "offload_opt": self.offload_opt,
            "fp8_exclude": list(self.fp8_exclude),
            "master_weights": self.master_weights,
        }

    @classmethod
    def from_json(cls, d: Mapping | None) -> Recipe:
        """Inverse of :meth:`to_json` (``None``: the default recipe)."""
        if not d:
            return cls()
        return cls(
            remat=d.get("remat", "none"),
            save_names=tuple(d.get("save_names", ())),
            remat_offload=bool(d.get("remat_offload", False)),
            remat_every=int(d.get("remat_every", 1)),
            compute_dtype=d.get("compute_dtype"),
            fp8_scaling=d.get("fp8_scaling", "current"),
            microbatches=int(d.get("microbatches", 1)),
            offload_opt=bool(d.get("offload_opt", False)),
            fp8_exclude=tuple(d.get("fp8_exclude", FP8_EXCLUDE)),
            master_weights=d.get("master_weights", "params"),
        )


def _check_every(remat: str, every: Any) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise RecipeError(
            op="Recipe",
            must="remat_every is an int >= 1",
            given=repr(every),
            fix="pass remat_every=1 (every layer) or 2 (one layer in two), ...",
        )
    if every > 1 and remat == "none":
        raise RecipeError(
            op="Recipe",
            must="remat_every > 1 is given with a remat policy",
            given=f"remat='none', remat_every={every}",
            fix="pass remat='full' (or another policy) with remat_every, or drop it",
        )


#: The recipe that changes nothing: the plain step.
PLAIN = Recipe()

_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8": "fp8"}


def _is_dtype(x: object) -> bool:
    try:
        jnp.dtype(x)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


# -- running a recipe ---------------------------------------------------------------


def checkpoint_policy(recipe: Recipe) -> Any:
    """The ``jax.checkpoint`` policy of the recipe's remat policy (None for ``none``);
    with ``remat_offload`` the kept values are offloaded from ``device`` to
    ``pinned_host`` memory instead of kept.

    Example::

        >>> checkpoint_policy(Recipe(remat="save_qkv_proj", remat_offload=True))
        <function save_and_offload_only_these_names.<locals>.policy at ...>
    """
    cp = jax.checkpoint_policies
    if recipe.remat == "none":
        return None
    if recipe.remat == "full":
        return cp.nothing_saveable
    if recipe.remat == "dots":
        if recipe.remat_offload:
            return cp.offload_dot_with_no_batch_dims("device", "pinned_host")
        return cp.dots_with_no_batch_dims_saveable
    names = list(recipe.saved_names)
    if recipe.remat_offload:
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=names,
            offload_src="device",
            offload_dst="pinned_host",
        )
    return cp.save_only_these_names(*names)


# the recipes of the sk.value_and_grad calls traced while a step is being checked
_SEEN: contextvars.ContextVar[list[Recipe] | None] = register_context(
    contextvars.ContextVar("spmdkit_recipes_seen", default=None),
    module=__name__,
    name="_SEEN",
    set_by="`recipes_used()` (`sk.jit`'s check)",
    read_by="`sk.value_and_grad`'s `grad_fn`, which appends its recipe",
    why="the recipes of the gradients traced inside the block.",
)


def recipe_of(recipe_or_plan: Any) -> Recipe:
    """The :class:`Recipe` of a recipe, or of a plan (anything with ``.recipe``)."""
    if isinstance(recipe_or_plan, Recipe):
        return recipe_or_plan
    recipe = getattr(recipe_or_plan, "recipe", None)
    if isinstance(recipe, Recipe):
        return recipe
    raise RecipeError(
        op="sk.value_and_grad",
        must="the second argument is a Recipe or a plan",
        given=type(recipe_or_plan).__name__,
        fix="pass sk.value_and_grad(loss, plan) or sk.value_and_grad(loss, sk.Recipe(...))",
    )


@contextlib.contextmanager
def recipes_used() -> Iterator[list[Recipe]]:
    """Collect the recipes of the :func:`value_and_grad` gradients traced inside.

    ``sk.jit`` traces a step under this to check that the step runs its plan's
    recipe (a recipe that is planned but not run would make every prediction
    wrong).

    Example::

        >>> with recipes_used() as seen:
        ...     jax.eval_shape(step, params, batch)
        >>> seen
        [Recipe(remat=full)]
    """
    seen: list[Recipe] = []
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def remat_loss(loss_fn: Callable, recipe: Recipe) -> Callable:
    """``loss_fn`` with each scanned layer recomputed per the recipe's policy.

    The loss is traced (for the arguments of each call), the layer scan's body
    (:func:`~spmdkit.pipeline.layer_scan.find_layer_scan`, the scan the planner
    and the pipeline split take too) is wrapped in ``jax.checkpoint(policy=...)``,
    and the rewritten jaxpr is evaluated; the model is not edited. ``remat="none"``
    returns ``loss_fn`` itself.

    Raises:
      RecipeError: the loss has no layer scan (its layers are a python loop), or
        runs it inside a ``jax.checkpoint``/``custom_vjp``: there is no layer
        boundary to recompute at; ``remat_offload`` on a backend without a
        ``pinned_host`` memory kind; ``remat_every`` that does not divide the
        layer count or leaves fewer than two recomputed layers.

    Example::

        >>> loss = remat_loss(model_loss, Recipe(remat="full"))
        >>> jax.grad(loss)(params, batch)  # each layer recomputed in the backward
    """
    if recipe.remat == "none":
        return loss_fn

    @functools.wraps(loss_fn)
    def rematted(*args: Any) -> Any:
        check_offload(recipe)
        closed, shape = jax.make_jaxpr(loss_fn, return_shape=True)(*args)
        layer = find_layer_scan(closed.jaxpr)
        if layer is None or any(c.primitive.name not in CALLS for c in layer.calls):
            raise RecipeError(
                op="sk.value_and_grad",
                must=f"remat={recipe.remat!r} finds the layers as a scan in the loss",
                given="a loss with no scan (layers run as a python loop: unrolled)",
                fix="scan the layers (scan_layers=True in the reference models, nnx.scan / "
                "jax.lax.scan over stacked layer params, not wrapped in jax.checkpoint), or "
                "use remat='none'",
            )
        new = rematted_scan(
            layer, checkpoint_policy(recipe), recipe.remat_every, recipe.saved_names
        )
        jaxpr = rewrite(closed.jaxpr, layer, new)
        flat = jex.jaxpr_as_fun(jaxprs.closed(jaxpr, closed.consts))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    return rematted


def _cast(params: Any, dtype: str | None) -> Any:
    if dtype is None:
        return params

    def one(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(one, params)


def _constrain(grads: Any, grad_specs: Any) -> Any:
    if grad_specs is None:
        return grads

    specs = (PartitionSpec, NamedSharding)
    is_spec = lambda x: isinstance(x, specs)  # noqa: E731
    return jax.tree.map(jax.lax.with_sharding_constraint, grads, grad_specs, is_leaf=is_spec)


def _fold_keys(rest: tuple, i: Any) -> tuple:
    """PRNG key leaves of ``rest`` folded with the micro-batch index."""

    def one(x: Any) -> Any:
        key = hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        return jax.random.fold_in(x, i) if key else x

    return jax.tree.map(one, rest)


def _plan_grad_specs(recipe_or_plan: Any, params: Any) -> Any:
    """A plan's per-path gradient specs (ZeRO-2) when it shards gradients, else None."""
    if isinstance(recipe_or_plan, Recipe) or not getattr(recipe_or_plan, "grads", None):
        return None
    mesh = recipe_or_plan.sharding_mesh
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        recipe_or_plan.grad_specs(params),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def value_and_grad(
    loss_fn: Callable[..., Any] | Loss,
    recipe: Any,
    *,
    grad_specs: Any = None,
    has_aux: bool = False,
    has_state: bool = False,
    _for_update: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad(loss_fn)`` with a recipe applied (module docstring).

    Args:
      loss_fn: ``loss_fn(params, batch, *rest)`` → scalar loss (the mean over the
        batch's examples), or ``(loss, aux)`` with ``has_aux=True``; with
        ``has_state=True``, ``loss_fn(params, batch, state, *rest)`` →
        ``(value, new_state)`` where ``value`` is as above. Or a
        :class:`~spmdkit.step.loss.Loss` (a described model's ``info.train_loss``, or
        the model itself), which carries these flags and whether it takes a key.
      recipe: a :class:`Recipe`, or a plan (its ``recipe``; its gradient specs
        when it shards gradients, ZeRO-2).
      grad_specs: a tree like the params of ``PartitionSpec`` / ``NamedSharding``
        the gradients are constrained to (accumulated in, with micro-batches);
        ``None``: the plan's, if a plan is given, else unconstrained.
      has_aux: as for ``jax.value_and_grad``; with micro-batches ``aux`` is the
        mean over them.
      has_state: the loss takes the model's mutable state after the batch and
        returns it updated (module docstring); it is not differentiated.

    A plan with a ``pipeline`` runs its layer stack pipelined over the pipe axis
    (:func:`spmdkit.pipeline.execute.pipelined_value_and_grad`; the pipeline's
    micro-batches, not the recipe's).

    Returns:
      ``f(params, batch, *rest) -> (loss, grads)`` (``((loss, aux), grads)``);
      with ``has_state``, ``f(params, batch, state, *rest) -> ((value,
      new_state), grads)``, ``new_state`` in the dtypes of ``state``.
      Gradients have the params' dtypes whatever the compute dtype. With
      micro-batches the batch is split by :func:`spmdkit.batch.microbatches`
      (micro-batch ``i`` takes rows ``i, i+n, ...``; a non-tensor field with one
      item per example is split too, and the micro-batches then run unrolled),
      PRNG-key leaves of ``rest`` are folded with ``i``, other ``rest`` leaves
      reach every micro-batch; the loss is the mean of the micro-batch losses,
      the gradient the mean of theirs (the full batch's, for a mean loss).

    Raises:
      RecipeError: the loss has no scanned layers to recompute, or a batch leaf
        does not divide into the micro-batches.
      LossError: a loss that draws random numbers is called without a key.

    Example::

        >>> grad_fn = sk.value_and_grad(loss, Recipe(remat="full", microbatches=2))
        >>> loss_value, grads = grad_fn(params, batch)
    """
    rcp = recipe_of(recipe)
    loss = as_loss(loss_fn, has_state=has_state, has_aux=has_aux)

    on_tree = context_parallel_loss(loss.fn, recipe)  # a CP plan's balanced order

    def user_loss(params: Any, batch: Any, *rest: Any) -> Any:
        return on_tree(params, as_tree(batch), *rest)

    delayed = rcp.fp8_scaling == "delayed"
    pipe = getattr(recipe, "pipeline", None)
    f8 = fp8_loss(user_loss, rcp.fp8_scaling, rcp.fp8_exclude)
    if delayed:
        _check_delayed(loss, pipe)
        inner = remat_loss(lambda p, b, state, *r: f8(state, p, b, *r), rcp)
    else:
        inner = remat_loss(f8 if rcp.compute_dtype == "float8" else user_loss, rcp)

    def cast_loss(params: Any, batch: Any, *rest: Any) -> Any:
        return inner(_cast(params, rcp.activation_dtype), batch, *rest)

    if loss.has_state:
        vg = _state_value_and_grad(cast_loss, loss.has_aux)
    elif delayed:
        vg = _delayed_value_and_grad(cast_loss, loss.has_aux)
    else:
        vg = jax.value_and_grad(cast_loss, has_aux=loss.has_aux)
    if pipe is not None:
        _check_pipelined(loss, pipe, rcp)
        # the plan pipelines its layer stack over its pipe axis (spmdkit.pipeline.execute)
        batch_axes = tuple(getattr(recipe, "activation", {}).get("batch", ()))
        where = (recipe.sharding_mesh, batch_axes, _plan_layouts(recipe, _for_update))
        context = {**_pipelined_context(recipe), **_pipelined_experts(recipe)}
        vg = _pipelined(cast_loss, pipe, where, loss.has_aux, context)

    def grad_fn(params: Any, batch: Any, *rest: Any) -> tuple[Any, Any]:
        seen = _SEEN.get()
        if seen is not None:
            seen.append(rcp)
        loss.check_key(rest, op="sk.value_and_grad", call="grad_fn(params, batch, key)")
        specs = grad_specs if grad_specs is not None else _plan_grad_specs(recipe, params)
        if rcp.microbatches == 1:
            out, grads = vg(params, as_traced(batch), *rest)
            return out, _constrain(grads, specs)
        if loss.has_state or delayed:
            return _accumulate_state(vg, rcp.microbatches, specs, params, batch, rest)
        return _accumulate(vg, rcp.microbatches, specs, params, batch, rest)

    grad_fn.recipe = rcp  # type: ignore[attr-defined]
    return functools.wraps(loss.fn)(grad_fn)


def _check_delayed(loss: Loss, pipe: Any) -> None:
    """Delayed float8 scaling's state is the step's only state, and the step is
    not pipelined."""
    if loss.has_state or pipe is not None:
        what = "mutable model state" if loss.has_state else f"a pipeline ({pipe!r})"
        raise RecipeError(
            op="sk.value_and_grad",
            must="with fp8_scaling='delayed' the loss carries no mutable model state of "
            "its own and the plan has no pipeline (the amax histories are the step's state)",
            given=f"{loss!r} with {what}",
            fix="use Recipe(compute_dtype='float8') (current scaling), which needs no state",
        )


def _delayed_value_and_grad(loss: Callable, has_aux: bool) -> Callable:
    """``f(params, batch, state, *rest) -> ((value, new_state), grads)`` for delayed
    float8 scaling: ``state`` holds the amax histories (:func:`init_fp8_state`),
    and its gradient is the updated histories (``spmdkit.step.fp8.fp8_dot_delayed``)."""
    vg = jax.value_and_grad(loss, argnums=(0, 2), has_aux=has_aux)

    def f(params: Any, batch: Any, state: Any, *rest: Any) -> tuple[tuple[Any, Any], Any]:
        value, (grads, new_state) = vg(params, batch, state, *rest)
        return (value, new_state), grads

    return f


def init_fp8_state(
    loss_fn: Callable[..., Any] | Loss,
    params: Any,
    batch: Any,
    *rest: Any,
    history: int = HISTORY,
    exclude: Sequence[str] = FP8_EXCLUDE,
) -> dict[str, jax.Array]:
    """The amax histories a step with ``Recipe(compute_dtype="float8",
    fp8_scaling="delayed")`` carries, initially empty (zeros: the first step scales
    as current scaling does): one ``float32[..., 3, history]`` per weight matmul
    of the loss (``spmdkit.step.fp8.fp8_state``). The step takes and returns it as
    state: ``step(params, opt_state, fp8_state, batch) -> (params, opt_state,
    fp8_state, loss)``.

    Args:
      loss_fn: as for :func:`value_and_grad` (a loss without state of its own).
      params: the step's parameters (arrays or shape structs).
      batch: the step's batch (arrays or shape structs).
      *rest: the loss's other arguments, if any.
      history: amax steps kept per operand (the scale's window).
      exclude: the recipe's ``fp8_exclude`` (what it keeps in bf16 has no history).

    Example::

        >>> state = init_fp8_state(info, params, batch)
        >>> params, opt_state, state, loss = step(params, opt_state, state, batch)
    """
    loss = as_loss(loss_fn)
    kw = {"history": history, "exclude": exclude}
    return fp8_state(lambda p, b, *r: loss.fn(p, as_tree(b), *r), params, batch, *rest, **kw)


def _check_pipelined(loss: Loss, pipe: Any, recipe: Recipe) -> None:
    """A pipelined plan's loss carries no model state and draws no random numbers
    (its micro-batches would share one key); its stages recompute every layer alike."""
    if recipe.remat_every != 1:
        raise RecipeError(
            op="sk.value_and_grad",
            must="a pipelined plan recomputes every layer of its stages alike",
            given=f"remat_every={recipe.remat_every} with {pipe!r}",
            fix="pass remat_every=1 with a pipeline, or plan without one",
        )
    if loss.has_state or loss.rng:
        what = "mutable model state" if loss.has_state else "random numbers (a key)"
        raise RecipeError(
            op="sk.value_and_grad",
            must="a pipelined plan's loss carries no mutable model state and takes no key",
            given=f"{loss!r}: {what}, with {pipe!r}",
            fix="plan without a pipeline, or keep the state and dropout out of the pipelined loss",
        )


def _plan_layouts(plan: Any, update: bool = False) -> Callable[[Any], tuple[Any, Any]]:
    """``params -> (param specs, grad specs)`` of a plan (what the pipeline takes as
    given at its inputs and reduce-scatters its gradients to); ``update``: for the
    optimizer update (:func:`spmdkit.pipeline.layouts.update_specs`)."""
    grads = functools.partial(update_specs, plan) if update else plan.grad_specs
    return lambda params: (plan.param_specs(params), grads(params))


def _pipelined_context(plan: Any) -> dict[str, Any]:
    """A pipelined plan's context parallelism, as the executor takes it: its axes,
    strategy and order, and per batch field the dim named ``seq``."""
    cp = plan_context(plan)
    if cp is None:
        return {}
    sizes = axis_sizes(plan.sharding_mesh)
    shard = ContextShard(
        tuple(cp.axes), tuple(sizes[a] for a in cp.axes), cp.load_balanced, cp.attention
    )
    names = dict(getattr(plan, "batch_axes", {}))
    seq = {k: tuple(v).index("seq") for k, v in names.items() if "seq" in tuple(v)}
    return {"context": shard, "seq_dims": seq}


def _pipelined_experts(plan: Any) -> dict[str, Any]:
    """A pipelined plan's routed experts, as the executor takes them: per parameter,
    the dim its logical names call ``expert`` (None for the others)."""
    info = getattr(plan, "info", None) or {}
    if not any("expert" in tuple(names or ()) for _, _, names in info.values()):
        return {}

    def dims(params: Any) -> Any:
        def one(kp: tuple, x: Any) -> int | None:
            path = path_str(kp)  # the plan's path, or the longest one it ends with
            ends = (p for p in info if path.endswith("/" + p))
            key = path if path in info else max(ends, key=len, default=None)
            names = tuple(info[key][2] or ()) if key is not None else ()
            return names.index("expert") if "expert" in names else None

        return jax.tree_util.tree_map_with_path(one, params)

    return {"experts": dims}


def _pipelined(
    loss: Callable, pipe: Any, where: tuple, has_aux: bool, context: dict[str, Any]
) -> Callable:
    """The pipelined gradient (``where``: the mesh and the batch's axes;
    ``context``: its context parallelism); with ``has_aux``, an aux with no arrays
    (train's empty metrics) passes through, any other is a :class:`RecipeError`."""
    if not has_aux:
        return pipelined_value_and_grad(loss, pipe, *where, **context)
    if pipe.return_output:
        raise RecipeError(
            op="sk.value_and_grad",
            must="has_aux=False when the pipeline returns the last stage's outputs",
            given=f"has_aux=True with {pipe!r}",
            fix="drop has_aux (the value is then (loss, outputs)) or pass return_output=False",
        )
    vg = pipelined_value_and_grad(lambda *a: loss(*a)[0], pipe, *where, **context)

    def f(*args: Any) -> tuple:
        aux = jax.eval_shape(loss, *args)[1]
        if jax.tree.leaves(aux):
            raise RecipeError(
                op="sk.value_and_grad",
                must="a pipelined plan's loss returns no aux arrays (the head and loss "
                "run per micro-batch on the last stage)",
                given=f"aux {jax.tree.structure(aux)}",
                fix="return the loss alone, and compute metrics in an evaluation step",
            )
        value, grads = vg(*args)
        return (value, aux), grads

    return f


def _state_value_and_grad(loss: Callable, has_aux: bool) -> Callable:
    """``f(params, batch, state, *rest) -> ((value, new_state), grads)`` for a loss
    returning ``(value, new_state)``: the new state rides as ``jax.value_and_grad``'s
    aux (not differentiated) and comes back in the dtypes of ``state``."""

    def split(params: Any, batch: Any, state: Any, *rest: Any) -> tuple[Any, tuple[Any, Any]]:
        value, new_state = loss(params, batch, state, *rest)
        new_state = jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), new_state, state)
        loss_value, aux = value if has_aux else (value, None)
        return loss_value, (aux, new_state)

    vg = jax.value_and_grad(split, has_aux=True)

    def f(params: Any, batch: Any, state: Any, *rest: Any) -> tuple[tuple[Any, Any], Any]:
        (loss_value, (aux, new_state)), grads = vg(params, batch, state, *rest)
        value = (loss_value, aux) if has_aux else loss_value
        return (value, new_state), grads

    return f


def _accumulate_state(
    vg: Callable, n: int, specs: Any, params: Any, batch: Any, rest: tuple
) -> tuple[Any, Any]:
    """:func:`_accumulate` for a loss with state: the state is threaded through the
    micro-batches in order (the scan's carry) and returned as the last one left it."""
    state, others = rest[0], rest[1:]

    def step(params: Any, mb: Any, carried: Any, *more: Any) -> tuple[Any, Any, Any]:
        (value, new_state), grads = vg(params, mb, carried, *more)
        return value, grads, new_state

    value, grads, state = _accumulate(step, n, specs, params, batch, others, state=state)
    return (value, state), grads


def _accumulate(
    vg: Callable,
    n: int,
    specs: Any,
    params: Any,
    batch: Any,
    rest: tuple,
    *,
    state: Any = None,
) -> Any:
    """Run ``vg`` over ``n`` micro-batches (:func:`spmdkit.batch.microbatches`) in a
    ``lax.scan``, or a python loop when they differ in non-tensor values; the
    mean loss and gradients, summed in the parameters' dtype."""
    mb = microbatches(batch, n, op="sk.value_and_grad", error=RecipeError)
    carried = (state,) if state is not None else ()

    def run(i: Any, rows: list, st: Any) -> Any:
        return vg(params, as_traced(mb.batch(i, rows)), *st, *_fold_keys(rest, i))

    out_shape = jax.eval_shape(lambda st, rows: run(0, rows, st), carried, mb.rows(0))[0]

    def add(carry: tuple, i: Any, rows: list) -> tuple:
        gsum, osum, *st = carry
        got = run(i, rows, st)
        out, grads = got[:2]
        gsum = _constrain(jax.tree.map(jnp.add, gsum, grads), specs)
        return (gsum, jax.tree.map(jnp.add, osum, out), *got[2:])

    carry = (
        _constrain(jax.tree.map(jnp.zeros_like, params), specs),
        jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out_shape),
        *carried,
    )
    if mb.unrolled:
        for i in range(n):
            carry = add(carry, i, mb.rows(i))
    else:
        xs = (jnp.arange(n), list(mb.stacked))
        carry, _ = jax.lax.scan(lambda c, x: (add(c, *x), None), carry, xs)
    gsum, osum, *st = carry
    grads = jax.tree.map(lambda g: (g / n).astype(g.dtype), gsum)
    out = jax.tree.map(lambda o: (o / n).astype(o.dtype), osum)
    if state is not None:
        return out, _constrain(grads, specs), st[0]
    return out, _constrain(grads, specs)


def train_step(
    loss_fn: Callable[..., Any] | Loss,
    optimizer: Any,
    recipe: Any,
    *,
    grad_specs: Any = None,
    has_state: bool = False,
) -> Callable[..., tuple[Any, ...]]:
    """``step(params, opt_state, batch, *rest) -> (params, opt_state, value)`` for a recipe.

    With state (``has_state=True``, or a described model with batch statistics,
    module docstring): ``step(params, opt_state, state, batch, *rest) ->
    (params, opt_state, state, value)``; the state is updated by the loss, not by
    the optimizer. Delayed float8 scaling (``Recipe(compute_dtype="float8",
    fp8_scaling="delayed")``) makes the amax histories that state
    (:func:`init_fp8_state`). ``rest`` reaches the loss after the batch (and state): a loss
    that draws random numbers takes the step's key there (micro-batch ``i``
    gets it folded with ``i``). ``value`` is the loss, or ``(loss, aux)`` for a
    loss with aux.

    The gradients come from :func:`value_and_grad` (recompute, compute dtype,
    micro-batches, gradient specs); with ``offload_opt`` the optimizer state
    arrives from host memory, moves to the device for the update and goes back.
    ``sk.jit`` compiles it and ``train`` runs exactly that; the planner traces the
    same function of the described model's loss.

    Args:
      loss_fn: a described model (``sk.describe(...)``; its ``train_loss``), a
        :class:`~spmdkit.step.loss.Loss`, or ``loss_fn(params, batch, *rest)`` →
        scalar mean loss (with ``has_state``: ``loss_fn(params, batch, state,
        *rest) -> (loss, new_state)``).
      optimizer: an optax ``GradientTransformation``.
      recipe: a :class:`Recipe` or a plan.
      grad_specs: as for :func:`value_and_grad`.
      has_state: the loss carries mutable model state.

    Raises:
      LossError: the loss draws random numbers and the step gets no key.

    Example::

        >>> step = sk.jit(train_step(info, optax.adam(1e-3), plan), plan, donate_state=True)
        >>> params, opt_state, loss_value = step(params, opt_state, batch, key)
    """
    rcp = recipe_of(recipe)
    loss = as_loss(loss_fn, has_state=has_state)
    pipe = getattr(recipe, "pipeline", None)
    if pipe is not None and pipe.return_output:
        raise RecipeError(
            op="sk.train_step",
            must="a training step's pipeline has return_output=False (the step returns "
            "the loss; the last stage's outputs are for evaluation)",
            given=f"{pipe!r}",
            fix="use sk.value_and_grad(loss, plan), which returns ((loss, outputs), grads), "
            "or plan the step with Pipeline(..., return_output=False)",
        )
    grad_fn = value_and_grad(loss, recipe, grad_specs=grad_specs, _for_update=True)
    stateful = loss.has_state or rcp.fp8_scaling == "delayed"
    call = "step(params, opt_state, " + ("state, " if stateful else "") + "batch, key)"

    def update(params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        if rcp.offload_opt:
            opt_state = to_memory(opt_state, jax.memory.Space.Device)
        if rcp.master_weights == "optimizer":  # fp32 master updated, then cast down
            params, opt_state = master_update(optimizer, grads, opt_state, params)
        else:
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
        if rcp.offload_opt:
            opt_state = to_memory(opt_state, jax.memory.Space.Host)
        return params, opt_state

    def step(params: Any, opt_state: Any, batch: Any, *rest: Any) -> tuple[Any, Any, Any]:
        loss.check_key(rest, op="sk.train_step", call=call)
        check_stored(params, rcp, op="sk.train_step")
        value, grads = grad_fn(params, batch, *rest)
        params, opt_state = update(params, opt_state, grads)
        return params, opt_state, value

    def state_step(
        params: Any, opt_state: Any, state: Any, batch: Any, *rest: Any
    ) -> tuple[Any, Any, Any, Any]:
        loss.check_key(rest, op="sk.train_step", call=call)
        check_stored(params, rcp, op="sk.train_step")
        (value, state), grads = grad_fn(params, batch, state, *rest)
        params, opt_state = update(params, opt_state, grads)
        return params, opt_state, state, value

    out = state_step if stateful else step
    out.recipe = rcp  # type: ignore[attr-defined]
    out.loss = loss  # type: ignore[attr-defined]
    return out
