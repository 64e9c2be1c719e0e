"""The step-time model against published runs: one table, the fit written down.

Every row is a published training run (model, devices, mesh, recipe, tokens/s per
GPU and memory where published) beside what spmdkit's analytic model predicts for
the same layout and recipe on abstract meshes, and their ratio. Tokens/s/GPU =
global tokens per step / step time / GPUs.

Procedure (``docs/recipes.md``, "Step-time model and calibration"):

1. Each software stack has one free constant, the ceiling a large GEMM reaches
   (``matmul_efficiency``); the rest (peaks, HBM bandwidth, tiles, links) are
   datasheet figures and the attention kernels' published rates.
2. The JAX/XLA stack's ceiling is fitted (bisection) so that MaxText's Llama 2
   70B on 64 H100s is predicted exactly; the eager PyTorch stack's so that
   torchtitan's Llama 3.1 8B on 8 H100s is, and the compiled PyTorch stack's
   (``torch.compile``: elementwise chains fused, the same attention kernel) so
   that the compiled run of the same is. Every other row is a hold-out. A row
   outside its tolerance stays in the table as a miss, with the reason
   (``miss``), rather than moving a constant.
   The pipelined rows (NeMo, Megatron-Bridge) run Megatron-LM's distributed
   optimizer: ``megatron_sp+zero1`` (optimizer state sharded over the data and
   context axes, :data:`spmdkit.planner.logical.SHARDED_OPT_PRESETS`), with bf16
   parameters and the fp32 master in that state (``master_weights="optimizer"``).
3. Rows whose recipe lies outside the planner's search space are priced at the
   nearest recipe in it and marked (``in_space: false``, with the reason).
4. ``auto``: ``sk.plan(..., "auto", pipeline="auto")`` within 80 GiB on the
   row's published mesh with its pipe axis folded into the data axis
   (:func:`auto_mesh`: auto splits it out again, so the published pipelined
   layout, context axis included, is among the candidates it costs) says whether
   the planner would pipeline, and what it picks instead, priced beside the
   published layout's prediction. The levers the published recipe chose that
   auto takes only when asked are allowed: float8 (``allow_fp8``), the fp32
   master in the optimizer state (``allow_master_weights``) and a pipeline's
   router statistics per device's rows (``allow_local_statistics``).

Run: ``python benchmarks/calibration.py [--no-auto] [--only NAME...]``; saves
``benchmarks/results/calibration.json`` (``--only``: the rows whose name holds one
of the given strings recomputed, the others' saved figures kept). ``--markdown``
prints the saved table as ``docs/recipes.md`` shows it (a test keeps the two equal);
``--breakdown NAME...`` prints the named rows' predicted step term by term beside
what their published figures imply (:func:`breakdown`), and saves nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import warnings
from pathlib import Path

import spmdkit as sk
from spmdkit.models import get_model
from spmdkit.pipeline import Pipeline

GIB = 2**30

#: MaxText's ``save_dot_except_mlpwi``: keep every weight matmul's output but the
#: MLP's two input projections (a named policy of :mod:`spmdkit.step.recipe`).
SAVE_DOT_EXCEPT_MLPWI = sk.Recipe(remat="save_dot_except_mlpwi", compute_dtype="bfloat16")
#: MaxText's FP8 recipe: ``quantization=fp8`` with ``remat_policy=custom`` keeping
#: the query/key/value and output projections on the device.
SAVE_QKV_OUT_FP8 = sk.Recipe(
    remat="names",
    save_names=("query_proj", "key_proj", "value_proj", "out_proj"),
    compute_dtype="float8",
)
#: torchtitan's selective (op) activation checkpointing, nearest in the space:
#: keep the weight matmuls' outputs (torchtitan keeps every other one and the
#: attention output).
SELECTIVE = sk.Recipe(remat="dots", compute_dtype="bfloat16")
#: torchtitan's Float8 (torchao ``Float8Linear``, dynamic per-tensor scaling, FSDP
#: weights all-gathered in float8, the ``output`` projection left in bf16: the
#: recipe's default ``fp8_exclude=("lm_head",)``) with the same selective AC.
SELECTIVE_FP8 = sk.Recipe(remat="dots", compute_dtype="float8")
TORCHTITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
#: Megatron-LM's bf16 training as NeMo and Megatron-Bridge run it: bf16 parameters,
#: the fp32 master copy in the distributed optimizer's state (sharded with it over
#: the data-parallel ranks): :mod:`spmdkit.step.master`.
MEGATRON_BF16 = sk.Recipe(compute_dtype="bfloat16", master_weights="optimizer")
#: The same with Transformer Engine's FP8 GEMMs (bf16 parameters quantized per GEMM).
MEGATRON_FP8 = sk.Recipe(compute_dtype="float8", master_weights="optimizer")


def _llama(**over: int) -> object:
    from models.llama import CONFIGS

    base = CONFIGS["70b"]() if over.pop("big", 1) else CONFIGS["8b"]()
    return dataclasses.replace(base, **over)


def _model(row: dict) -> tuple[object, object]:
    """The row's model spec and config: Llama (70B, or 8B with ``big: 0``) unless
    the row names another reference model and size (``"model": ("gpt", "gpt3_175b")``)."""
    if "model" not in row:
        return get_model("llama"), _llama(**row["config"])
    name, size = row["model"]
    spec = get_model(name)
    return spec, dataclasses.replace(spec.configs[size](), **row["config"])


def _twin(row: dict, **changes: object) -> dict:
    """A row of the same run under another recipe or device count: ``row`` with
    ``changes`` (a published table's FP8 or compiled figure beside its bf16 one).
    A twin never fits a constant unless it says so."""
    return {**row, "fit": False, **changes}


MAXTEXT_70B = {
    "name": "MaxText Llama 2 70B",
    "source": "NVIDIA dgxc-benchmarking maxtext/README_70b.md (commit 143b90d)",
    "config": {"vocab": 32000, "seq_len": 4096},
    "devices": 64,
    "mesh": {"data": 8, "model": 8},
    "published_mesh": "FSDP 64 (ici 8 x dcn 8)",
    "strategy": "fsdp",
    "batch": 128,
    "recipe": SAVE_DOT_EXCEPT_MLPWI,
    "published_recipe": "bf16, remat save_dot_except_mlpwi, cuDNN flash attention",
    "stack": "xla",
    "published": 1170.5,
    "memory_gib": None,
    "fit": True,
    "pipelined": False,
}
TORCHTITAN_8B = {
    "name": "torchtitan Llama 3.1 8B",
    "source": TORCHTITAN,
    "config": {"big": 0},
    "devices": 8,
    "mesh": {"data": 8},
    "published_mesh": "FSDP 8",
    "strategy": "fsdp",
    "batch": 16,
    "recipe": SELECTIVE,
    "published_recipe": "bf16 / fp32 master, selective op AC, eager",
    "stack": "pytorch",
    "published": 5762,
    "memory_gib": 82.4,
    "fit": True,
    "pipelined": False,
}
#: What changes for torchtitan's 8B rows on 128 GPUs.
AT_128 = {
    "devices": 128,
    "mesh": {"data": 16, "model": 8},
    "published_mesh": "FSDP 128",
    "batch": 256,
}
TORCHTITAN_COMPILE = _twin(
    TORCHTITAN_8B,
    name="torchtitan Llama 3.1 8B compile",
    published_recipe="bf16 / fp32 master, selective op AC, torch.compile",
    stack="pytorch_compile",
    published=6667,
    memory_gib=77.0,
    fit=True,
)
TORCHTITAN_FLOAT8 = _twin(
    TORCHTITAN_COMPILE,
    name="torchtitan Llama 3.1 8B Float8",
    recipe=SELECTIVE_FP8,
    published_recipe="Float8 (torchao, dynamic scaling, FP8 all-gather), selective "
    "op AC, torch.compile",
    published=8532,
    memory_gib=76.8,
)
NEMO_70B = {
    "name": "NeMo Llama 3.1 70B",
    "source": "NVIDIA dgxc-benchmarking llama3.1/README_70b.md",
    "config": {"seq_len": 8192},
    "devices": 64,
    "mesh": {"pipe": 4, "data": 2, "context": 2, "model": 4},
    "published_mesh": "TP 4 x PP 4 x CP 2 x VP 5 (DP 2)",
    "strategy": "megatron_sp+zero1",
    # each sequence over the context axis (CP 2) and, within a tensor group,
    # over the model axis (Megatron's sequence parallelism)
    "rules": [("seq", ("context", "model"))],
    "batch": 128,
    "pipeline": Pipeline(stages=4, microbatches=64, schedule="interleaved", virtual=5),
    "recipe": MEGATRON_BF16,
    "published_recipe": "bf16, GBS 128, MBS 1, TE fused kernels, distributed optimizer",
    "stack": "xla",
    "published": 1121,
    "memory_gib": None,
    "fit": False,
    "pipelined": True,
}


#: Megatron-Bridge's expert parallelism without expert tensor parallelism (ETP 1,
#: its MoE recipes' setting): the experts over the data-parallel axes named
#: (``ep``), the batch over the data axes and those, each layer's tokens exchanged
#: by all-to-all (dropless, balanced routing forced in the published runs).
def _experts_over(*ep: str) -> list:
    return [("expert", ep), ("batch", ("data", *(a for a in ep if a != "data")))]


#: Megatron-LM's alltoall token dispatcher (``moe_token_dispatcher_type="alltoall"``,
#: the published GPT-OSS run's), priced only: the per-expert counts exchanged
#: first (the host waits for them), then buffers of the rows routed, where
#: spmdkit's op pads them for the worst case (``n_ep`` times as many rows at
#: top-k >= the local experts).
MEGATRON_ALLTOALL = {"expert_exchange": "routed"}

#: Megatron-LM's flex dispatcher on HybridEP (``moe_token_dispatcher_type="flex"``,
#: ``moe_flex_dispatcher_backend="hybridep"``: the published Qwen3-30B-A3B run's,
#: Megatron-Bridge's H100 config since its #2477 of 2026-02-23, before 26.04),
#: priced only: hierarchical, a token over InfiniBand once per node holding one of
#: its experts and fanned out over NVLink inside it, as DeepEP's normal kernels
#: run it; not overlapped (the config's ``moe_a2a_overlap=False``).
MEGATRON_HYBRIDEP = {"expert_exchange": "node_dedup"}

#: What Megatron-LM's MoE layers cost beyond their kernels' price, per layer call and
#: micro-batch, forward and backward (``Topology.moe_call_s``, priced only): fitted on
#: the Qwen3-30B-A3B row (:func:`fit_call`), the MoE rows' one fit, every other MoE
#: row and variant a hold-out. A fixed cost per call: GPT-OSS's rows at micro-batch 1
#: and 4 lack the same seconds per layer and tick without it. The eager framework's
#: host dispatch at micro-batch 1 (no CUDA graphs in these H100 recipes) is the
#: candidate; spmdkit's compiled step is priced without it.
MEGATRON_MOE_CALL_S = 3.5e-3
MEGATRON_MOE = {"moe_call_s": MEGATRON_MOE_CALL_S}


MEGATRON_BRIDGE_MOE = "Megatron-Bridge performance summary (H100), 26.04.01"
QWEN3_30B = {
    "name": "Megatron-Bridge Qwen3-30B-A3B FP8",
    "source": MEGATRON_BRIDGE_MOE,
    "model": ("qwen3_moe", "30b_a3b"),
    "config": {},
    "devices": 16,
    # EP 16 over two nodes: the experts over both axes, so the exchange's pieces
    # for the node's own GPUs go over NVLink
    "mesh": {"data": 2, "expert": 8},
    "published_mesh": "EP 16 (DP 16)",
    "strategy": "megatron+zero1",
    "rules": _experts_over("data", "expert"),
    "batch": 1024,
    "recipe": dataclasses.replace(MEGATRON_FP8, microbatches=64),
    "published_recipe": "FP8, GBS 1024, MBS 1, dropless, distributed optimizer",
    # priced with the alltoall dispatcher's bytes (every (token, expert) copy over
    # InfiniBand, about 8 times what HybridEP sends) this row was once within its
    # tolerance without moe_call_s, by a wrong exchange; the same model in 26.02.01's
    # layout (PP 2 x VP 12 x EP 8, its exchange inside a node: 9,058 tok/s/GPU)
    # lacks about as much per layer call without it, so the network does not make it
    "exchange": {**MEGATRON_HYBRIDEP, **MEGATRON_MOE},
    "fits": "moe_call_s",
    "stack": "xla",
    "published": 8960,
    "memory_gib": None,
    "fit": False,
    "pipelined": False,
}
GPT_OSS_120B = {
    "name": "Megatron-Bridge GPT-OSS 120B",
    "source": MEGATRON_BRIDGE_MOE,
    "model": ("qwen3_moe", "gpt_oss_120b"),
    "config": {},
    "devices": 64,
    "mesh": {"pipe": 4, "data": 2, "expert": 8},
    "published_mesh": "PP 4 x EP 8 (DP 16)",
    "strategy": "megatron+zero1",
    "rules": _experts_over("expert"),
    "batch": 1280,
    # the router's load-balancing statistics per data-parallel rank, as Megatron-LM
    "pipeline": Pipeline(stages=4, microbatches=80, schedule="1f1b", local_statistics=True),
    "recipe": MEGATRON_BF16,
    "published_recipe": "bf16, GBS 1280, MBS 1, dropless, distributed optimizer",
    # the zoo's gpt_oss_120b has the published dims that set the FLOPs (layers,
    # width, heads, KV heads, head_dim, experts, top-k, expert width, vocab) but not
    # the attention sinks, the alternating sliding-window attention (which would lower
    # the price) or the biases; the published recipe recomputes the norms and the
    # experts' activation. TE runs the sinks in cuDNN's fused kernel (the unfused path
    # keeps each layer's 2 GiB of probabilities a micro-batch and would not fit)
    "exchange": {**MEGATRON_ALLTOALL, **MEGATRON_MOE},
    "stack": "xla",
    "published": 5824,
    # the same model, mesh and layout in earlier releases' summaries (DGX-H100 rows):
    # MBS 1 again, and MBS 4 over a quarter of the batch (8 micro-batches, the
    # bubble 3 of 11 ticks); --breakdown prices each beside its published step
    "variants": [
        {"release": "26.02", "batch": 1280, "microbatches": 80, "published": 5993},
        {"release": "25.11", "batch": 512, "microbatches": 8, "published": 5630},
    ],
    "memory_gib": None,
    "fit": False,
    "pipelined": True,
}

#: Megatron-Bridge's DeepSeek-V3 layout on 1,024 H100s: TP 2 (sequence parallel) x
#: PP 8 x VP 4, EP 64 over the tensor ranks and 32 of the 64 data-parallel ranks
#: (ETP 1), its pipeline layout ``Et|(tt|)*30mL``: chunk 0 the embedding and dense
#: layer 0, chunk 1 dense layers 1-2, chunks 2-30 two MoE layers each, chunk 31 the
#: MTP layer and the loss. Priced with the dense stack on the first device (before
#: the MoE stack it pipelines: the second device's two dense layers counted on the
#: first), the 58 MoE layers over chunks 2-30, and the MTP layer (the zoo's
#: ``mtp_layers=1``: one more MoE block and the shared head again) after the stack,
#: on the last device with the head and the loss, as chunk 31 holds them.
#: The executor runs the layout (the 58-layer stack stored split over the pipe axis
#: on a dim 8 divides), but not the published expert exchange: the row is priced.
DEEPSEEK_V3 = {
    "name": "Megatron-Bridge DeepSeek-V3 671B FP8",
    "source": "Megatron-Bridge performance summary (H100), 25.09; its DeepSeek-V3 "
    "H100 workload config (scripts/performance/configs/deepseek)",
    "model": ("deepseek", "v3_671b"),
    # the recipe's one multi-token-prediction depth (mtp_num_layers=1), the layout's m
    "config": {"mtp_layers": 1},
    "devices": 1024,
    "mesh": {"pipe": 8, "data": 2, "expert": 32, "model": 2},
    "published_mesh": "TP 2 x PP 8 x VP 4 x EP 64 (DP 64, ETP 1)",
    "strategy": "megatron_sp+zero1",
    "rules": [("expert", ("expert", "model")), ("batch", ("data", "expert"))],
    "batch": 8192,
    "pipeline": Pipeline(
        stages=8,
        microbatches=128,
        schedule="interleaved",
        virtual=4,
        local_statistics=True,
        layout=(0, 0) + (2,) * 29 + (0,),
    ),
    # recompute mla_up_proj and mlp: the nearest named policy keeps the attention's
    # output projection and the routed experts' exchanged buffers (Megatron keeps
    # the routed experts), recomputing attention, its projections and the dense MLPs
    "recipe": dataclasses.replace(MEGATRON_FP8, remat="save_out_proj_experts"),
    "published_recipe": "FP8, GBS 8192, MBS 1, seq 4096, dropless (router forced to "
    "balance), recompute mla_up_proj and mlp, DeepEP dispatch in bf16, 1F1B all-to-all "
    "overlap, layout Et|(tt|)*30mL",
    # the published run's expert exchange, priced only (spmdkit's executor runs an
    # all-to-all per (token, expert) copy on each micro-batch's critical path):
    # DeepEP (moe_token_dispatcher_type "flex", moe_enable_deepep) and the 1F1B
    # all-to-all overlap (overlap_moe_expert_parallel_comm, delay_wgrad_compute);
    # DeepEP's kernels on 20 SMs of their own (Megatron-LM's moe_deepep_num_sms
    # default, which the recipe keeps) while they overlap the expert GEMMs
    "exchange": {
        "expert_exchange": "node_dedup",
        "expert_overlap": True,
        "exchange_sms": 20,
        **MEGATRON_MOE,
    },
    "stack": "xla",
    "published": 1297,
    "memory_gib": None,
    "fit": False,
    "pipelined": True,
    "runs": "priced only: the executor runs the uneven layout (the 58-layer stack "
    "stored split over the pipe axis on a dim 8 divides), but the "
    "expert exchange is priced as the published run does it (row's exchange: DeepEP's "
    "node-deduplicated dispatch, each token over InfiniBand once per node holding its "
    "experts, on 20 SMs of its own, and Megatron's 1F1B all-to-all overlap), which "
    "spmdkit's executor does not run (it sends every (token, expert) copy, exposed): the "
    "plan's priced_only note. Its memory holds the exchanged buffers "
    "save_out_proj_experts keeps per micro-batch in flight at the rows routed, as DeepEP "
    "sizes them (T_local x k rows received per call, the busiest device's); spmdkit's "
    "executor pads them to n_ep x T_local x min(k, E_local), 32 times as many here, and "
    "would not fit 80 GiB",
}

#: Published runs the planner cannot price as published, each with why: saved
#: beside the rows (``unpriced``), with the figures of what it can price instead.
UNPRICED: list[dict] = []

#: DeepSeek-V3 671B's layouts on 1,024 H100s (global batch 8,192), priced
#: analytically: MaxText's (pure FSDP, bf16, full recompute) and Megatron-Bridge's
#: without its pipeline (TP 2 x EP 64 over the 1,024, FP8, MBS 1), at the
#: micro-batch counts named.
DEEPSEEK_LAYOUTS = [
    {
        "name": "MaxText pure FSDP 1024",
        "mesh": {"data": 1024},
        "strategy": "fsdp",
        "rules": None,
        "recipes": [
            sk.Recipe(compute_dtype="bfloat16", remat="full", microbatches=m) for m in (1, 2, 4)
        ],
    },
    {
        "name": "Megatron TP 2 x EP 64, no PP",
        "mesh": {"data": 16, "expert": 32, "model": 2},
        "strategy": "megatron_sp+zero1",
        "rules": _experts_over("expert", "model"),
        "recipes": [dataclasses.replace(MEGATRON_FP8, remat="full", microbatches=16)],
    },
]


def deepseek_layouts() -> list[dict]:
    """Each of :data:`DEEPSEEK_LAYOUTS` priced (analytic, abstract H100 mesh)."""
    spec = get_model("deepseek")
    config = spec.configs["v3_671b"]()
    out = []
    for layout in DEEPSEEK_LAYOUTS:
        for recipe in layout["recipes"]:
            p = sk.plan(
                spec,
                sk.abstract_mesh(**layout["mesh"]),
                layout["strategy"],
                config=config,
                batch_size=8192,
                recipe=recipe,
                rules=layout["rules"],
                topology=sk.Topology.h100(),
                estimator="analytic",
            )
            c = p.cost
            out.append(
                {
                    "name": layout["name"],
                    "mesh": layout["mesh"],
                    "strategy": layout["strategy"],
                    "recipe": recipe.short(),
                    "experts": str(p.params["moe_layers/moe/w_gate"]),
                    "tok_s_gpu": 8192 * config.seq_len / c.step_time_s / 1024,
                    "memory_gib": c.peak_bytes / GIB,
                    "memory": {k: v / GIB for k, v in c.memory.items()},
                    "step_time_s": c.step_time_s,
                    "compute_s": c.compute_time_s,
                    "comm_s": c.comm_time_s,
                    "comm_tib": {k: v / 2**40 for k, v in c.comm_bytes.items()},
                }
            )
    return out


#: One published run per row. ``fit``: the row that fits its stack's constant.
ROWS = [
    MAXTEXT_70B,
    _twin(
        MAXTEXT_70B,
        name="MaxText Llama 2 70B FP8",
        recipe=SAVE_QKV_OUT_FP8,
        published_recipe="quantization=fp8, remat custom (q/k/v/qkv/out projections on "
        "device), cuDNN flash attention",
        published=1894.5,
    ),
    TORCHTITAN_8B,
    _twin(TORCHTITAN_8B, **AT_128, published=5605, memory_gib=67.0),
    {
        "name": "Megatron-Bridge Llama 3 70B FP8",
        "source": "Megatron-Bridge 26.02 docs/performance-summary.md",
        "config": {"seq_len": 8192},
        "devices": 64,
        "mesh": {"pipe": 8, "data": 2, "model": 4},
        "published_mesh": "TP 4 x PP 8 x VP 5 (DP 2)",
        "strategy": "megatron_sp+zero1",
        "batch": 256,
        "pipeline": Pipeline(stages=8, microbatches=128, schedule="interleaved", virtual=5),
        "recipe": MEGATRON_FP8,
        "published_recipe": "FP8, GBS 256, MBS 1, TE fused kernels, distributed optimizer",
        "stack": "xla",
        "published": 1621,
        "memory_gib": None,
        "fit": False,
        "pipelined": True,
    },
    {
        "name": "NeMo GPT-3 175B FP8",
        "source": "NVIDIA NeMo 24.07 performance summary (GPT-3 175B, H100)",
        "model": ("gpt", "gpt3_175b"),
        # Megatron pads the vocabulary to a multiple of 128 x TP (50,257 -> 50,304)
        "config": {"vocab": 50304},
        "devices": 128,
        "mesh": {"pipe": 8, "data": 4, "model": 4},
        "published_mesh": "TP 4 x PP 8 x VP 6 (DP 4)",
        "strategy": "megatron_sp+zero1",
        "batch": 256,
        "pipeline": Pipeline(stages=8, microbatches=64, schedule="interleaved", virtual=6),
        "recipe": MEGATRON_FP8,
        "published_recipe": "FP8, GBS 256, MBS 1, seq 2048, TE fused kernels, "
        "distributed optimizer",
        "stack": "xla",
        "published": 726,
        "memory_gib": None,
        "fit": False,
        "pipelined": True,
    },
    NEMO_70B,
    _twin(
        NEMO_70B,
        name="NeMo Llama 3.1 70B FP8",
        recipe=MEGATRON_FP8,
        published_recipe="FP8, GBS 128, MBS 1, TE fused kernels, distributed optimizer",
        published=1567,
    ),
    TORCHTITAN_COMPILE,
    TORCHTITAN_FLOAT8,
    _twin(TORCHTITAN_COMPILE, **AT_128, published=6514, memory_gib=None),
    _twin(TORCHTITAN_FLOAT8, **AT_128, published=8380, memory_gib=None),
    QWEN3_30B,
    GPT_OSS_120B,
    DEEPSEEK_V3,
]


def row_topology(row: dict) -> sk.Topology:
    """The topology ``row`` is priced on: H100 nodes of 8 with its stack's constants,
    and the priced-only forms its published run uses (``exchange``:
    :class:`~spmdkit.topology.Topology` fields: its expert exchange's
    ``expert_exchange``, ``expert_overlap`` and ``exchange_sms``, and Megatron-LM's
    ``moe_call_s``), if any."""
    return dataclasses.replace(sk.Topology.h100(stack=row["stack"]), **row.get("exchange", {}))


def predict(row: dict, topology: sk.Topology) -> sk.Cost:
    """The analytic cost of ``row``'s layout and recipe on its abstract mesh."""
    spec, config = _model(row)
    return sk.plan(
        spec,
        sk.abstract_mesh(**row["mesh"]),
        row["strategy"],
        config=config,
        batch_size=row["batch"],
        recipe=row["recipe"],
        rules=row.get("rules"),
        topology=topology,
        pipeline=row.get("pipeline"),
        estimator="analytic",
    ).cost


def tok_s(row: dict, cost: sk.Cost) -> float:
    """Tokens per second per GPU of a step of ``cost``."""
    seq = _model(row)[1].seq_len
    return row["batch"] * seq / cost.step_time_s / row["devices"]


def tolerance(row: dict) -> float:
    """The relative error a row's tokens/s/GPU must stay within: ±15% (issue 33's
    table), ±20% for a float8 row (issue 34's)."""
    return 0.2 if row["recipe"].compute_dtype == "float8" else 0.15


def fit(row: dict, base: sk.Topology) -> float:
    """The ``matmul_efficiency`` at which ``row`` is predicted exactly (bisection:
    the prediction rises with the efficiency)."""
    lo, hi = 0.2, 1.0
    for _ in range(24):
        mid = (lo + hi) / 2
        topo = dataclasses.replace(base, matmul_efficiency=mid)
        if tok_s(row, predict(row, topo)) < row["published"]:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_call(row: dict, base: sk.Topology) -> float:
    """The ``moe_call_s`` at which ``row`` is predicted exactly on ``base`` (its
    own ``moe_call_s`` replaced): the step grows by the same seconds per call
    however many there are, so two predictions place it."""
    at = [predict(row, dataclasses.replace(base, moe_call_s=c)).step_time_s for c in (0, 1e-3)]
    published_s = row["batch"] * _model(row)[1].seq_len / row["published"] / row["devices"]
    return (published_s - at[0]) / (at[1] - at[0]) * 1e-3


def auto_mesh(row: dict) -> dict[str, int]:
    """The mesh auto plans a row on: the published one, its pipe axis folded into
    the data axis (``pipeline="auto"`` splits it out again, the published degree
    among the others), so the published layout is one auto costs."""
    mesh = dict(row["mesh"])
    pipe = mesh.pop("pipe", 1)
    mesh["data"] = mesh.get("data", 1) * pipe
    return {"data": mesh.pop("data"), **mesh}


def auto_choice(row: dict, topology: sk.Topology) -> dict:
    """What ``sk.plan(..., "auto")`` picks for the row's devices within 80 GiB: on
    :func:`auto_mesh` with pipelines searched (``pipeline="auto"``) when the row is
    in the search space, else with the row's pipeline fixed (layouts and recipe
    searched: the nearest plan that fits). The levers the published recipe chose
    that auto tries only when asked are allowed: float8, the fp32 master in the
    optimizer state (``allow_master_weights``), and the router's statistics per
    device's rows where the published pipeline computes them so
    (``allow_local_statistics``)."""
    mesh = dict(row["mesh"]) if "outside" in row else auto_mesh(row)
    pipeline = row.get("pipeline") if "outside" in row else "auto"
    t0 = time.perf_counter()
    spec, config = _model(row)
    options = sk.SearchOptions(
        pipeline=pipeline,
        allow_fp8=row["recipe"].compute_dtype == "float8",
        allow_master_weights=row["recipe"].master_weights == "optimizer",
        allow_local_statistics=getattr(row.get("pipeline"), "local_statistics", False),
    )
    p = sk.plan(
        spec,
        sk.abstract_mesh(**mesh),
        "auto",
        config=config,
        batch_size=row["batch"],
        topology=topology,
        options=options,
    )
    return {
        "mesh": mesh,
        "chosen": f"{p.chosen}+{p.recipe.short()}"
        + (f"+{p.pipeline.short()}" if p.pipeline else ""),
        "pipelined": p.pipeline is not None,
        "consistent": (p.pipeline is not None) == row["pipelined"],
        "tok_s_gpu": tok_s(row, p.cost),
        "memory_gib": p.cost.peak_bytes / GIB,
        # the best of the other kind among auto's runner-ups (None: not among them)
        "best_other": next(
            (
                {"chosen": n, "tok_s_gpu": tok_s(row, c), "memory_gib": c.peak_bytes / GIB}
                for n, c in p.alternatives
                if ("+pp" in n) != (p.pipeline is not None) and c.peak_bytes <= 80 * GIB
            ),
            None,
        ),
        "plan_s": time.perf_counter() - t0,
    }


def breakdown(row: dict, topology: sk.Topology) -> str:
    """The terms of ``row``'s predicted step beside what the published run implies:
    the published step time (tokens per step / published tok/s/GPU / GPUs) and
    model FLOP/s per GPU at the published and predicted rates (6 FLOPs per token
    and weight it meets, routed experts' by their top-k share, plus the traced
    attention dots), then the prediction's compute (with a pipeline's bubble),
    communication (exposed and hidden) and memory by kind, and each parameter
    group's share as the analytic model priced it (compute, communication, bytes by
    collective kind; a pipelined row's groups as a stage holds them)."""
    from unittest import mock

    from spmdkit.introspect import describe
    from spmdkit.planner import analytic
    from spmdkit.planner.trace import trace_step

    seen: dict[str, tuple] = {}
    price = analytic.group_cost

    def recorded(
        ctx: analytic.CostContext,
        g: analytic.ParamGroup,
        layout: analytic.GroupLayout,
        batch_axes: tuple[str, ...],
        seq_axes: tuple[str, ...],
    ) -> analytic.GroupCost:
        out = price(ctx, g, layout, batch_axes, seq_axes)
        if batch_axes or not ctx.gather_once:  # not the pipe-axis gradient sync's pricing
            seen[g.key] = (g, out)
        return out

    with mock.patch.object(analytic, "group_cost", recorded):
        cost = predict(row, topology)
    spec, config = _model(row)
    info = describe(spec, config=config, batch_size=row["batch"])
    trace = trace_step(info, None)
    tokens = row["batch"] * config.seq_len
    # 6 per weight and token it meets (routed experts': their top-k share; the
    # embedding table's counted too, as a lookup's are not in the price) +
    # attention's dots as the step traces them
    weights = sum(
        analytic.param_flops(dataclasses.replace(g, uses=max(g.uses, 1)), trace) * g.count
        for g in analytic.param_groups(info, trace)
    )
    flops_token = (weights + trace.attn_flops) / trace.tokens
    published_s = tokens / row["published"] / row["devices"]
    lines = [
        f"{row['name']} ({row['devices']} GPUs, {row['published_mesh']}, {row['recipe'].short()}"
        + (f", {row['pipeline'].short()}" if row.get("pipeline") else "")
        + ")",
        f"  published: {row['published']:,} tok/s/GPU = step {published_s:.2f} s, "
        f"{row['published'] * flops_token / 1e12:.0f} TFLOP/s/GPU at "
        f"{flops_token / 1e9:.1f} GFLOP/token (6 x the weights a token meets, "
        f"the embedding table's included, {weights / trace.tokens / 1e9:.1f}; attention's "
        "dots as traced, recomputation included)",
        f"  predicted: {tok_s(row, cost):,.0f} tok/s/GPU = step {cost.step_time_s:.2f} s, "
        f"{tok_s(row, cost) * flops_token / 1e12:.0f} TFLOP/s/GPU",
        f"    compute {cost.compute_time_s:.2f} s (pipeline bubble {cost.bubble_s:.2f} s); "
        f"communication {cost.comm_time_s:.2f} s, hidden {cost.hidden_comm_s:.2f} s, "
        f"exposed {cost.comm_time_s - cost.hidden_comm_s:.2f} s",
        "    collectives GiB/step: "
        + ", ".join(f"{k} {v / GIB:,.1f}" for k, v in cost.comm_bytes.items()),
        "    memory GiB: " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in cost.memory.items()),
        f"  {'group':<28}{'shape':<28}{'compute s':>10}{'comm s':>8}{'hidden':>8}  GiB/step",
    ]
    for key, (g, c) in sorted(seen.items()):
        moved = ", ".join(f"{k} {v / GIB:,.1f}" for k, v in c.comm_bytes if v >= GIB / 10)
        lines.append(
            f"  {key:<28.28}{tuple(g.shape)!s:<28}{c.compute_s:>10.3f}{c.comm_s:>8.3f}"
            f"{c.hidden_s:>8.3f}  {moved}"
        )
    lines += variant_lines(row, topology, config.n_layers)
    return "\n".join(lines)


