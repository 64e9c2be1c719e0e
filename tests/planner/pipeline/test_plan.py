"""Pipelined plans: the strategy on the other axes, the stacked layers over the pipe axis."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.models import get_model
from spmdkit.pipeline import Pipeline, PipelineError
from spmdkit.planner.pipeline.plan import layer_rules
from spmdkit.planner.plans import Plan


def _plan(name: str, strategy: str, pipeline: Pipeline, config: str = "tiny_pipe", **axes: int):
    mesh = sk.abstract_mesh(**axes)
    return sk.plan(get_model(name), mesh, strategy, config=config, pipeline=pipeline)


def test_megatron_on_the_other_axes_and_layers_over_pipe():
    pipe = Pipeline(stages=2, microbatches=4)
    p = _plan("llama", "megatron", pipe, pipe=2, data=2, model=2)
    assert p.pipeline == pipe
    assert p.params["layers/attn/wq"] == P("pipe", None, "model")
    assert p.opt["layers/attn/wq"] == P("pipe", None, "model")
    assert p.params["embed/embedding"] == P("model")  # not stacked: replicated over pipe
    assert p.activation["batch"] == ("data",)
    assert "pipeline: pp2 1f1b m4" in p.table()
    assert Plan.from_json(p.to_json(), mesh=p.mesh) == p


def test_fsdp_keeps_the_layer_dim_for_the_pipe_axis():
    p = _plan("llama", "fsdp", Pipeline(stages=2, microbatches=2), pipe=2, data=2, model=2)
    spec = p.params["layers/attn/wq"]
    assert spec[0] == "pipe" and "pipe" not in str(spec[1:])
    assert "pipe" not in str(p.params["embed/embedding"])


def test_pipe_axis_alone():
    pipe = Pipeline(stages=2, microbatches=4, virtual=2, schedule="interleaved")
    p = _plan("gpt", "dp", pipe, pipe=2)
    assert p.params["blocks/fc/kernel"] == P("pipe")
    assert p.params["embed/embedding"] == P()
    assert p.activation["batch"] == ()


def test_layer_rules_put_layers_first():
    assert layer_rules(None).entries[0] == ("layers", None)
    assert layer_rules([("embed", ("data",))]).entries[0][0] == "layers"


@pytest.mark.parametrize(
    ("pipe", "axes", "config", "match"),
    [
        (Pipeline(stages=4, microbatches=8, virtual=2, schedule="interleaved"),
         {"pipe": 4, "data": 2}, "tiny_pipe", "split evenly"),
        (Pipeline(stages=2, microbatches=4), {"pipe": 2}, "tiny", "stacked"),
        (Pipeline(stages=2, microbatches=4), {"data": 2}, "tiny_pipe", "has the pipeline's axis"),
        (Pipeline(stages=2, microbatches=4), {"pipe": 4}, "tiny_pipe", "one device per stage"),
        (Pipeline(stages=2, microbatches=3, schedule="fthenb"), {"pipe": 2}, "tiny_pipe",
         "divides into the pipeline's micro-batches"),
    ],
)  # fmt: skip
def test_bad_requests_are_typed(pipe, axes, config, match):
    with pytest.raises(PipelineError, match=match) as e:
        _plan("llama", "dp", pipe, config=config, **axes)
    assert e.value.fix


def test_each_devices_rows_divide_into_the_microbatches():
    with pytest.raises(PipelineError, match="each device's batch rows"):
        _plan("llama", "dp", Pipeline(stages=2, microbatches=4), pipe=2, data=4)


def test_recipe_microbatches_are_the_pipelines():
    mesh = sk.abstract_mesh(pipe=2)
    with pytest.raises(PipelineError, match="not the recipe's"):
        sk.plan(
            get_model("llama"),
            mesh,
            "dp",
            config="tiny_pipe",
            pipeline=Pipeline(stages=2, microbatches=2),
            recipe=sk.Recipe(microbatches=2),
        )


def test_not_a_pipeline_is_typed():
    with pytest.raises(PipelineError, match=r"spmdkit\.Pipeline"):
        sk.plan(get_model("llama"), sk.abstract_mesh(pipe=2), "dp", config="tiny_pipe",
                pipeline={"stages": 2})  # fmt: skip


@pytest.mark.slow
def test_a_layer_combining_rows_is_refused_when_planned():
    """A MoE router's statistics over a micro-batch's rows, with the batch over a
    data axis beside the pipe axis: a typed error at plan time (not at sk.jit),
    lifted by local_statistics; without batch axes the rows stay together."""
    with pytest.raises(PipelineError, match=r"reduce_sum over the rows.*local_statistics=True"):
        _plan("moe", "megatron", Pipeline(stages=2, microbatches=4), pipe=2, data=2, model=2)
    pipe = Pipeline(stages=2, microbatches=4, local_statistics=True)
    assert _plan("moe", "megatron", pipe, pipe=2, data=2, model=2).pipeline == pipe
    p = _plan("moe", "megatron", Pipeline(stages=2, microbatches=4), pipe=2, model=4)
    assert p.activation["batch"] == ()


@pytest.mark.slow
def test_a_pipelined_preset_is_costed_as_a_pipeline():
    """The plan's cost is the pipeline's (stages, bubble, sends), not the smaller
    mesh's cost of the whole stack on every device."""
    pipe = Pipeline(stages=2, microbatches=4)
    mesh = sk.abstract_mesh(pipe=2, data=2, model=2)
    kw = {"config": "tiny_pipe", "estimator": "analytic"}
    piped = sk.plan(get_model("llama"), mesh, "megatron", pipeline=pipe, **kw)
    # the same micro-batches (tiny GEMMs are memory bound: each re-reads its weight)
    flat_mesh = sk.abstract_mesh(data=2, model=2)
    mb4 = sk.Recipe(microbatches=4)
    flat = sk.plan(get_model("llama"), flat_mesh, "megatron", recipe=mb4, **kw)
    c = piped.cost
    assert len(c.stage_memory) == 2 and c.peak_bytes == max(c.stage_memory)
    assert c.bubble_s > 0 and c.comm_bytes["collective_permute"] > 0
    # each device runs half the layers: the stage's compute (bubble aside) is
    # below the whole stack's on the smaller mesh
    assert c.compute_time_s - c.bubble_s < flat.cost.compute_time_s
    assert "stages: memory/device d0" in piped.table()
    calibrated = sk.plan(get_model("llama"), mesh, "megatron", pipeline=pipe, config="tiny_pipe")
    assert calibrated.cost.estimator == "analytic+propagate"
    assert len(calibrated.cost.stage_memory) == 2


