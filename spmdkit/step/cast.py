"""The compute-dtype pass: the parameters cast to the recipe's activation dtype
inside the differentiated function, so matmuls and activations run in it while
the gradients come back in the parameters' own dtype (mixed precision: fp32
master weights, bf16 compute; bfloat16 around float8's matmuls)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp

from spmdkit.step.passes import Step

__all__ = ["cast_params"]


def _cast(params: Any, dtype: str | None) -> Any:
    if dtype is None:
        return params

    def one(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(one, params)


def cast_params(step: Step) -> Step:
    """The compute-dtype pass: the loss called on its floating parameters cast to
    :attr:`~spmdkit.step.recipe.Recipe.activation_dtype` (``None``: as they are)."""
    inner, dtype = step.fn, step.recipe.activation_dtype

    def cast_loss(params: Any, batch: Any, *rest: Any) -> Any:
        return inner(_cast(params, dtype), batch, *rest)

    return replace(step, fn=cast_loss)
