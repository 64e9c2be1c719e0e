"""ConvNet: GroupNorm and BatchNorm blocks, BatchNorm statistics in train/eval mode."""

import numpy as np
import pytest
from flax import nnx

from spmdkit import nn as sknn
from spmdkit.models import convnet
from spmdkit.models.layers import ModelConfigError


def test_mixes_group_and_batch_norm(tiny):
    _, _, model = tiny("convnet")
    kinds = {type(b.norm1) for b in model.blocks}
    assert kinds == {sknn.GroupNorm, sknn.BatchNorm}  # the spmdkit.nn drop-ins
    stats = nnx.to_flat_state(nnx.state(model, nnx.BatchStat))
    assert len(stats) == 4  # mean and var of the two BatchNorms of the "batch" stage
    assert model.blocks[1].norm1.mean.get_metadata()["out_sharding"] == ("norm",)
    names = ("conv_window", "conv_window", "conv_in", "conv_out")
    assert model.stem.kernel.get_metadata()["out_sharding"] == names
    assert model.head.get_metadata()["out_sharding"] == ("embed", "classes")


def test_batch_stats_update_in_train_mode_only(tiny):
    _, cfg, model = tiny("convnet")
    batch = convnet.image_batch(cfg, 4, np.random.default_rng(0))
    forward = nnx.jit(lambda model, images: model(images))
    bn = model.blocks[1].norm1
    saved = nnx.state(model, nnx.BatchStat)
    try:
        model.train()
        m0 = np.asarray(bn.mean[...])
        forward(model, batch["images"])
        m1 = np.asarray(bn.mean[...])
        assert not np.allclose(m0, m1)
        model.eval()
        out = forward(model, batch["images"])
        np.testing.assert_array_equal(np.asarray(bn.mean[...]), m1)  # eval: frozen
        # Eval normalizes with running stats: one image alone gives the same logits.
        np.testing.assert_allclose(
            forward(model, batch["images"][:1]), out[:1], rtol=1e-4, atol=1e-5
        )
    finally:
        model.train()
        nnx.update(model, saved)


def test_bad_config_raises_typed_error():
    with pytest.raises(ModelConfigError, match="norms"):
        convnet.ConvNetConfig(norms=("group", "layer"))
    with pytest.raises(ModelConfigError, match="per stage"):
        convnet.ConvNetConfig(blocks=(1,))