@pytest.mark.parametrize("strategy", ["fsdp", "zero1", "megatron_sp"])
@pytest.mark.parametrize("axes", [{"pipe": 2}, {"pipe": 2, "data": 2, "model": 2}])
def test_every_preset_pipelined_is_costed_per_stage(strategy, axes):
    mesh = sk.abstract_mesh(**axes)
    pipe = Pipeline(stages=2, microbatches=4)
    kw = {"config": "tiny_pipe", "batch_size": 16, "estimator": "analytic"}
    p = sk.plan(get_model("llama"), mesh, strategy, pipeline=pipe, **kw)
    assert len(p.cost.stage_memory) == 2 and p.cost.bubble_s > 0


# -- flax's documented layer stack, without sharding names ------------------------------

_D, _LAYERS = 16, 4


def _scanned_mlp(metadata: bool):
    """Flax's scan-over-layers pattern (blocks made by ``nnx.vmap``, run by
    ``nnx.scan``), no sharding names; ``metadata``: both transforms given
    ``transform_metadata={nnx.PARTITION_NAME: "layers"}`` as flax's guide shows."""
    from flax import nnx

    kw = {"transform_metadata": {nnx.PARTITION_NAME: "layers"}} if metadata else {}

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up = nnx.Linear(_D, 2 * _D, rngs=rngs)
            self.down = nnx.Linear(2 * _D, _D, rngs=rngs)

        def __call__(self, x):
            return x + self.down(nnx.gelu(self.up(x), approximate=False))

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(32, _D, rngs=rngs)

            @nnx.split_rngs(splits=_LAYERS)
            @nnx.vmap(in_axes=(0,), out_axes=0, **kw)
            def blocks(rngs: nnx.Rngs) -> Block:
                return Block(rngs)

            self.blocks = blocks(rngs)
            self.head = nnx.Linear(_D, 32, rngs=rngs)

        def __call__(self, tokens):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, **kw)
            def layer(x, block: Block):
                return block(x)

            return self.head(layer(self.embed(tokens), self.blocks))

    return lambda: Model(nnx.Rngs(0))


def _lm_loss(model, batch):
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(model(batch["tokens"]))
    return -jnp.mean(jnp.sum(jax.nn.one_hot(batch["labels"], 32) * logp, -1))


def _lm_batch(rows: int = 16) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(0, 32, (rows, 8)), "labels": rng.integers(0, 32, (rows, 8))}


def _scanned_plan(metadata: bool):
    info = sk.describe(_scanned_mlp(metadata), loss=_lm_loss, batch=_lm_batch())
    pipe = Pipeline(stages=2, microbatches=4)
    return info, sk.plan(info, sk.make_mesh(pipe=2, data=4), "fsdp", pipeline=pipe)


@pytest.mark.parametrize("metadata", [False, True])
def test_an_unannotated_nnx_scan_stack_is_pipelined_on_its_inferred_layers_dim(metadata):
    """No sharding names: the dim nnx.scan runs over is inferred as 'layers', so a
    preset pipelines it (it was checked before names were inferred, and refused
    as 'a python list of blocks')."""
    info, plan = _scanned_plan(metadata)
    assert all(p.logical is None for p in info.params)
    assert plan.params["blocks/up/kernel"][0] == "pipe"
    assert plan.names_from["blocks/up/kernel"] == "inferred"
    assert "pipe" not in str(plan.params["embed/embedding"])


