"""spmdkit.runtime.data: host batches → global sharded arrays, last-batch policies, positions."""

import collections
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.runtime.data import DataError, ShardedLoader, to_global


@pytest.fixture(scope="module")
def batch_sharding(mesh2d):
    return NamedSharding(mesh2d, P("a"))


def _source(n=10, d=3):
    return {
        "x": np.arange(n * d, dtype=np.float32).reshape(n, d),
        "y": np.arange(n, dtype=np.int32),
        "ids": [f"ex{i}" for i in range(n)],
    }


def test_to_global_shards_arrays_and_passes_other_fields(batch_sharding):
    batch = {"x": np.ones((4, 3), np.float32), "y": np.arange(4), "ids": ["a", "b", "c", "d"]}
    g = to_global(batch, batch_sharding)
    assert isinstance(g["x"], jax.Array) and g["x"].shape == (4, 3)
    assert g["x"].sharding.spec == P("a")
    assert g["y"].sharding.spec == P("a")  # the rank-1 field gets the spec's first entry
    assert g["ids"] is batch["ids"]  # untouched
    np.testing.assert_array_equal(np.asarray(g["y"]), np.arange(4))
    assert {s.data.shape for s in g["x"].addressable_shards} == {(2, 3)}


def test_to_global_per_field_shardings(mesh2d):
    sh = {"x": NamedSharding(mesh2d, P("a", "b")), "y": NamedSharding(mesh2d, P())}
    g = to_global({"x": np.ones((2, 8)), "y": np.ones(3)}, sh)
    assert g["x"].sharding.spec == P("a", "b") and g["y"].sharding.spec == P()
    with pytest.raises(DataError, match="no sharding for field 'z'"):
        to_global({"z": np.ones(2)}, sh)


def test_to_global_uneven_batch_is_a_typed_error(batch_sharding):
    with pytest.raises(DataError, match="divides evenly"):
        to_global({"x": np.ones((3, 2))}, batch_sharding)


def test_drop_policy_skips_the_remainder_and_is_reiterable(batch_sharding):
    loader = ShardedLoader(_source(10), batch_sharding, batch_size=4)
    assert loader.batches_per_epoch() == 2
    first = [np.asarray(b["y"]).tolist() for b in loader]
    second = [np.asarray(b["y"]).tolist() for b in loader]
    assert first == second == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert loader.state() == {"epoch": 2, "batch": 0}


def test_pad_policy_adds_a_mask(batch_sharding):
    loader = ShardedLoader(_source(10), batch_sharding, batch_size=4, last_batch="pad")
    batches = list(loader)
    assert len(batches) == 3
    last = batches[-1]
    assert last["x"].shape == (4, 3)
    np.testing.assert_array_equal(np.asarray(last["mask"]), [True, True, False, False])
    np.testing.assert_array_equal(np.asarray(last["x"])[2:], 0)
    # example-aligned non-tensor fields stay aligned with the rows: padded with None
    assert last["ids"] == ["ex8", "ex9", None, None]
    assert np.asarray(batches[0]["mask"]).all()


def test_keep_policy_yields_the_short_batch(batch_sharding):
    loader = ShardedLoader(_source(10), batch_sharding, batch_size=4, last_batch="keep")
    assert [b["x"].shape[0] for b in loader] == [4, 4, 2]


def test_position_roundtrip_resumes_exactly(batch_sharding):
    loader = ShardedLoader(_source(16), batch_sharding, batch_size=4, shuffle_seed=7)
    it = iter(loader)
    next(it)
    next(it)
    pos = loader.state()
    rest = [np.asarray(b["y"]).tolist() for b in it]
    fresh = ShardedLoader(_source(16), batch_sharding, batch_size=4, shuffle_seed=7)
    fresh.set_state(pos)
    assert [np.asarray(b["y"]).tolist() for b in fresh] == rest
    # the next epoch is shuffled differently but deterministically
    a = [np.asarray(b["y"]).tolist() for b in loader]
    b = [np.asarray(b["y"]).tolist() for b in fresh]
    assert a == b and sorted(y for batch in a for y in batch) == list(range(16))


def test_generic_source_replays_to_the_position(batch_sharding):
    def batches():
        for i in range(3):
            yield {"x": np.full((4, 2), i, np.float32)}
        yield {"x": np.full((2, 2), 9, np.float32)}  # short: dropped

    loader = ShardedLoader(batches, batch_sharding)
    assert [float(np.asarray(b["x"])[0, 0]) for b in loader] == [0, 1, 2]
    loader.set_state({"epoch": 1, "batch": 2})
    assert [float(np.asarray(b["x"])[0, 0]) for b in loader] == [2]


def test_bad_options_raise(batch_sharding):
    with pytest.raises(DataError, match="last_batch"):
        ShardedLoader(_source(), batch_sharding, batch_size=2, last_batch="wrap")
    with pytest.raises(DataError, match="batch_size"):
        ShardedLoader(_source(), batch_sharding)
    with pytest.raises(DataError, match="same number of examples"):
        ShardedLoader({"x": np.ones(3), "y": np.ones(4)}, batch_sharding, batch_size=2)
    with pytest.raises(DataError, match="epoch"):
        ShardedLoader(_source(), batch_sharding, batch_size=2).set_state({"step": 1})


@dataclasses.dataclass
class _Pair:
    pix: np.ndarray
    caption: str


