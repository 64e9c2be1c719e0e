"""Rule-enforcing ops: plain JAX functions whose partitioning is the registered rule.

Each op reshards its inputs to the specs its rule requires, runs the local
computation with exactly the rule's collectives (``shard_map``; see
:mod:`spmdkit.ops.base`) and returns outputs that carry the rule's output specs;
``jax.grad`` through it yields the grad rule's specs. One module per family.

The functions are imported here eagerly: two of them share their module's name
(``attention``, ``index_put``), and binding the function after the module import
keeps ``spmdkit.ops.attention`` the function however the module was reached.
"""

from spmdkit.ops.attention import attention
from spmdkit.ops.cross_entropy import softmax_cross_entropy
from spmdkit.ops.embedding import embedding_lookup
from spmdkit.ops.index_put import index_put
from spmdkit.ops.norms import (
    batch_norm,
    group_norm,
    instance_norm,
    layer_norm,
    rms_norm,
    sync_batch_norm,
)

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
