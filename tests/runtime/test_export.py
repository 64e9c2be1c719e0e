"""spmdkit.runtime.export: safetensors export, import sharded onto any plan."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.models import get_model
from spmdkit.runtime.checkpoint import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    abstract_target,
    tree_paths,
)
from spmdkit.runtime.export import (
    INDEX_FILE,
    export_params,
    exported_config,
    exported_shapes,
    import_params,
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """GPT-tiny's parameters laid out by a 2x4 megatron plan, exported."""
    spec = get_model("gpt")
    mesh = sk.make_mesh(data=2, model=4)
    plan = sk.plan(spec, mesh, "megatron", config="tiny", batch_size=8)
    with nnx.use_eager_sharding(False):
        model = spec.build(spec.config("tiny"), nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    abstract = jax.eval_shape(lambda: params)
    params = jax.device_put(params, plan.param_shardings(abstract))
    assert any(
        isinstance(x.sharding, NamedSharding) and x.sharding.spec != P()
        for x in jax.tree.leaves(params)
    )
    d = tmp_path_factory.mktemp("export")
    export_params(params, d, config={"model": "gpt", "size": "tiny"}, max_file_bytes=1 << 16)
    return d, params, abstract, spec


def _same(a, b):
    for (p, x), y in zip(tree_paths(a).items(), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, p
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=p)


@pytest.mark.slow
def test_export_writes_one_tensor_per_parameter_path(exported):
    d, params, _, _ = exported
    index = json.loads((d / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tree_paths(params))
    assert len(set(index["weight_map"].values())) > 1  # split at max_file_bytes
    shapes = exported_shapes(d)
    assert {p: s.shape for p, s in shapes.items()} == {
        p: x.shape for p, x in tree_paths(params).items()
    }
    assert exported_config(d) == {"model": "gpt", "size": "tiny"}


def test_round_trip_is_bit_exact_onto_one_device_and_a_4x2_fsdp_plan(exported):
    d, params, abstract, spec = exported
    one = SingleDeviceSharding(jax.devices()[0])
    single = import_params(d, abstract_target(abstract, jax.tree.map(lambda _: one, abstract)))
    _same(params, single)
    assert all(x.sharding == one for x in jax.tree.leaves(single))
    fsdp = sk.plan(spec, sk.make_mesh(data=4, model=2), "fsdp", config="tiny", batch_size=8)
    shardings = fsdp.param_shardings(abstract)
    sharded = import_params(d, abstract_target(abstract, shardings))
    _same(params, sharded)
    for x, s in zip(jax.tree.leaves(sharded), jax.tree.leaves(shardings), strict=True):
        assert x.sharding == s
    # a sharded tensor arrives as shards: no device holds all of it
    big = max(jax.tree.leaves(sharded), key=lambda x: x.size)
    assert all(s.data.size < big.size for s in big.addressable_shards)


def test_mismatched_targets_and_bad_inputs_are_typed_errors(exported, tmp_path, mesh2d):
    d, _, abstract, _ = exported
    rep = NamedSharding(mesh2d, P())
    target = abstract_target(abstract, jax.tree.map(lambda _: rep, abstract))
    flat = tree_paths(target)
    first = next(iter(flat))
    with pytest.raises(CheckpointMismatchError, match="not in the export"):
        import_params(d, {**target, "extra": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=rep)})
    with pytest.raises(CheckpointMismatchError, match="without a sharding"):
        import_params(d, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target))
    wrong = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=rep), target
    )
    with pytest.raises(CheckpointMismatchError, match=first.split("/")[0]):
        import_params(d, wrong)
    with pytest.raises(CheckpointNotFoundError):
        import_params(tmp_path, target)
    with pytest.raises(CheckpointError, match="PRNG key"):
        export_params({"k": jax.random.key(0)}, tmp_path / "k")
    with pytest.raises(CheckpointError, match="no arrays"):
        export_params({}, tmp_path / "e")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / INDEX_FILE).write_text("{")
    with pytest.raises(CheckpointCorruptedError):
        exported_shapes(tmp_path / "bad")


def test_zero_size_and_damaged_tensors(tmp_path, mesh2d):
    params = {
        "w": jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh2d, P("a", "b"))),
        "z": jnp.zeros((0, 4), jnp.bfloat16),
    }
    export_params(params, tmp_path)
    target = abstract_target(
        params, {"w": NamedSharding(mesh2d, P("b")), "z": NamedSharding(mesh2d, P(None, "b"))}
    )
    back = import_params(tmp_path, target)
    assert back["z"].shape == (0, 4) and back["z"].sharding.spec == P(None, "b")
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(params["w"]))
    # flip the last data byte of the file: the checksum catches it
    path = tmp_path / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptedError, match="checksum"):
        import_params(tmp_path, target)
