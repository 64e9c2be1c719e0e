"""Flax NNX drop-ins whose computation is a :mod:`spmdkit.ops` op.

Each module subclasses its ``flax.nnx`` namesake: the constructor and call
signatures are flax's (plus an optional ``strategy=``), the parameters have the
same names, shapes and paths (flax parameters load unchanged), and the
parameters carry logical axis names in flax's ``out_sharding`` metadata
(``norm``, ``vocab``/``embed``, ``embed``/``heads``/``head_dim``). Inside a
planned step (``sk.plan``, ``sk.jit``) each call is a region the planner lays
out with the op's rule and strategies; called on sharded arrays it applies the
rule directly.

================== ======================================= =============================
module / function  op                                      notes
================== ======================================= =============================
LayerNorm          ``layer_norm``                          trailing reduction axes
RMSNorm            ``rms_norm``                            trailing reduction axes
GroupNorm          ``group_norm`` (channels last)          flax's NHWC layout
BatchNorm          ``sync_batch_norm`` / ``batch_norm``    global statistics by default
Embed              ``embedding``                           ``attend``: one matmul
MultiHeadAttention ``attention`` (no mask, no dropout)     else flax's attention
cross_entropy      ``softmax_cross_entropy``               integer labels, mean
MoE                ``moe_experts``                         routing, losses: jnp
================== ======================================= =============================

:mod:`spmdkit.nn.linen` has the flax linen counterparts (``LayerNorm``, ``RMSNorm``,
``GroupNorm``, ``BatchNorm``, ``Embed``, ``MultiHeadDotProductAttention``): linen's
attributes and variable names.
"""

from spmdkit.nn import linen
from spmdkit.nn.embedding import Embed
from spmdkit.nn.losses import cross_entropy, softmax_cross_entropy_with_integer_labels
from spmdkit.nn.mha import MultiHeadAttention, attention_fn
from spmdkit.nn.moe import ExpertBias, MoE
from spmdkit.nn.norms import BatchNorm, GroupNorm, LayerNorm, RMSNorm

__all__ = [
    "BatchNorm",
    "Embed",
    "ExpertBias",
    "GroupNorm",
    "LayerNorm",
    "MoE",
    "MultiHeadAttention",
    "RMSNorm",
    "attention_fn",
    "cross_entropy",
    "linen",
    "softmax_cross_entropy_with_integer_labels",
]
