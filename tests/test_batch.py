"""spmdkit.batch: batch trees at a step's boundary, and the one micro-batch split."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdkit.batch import (
    Batch,
    BatchError,
    as_traced,
    as_tree,
    is_array_field,
    is_tensor,
    microbatches,
    split_batch,
    split_rows,
    stack_rows,
)


def test_what_is_a_tensor():
    assert is_array_field(np.ones(2)) and is_array_field(np.array([True]))
    assert not is_array_field(np.array(["a"])) and not is_array_field([1, 2])
    assert not is_array_field(3) and is_tensor(3) and is_tensor(np.float32(1))
    assert is_tensor(jax.ShapeDtypeStruct((2,), jnp.float32))
    assert not is_tensor("ex0") and not is_tensor(None) and not is_tensor(np.array(["a"]))


@dataclasses.dataclass
class _Pair:
    pix: np.ndarray
    caption: str


def test_a_batch_with_strings_travels_as_one_node_keyed_by_path():
    batch = {
        "inp": {"x": np.ones((4, 2))},
        "ids": ["a", "b", "c", "d"],
        "dc": _Pair(np.ones(4), "c"),
    }
    node = as_traced(batch)
    assert isinstance(node, Batch)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(node)[0]]
    assert paths == ["['inp/x']", "['dc/pix']"]
    back = as_tree(node)
    assert back["ids"] == batch["ids"] and back["dc"].caption == "c"
    plain = {"x": np.ones(2), "t": 0.5}
    assert as_traced(plain) is plain and as_tree(plain) is plain


def test_the_static_part_compares_by_structure_not_value():
    """Two batches whose ids differ compile one step: the skeleton is the same."""
    one = as_traced({"x": np.ones(2), "ids": ["a", "b"]})
    two = as_traced({"x": np.zeros(2), "ids": ["c", "d"]})
    assert jax.tree.structure(one) == jax.tree.structure(two)
    longer = as_traced({"x": np.ones(2), "ids": ["a", "b", "c"]})
    assert jax.tree.structure(one) != jax.tree.structure(longer)
    traces = []

    @jax.jit
    def f(b):
        traces.append(as_tree(b)["ids"])
        return b.leaves[0].sum()

    f(one), f(two)
    assert traces == [["a", "b"]]


def test_split_rows_takes_strided_rows_and_names_the_leaf():
    x = jnp.arange(12).reshape(6, 2)
    y = split_rows(x, 2)
    assert y.shape == (2, 3, 2) and y[1, :, 0].tolist() == [2, 6, 10]
    with pytest.raises(BatchError, match=r"batch\['x'\]: shape \(6, 2\), microbatches=4"):
        stack_rows({"x": x}, 4)


def test_microbatches_split_example_aligned_fields_and_keep_scalars_whole():
    batch = {"x": jnp.arange(8).reshape(4, 2), "ids": ["a", "b", "c", "d"], "t": 0.5, "tag": "k"}
    mb = microbatches(batch, 2)
    assert mb.unrolled and len(mb.stacked) == 1
    second = mb.batch(1, mb.rows(1))
    assert second["ids"] == ["b", "d"] and second["t"] == 0.5 and second["tag"] == "k"
    assert second["x"][:, 0].tolist() == [2, 6]
    assert not microbatches({"x": jnp.ones((4, 2))}, 2).unrolled
    leaves, skel = split_batch({"x": np.ones(2), "ids": ["a"]})
    assert len(leaves) == 1 and skel.paths == ("x",)
