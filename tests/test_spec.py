"""TensorSpec: construction, validation, printing, JAX round trips."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk


def test_short_and_long_forms_agree():
    a = sk.TensorSpec((64, 32), P("y", None), partial={"x": "max"})
    b = sk.TensorSpec((64, 32), [("y",), None], partial={"x": "max"})
    assert a == b and hash(a) == hash(b)
    assert a.dims == (("y",), ())
    assert a.partial_ops == {"x": "max"}


def test_partial_axis_names_mean_sum():
    assert sk.TensorSpec((4,), partial=("x", "y")).partial_ops == {"x": "sum", "y": "sum"}
    assert sk.TensorSpec((4,), partial="x").partial_ops == {"x": "sum"}


def test_prints_like_jax_typeof():
    s = sk.TensorSpec((64, 32), P("y", "x"), dtype="float32")
    assert str(s) == "f32[64@y,32@x]"
    multi = sk.TensorSpec((8, 4), P(("data", "fsdp")), partial={"model": "sum"}, dtype="bfloat16")
    assert str(multi) == "bf16[8@(data,fsdp),4]{sum:model}"
    assert str(sk.TensorSpec((3,))) == "[3]"


def test_frozen_and_hashable():
    s = sk.TensorSpec((4, 4), P("x"))
    with pytest.raises(AttributeError):
        s.shape = (2, 2)
    assert {s: 1}[sk.TensorSpec((4, 4), P("x", None))] == 1
    assert pickle.loads(pickle.dumps(s)) == s


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (lambda m: sk.TensorSpec((8, 8), P("x", "x")), sk.DuplicateAxisError),
        (lambda m: sk.TensorSpec((8, 8), P(("x", "x"))), sk.DuplicateAxisError),
        (lambda m: sk.TensorSpec((8,), P("x"), partial="x"), sk.PartialConflictError),
        (lambda m: sk.TensorSpec((8,), partial={"x": "mean"}), sk.PartialConflictError),
        (lambda m: sk.TensorSpec((8,), P("modle"), mesh=m), sk.UnknownAxisError),
        (lambda m: sk.TensorSpec((8,), P("x", None)), sk.SpecError),
        (lambda m: sk.TensorSpec((8,), [3]), sk.SpecError),
        (
            lambda m: sk.TensorSpec((8,), P(unreduced={"x"}), partial={"x": "max"}),
            sk.PartialConflictError,
        ),
        (lambda m: sk.TensorSpec((-1,)), sk.SpecError),
    ],
)
def test_bad_specs_raise_typed_errors(build, error):
    mesh = sk.abstract_mesh(x=2, model=4)
    with pytest.raises(error) as info:
        build(mesh)
    err = info.value
    assert isinstance(err, sk.SpmdError) and isinstance(err, ValueError)
    assert err.op and err.must and err.given and err.fix
    assert "Fix:" in str(err)


def test_unknown_axis_names_near_match():
    with pytest.raises(sk.UnknownAxisError, match="did you mean 'model'"):
        sk.TensorSpec((8,), P("modle"), mesh=sk.abstract_mesh(data=2, model=4))


def test_partition_spec_round_trip_with_unreduced():
    s = sk.TensorSpec((8, 4), P(("a", "b")), partial={"c": "sum"})
    p = s.to_partition_spec()
    assert p == P(("a", "b"), unreduced={"c"})
    assert sk.TensorSpec((8, 4), p) == s


def test_non_sum_partial_has_no_partition_spec():
    with pytest.raises(sk.SpecError, match="sum-partial"):
        sk.TensorSpec((8,), partial={"x": "max"}).to_partition_spec()


def test_named_sharding_and_shape_dtype_struct_round_trip(mesh2d):
    s = sk.TensorSpec((8, 4), P("b", "a"), dtype="bfloat16")
    ns = s.to_named_sharding(mesh2d)
    assert isinstance(ns, NamedSharding) and ns.spec == P("b", "a")
    assert sk.TensorSpec.from_sharding((8, 4), ns, dtype="bfloat16") == s
    sds = s.to_shape_dtype_struct(mesh2d)
    assert sds.shape == (8, 4) and sds.dtype == jnp.bfloat16
    assert sk.TensorSpec.from_value(sds) == s


def test_from_real_array(mesh2d):
    x = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh2d, P("b")))
    assert str(sk.TensorSpec.from_value(x)) == "f32[8@b,4]"
    assert sk.TensorSpec.from_value(np.zeros(3)).is_replicated


def test_local_shape_pads_uneven_dims():
    mesh = sk.abstract_mesh(x=4)
    s = sk.TensorSpec((6, 3), P("x"), dtype="float32")
    assert s.local_shape(mesh) == (2, 3)
    assert s.local_bytes(mesh) == 24
    assert not s.is_even(mesh)
    assert sk.TensorSpec((8, 3), P("x")).is_even(mesh)


def test_replace_and_without_partial():
    s = sk.TensorSpec((8, 4), P("x"), partial={"y": "sum"})
    assert s.without_partial() == sk.TensorSpec((8, 4), P("x"))
    assert s.replace(spec=P(None, "x")).dims == ((), ("x",))
    with pytest.raises(TypeError):
        s.replace(bogus=1)
