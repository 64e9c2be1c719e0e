"""Sharded checkpoints on orbax: save on one mesh, restore onto any other.

A checkpoint is one orbax step directory holding two items:

* ``state`` — the array pytree (params, optimizer state, step, RNG keys, ...),
  written by orbax's ``PyTreeCheckpointHandler`` shard by shard, each process
  writing only what it owns;
* ``meta`` — one JSON document: the step, the data-iterator position, the plan
  (``plan.to_json()``) and mesh it was saved with, user metadata, which leaves were
  typed PRNG keys, and a checksum per array.

Atomicity comes from orbax: a step is written into a temporary directory and
renamed only when every item is complete, so a process killed at any moment of a
save leaves at most a temporary directory that :meth:`Manager.latest_step` never
picks; the next :class:`Manager` on that directory deletes it.

Restores always go through an *abstract target*: a pytree of
``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` (or arrays, whose sharding is
used). Every process then reads only the shards its devices hold, so a restore
onto more, fewer or differently laid out devices never gathers a whole tensor on
one device. Before reading, the target is checked against the saved metadata:
missing or unexpected keys, different shapes, and different dtypes raise
:class:`CheckpointMismatchError` naming every offending path (orbax itself would
cast dtypes silently; pass ``allow_cast=True`` to ask for the cast). After
reading, each array's checksum is compared with the saved one, so a damaged file
raises :class:`CheckpointCorruptedError` instead of yielding wrong values.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from spmdkit.errors import SpmdError

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointCorruptedError",
    "Manager",
    "Restored",
    "abstract_target",
    "mesh_metadata",
]

_FORMAT = "spmdkit.checkpoint/1"
_MAX_LISTED = 8


class CheckpointError(SpmdError, RuntimeError):
    """Root of the checkpoint errors.

    Broken example: ``Manager(d).restore(target=t)`` while another run is writing
    garbage into ``d``.
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint exists for the requested step.

    Broken example: ``Manager(empty_dir).restore(target=t)``.
    """


class CheckpointMismatchError(CheckpointError, ValueError):
    """The restore target disagrees with the saved metadata: keys, shapes or dtypes.

    Broken example: restoring a float32 checkpoint into a bfloat16 target without
    ``allow_cast=True``.
    """


class CheckpointCorruptedError(CheckpointError):
    """A checkpoint exists but cannot be read back intact (damaged or truncated files,
    checksum mismatch, unreadable metadata).

    Broken example: overwriting bytes of a file under ``<dir>/<step>/state/``.
    """


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Manager.restore` returns.

    Attributes:
      step: the restored step.
      state: the restored pytree, laid out as the target asked.
      metadata: the JSON metadata saved with it (``data``, ``plan``, ``mesh``, ``user``...).
    """

    step: int
    state: Any
    metadata: dict[str, Any]

    @property
    def data_state(self) -> Any:
        """The data-iterator position saved with the checkpoint (or ``None``)."""
        return self.metadata.get("data")

    @property
    def plan_json(self) -> str | None:
        """The ``plan.to_json()`` text saved with the checkpoint (or ``None``)."""
        return self.metadata.get("plan")


# -- paths, keys and checksums --------------------------------------------------


