"""spmdkit.runtime.checkpoint: sharded save, restore onto any mesh, checks, corruption, crash."""

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.runtime.checkpoint import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    Manager,
    checksums,
    config_metadata,
    mesh_metadata,
)


def _state(mesh):
    w = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) / 7.0
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))),
            "b": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(mesh, P("b"))),
        },
        "opt_state": {"mu": jax.device_put(-w, NamedSharding(mesh, P(None, "b")))},
        "count": jnp.int32(5),
        "rng": jax.random.key(42),
    }


class _Plan:
    """The plan duck type: to_json() and mesh."""

    def __init__(self, mesh):
        self.mesh = mesh

    def to_json(self):
        return json.dumps({"strategy": "fake", "axes": list(self.mesh.axis_names)})


def _target(state, mesh, specs):
    """Target on ``mesh``: ``specs`` maps a leaf path to a spec; the rest replicated."""

    def leaf(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, specs.get(name, P()))
        )

    return jax.tree_util.tree_map_with_path(leaf, state)


def _equal(a, b):
    fa, fb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(x), jax.random.key_data(y))
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, mesh2d):
    """One checkpoint saved on the 2x4 mesh, with plan metadata and a data position."""
    d = tmp_path_factory.mktemp("ckpt")
    state = _state(mesh2d)
    with Manager(d) as mgr:
        assert mgr.save(3, state, plan=_Plan(mesh2d), data={"epoch": 1, "batch": 4})
        mgr.wait()
    return d, state


@pytest.mark.parametrize(
    "shape,specs",
    [
        ((8,), {"params/w": P("x"), "params/b": P("x"), "opt_state/mu": P(None, "x")}),
        ((4, 2), {"params/w": P("y", "x"), "opt_state/mu": P("x", "y")}),
        ((1,), {}),
    ],
    ids=["8x1", "4x2", "1-device"],
)
def test_restore_onto_other_meshes_is_bit_exact(saved, shape, specs):
    d, state = saved
    names = ("x", "y")[: len(shape)]
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])
    target = _target(state, mesh, specs)
    r = Manager(d).restore(target=target)
    assert r.step == 3
    _equal(r.state, state)
    for x, t in zip(jax.tree.leaves(r.state), jax.tree.leaves(target), strict=True):
        assert x.sharding == t.sharding
    # sharded leaves arrive as shards: no device holds the whole tensor
    w = r.state["params"]["w"]
    if specs:
        assert all(s.data.size < w.size for s in w.addressable_shards)


def test_metadata_holds_plan_mesh_data_and_keys(saved, mesh2d):
    d, _ = saved
    mgr = Manager(d)
    meta = mgr.metadata()
    assert meta["step"] == 3 and meta["data"] == {"epoch": 1, "batch": 4}
    assert json.loads(meta["plan"]) == {"strategy": "fake", "axes": ["a", "b"]}
    assert meta["mesh"] == mesh_metadata(mesh2d)
    assert meta["mesh"]["axes"] == {"a": 2, "b": 4}
    assert meta["mesh"]["axis_types"] == ["Explicit", "Explicit"]
    assert meta["specs"]["params/w"] == str(P("a", "b"))
    assert set(meta["prng_keys"]) == {"rng"}
    shapes = mgr.saved_shapes()
    assert shapes["params/b"].dtype == jnp.bfloat16 and shapes["params/w"].shape == (16, 8)


def test_partial_restore_loads_params_only(saved, mesh2d):
    d, state = saved
    target = {"params": _target(state["params"], mesh2d, {"w": P("b", "a")})}
    r = Manager(d).restore(target=target, partial=True)
    assert set(r.state) == {"params"}
    _equal(r.state["params"], state["params"])
    assert r.state["params"]["w"].sharding.spec == P("b", "a")


def test_mismatches_raise_naming_paths(saved, mesh2d):
    d, state = saved
    mgr = Manager(d)
    good = _target(state, mesh2d, {})
    bad_dtype = dict(
        good, count=jax.ShapeDtypeStruct((), jnp.float32, sharding=good["count"].sharding)
    )
    with pytest.raises(CheckpointMismatchError, match="count saved int32 target float32"):
        mgr.restore(target=bad_dtype)
    r = mgr.restore(target=bad_dtype, allow_cast=True)
    assert r.state["count"].dtype == jnp.float32 and float(r.state["count"]) == 5.0
    w = good["params"]["w"]
    bad_shape = {
        **good,
        "params": {
            **good["params"],
            "w": jax.ShapeDtypeStruct((8, 16), w.dtype, sharding=w.sharding),
        },
    }
    with pytest.raises(CheckpointMismatchError, match=r"params/w saved \(16, 8\) target \(8, 16\)"):
        mgr.restore(target=bad_shape)
    missing = {**good, "extra": good["count"]}
    with pytest.raises(CheckpointMismatchError, match="not in the checkpoint: extra"):
        mgr.restore(target=missing)
    fewer = {k: v for k, v in good.items() if k != "opt_state"}
    with pytest.raises(CheckpointMismatchError, match="saved but not in the target: opt_state/mu"):
        mgr.restore(target=fewer)
    no_sharding = {**good, "count": jax.ShapeDtypeStruct((), jnp.int32)}
    with pytest.raises(CheckpointError, match="carries a sharding"):
        mgr.restore(target=no_sharding)


