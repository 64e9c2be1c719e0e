"""Rule-enforcing ops: plain JAX functions whose partitioning is the registered rule.

Each op reshards its inputs to the specs its rule requires, runs the local
computation with exactly the rule's collectives and returns outputs that carry
the rule's output specs; ``jax.grad`` through it yields the grad rule's specs.
One module per family; names are resolved lazily so importing ``spmdkit.ops``
stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public op name -> module (inside ``spmdkit.ops``) that defines it
_OPS = {
    "rms_norm": "norms",
    "layer_norm": "norms",
    "group_norm": "norms",
    "instance_norm": "norms",
    "batch_norm": "norms",
    "sync_batch_norm": "norms",
    "softmax_cross_entropy": "cross_entropy",
    "embedding_lookup": "embedding",
    "index_put": "index_put",
    "attention": "attention",
}

__all__ = [
    "attention",
    "batch_norm",
    "embedding_lookup",
    "group_norm",
    "index_put",
    "instance_norm",
    "layer_norm",
    "rms_norm",
    "softmax_cross_entropy",
    "sync_batch_norm",
]


def __getattr__(name: str) -> Any:
    module = _OPS.get(name)
    if module is None:
        raise AttributeError(f"module 'spmdkit.ops' has no attribute {name!r}")
    return getattr(importlib.import_module(f"spmdkit.ops.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
