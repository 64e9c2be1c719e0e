"""One case checked: a rule's claim on every device's pieces against the unsharded op."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.testing import check_forward_case, enumerate_specs

T = sk.TensorSpec


def test_single_forward_case(mesh2d):
    rng = np.random.default_rng(0)
    x, w = (
        rng.standard_normal((8, 8)).astype(np.float32),
        rng.standard_normal((8, 4)).astype(np.float32),
    )
    failure, res = check_forward_case(
        "matmul", [T((8, 8), P("a", "b")), T((8, 4), P("b"))], mesh2d, values=[x, w]
    )
    assert failure is None
    assert str(res.outputs[0]) == "[8@a,4]{sum:b}"


_DIMS = st.sampled_from([4, 8])


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    op=st.sampled_from(["add", "mul", "matmul", "reduce_sum", "reduce_max", "softmax", "exp"]),
    m=st.integers(0, 1),
)
def test_property_random_specs(data, op, m, mesh1d, mesh2d):
    """Random shapes and specs: every inferred spec is valid and the numeric check holds."""
    mesh = (mesh1d, mesh2d)[m]
    shape = (data.draw(_DIMS), data.draw(_DIMS))
    shapes = {"add": [shape, shape[1:]], "mul": [shape, shape], "matmul": [shape, shape[::-1]]}
    shapes = shapes.get(op, [shape])
    takes_axis = op.startswith("reduce") or op == "softmax"
    attrs = {"axis": data.draw(st.sampled_from([0, 1]))} if takes_axis else {}
    specs = [data.draw(st.sampled_from(enumerate_specs(s, mesh))) for s in shapes]
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    failure, res = check_forward_case(op, specs, mesh, values=values, attrs=attrs)
    assert failure is None, str(failure)
    for s in (*res.inputs, *res.outputs):
        s.validate(mesh)
        assert not (s.used_axes - set(mesh.axis_names))
