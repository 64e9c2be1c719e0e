"""Host memory for a recipe's offload levers: which memory kinds a device has,
the check that the backend can offload, moving a tree between memory spaces
inside a jitted step (``offload_opt``, ``remat_offload``), and the offload pass
(:func:`offload_opt_state`: the optimizer state kept in host memory between
steps)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax

from spmdkit.errors import RecipeError
from spmdkit.step.passes import Step
from spmdkit.step.recipe import Recipe

__all__ = ["check_offload", "host_memory_kinds", "offload_opt_state", "to_memory"]


def host_memory_kinds(device: Any = None) -> frozenset[str]:
    """The memory kinds a device exposes (``device``, ``pinned_host``, ...).

    Example::

        >>> "pinned_host" in host_memory_kinds()
        True
    """
    device = device if device is not None else jax.devices()[0]
    try:
        return frozenset(m.kind for m in device.addressable_memories())
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return frozenset()


def check_offload(recipe: Recipe, device: Any = None) -> None:
    """Raise when the recipe offloads optimizer state or saved activations and
    the backend cannot.

    Raises:
      RecipeError: ``offload_opt`` or ``remat_offload`` on a backend whose
        devices have no ``pinned_host`` memory kind.
    """
    for lever, on in (("offload_opt", recipe.offload_opt), ("remat_offload", recipe.remat_offload)):
        if not on:
            continue
        kinds = host_memory_kinds(device)
        if "pinned_host" not in kinds:
            dev = device if device is not None else jax.devices()[0]
            raise RecipeError(
                op=lever,
                must="the devices expose a 'pinned_host' memory kind (JAX memory kinds)",
                given=f"{getattr(dev, 'platform', dev)} device with memory kinds {sorted(kinds)}",
                fix=f"use {lever}=False on this backend (or a backend with host memory "
                "spaces: GPU, TPU, CPU)",
            )


def to_memory(tree: Any, space: Any) -> Any:
    """Every array leaf of ``tree`` moved to a memory space inside a jitted step
    (``jax.memory.Space.Device`` / ``Host``), its sharding kept: how an offloaded
    optimizer state reaches the device for the update and goes back.

    Example::

        >>> opt_state = to_memory(opt_state, jax.memory.Space.Device)
    """
    return jax.tree.map(lambda x: jax.device_put(x, space) if hasattr(x, "shape") else x, tree)


def offload_opt_state(step: Step) -> Step:
    """The offload pass: under ``offload_opt`` the optimizer state arrives from host
    memory, moves to the device for the update and goes back; else the update is
    left as it is."""
    inner = step.update
    if inner is None or not step.recipe.offload_opt:
        return step

    def update(params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        opt_state = to_memory(opt_state, jax.memory.Space.Device)
        params, opt_state = inner(params, opt_state, grads)
        return params, to_memory(opt_state, jax.memory.Space.Host)

    return replace(step, update=update)