def _key_str(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _path(path: tuple) -> str:
    return "/".join(_key_str(k) for k in path) or "<root>"


def _flat(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_path(p): leaf for p, leaf in leaves}


def _listing(paths: list[str]) -> str:
    shown = ", ".join(paths[:_MAX_LISTED])
    return shown + (f" and {len(paths) - _MAX_LISTED} more" if len(paths) > _MAX_LISTED else "")


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _checksum_leaf(x: jax.Array) -> jax.Array:
    """A position-weighted sum of the array's bits, mod 2**32: independent of the
    sharding and of reduction order (integer addition), sensitive to any changed or
    moved element. The weights come from per-dim iotas so XLA fuses them into the
    reduction instead of materialising an index array."""
    bits = x.dtype.itemsize * 8
    if x.dtype == jnp.bool_:
        words = x.astype(jnp.uint32)
    elif bits <= 32:
        unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
        words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    else:  # 64-bit: split every element into two 32-bit words
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    index = jnp.zeros((), jnp.uint32)
    stride = 1
    for d in reversed(range(words.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, d)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= words.shape[d]
    return jnp.sum(words * (index * jnp.uint32(2654435761) + jnp.uint32(1)), dtype=jnp.uint32)


def _checksummable(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if not isinstance(x, jax.Array) or dtype is None:
        return False
    return dtype == jnp.bool_ or (
        jnp.issubdtype(dtype, jnp.number) and not jnp.issubdtype(dtype, jnp.complexfloating)
    )


# one compiled checksum per (shape, dtype, sharding), whatever the leaf's name
_checksum_jit = jax.jit(_checksum_leaf)


def _compute_checksums(flat: dict[str, Any]) -> dict[str, int]:
    # One checksum at a time: each is a program with a cross-device reduction, and
    # several such programs in flight at once can deadlock XLA:CPU's in-process
    # collectives (seen restoring onto another mesh: 7 of 8 devices joined an
    # all-reduce). Blocking per leaf also bounds the transient memory to one leaf.
    out: dict[str, int] = {}
    for k, v in flat.items():
        if _checksummable(v):
            out[k] = int(np.asarray(_checksum_jit(v)))
    return out


# -- metadata helpers ------------------------------------------------------------


def mesh_metadata(mesh: Any) -> dict[str, Any]:
    """A JSON-able description of a mesh: ``{"axes": {name: size}, "axis_types": [...]}``.

    Example::

        >>> mesh_metadata(sk.make_mesh(data=2, model=4))["axes"]
        {'data': 2, 'model': 4}
    """
    axes = {str(n): int(s) for n, s in zip(mesh.axis_names, mesh.axis_sizes, strict=True)}
    types = [str(t).split(".")[-1] for t in getattr(mesh, "axis_types", ())]
    return {"axes": axes, "axis_types": types, "device_count": int(np.prod(mesh.axis_sizes))}


def _spec_str(x: Any) -> str | None:
    sharding = getattr(x, "sharding", None)
    return str(sharding.spec) if isinstance(sharding, NamedSharding) else None


def abstract_target(tree: Any, shardings: Any | None = None) -> Any:
    """Turn arrays / ShapeDtypeStructs (+ a matching pytree of shardings) into a restore
    target: a pytree of ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``.

    Args:
      tree: a pytree whose leaves have ``shape`` and ``dtype`` (arrays, ShapeDtypeStructs).
      shardings: a pytree of shardings with the same structure, or ``None`` to keep
        each leaf's own ``sharding``.

    Returns:
      The abstract target pytree.

    Example::

        >>> t = abstract_target(jax.eval_shape(init), plan_shardings)
        >>> mgr.restore(target=t)
    """
    if shardings is None:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            tree,
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


# -- the manager -------------------------------------------------------------------


class Manager:
    """Periodic, asynchronous, atomic sharded checkpoints in one directory.

    Args:
      directory: where step directories live (created if missing).
      max_to_keep: keep at most this many complete checkpoints (``None``: all).
      save_interval_steps: :meth:`save` writes only on multiples of this (unless
        ``force=True``), and always when the directory holds no checkpoint yet.
      async_: write in the background; :meth:`save` returns after the device→host
        copy, :meth:`wait` blocks until the files are committed.
      save_concurrent_gb: bound on host memory (GB) used by in-flight writes.
      restore_concurrent_gb: bound on host memory (GB) used by in-flight reads.
      verify: store a checksum per array at save (one device reduction) and check it
        after restore.

    Example::

        >>> mgr = Manager("/tmp/run", max_to_keep=2)
        >>> mgr.save(100, {"params": params, "opt_state": opt_state}, plan=plan)
        >>> mgr.wait()
        >>> r = mgr.restore(target=abstract_target(state, other_shardings))
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_: bool = True,
        save_concurrent_gb: int | None = None,
        restore_concurrent_gb: int | None = None,
        verify: bool = True,
    ) -> None:
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise CheckpointError(
                op="checkpoint.Manager",
                must="save_interval_steps is a positive int",
                given=repr(save_interval_steps),
                fix="pass save_interval_steps=1 (every step) or larger",
            )
        self.directory = os.path.abspath(os.fspath(directory))
        self.verify = verify
        self._handlers = {
            "state": ocp.PyTreeCheckpointHandler(
                save_concurrent_gb=save_concurrent_gb,
                restore_concurrent_gb=restore_concurrent_gb,
            ),
            "meta": ocp.JsonCheckpointHandler(),
        }
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._mgr = ocp.CheckpointManager(
            self.directory, item_handlers=self._handlers, options=options
        )

    # lifecycle
    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pending writes, then release orbax's threads."""
        self._mgr.close()

    def wait(self) -> None:
        """Block until every pending asynchronous save is committed to disk."""
        self._mgr.wait_until_finished()

    # queries
    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``."""
        self._mgr.reload()
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all complete checkpoints, ascending."""
        self._mgr.reload()
        return sorted(self._mgr.all_steps())

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` at ``step`` would write (the save interval)."""
        return self._mgr.should_save(step)

    def _resolve(self, step: int | None, op: str) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(
                    op=op,
                    must="the directory holds at least one complete checkpoint",
                    given=f"none in {self.directory}",
                    fix="save one first, or start without resume",
                )
            return steps[-1]
        if step not in steps:
            raise CheckpointNotFoundError(
                op=op,
                must="the requested step is a complete checkpoint",
                given=f"step {step}; complete steps: {steps}",
                fix="pass one of the listed steps or step=None for the latest",
            )
        return step

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata saved with a checkpoint (default: the latest)."""
        return self._metadata(self._resolve(step, "checkpoint.metadata"))

    def _metadata(self, step: int) -> dict[str, Any]:
        path = os.path.join(self.directory, str(step), "meta", "metadata")
        try:
            with open(path) as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointCorruptedError(
                op="checkpoint.metadata",
                must="the checkpoint's metadata file is readable JSON",
                given=f"{path}: {e}",
                fix="restore an older step (all_steps()) or delete this one",
            ) from e
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise CheckpointCorruptedError(
                op="checkpoint.metadata",
                must=f"the metadata has format {_FORMAT!r}",
                given=f"{path}: {str(meta)[:80]}",
                fix="restore an older step (all_steps()) or delete this one",
            )
        return meta

    def saved_shapes(self, step: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
        """Shape and dtype of every saved array, keyed by path (``"params/w"``)."""
        step = self._resolve(step, "checkpoint.saved_shapes")
        return self._saved_shapes(step, self._metadata(step))

    def _saved_shapes(self, step: int, meta: dict[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
        try:
            tree = self._mgr.item_metadata(step)["state"].tree
        except Exception as e:
            raise CheckpointCorruptedError(
                op="checkpoint.saved_shapes",
                must="the checkpoint's array metadata is readable",
                given=f"step {step} in {self.directory}: {type(e).__name__}: {e}",
                fix="restore an older step (all_steps()) or delete this one",
            ) from e
        keys = meta.get("prng_keys", {})
        out = {
            path: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype))
            for path, m in _flat(tree).items()
            if path not in keys
        }
        for path, info in keys.items():
            dtype = jax.eval_shape(lambda impl=info["impl"]: jax.random.key(0, impl=impl)).dtype
            out[path] = jax.ShapeDtypeStruct(tuple(info["shape"]), dtype)
        return out

    # save
    def save(
        self,
        step: int,
        state: Any,
        *,
        plan: Any | None = None,
        mesh: Any | None = None,
        data: Any | None = None,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Save ``state`` as checkpoint ``step`` (asynchronously unless ``async_=False``).

        Args:
          step: the step number (checkpoint name).
          state: a pytree of arrays (typed PRNG keys allowed).
          plan: a plan object (its ``to_json()`` and ``mesh`` are recorded).
          mesh: the mesh, when no plan is given (recorded as axes and axis types).
          data: the data-iterator position: an object with ``state()`` or any JSON value.
          metadata: extra JSON-able user metadata.
          force: save even when ``step`` is not on the save interval.

        Returns:
          Whether a save was started.
        """
        if not force and not self._mgr.should_save(step):
            return False
        flat = _flat(state)
        keys = {p: v for p, v in flat.items() if _is_key(v)}
        if keys:
            state = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)
        if mesh is None and plan is not None:
            mesh = getattr(plan, "mesh", None)
        if data is not None and hasattr(data, "state") and callable(data.state):
            data = data.state()
        meta = {
            "format": _FORMAT,
            "step": int(step),
            "data": data,
            "plan": plan.to_json() if plan is not None else None,
            "mesh": mesh_metadata(mesh) if mesh is not None else None,
            "process_count": jax.process_count(),
            "user": dict(metadata) if metadata else None,
            "prng_keys": {
                p: {"impl": str(jax.random.key_impl(k)), "shape": list(k.shape)}
                for p, k in keys.items()
            },
            "specs": {p: _spec_str(v) for p, v in _flat(state).items()},
            "checksums": _compute_checksums(_flat(state)) if self.verify else {},
        }
        try:
            json.dumps(meta)
        except TypeError as e:
            raise CheckpointError(
                op="checkpoint.save",
                must="data position and metadata are JSON-serialisable",
                given=str(e),
                fix="pass plain dicts/lists/str/int/float",
            ) from e
        return self._mgr.save(
            step,
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
            force=force,
        )

    # restore
    def restore(
        self,
        step: int | None = None,
        *,
        target: Any,
        partial: bool = False,
        allow_cast: bool = False,
    ) -> Restored:
        """Restore a checkpoint onto the layout ``target`` describes.

        Args:
          step: which step (default: the latest complete one).
          target: a pytree of ``jax.ShapeDtypeStruct`` with ``sharding=`` (or arrays);
            see :func:`abstract_target`. Any mesh, specs or device count.
          partial: restore only the keys in ``target`` (e.g. ``{"params": ...}`` for
            weights into a fresh optimizer); saved keys not in the target are skipped.
          allow_cast: let a target dtype differ from the saved one (orbax casts).

        Returns:
          :class:`Restored` with the state and its metadata.

        Raises:
          CheckpointNotFoundError: no such (complete) checkpoint.
          CheckpointMismatchError: keys, shapes or dtypes disagree (paths named).
          CheckpointCorruptedError: the files cannot be read back intact.
        """
        op = "checkpoint.restore"
        step = self._resolve(step, op)
        meta = self._metadata(step)
        saved = self._saved_shapes(step, meta)
        key_info = meta.get("prng_keys", {})
        flat_target = _flat(target)
        self._check(op, saved, flat_target, partial=partial, allow_cast=allow_cast)

        def to_restore_leaf(path: str, x: Any) -> Any:
            sharding = getattr(x, "sharding", None)
            if not isinstance(sharding, jax.sharding.Sharding):
                raise CheckpointError(
                    op=op,
                    must="every target leaf carries a sharding",
                    given=f"{path}: {x!r}",
                    fix="build the target with abstract_target(tree, shardings)",
                )
            if path in key_info:
                data_shape = jax.eval_shape(jax.random.key_data, x).shape
                return jax.ShapeDtypeStruct(data_shape, jnp.uint32, sharding=sharding)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
        paths = [_path(p) for p, _ in paths_leaves]
        raw = jax.tree_util.tree_unflatten(
            treedef, [to_restore_leaf(p, x) for p, (_, x) in zip(paths, paths_leaves, strict=True)]
        )
        try:
            out = self._mgr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        raw,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(raw),
                        partial_restore=partial,
                    ),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:
            raise CheckpointCorruptedError(
                op=op,
                must="the checkpoint's array files are readable",
                given=f"step {step} in {self.directory}: {type(e).__name__}: {str(e)[:300]}",
                fix="restore an older step (all_steps()) or delete this one",
            ) from e
        state = out["state"]
        flat_state = _flat(state)
        if self.verify and meta.get("checksums"):
            self._verify(op, step, meta["checksums"], flat_state, saved, flat_target)
        if key_info:
            leaves = [
                jax.random.wrap_key_data(v, impl=key_info[p]["impl"]) if p in key_info else v
                for p, v in zip(paths, jax.tree.leaves(state), strict=True)
            ]
            state = jax.tree_util.tree_unflatten(treedef, leaves)
        return Restored(step=step, state=state, metadata=meta)

    def _check(
        self,
        op: str,
        saved: dict[str, jax.ShapeDtypeStruct],
        target: dict[str, Any],
        *,
        partial: bool,
        allow_cast: bool,
    ) -> None:
        missing = sorted(set(target) - set(saved))
        if missing:
            raise CheckpointMismatchError(
                op=op,
                must="every target key exists in the checkpoint",
                given=f"not in the checkpoint: {_listing(missing)}",
                fix="drop those keys from the target, or restore a checkpoint that has them",
            )
        extra = sorted(set(saved) - set(target))
        if extra and not partial:
            raise CheckpointMismatchError(
                op=op,
                must="the target has every saved key (or partial=True)",
                given=f"saved but not in the target: {_listing(extra)}",
                fix="add them to the target, or pass partial=True to skip them",
            )
        bad_shape = [
            f"{p} saved {saved[p].shape} target {tuple(x.shape)}"
            for p, x in target.items()
            if tuple(saved[p].shape) != tuple(x.shape)
        ]
        if bad_shape:
            raise CheckpointMismatchError(
                op=op,
                must="target shapes equal the saved shapes",
                given=_listing(bad_shape),
                fix="build the target from the same model config as the checkpoint",
            )
        bad_dtype = [
            f"{p} saved {saved[p].dtype} target {x.dtype}"
            for p, x in target.items()
            if saved[p].dtype != x.dtype
        ]
        if bad_dtype and not allow_cast:
            raise CheckpointMismatchError(
                op=op,
                must="target dtypes equal the saved dtypes",
                given=_listing(bad_dtype),
                fix="use the saved dtypes in the target, or pass allow_cast=True to cast",
            )

    def _verify(
        self,
        op: str,
        step: int,
        checksums: dict[str, int],
        state: dict[str, Any],
        saved: dict[str, jax.ShapeDtypeStruct],
        target: dict[str, Any],
    ) -> None:
        same_dtype = {
            p: v
            for p, v in state.items()
            if p in checksums and saved[p].dtype == target[p].dtype and _checksummable(v)
        }
        got = _compute_checksums(same_dtype)
        bad = sorted(p for p, c in got.items() if c != checksums[p])
        if bad:
            raise CheckpointCorruptedError(
                op=op,
                must="restored arrays match the checksums recorded at save",
                given=f"step {step}: checksum mismatch in {_listing(bad)}",
                fix="the files are damaged: restore an older step (all_steps())",
            )
