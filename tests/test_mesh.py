"""Meshes: real (virtual CPU) and abstract, with chosen axis types."""

import pytest
from jax.sharding import AxisType

import spmdkit as sk


def test_make_mesh_explicit_by_default():
    mesh = sk.make_mesh(data=2, model=4)
    assert mesh.axis_names == ("data", "model")
    assert mesh.devices.shape == (2, 4)
    assert all(t == AxisType.Explicit for t in mesh.axis_types)


def test_make_mesh_auto_on_request():
    mesh = sk.make_mesh(x=8, axis_types="auto")
    assert mesh.axis_types == (AxisType.Auto,)


def test_abstract_mesh_plans_a_thousand_devices():
    mesh = sk.abstract_mesh(data=128, model=8)
    assert mesh.size == 1024
    spec = sk.TensorSpec((4096, 4096), ("data", "model"), mesh=mesh)
    assert spec.local_shape(mesh) == (32, 512)


@pytest.mark.parametrize(
    "call",
    [
        lambda: sk.make_mesh(x=64),
        sk.make_mesh,
        lambda: sk.abstract_mesh(x=0),
        lambda: sk.abstract_mesh(x=2, axis_types="manual"),
    ],
)
def test_bad_meshes_raise(call):
    with pytest.raises(sk.SpmdError) as info:
        call()
    assert info.value.fix


def test_virtual_devices_already_there():
    assert sk.use_virtual_cpu_devices(8)
