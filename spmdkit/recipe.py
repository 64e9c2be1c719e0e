"""Recipes: the training levers a plan carries besides its layouts.

A layout says where every tensor lives; a :class:`Recipe` says how the step
uses memory and time around it, as the published large-model recipes do
(torchtitan, MaxText, Megatron-LM, PaddlePaddle's auto-parallel):

- ``remat``: activation recomputation per layer (per scanned block):
  ``"none"``; ``"full"`` (keep each layer's input, recompute the layer in the
  backward pass); ``"dots"`` (selective: keep only the outputs of weight
  matmuls, ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``; the
  attention scores and elementwise temporaries are recomputed); ``"names"``
  (keep only the values tagged with ``jax.ad_checkpoint.checkpoint_name`` in
  :attr:`Recipe.save_names`).
- ``compute_dtype``: mixed precision. ``None`` computes in the parameters'
  dtype; ``"bfloat16"`` casts the (fp32 master) parameters to bf16 inside the
  step, so matmuls and activations run in bf16 while parameters, gradients and
  optimizer state stay fp32 (torchtitan's ``MixedPrecisionPolicy``, MaxText's
  ``weight_dtype`` vs ``dtype``).
- ``microbatches``: gradient accumulation: the batch is split along its batch
  dim into this many micro-batches, run one after another, gradients summed;
  activation memory is that of one micro-batch.
- ``offload_opt``: optimizer state lives in host memory (``pinned_host``) and
  moves over the host link each step.

Recipes are frozen, hashable, validate themselves and round-trip through JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax.numpy as jnp

from spmdkit.errors import SpmdError

__all__ = ["PLAIN", "REMAT_POLICIES", "Recipe", "RecipeError"]

#: The per-layer recomputation policies (module docstring).
REMAT_POLICIES = ("none", "full", "dots", "names")

#: Compute dtypes a recipe may ask for (``None``: the parameters' own dtype).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


class RecipeError(SpmdError, ValueError):
    """A recipe option is invalid, or cannot run on this model or backend."""


@dataclass(frozen=True)
class Recipe:
    """The levers of a train step besides layouts (module docstring).

    Attributes:
      remat: ``"none"``, ``"full"``, ``"dots"`` or ``"names"``.
      save_names: for ``remat="names"``, the ``checkpoint_name`` tags to keep.
      compute_dtype: ``None`` (the parameters' dtype) or a floating dtype name;
        parameters stay in their own dtype (fp32 master weights).
      microbatches: gradient-accumulation steps per train step (>= 1).
      offload_opt: keep optimizer state in host memory (``pinned_host``).

    Example::

        >>> Recipe(remat="full", compute_dtype="bfloat16", microbatches=2)
        Recipe(remat=full, bf16, microbatches=2)
    """

    remat: str = "none"
    save_names: tuple[str, ...] = ()
    compute_dtype: str | None = None
    microbatches: int = 1
    offload_opt: bool = False

    def __post_init__(self) -> None:
        if self.remat not in REMAT_POLICIES:
            raise RecipeError(
                op="Recipe",
                must=f"remat is one of {REMAT_POLICIES}",
                given=repr(self.remat),
                fix="pass remat='full' (keep layer inputs), 'dots' (keep weight-matmul "
                "outputs) or 'names' with save_names=",
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
        if self.compute_dtype is not None:
            name = jnp.dtype(self.compute_dtype).name if _is_dtype(self.compute_dtype) else None
            if name not in COMPUTE_DTYPES:
                raise RecipeError(
                    op="Recipe",
                    must=f"compute_dtype is None or one of {COMPUTE_DTYPES}",
                    given=repr(self.compute_dtype),
                    fix="pass compute_dtype='bfloat16' for bf16 compute with fp32 master weights",
                )
            object.__setattr__(self, "compute_dtype", name)
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

    @property
    def is_default(self) -> bool:
        """True when the recipe changes nothing (plain step)."""
        return self == Recipe()

    def compute_itemsize(self, param_itemsize: int) -> int:
        """Bytes per activation element: the compute dtype's, else the params'."""
        if self.compute_dtype is None:
            return param_itemsize
        return jnp.dtype(self.compute_dtype).itemsize

    def short(self) -> str:
        """Compact text, e.g. ``remat=full, bf16, microbatches=2`` (``plain`` when default)."""
        parts = []
        if self.remat != "none":
            parts.append(f"remat={self.remat}")
            if self.save_names:
                parts.append("save=" + "+".join(self.save_names))
        if self.compute_dtype is not None:
            parts.append(_DTYPE_SHORT.get(self.compute_dtype, self.compute_dtype))
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
            "compute_dtype": self.compute_dtype,
            "microbatches": self.microbatches,
            "offload_opt": self.offload_opt,
        }

    @classmethod
    def from_json(cls, d: Mapping | None) -> Recipe:
        """Inverse of :meth:`to_json` (``None``: the default recipe)."""
        if not d:
            return cls()
        return cls(
            remat=d.get("remat", "none"),
            save_names=tuple(d.get("save_names", ())),
            compute_dtype=d.get("compute_dtype"),
            microbatches=int(d.get("microbatches", 1)),
            offload_opt=bool(d.get("offload_opt", False)),
        )


#: The recipe that changes nothing: the plain step.
PLAIN = Recipe()

_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _is_dtype(x: object) -> bool:
    try:
        jnp.dtype(x)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
