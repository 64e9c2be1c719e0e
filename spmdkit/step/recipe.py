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
  models tag them), and ``"save_out_proj_experts"``: ``save_out_proj`` plus the
  buffers the routed experts' forward exchanged (``moe_experts``' kept
  residuals, tagged ``moe_experts``), so the backward reruns attention, its
  projections and the dense MLPs but neither the experts' forward nor its token
  exchange (the nearest to Megatron-LM's ``recompute_modules=["mla_up_proj",
  "mlp"]``, which keeps the routed experts); ``"names"`` (keep the tags in
  :attr:`Recipe.save_names`).
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
This module is the value and the names its fields take; the step that runs one
is :mod:`spmdkit.step.grad` (``sk.value_and_grad``, ``sk.train_step``), each
lever a pass of its own module (:mod:`spmdkit.step`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from spmdkit.errors import RecipeError, SpmdError

__all__ = [
    "COMPUTE_DTYPES",
    "EXCLUDABLE",
    "FP8_EXCLUDE",
    "LM_HEAD",
    "MASTER_WEIGHTS",
    "NAMED_POLICIES",
    "PLAIN",
    "REMAT_POLICIES",
    "SCALINGS",
    "Recipe",
    "RecipeError",
    "check_exclude",
    "check_master_weights",
    "checkpoint_policy",
]

_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")

#: MaxText's recompute policies by name (its ``remat_policy``): the
#: ``checkpoint_name`` tags each keeps, most kept first. ``minimal`` is MaxText's
#: *minimal recomputation*: every projection kept, only attention's inner
#: products and the elementwise work recomputed. ``save_out_proj_experts`` (not
#: MaxText's) adds the routed experts' exchanged buffers to ``save_out_proj``
#: (module docstring); on a model without routed experts it keeps the same.
NAMED_POLICIES: dict[str, tuple[str, ...]] = {
    "minimal": (*_QKV, "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo"),
    "save_dot_except_mlpwi": (*_QKV, "out_proj", "mlpwo"),
    "save_dot_except_mlp": (*_QKV, "out_proj"),
    "save_qkv_proj": _QKV,
    "save_out_proj": ("out_proj",),
    "save_out_proj_experts": ("out_proj", "moe_experts"),
}

#: The per-layer recomputation policies (module docstring), most kept first.
REMAT_POLICIES = ("none", "dots", *NAMED_POLICIES, "full", "names")

#: Compute dtypes a recipe may ask for (``None``: the parameters' own dtype).
#: ``"float8"``: weight matmuls on float8 operands, the rest in bfloat16 (:mod:`spmdkit.step.fp8`).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float8")


#: The scalings the float8 lever (:func:`~spmdkit.step.fp8.fp8_loss`) runs:
#: ``"current"`` (each tensor by its own amax) and ``"delayed"`` (by the amax
#: history of previous steps).
SCALINGS = ("current", "delayed")

#: The name :func:`~spmdkit.step.fp8.fp8_loss`'s ``exclude`` gives the LM head
#: (:func:`~spmdkit.step.fp8.lm_heads`).
LM_HEAD = "lm_head"
#: What ``exclude`` may name: the matmuls that can stay in bfloat16.
EXCLUDABLE = (LM_HEAD,)
#: What ``Recipe(compute_dtype="float8")`` keeps in bfloat16 by default: the LM
#: head, as NeMo / Megatron-LM (its output layer is no Transformer Engine layer)
#: and torchtitan (torchao's float8 converter skips ``output``) do.
FP8_EXCLUDE = (LM_HEAD,)

#: Where the fp32 master copy of the parameters lives (:mod:`spmdkit.step.master`):
#: ``"params"`` (the parameters are the master; the step casts a compute copy) or
#: ``"optimizer"`` (parameters in the compute dtype, the master in the optimizer
#: state).
MASTER_WEIGHTS = ("params", "optimizer")


def check_exclude(
    exclude: Sequence[str], op: str, error: type[SpmdError] = SpmdError, float8: bool = True
) -> tuple[str, ...]:
    """``exclude`` as a tuple of :data:`EXCLUDABLE` names (``float8``: the recipe
    computes in float8; without, only the default :data:`FP8_EXCLUDE` is allowed).

    Raises:
      SpmdError: (``error``) a name that is not one of them, a bare string, or
        another value than the default without float8."""
    if isinstance(exclude, str) or any(n not in EXCLUDABLE for n in exclude):
        raise error(
            op=op,
            must="the matmuls kept out of float8 (exclude, Recipe.fp8_exclude) are a tuple "
            f"of names, each one of {EXCLUDABLE}",
            given=repr(exclude),
            fix="pass fp8_exclude=('lm_head',) (the default: the LM head in bfloat16) or "
            "fp8_exclude=() (every weight matmul in float8)",
        )
    exclude = tuple(dict.fromkeys(exclude))
    if exclude != FP8_EXCLUDE and not float8:
        raise error(
            op=op,
            must="fp8_exclude other than the default only with compute_dtype='float8'",
            given=f"fp8_exclude={exclude!r} without float8",
            fix="pass compute_dtype='float8' with fp8_exclude, or drop fp8_exclude",
        )
    return exclude


def check_master_weights(master_weights: object, compute_dtype: str | None) -> str:
    """Validate a recipe's ``master_weights`` against its compute dtype.

    Raises:
      RecipeError: a value outside :data:`MASTER_WEIGHTS`, or ``"optimizer"``
        without a low-precision compute dtype (the parameters would be stored in
        fp32 anyway).
    """
    if master_weights not in MASTER_WEIGHTS:
        raise RecipeError(
            op="Recipe",
            must=f"master_weights is one of {MASTER_WEIGHTS}",
            given=repr(master_weights),
            fix="pass master_weights='optimizer' (bf16 parameters, fp32 master in the "
            "optimizer state) or 'params' (fp32 parameters: the default)",
        )
    if master_weights == "optimizer" and compute_dtype in (None, "float32"):
        raise RecipeError(
            op="Recipe",
            must="master_weights='optimizer' is given with a low-precision compute dtype "
            "(the parameters are stored in it)",
            given=f"compute_dtype={compute_dtype!r}",
            fix="pass compute_dtype='bfloat16' (or 'float8') with master_weights='optimizer'",
        )
    return str(master_weights)


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
        :func:`spmdkit.step.grad.init_fp8_state`).
      microbatches: gradient-accumulation steps per train step (>= 1).
      offload_opt: keep optimizer state in host memory (``pinned_host``).
      fp8_exclude: under ``compute_dtype="float8"``, the weight matmuls kept in
        bfloat16 (:data:`EXCLUDABLE`): by default the LM head
        (:func:`spmdkit.step.fp8.lm_heads`), as published recipes do; ``()``: none.
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
