"""The context-order pass: the batch as a tree, in a context-parallel plan's
balanced token order (:func:`spmdkit.context_parallel.context_parallel_loss`: each
device's chunks of every sequence so causal attention's work is even), with the
loss traced under that order (RoPE's positions, the causal mask, the planned
attention strategy). It runs first: every other pass sees the batch as the
plan lays it out."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from spmdkit.batch import as_tree
from spmdkit.context_parallel import context_parallel_loss
from spmdkit.step.passes import Step

__all__ = ["balanced_batch"]


def balanced_batch(step: Step) -> Step:
    """The context-order pass: ``fn(params, batch, *rest)`` on the batch as a tree,
    put in the plan's balanced order when the plan has context parallelism."""
    on_tree = context_parallel_loss(step.fn, step.plan)

    def user_loss(params: Any, batch: Any, *rest: Any) -> Any:
        return on_tree(params, as_tree(batch), *rest)

    return replace(step, fn=user_loss)
