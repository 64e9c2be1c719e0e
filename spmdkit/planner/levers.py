"""The recipes ``auto`` searches: remat policy, compute dtype, master weights, micro-batches.

:func:`auto_recipes` lists them in rounds (the second, with the optimizer state
offloaded to the host, only when nothing in the first fits). The levers that
change the numerics or the caller's parameters are searched only when asked:

- ``allow_fp8``: ``compute_dtype="float8"`` (weight matmuls on float8 operands,
  :mod:`spmdkit.step.fp8`);
- ``allow_master_weights``: ``master_weights="optimizer"`` beside each
  narrower compute dtype: bf16 parameters, the fp32 master in the optimizer
  state (:mod:`spmdkit.step.master`). The parameters a plan's step takes are then
  bf16, so a caller holding fp32 parameters must let auto change them. It is
  the lever Megatron-LM's pipelines with a distributed optimizer rely on: a
  layout that keeps the parameters whole over the data axis (``megatron+zero1``)
  holds them, and their gradients, at half the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from spmdkit.planner.analytic import ParamGroup, StepTrace
from spmdkit.planner.logical import PlanError
from spmdkit.step.recipe import NAMED_POLICIES, Recipe
from spmdkit.topology import Topology
from spmdkit.util import divisors

__all__ = ["auto_recipes", "check_fp8", "compute_choices"]


def remat_choices(trace: StepTrace) -> list[tuple[str, bool, int]]:
    """The ``(remat, remat_offload, remat_every)`` levers auto searches: ``none``, ``dots``,
    each named policy that keeps something of its own on this model (an untagged
    model's matmuls tagged by role, :mod:`spmdkit.step.matmul_roles`), ``full``, ``full`` on one
    layer in two (4 or more layers, an even count); then the offload form of each
    that keeps something. Nothing without a layer scan."""
    if not trace.layers:
        return [("none", False, 1)]
    out = [("none", False), ("dots", False)]
    seen = {(trace.saved_bytes(Recipe(remat="dots")), 0.0)}
    seen.add((0.0, trace.recompute_flops(Recipe(remat="full"))[0]))
    for name in NAMED_POLICIES:
        r = Recipe(remat=name)
        key = (trace.saved_bytes(r)[0], trace.recompute_flops(r)[0])
        if key[0] and key not in seen and (key[0], 0.0) not in seen:
            seen.add(key)
            out.append((name, False))
    out.append(("full", False))
    offloaded = [(r, True) for r, _ in out if r not in ("none", "full")]
    halves = [("full", False, 2)] if trace.layers >= 4 and trace.layers % 2 == 0 else []
    return [(r, o, 1) for r, o in out] + halves + [(r, o, 1) for r, o in offloaded]


def check_fp8(topology: Topology, peak_flops: float | None) -> None:
    """Raise when the device has no float8 matmuls (``allow_fp8`` on an A100).

    Raises:
      PlanError: the topology has no float8 peak (and no ``peak_flops`` override).
    """
    peaks = dict(topology.peak_flops)
    if "float8" not in peaks and peak_flops is None:
        raise PlanError(
            op="plan(allow_fp8=True)",
            must="the device computes in float8 (H100 and later: the topology has a float8 peak)",
            given=f"a topology with peaks for {sorted(peaks)}",
            fix="plan without allow_fp8 (bf16 compute), or for a device with float8 "
            "tensor cores (sk.Topology.h100())",
        )


def compute_choices(
    groups: Sequence[ParamGroup],
    *,
    allow_fp8: bool,
    allow_master_weights: bool,
    topology: Topology | None = None,
) -> list[tuple[str | None, str]]:
    """``(compute_dtype, master_weights)`` pairs auto tries: the parameters' own
    dtype; bf16 compute when some parameter is fp32 and the device (``topology``,
    None: any) computes bf16 faster than fp32 (a CPU does not); float8 when allowed; each
    narrower compute dtype with the fp32 master in the optimizer state too when
    ``allow_master_weights`` (and some parameter is fp32: a bf16 model has no
    master to move).

    Example::

        >>> from spmdkit.planner.analytic import ParamGroup
        >>> g = ParamGroup("w", ("w",), (4, 4), "float32", None, None, 128)
        >>> compute_choices([g], allow_fp8=False, allow_master_weights=True)
        [(None, 'params'), ('bfloat16', 'params'), ('bfloat16', 'optimizer')]
    """
    fp32 = any(np.dtype(g.dtype) == np.float32 for g in groups)
    peaks = {} if topology is None else dict(topology.peak_flops)
    fp32 = fp32 and peaks.get("bfloat16", 1.0) > peaks.get("float32", 0.0)
    dtypes: list[str | None] = [None, *(["bfloat16"] if fp32 else [])]
    if allow_fp8:
        dtypes.append("float8")
    out: list[tuple[str | None, str]] = []
    for d in dtypes:
        out.append((d, "params"))
        if d is not None and fp32 and allow_master_weights:
            out.append((d, "optimizer"))
    return out


def auto_recipes(
    trace: StepTrace,
    groups: Sequence[ParamGroup],
    *,
    allow_fp8: bool = False,
    allow_master_weights: bool = False,
    topology: Topology | None = None,
) -> list[list[Recipe]]:
    """The recipes auto tries, in rounds: each round's micro-batch counts (every
    divisor of the batch, no cap: the search stops adding them once a plan fits
    or more cannot help, :meth:`spmdkit.planner.search._Planner.analytic_candidates`,
    so the count follows the memory the step needs) are tried smallest first,
    and the second round (the optimizer state offloaded,
    with the activations' offload forms) only when no plan of the first fits
    (``spmdkit.planner.search``); ``topology``: as for :func:`compute_choices`."""
    remats = remat_choices(trace)
    choices = compute_choices(
        groups, allow_fp8=allow_fp8, allow_master_weights=allow_master_weights, topology=topology
    )
    rounds = []
    for offload in (False, True):  # activations go to the host with the optimizer
        rounds.append(
            [
                Recipe(
                    remat=r,
                    remat_offload=o,
                    remat_every=k,
                    compute_dtype=d,
                    master_weights=mw,
                    microbatches=m,
                    offload_opt=offload,
                )
                for r, o, k in remats
                if offload or not o
                for d, mw in choices
                for m in divisors(trace.batch_size)
            ]
        )
    return rounds