def test_missing_checkpoints_raise(tmp_path, saved, mesh2d):
    d, state = saved
    with pytest.raises(CheckpointNotFoundError, match="at least one complete checkpoint"):
        Manager(tmp_path / "empty").restore(target={})
    with pytest.raises(CheckpointNotFoundError, match="complete steps: \\[3\\]"):
        Manager(d).restore(7, target=_target(state, mesh2d, {}))


def _copy_checkpoint(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupted_array_file_raises(tmp_path, saved, mesh2d):
    d, state = saved
    d2 = _copy_checkpoint(d, tmp_path / "c")
    # the OCDBT data files (array chunks and the b-tree that indexes them)
    for path in (d2 / "3" / "state").glob("**/d/*"):
        data = bytearray(path.read_bytes())
        for i in range(len(data) // 4, len(data)):
            data[i] ^= 0xA5
        path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptedError, match=r"readable|checksum"):
        Manager(d2).restore(target=_target(state, mesh2d, {}))


def test_checksum_mismatch_and_bad_metadata_raise(tmp_path, saved, mesh2d):
    d, state = saved
    d2 = _copy_checkpoint(d, tmp_path / "c")
    meta_path = d2 / "3" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["checksums"]["params/w"] += 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointCorruptedError, match="checksum mismatch in params/w"):
        Manager(d2).restore(target=_target(state, mesh2d, {}))
    meta_path.write_text("{not json")
    with pytest.raises(CheckpointCorruptedError, match="readable JSON"):
        Manager(d2).restore(target=_target(state, mesh2d, {}))


def _chunk_of(w, mesh, spec, device_index):
    """The bytes of one shard of ``w`` as an uncompressed chunk holds them."""
    x = jax.device_put(w, NamedSharding(mesh, spec))
    shard = next(s for s in x.addressable_shards if s.device == mesh.devices.flat[device_index])
    return np.ascontiguousarray(np.asarray(shard.data)).tobytes()


def _damage(directory, chunk, edit):
    """Apply ``edit`` to the one place ``chunk`` occurs in the checkpoint's data files."""
    hits = []
    for path in (directory / "3" / "state").glob("**/d/*"):
        data = bytearray(path.read_bytes())
        at = data.find(chunk)
        if at >= 0:
            hits.append(path)
            data[at : at + len(chunk)] = edit(bytearray(chunk))
            path.write_bytes(bytes(data))
    assert len(hits) == 1, hits


@pytest.mark.parametrize("damage", ["bit flip", "two elements swapped"])
def test_checksums_catch_silent_damage_to_array_bytes(tmp_path, mesh2d, damage):
    # The chunks are stored raw (no zstd; 2 KiB each, above OCDBT's 1 KiB inlining into
    # its compressed b-tree), so damaging a value inside one leaves every file readable:
    # orbax returns the wrong number, and only the checksum notices.
    w = np.random.default_rng(0).standard_normal((64, 64), dtype=np.float32)
    state = {"w": jax.device_put(w, NamedSharding(mesh2d, P("a", "b")))}
    with Manager(tmp_path / "c") as mgr:
        mgr.save(3, state)

    def edit(b):
        if damage == "bit flip":
            b[9] ^= 0x10
        else:  # two float32 elements trade places: the same multiset of words
            b[0:4], b[4:8] = b[4:8], b[0:4]
        return b

    _damage(tmp_path / "c", _chunk_of(w, mesh2d, P("a", "b"), 7), edit)
    target = _target(state, mesh2d, {"w": P("b", "a")})
    wrong = Manager(tmp_path / "c", verify=False).restore(target=target).state["w"]
    assert not np.array_equal(np.asarray(wrong), w)  # the damage is silent without checks
    with pytest.raises(CheckpointCorruptedError, match="checksum mismatch in w"):
        Manager(tmp_path / "c").restore(target=target)