def variant_lines(row: dict, topology: sk.Topology, n_layers: int) -> list[str]:
    """A pipelined row's ``variants`` (the same layout in other releases' published
    summaries, at another batch and micro-batch count) each priced beside its
    published step, with the gap spread over the slowest stage's work: per tick
    (a micro-batch's forward and backward on a stage, ``m + p - 1`` of them) and
    per layer of a stage in a tick. A gap that stays per layer and micro-batch as
    the micro-batch grows is a fixed cost per launch of a layer (the host's,
    the kernels' latencies), not a rate; one that grows with it is a rate."""
    variants = row.get("variants", ())
    pipe = row.get("pipeline")
    if not variants or pipe is None:
        return []
    out = [
        f"  {'variant':<10}{'batch':>6}{'m':>5}{'published':>11}{'predicted':>11}{'ratio':>7}"
        f"{'gap s':>8}{'per tick ms':>13}{'per layer ms':>14}"
    ]
    seq = _model(row)[1].seq_len
    for v in (
        {"release": "this", "batch": row["batch"], "microbatches": pipe.microbatches},
        *variants,
    ):
        published = v.get("published", row["published"])
        r = dict(
            row,
            batch=v["batch"],
            published=published,
            pipeline=dataclasses.replace(pipe, microbatches=v["microbatches"]),
        )
        cost = predict(r, topology)
        published_s = v["batch"] * seq / published / row["devices"]
        gap = published_s - cost.step_time_s
        ticks = v["microbatches"] + pipe.stages - 1
        out.append(
            f"  {v['release']:<10}{v['batch']:>6}{v['microbatches']:>5}{published:>11,}"
            f"{tok_s(r, cost):>11,.0f}{tok_s(r, cost) / published:>7.2f}{gap:>8.2f}"
            f"{gap / ticks * 1e3:>13.1f}{gap / ticks / (n_layers / pipe.stages) * 1e3:>14.1f}"
        )
    return out