def test_array_leaves_at_any_depth_become_global_arrays(batch_sharding):
    Named = collections.namedtuple("Named", "a b")
    batch = {
        "img": {"pix": np.ones((4, 2), np.float32)},
        "seq": [np.arange(4), ("keep", np.zeros((4, 1)))],
        "nt": Named(np.ones(4), None),
        "dc": _Pair(np.ones((4, 3)), "a cat"),
        "ids": ["a", "b", "c", "d"],
    }
    g = to_global(batch, batch_sharding)
    for arr in (g["img"]["pix"], g["seq"][0], g["seq"][1][1], g["nt"].a, g["dc"].pix):
        assert isinstance(arr, jax.Array) and arr.sharding.spec[0] == "a"
    assert g["seq"][1][0] == "keep" and g["nt"].b is None and g["dc"].caption == "a cat"
    assert g["ids"] is batch["ids"] and isinstance(g["nt"], Named)
    assert isinstance(batch["img"]["pix"], np.ndarray)  # the input is not modified
    # a dict of shardings is followed down the tree
    sh = {"img": {"pix": NamedSharding(batch_sharding.mesh, P(None, "b"))}, "y": batch_sharding}
    g = to_global({"img": {"pix": np.ones((4, 4))}, "y": np.ones(4)}, sh)
    assert g["img"]["pix"].sharding.spec == P(None, "b")
    with pytest.raises(DataError, match="img/other"):
        to_global({"img": {"other": np.ones(4)}}, sh)


def _id_source(n=12):
    return {
        "x": np.arange(n, dtype=np.float32)[:, None],
        "meta": {"ids": [f"e{i}" for i in range(n)]},
    }


def test_non_tensor_fields_follow_their_examples_and_resume_exactly(batch_sharding):
    loader = ShardedLoader(_id_source(), batch_sharding, batch_size=4, shuffle_seed=3)
    it = iter(loader)
    first = next(it)
    ids = first["meta"]["ids"]
    assert [f"e{int(v)}" for v in np.asarray(first["x"])[:, 0]] == ids
    pos = loader.state()
    rest = [list(b["meta"]["ids"]) for b in it]
    fresh = ShardedLoader(_id_source(), batch_sharding, batch_size=4, shuffle_seed=3)
    fresh.set_state(pos)
    assert [list(b["meta"]["ids"]) for b in fresh] == rest
    again = [list(b["meta"]["ids"]) for b in loader]  # re-iterating: the next epoch, whole
    assert len(again) == 3 and again != rest


def test_bucketing_pads_to_the_smallest_fitting_bucket(batch_sharding):
    lengths = [3, 5, 2, 7, 8, 1, 4, 6]
    tokens = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
    loader = ShardedLoader(
        {"tokens": tokens, "ids": list(range(8))},
        batch_sharding,
        batch_size=4,
        bucket_sizes=(4, 8),
        bucket_dims={"tokens": 0},
    )
    b1, b2 = list(loader)
    assert b1["tokens"].shape == (4, 8) and b2["tokens"].shape == (4, 8)
    mask = np.asarray(b1["tokens_mask"])
    assert mask.sum(axis=1).tolist() == lengths[:4]
    np.testing.assert_array_equal(np.asarray(b1["tokens"])[0], [1, 2, 3, 0, 0, 0, 0, 0])
    small = ShardedLoader(
        {"tokens": tokens[:2] + tokens[5:7]},
        batch_sharding,
        batch_size=4,
        bucket_sizes=(4, 8),
        bucket_dims={"tokens": 0},
    )
    assert next(iter(small))["tokens"].shape == (4, 8)  # the 5-token example needs 8
    images = [np.ones((h, w, 3), np.float32) for h, w in [(2, 3), (4, 1)]]
    (img,) = list(
        ShardedLoader(
            {"im": images},
            batch_sharding,
            batch_size=2,
            bucket_sizes=(2, 4),
            bucket_dims={"im": (0, 1)},
        )
    )
    assert img["im"].shape == (2, 4, 4, 3) and img["im_mask"].shape == (2, 4, 4)
    assert np.asarray(img["im_mask"]).sum(axis=(1, 2)).tolist() == [6, 4]
    with pytest.raises(DataError, match="largest bucket"):
        list(
            ShardedLoader(
                {"t": tokens}, batch_sharding, batch_size=4, bucket_sizes=(4,), bucket_dims={"t": 0}
            )
        )
    with pytest.raises(DataError, match="bucket_dims"):
        ShardedLoader({"t": tokens}, batch_sharding, batch_size=4, bucket_sizes=(4,))
    # a bucketed field that is not one array per example (found by tests/test_fuzz.py)
    gen = lambda: iter([{"x": None}])  # noqa: E731
    with pytest.raises(DataError, match="'x': NoneType None, not one array per example"):
        list(ShardedLoader(gen, batch_sharding, bucket_sizes=(2, 4), bucket_dims={"x": 0}))


def test_malformed_sources_are_typed_errors(batch_sharding):
    with pytest.raises(DataError, match="sequence of examples"):
        ShardedLoader({"x": 3}, batch_sharding, batch_size=2)
    with pytest.raises(DataError, match="no fields"):
        ShardedLoader({}, batch_sharding, batch_size=2)
    with pytest.raises(DataError, match="non-iterable"):
        list(ShardedLoader(lambda: 5, batch_sharding))
    with pytest.raises(DataError, match="pad"):
        list(ShardedLoader(lambda: iter([[np.ones(4)]]), batch_sharding, last_batch="pad"))