def test_compressed_checkpoints_are_smaller_and_restore_alike(tmp_path, mesh2d):
    zeros = {"w": jax.device_put(jnp.zeros((64, 256)), NamedSharding(mesh2d, P("a", "b")))}
    sizes = {}
    for compress in (False, True):
        d = tmp_path / f"z{compress}"
        with Manager(d, compress=compress) as mgr:
            mgr.save(3, zeros)
        sizes[compress] = sum(f.stat().st_size for f in (d / "3" / "state").glob("**/d/*"))
        # the reader follows the files, whatever the restoring Manager's flag
        out = Manager(d, compress=not compress).restore(target=_target(zeros, mesh2d, {}))
        _equal(out.state, zeros)
    assert sizes[True] * 4 < sizes[False], sizes


@pytest.mark.parametrize(
    "dtype", ["float32", "bfloat16", "int8", "bool", "uint16", "int32", "float64", "int64"]
)
def test_host_checksum_equals_the_device_checksum(mesh2d, dtype):
    # On CPU the checksum is computed from the shards in host memory; elsewhere on the
    # devices. Both must give the same number for every layout, or a checkpoint saved
    # on one platform would fail verification on the other.
    rng = np.random.default_rng(0)
    layouts = [
        ((8, 12), P("a", "b")),
        ((8, 12), P("b", None)),
        ((4, 8, 6), P(None, "b", "a")),
        ((6, 5, 8), P(None, None, "b")),
        ((16,), P(("a", "b"))),
        ((3,), P()),
        ((), P()),
        ((8, 0), P("a")),  # no elements
    ]
    data = {
        shape: (rng.standard_normal(shape) * 100).astype(jnp.dtype(dtype)) for shape, _ in layouts
    }
    with jax.enable_x64(dtype.endswith("64")):
        flat = {
            (shape, spec): jax.device_put(data[shape], NamedSharding(mesh2d, spec))
            for shape, spec in layouts
        }
        host = checksums(flat, evaluator="host")
        device = checksums(flat, evaluator="device")
        assert checksums(flat) == host  # "auto" evaluates CPU arrays on the host
        with pytest.raises(CheckpointError, match="evaluator"):
            checksums(flat, evaluator="gpu")
    assert host == device
    # the same values under two layouts agree; different arrays differ
    assert host[((8, 12), P("a", "b"))] == host[((8, 12), P("b", None))]
    assert host[((8, 0), P("a"))] == 0
    assert len(set(host.values())) == len(layouts) - 1


def test_async_save_copies_before_returning_and_keeps_max(tmp_path, mesh2d):
    # bounded host memory: orbax's in-flight byte limits are options
    mgr = Manager(
        tmp_path,
        max_to_keep=2,
        save_interval_steps=2,
        save_concurrent_gb=1,
        restore_concurrent_gb=1,
    )
    started = []
    for step in range(1, 7):
        s = _state(mesh2d)
        started.append(mgr.save(step, s))
        want = jax.tree.map(np.asarray, s["params"])
        # the arrays may be donated right after save returns
        for x in jax.tree.leaves(s):
            x.delete()
    mgr.wait()
    # orbax always saves into an empty directory, then on the interval
    assert started == [True, True, False, True, False, True]
    assert mgr.all_steps() == [4, 6]
    r = mgr.restore(target={"params": _target(_state(mesh2d)["params"], mesh2d, {})}, partial=True)
    _equal(r.state["params"], want)
    mgr.close()
    with pytest.raises(CheckpointError, match="save_interval_steps"):
        Manager(tmp_path, save_interval_steps=0)