MARKDOWN_HEADER = (
    "| run | GPUs | mesh (published) | recipe priced | stack | role | published tok/s/GPU "
    "| predicted | ratio | published GiB | predicted GiB | auto's choice within 80 GiB on the "
    "published mesh, pipe folded into data (flat/pipelined as published?) |"
)


def _exchange_cell(exchange: dict | None) -> str:
    """A row's priced-only expert exchange forms (its ``exchange`` Topology fields)
    as the table shows them, labelled priced only; empty without any."""
    if not exchange:
        return ""
    forms = [f"{k}={v}" if not isinstance(v, bool) else k for k, v in exchange.items() if v]
    return " + ".join(forms) + " (priced only)"


def markdown(saved: dict) -> str:
    """The saved table (``calibration.json``'s contents) as ``docs/recipes.md``
    shows it: one line per row, the header first."""
    lines = [MARKDOWN_HEADER, "|---" * MARKDOWN_HEADER.count(" | ") + "|---|"]
    for r in saved["rows"]:
        priced = ", ".join(
            x
            for x in (
                r["strategy"]
                + "".join(f" with {n} over {'×'.join(a)}*" for n, a in r.get("rules", {}).items()),
                r["recipe"],
                r["pipeline"],
                _exchange_cell(r.get("exchange")),
            )
            if x
        )
        auto = r.get("auto")
        auto_cell = (
            f"{auto['chosen']} on {'×'.join(f'{a}={n}' for a, n in auto['mesh'].items())}, "
            f"{auto['tok_s_gpu']:,.0f} tok/s at {auto['memory_gib']:.0f} GiB "
            f"({'yes' if auto['consistent'] else 'no'})"
            if auto
            else "-"
        )
        cells = (
            r["name"],
            str(r["devices"]),
            r["published_mesh"],
            priced,
            r["stack"],
            r["role"],
            f"{r['published']:,}",
            f"{r['predicted']:,.0f}",
            f"{r['ratio']:.2f}" + (" (miss)" if r.get("miss") else ""),
            f"{r['memory_gib']:.1f}" if r["memory_gib"] else "-",
            f"{r['predicted_memory_gib']:.1f}",
            auto_cell,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-auto", action="store_true", help="skip the auto-choice column")
    parser.add_argument(
        "--markdown", action="store_true", help="print the saved table for docs/recipes.md"
    )
    parser.add_argument(
        "--breakdown",
        nargs="+",
        metavar="NAME",
        help="print the terms of the rows whose name contains one of these beside what "
        "their published figures imply, and save nothing",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="recompute only the rows whose name contains one of these, keeping the "
        "saved figures of the others (the saved table must hold every other row)",
    )
    args = parser.parse_args()
    # many plans, whose notes are no figure: sk.plan's PlanNoteWarnings would bury the table
    warnings.filterwarnings("ignore", category=sk.PlanNoteWarning)
    path = Path(__file__).parent / "results" / "calibration.json"
    if args.markdown:
        print(markdown(json.loads(path.read_text())))
        return
    if args.breakdown:
        for row in ROWS:
            if any(n in row["name"] for n in args.breakdown):
                print(breakdown(row, row_topology(row)), flush=True)
        return
    saved = json.loads(path.read_text()) if args.only else None
    kept = {(r["name"], r["devices"]): r for r in saved["rows"]} if saved else {}

    def chosen(row: dict) -> bool:
        return not args.only or any(n in row["name"] for n in args.only)

    fitted = {}
    for row in ROWS:
        if row["fit"] and chosen(row):
            fitted[row["stack"]] = fit(row, row_topology(row))
        elif row["fit"]:
            fitted[row["stack"]] = saved["constants"][row["stack"]]["fitted_matmul_efficiency"]
    out = []
    print(
        f"{'run':<32}{'GPUs':>5}  {'mesh (published)':<34}{'stack':<16}{'publ.':>7}"
        f"{'pred.':>7}{'ratio':>6}{'mem':>6}{'pred':>6}{'ratio':>6}  auto"
    )
    for row in ROWS:
        if not chosen(row):
            out.append(kept[(row["name"], row["devices"])])
            continue
        topo = row_topology(row)
        cost = predict(row, topo)
        pred = tok_s(row, cost)
        mem = cost.peak_bytes / GIB
        rec = {
            k: v
            for k, v in row.items()
            if k not in ("recipe", "pipeline", "config", "fit", "rules") and not callable(v)
        }
        if row.get("rules"):
            rec["rules"] = {name: list(axes) for name, axes in row["rules"]}
        rec.update(
            config=row["config"],
            recipe=row["recipe"].short(),
            pipeline=row["pipeline"].short() if row.get("pipeline") else None,
            role="fit" if row["fit"] else f"fit: {row['fits']}" if "fits" in row else "hold-out",
            tolerance=tolerance(row),
            in_space="outside" not in row,
            predicted=pred,
            ratio=pred / row["published"],
            predicted_memory_gib=mem,
            memory_ratio=mem / row["memory_gib"] if row["memory_gib"] else None,
            step_time_s=cost.step_time_s,
            compute_s=cost.compute_time_s,
            comm_s=cost.comm_time_s,
            hidden_comm_s=cost.hidden_comm_s,
        )
        if not args.no_auto:
            rec["auto"] = auto_choice(row, topo)
        out.append(rec)
        pub_mem = f"{row['memory_gib']:>6.1f}" if row["memory_gib"] else f"{'-':>6}"
        mem_ratio = f"{rec['memory_ratio']:>6.2f}" if rec["memory_ratio"] else f"{'-':>6}"
        auto = rec.get("auto", {})
        auto = f"{auto['chosen']} {auto['tok_s_gpu']:.0f} {auto['memory_gib']:.0f}G" if auto else ""
        print(
            f"{row['name']:<32}{row['devices']:>5}  {row['published_mesh']:<34.34}"
            f"{row['stack']:<16}{row['published']:>7.0f}{pred:>7.0f}{rec['ratio']:>6.2f}"
            f"{pub_mem}{mem:>6.1f}{mem_ratio}  {'MISS ' if 'miss' in row else ''}{auto}",
            flush=True,
        )
    constants = {
        stack: {
            "fitted_matmul_efficiency": fitted.get(stack),
            **sk.topology.STACKS[stack],
            "overlap": sk.Topology.h100().overlap,
        }
        for stack in sk.topology.STACKS
    }
    for stack, c in constants.items():
        print(
            f"{stack}: matmul_efficiency {c['matmul_efficiency']:.2f} in use, "
            f"{c['fitted_matmul_efficiency']:.3f} fits its row exactly; attention "
            f"{c['attention_efficiency']:.2f}, fusion traffic {c['fusion_traffic']:.1f}"
        )
    call_row = next(r for r in ROWS if r.get("fits") == "moe_call_s")
    if chosen(call_row):
        call_fit = fit_call(call_row, row_topology(call_row))
    else:
        call_fit = saved["constants"]["moe_call_s"]["fitted"]
    constants["moe_call_s"] = {
        "in_use": MEGATRON_MOE_CALL_S,
        "fitted": call_fit,
        "row": call_row["name"],
    }
    print(
        f"Megatron-LM MoE: moe_call_s {MEGATRON_MOE_CALL_S * 1e3:.1f} ms in use, "
        f"{call_fit * 1e3:.2f} ms fits its row exactly ({call_row['name']})"
    )
    unpriced = [dict(r) for r in UNPRICED]
    if chosen({"name": "DeepSeek-V3 layouts"}):
        layouts = deepseek_layouts()
        for r in layouts:
            print(
                f"DeepSeek-V3 {r['name']}, {r['recipe']}: {r['tok_s_gpu']:.0f} tok/s/GPU "
                f"at {r['memory_gib']:.0f} GiB"
            )
    else:
        layouts = saved.get("deepseek_v3_layouts", [])
    path.write_text(
        json.dumps(
            {
                "rows": out,
                "constants": constants,
                "unpriced": unpriced,
                "deepseek_v3_layouts": layouts,
            },
            indent=1,
        )
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