@pytest.mark.slow
def test_an_unannotated_nnx_scan_stack_runs_pipelined_as_on_one_device():
    """The plan above compiled and run on pipe=2 x data=4: one device's loss and grads."""
    import jax
    import numpy as np

    info, plan = _scanned_plan(False)
    params, batch = info.init_fn(), _lm_batch()
    want, ref = jax.jit(jax.value_and_grad(info.loss_fn))(params, batch)
    loss, grads = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan)(params, batch)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-6)


def test_no_stacked_dim_names_its_cause():
    """A python list of blocks: the error says no scan runs over a parameter; a
    stack the model names without 'layers': the error names those parameters."""
    from flax import nnx

    class Listed(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(32, _D, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(_D, _D, rngs=rngs) for _ in range(2)])
            self.head = nnx.Linear(_D, 32, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    mesh, pipe = sk.abstract_mesh(pipe=2), Pipeline(stages=2, microbatches=4)
    info = sk.describe(lambda: Listed(nnx.Rngs(0)), loss=_lm_loss, batch=_lm_batch())
    with pytest.raises(PipelineError, match="no scan in the loss runs over") as e:
        sk.plan(info, mesh, "dp", pipeline=pipe)
    assert "python list of blocks" in str(e.value)
    stacked = sk.describe(_scanned_mlp(False), loss=_lm_loss, batch=_lm_batch())
    names = {"blocks/*": (None,)}
    with pytest.raises(PipelineError, match="call that dim otherwise") as e:
        sk.plan(stacked, mesh, "dp", pipeline=pipe, names=names)
    assert "blocks/down/bias (4, 16) named (None, None)" in str(e.value)
    assert "python list" not in str(e.value).split("Fix:")[0]


def _deepseek(pipe: Pipeline):
    """DeepSeek's tiny config with 1 dense and 4 MoE layers: two layer stacks, the
    MoE one the layer scan the pipe axis splits."""
    import dataclasses

    spec = get_model("deepseek")
    config = dataclasses.replace(spec.configs["tiny"](), n_layers=5, n_dense_layers=1)
    mesh = sk.abstract_mesh(pipe=2, model=2)
    return sk.plan(spec, mesh, "megatron", config=config, pipeline=pipe, estimator="analytic")


def test_a_dense_stack_before_the_pipelined_one_runs_on_the_first_stage():
    p = _deepseek(Pipeline(stages=2, microbatches=4))
    assert p.params["moe_layers/attn/wo"][0] == "pipe"
    assert "pipe" not in str(p.params["dense_layers/attn/wo"])


def test_an_uneven_layout_is_priced_by_its_busiest_device():
    """Layer counts per chunk: an even layout given is the default's price; one
    device running 3 of the 4 MoE layers computes longer and holds more."""
    even = _deepseek(Pipeline(stages=2, microbatches=4)).cost
    assert _deepseek(Pipeline(stages=2, microbatches=4, layout=(2, 2))).cost == even
    p = _deepseek(Pipeline(stages=2, microbatches=4, layout=(1, 3)))
    uneven = p.cost
    assert p.pipeline.layout == (1, 3) and "layout 1-3" in p.table()
    assert Plan.from_json(p.to_json(), mesh=p.mesh).pipeline == p.pipeline
    assert uneven.compute_time_s - uneven.bubble_s > even.compute_time_s - even.bubble_s
    assert uneven.bubble_s > even.bubble_s  # p − 1 ticks of the 3-layer chunk
    assert uneven.memory["activations"] > even.memory["activations"]
    with pytest.raises(PipelineError, match="summing to 4"):
        _deepseek(Pipeline(stages=2, microbatches=4, layout=(2, 3)))


@pytest.mark.slow
def test_a_dense_stack_before_the_pipelined_one_runs_as_on_one_device():
    """DeepSeek's two stacks pipelined on pipe=2 x model=2: the dense layer on the
    first stage, the MoE stack split, one device's loss and grads; in an uneven
    layout of the same stack too (one MoE layer on the first stage, three on the
    second: the first chunk padded to three, its two padded layers skipped)."""
    import dataclasses

    import jax
    import numpy as np

    from spmdkit.introspect import describe

    spec = get_model("deepseek")
    config = dataclasses.replace(spec.configs["tiny"](), n_layers=5, n_dense_layers=1)
    mesh = sk.make_mesh(pipe=2, model=2)
    info = describe(spec, config=config)
    params = info.init_fn()
    batch = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), info.batch)
    want, ref = jax.jit(jax.value_and_grad(info.loss_fn))(params, batch)
    for layout in (None, (1, 3)):
        # two micro-batches, the fewest 1F1B runs on two stages: XLA's compile of the
        # step grows with them (31 CPU s at four, 18 at two), and the dense stack and
        # the padded chunk run the same at any count
        pipe = Pipeline(stages=2, microbatches=2, layout=layout)
        plan = sk.plan(spec, mesh, "megatron", config=config, pipeline=pipe, estimator="analytic")
        step = sk.jit(sk.value_and_grad(info.loss_fn, plan), plan)
        loss, grads = step(params, batch)
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-5)