# A zygote: imports jax/orbax/spmdkit once (no backend started, one thread), then
# forks one child per line on stdin, so each killed process costs no import time.
_ZYGOTE = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from spmdkit.runtime.checkpoint import Manager

    def trial(d, stop):
        mesh = jax.make_mesh((4,), ("x",))
        sh = NamedSharding(mesh, P("x"))
        base = jnp.arange(1 << 19, dtype=jnp.float32).reshape(512, 1024)

        def state(step):
            return {"w": jax.device_put(base + step, sh), "v": jax.device_put(base * step, sh),
                    "step": jnp.int32(step)}

        leftovers = [n for n in os.listdir(d) if "tmp" in n]
        mgr = Manager(d, max_to_keep=2)
        latest = mgr.latest_step()
        if latest is not None:
            target = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(0))
            r = mgr.restore(target=target).state
            want = state(latest)
            for k in want:
                np.testing.assert_array_equal(np.asarray(r[k]), np.asarray(want[k]))
        print("RESTORED", latest, len(leftovers), os.getpid(), flush=True)
        step = latest or 0
        while True:
            step += 1
            mgr.save(step, state(step), force=True)
            print("SAVING", step, flush=True)
            if stop and step >= stop:
                mgr.wait()
                print("FINISHED", flush=True)
                return

    for line in sys.stdin:
        d, stop = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                trial(d, int(stop))
                os._exit(0)
            except BaseException:
                import traceback
                traceback.print_exc()
                os._exit(1)
        os.waitpid(pid, 0)
        print("DONE", flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.heavy
def test_sigkill_during_async_save_never_leaves_a_partial_latest(tmp_path):
    script = tmp_path / "zygote.py"
    script.write_text(_ZYGOTE)
    ckdir = tmp_path / "ck"
    ckdir.mkdir()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    zygote = subprocess.Popen(
        [sys.executable, str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
        start_new_session=True,
    )

    def finish():
        # the child may have printed more SAVING lines before it died
        last = None
        for line in iter(zygote.stdout.readline, ""):
            if line.startswith("DONE"):
                return last
            if line.startswith("SAVING"):
                last = int(line.split()[1])
        raise AssertionError("the zygote died")

    def start(stop):
        zygote.stdin.write(f"{ckdir} {stop}\n")
        zygote.stdin.flush()
        line = zygote.stdout.readline().split()
        assert line and line[0] == "RESTORED", line
        latest = 0 if line[1] == "None" else int(line[1])
        return latest, int(line[2]), int(line[3])

    # kill after the k-th save started plus a delay: lands in the device→host copy, the
    # background write, the commit rename, or between saves
    moments = [
        (1, 0.0),
        (1, 0.01),
        (2, 0.02),
        (1, 0.04),
        (2, 0.06),
        (1, 0.09),
        (3, 0.0),
        (2, 0.13),
        (1, 0.2),
        (2, 0.3),
        (1, 0.005),
    ]
    last_started = 0
    leftovers_seen = 0
    try:
        for k, delay in moments:
            latest, leftovers, pid = start(0)
            # a save is only started after the previous one committed, so the newest
            # complete checkpoint is the last started save or the one before it
            assert latest in (last_started - 1, last_started), (latest, last_started)
            leftovers_seen += leftovers
            for _ in range(k):
                line = zygote.stdout.readline().split()
                assert line and line[0] == "SAVING", line
                last_started = int(line[1])
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            last_started = finish() or last_started
        latest, _, _ = start(last_started + 1)
        assert latest in (last_started - 1, last_started)
        lines = [zygote.stdout.readline().split() for _ in range(last_started + 1 - latest)]
        assert lines[-1] == ["SAVING", str(last_started + 1)]
        assert zygote.stdout.readline().strip() == "FINISHED"
        finish()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(zygote.pid, signal.SIGKILL)  # the zygote and any child left
        zygote.wait(timeout=60)
    assert not [n for n in os.listdir(ckdir) if "tmp" in n]  # leftovers were cleaned
    assert leftovers_seen >= 1  # some kill did land inside a save


def test_zero_size_arrays_save_and_restore_with_their_shape(tmp_path, mesh2d):
    state = {
        "w": jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh2d, P("a", "b"))),
        "empty": jax.device_put(jnp.zeros((0, 8), jnp.bfloat16), NamedSharding(mesh2d, P("a"))),
        "none": jnp.zeros((3, 0), jnp.int32),
    }
    with Manager(tmp_path, async_=False) as mgr:
        assert mgr.save(1, state)
    mgr = Manager(tmp_path)
    shapes = mgr.saved_shapes()
    assert shapes["empty"].shape == (0, 8) and shapes["empty"].dtype == jnp.bfloat16
    target = _target(state, mesh2d, {"empty": P(None, "b"), "w": P("b")})
    r = mgr.restore(target=target)
    assert r.state["empty"].shape == (0, 8) and r.state["empty"].dtype == jnp.bfloat16
    assert r.state["empty"].sharding.spec == P(None, "b") and r.state["none"].shape == (3, 0)
    np.testing.assert_array_equal(np.asarray(r.state["w"]), 1.0)
    bad = dict(
        target, empty=jax.ShapeDtypeStruct((0, 4), jnp.bfloat16, sharding=target["w"].sharding)
    )
    with pytest.raises(CheckpointMismatchError, match="empty saved"):
        mgr.restore(target=bad)


@pytest.mark.parametrize("state", [{}, {"a": {}, "b": jnp.zeros((0,))}], ids=["empty", "no-data"])
def test_an_empty_state_saves_and_restores(tmp_path, mesh2d, state):
    with Manager(tmp_path, async_=False) as mgr:
        assert mgr.save(2, state, data={"epoch": 0, "batch": 1})
    r = Manager(tmp_path).restore(target=_target(state, mesh2d, {}))
    assert r.step == 2 and r.data_state == {"epoch": 0, "batch": 1}
    assert jax.tree.structure(r.state) == jax.tree.structure(state)


