"""The strategy names ``sk.plan`` takes: ``"auto"`` and the presets.

Plain data importing nothing heavy, so the command line checks ``--strategy``
before jax starts; what each preset lays out is
:func:`spmdkit.planner.logical.preset_rules`'s.
"""

from __future__ import annotations

import difflib

__all__ = ["PRESETS", "SHARDED_OPT_PRESETS", "STRATEGIES", "unknown_strategy"]

#: Preset strategies, in the order the planner tries them.
PRESETS = ("dp", "fsdp", "zero1", "zero2", "megatron", "megatron_sp", "tp_fsdp", "ep")

#: Tensor-parallel presets with their optimizer state sharded as ``zero1`` shards
#: it (Megatron-LM's distributed optimizer; :mod:`spmdkit.planner.logical`). Named
#: as strategies and searched with pipelines; the flat auto's preset list stays
#: :data:`PRESETS`.
SHARDED_OPT_PRESETS = ("megatron+zero1", "megatron_sp+zero1")

#: Every strategy name: ``"auto"`` (the search), then the presets.
STRATEGIES = ("auto", *PRESETS, *SHARDED_OPT_PRESETS)


def unknown_strategy(name: str) -> str | None:
    """``None`` when ``name`` is a strategy, else the fix to print: the near
    match, or the list.

    Example::

        >>> unknown_strategy("megatrn")
        "did you mean 'megatron'?"
        >>> unknown_strategy("fsdp") is None
        True
    """
    if name in STRATEGIES:
        return None
    near = difflib.get_close_matches(name, STRATEGIES, n=1)
    return f"did you mean {near[0]!r}?" if near else f"pick one of {', '.join(STRATEGIES)}"