@dataclasses.dataclass
class _Config:
    d_model: int
    name: str


def test_items_and_config_params_only_save_and_restore(tmp_path, saved, mesh2d):
    d, state = saved
    full = _target(state, mesh2d, {"params/w": P("b", "a")})
    r = Manager(d).restore(target=full, items=("params",))
    assert set(r.state) == {"params"} and r.state["params"]["w"].sharding.spec == P("b", "a")
    _equal(r.state["params"], state["params"])
    with Manager(tmp_path, async_=False) as mgr:
        mgr.save(5, state, items=("params",), config=_Config(64, "tiny"))
    mgr = Manager(tmp_path)
    assert {p.split("/")[0] for p in mgr.saved_shapes()} == {"params"}
    r = mgr.restore(target={"params": full["params"]})
    assert r.config == {"d_model": 64, "name": "tiny"}
    assert r.config_as(_Config) == _Config(64, "tiny")
    assert r.metadata["config"]["class"].endswith(":_Config")
    with pytest.raises(CheckpointError, match="fields of the given class"):
        r.config_as(Manager)
    with pytest.raises(CheckpointError, match="items="):
        mgr.save(6, state, items=("nope",), force=True)
    with pytest.raises(CheckpointError, match="dataclass instance or a dict"):
        mgr.save(6, state, config=[1, 2], force=True)
    with pytest.raises(CheckpointError, match="JSON"):
        mgr.save(6, state, config={"f": object()}, force=True)
    # dtypes (as model configs hold them) are saved by name
    assert config_metadata({"dtype": jnp.bfloat16, "d": np.dtype("int8"), "s": (1, 2)}) == {
        "class": None,
        "value": {"dtype": "bfloat16", "d": "int8", "s": [1, 2]},
    }


@pytest.mark.slow
def test_a_table_moved_into_a_module_restores_with_rename(tmp_path, mesh2d):
    # saved before the token table became sk.nn.Embed: params/embed (and its moments)
    import optax

    table = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
    old_params = {"embed": table, "blocks": [{"w": jnp.ones(8)}, {"w": jnp.zeros(8)}]}
    old = {"params": old_params, "opt_state": optax.adam(1e-3).init(old_params)}
    old["opt_state"][0].mu["embed"] = table + 1.0
    with Manager(tmp_path) as mgr:
        mgr.save(1, {**old, "rng": jax.random.key(3)}, force=True)
        mgr.wait()

    def moved(tree):  # the new layout: embed/embedding
        return {**tree, "embed": {"embedding": tree["embed"]}}

    new_params = moved(old_params)
    opt = old["opt_state"][0]
    new = {
        "params": new_params,
        "opt_state": (opt._replace(mu=moved(opt.mu), nu=moved(opt.nu)), old["opt_state"][1]),
        "rng": jax.random.key(3),
    }
    target = _target(new, mesh2d, {"params/embed/embedding": P("a", "b")})
    mgr = Manager(tmp_path)
    with pytest.raises(CheckpointMismatchError) as e:
        mgr.restore(target=target)
    message = str(e.value)
    assert "params/embed -> params/embed/embedding" in message
    assert "rename={'embed': 'embed/embedding'}" in message
    r = mgr.restore(target=target, rename={"embed": "embed/embedding"})
    _equal(r.state, new)
    assert r.state["params"]["embed"]["embedding"].sharding.spec == P("a", "b")
    np.testing.assert_array_equal(r.state["opt_state"][0].mu["embed"]["embedding"], table + 1.0)
    # params only, into a fresh optimizer
    r = mgr.restore(target=target, items=("params",), rename={"embed": "embed/embedding"})
    assert set(r.state) == {"params"}
    _equal(r.state["params"], new_params)


def test_read_only_manager_creates_and_writes_nothing(tmp_path, mesh2d):
    with pytest.raises(CheckpointNotFoundError, match="read_only=True"):
        Manager(tmp_path / "missing", read_only=True)
    assert not (tmp_path / "missing").exists()
    w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh2d, P("a")))
    with Manager(tmp_path / "run", async_=False) as mgr:
        mgr.save(3, {"w": w})
    with Manager(tmp_path / "run", read_only=True) as mgr:
        assert mgr.all_steps() == [3] and mgr.saved_shapes()["w"].shape == (8, 4)
        with pytest.raises(CheckpointError, match="opened to write"):
            mgr.save(4, {"w": w}, force=True)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["3"]
