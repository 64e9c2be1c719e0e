"""Sharded checkpoints on orbax: save on one mesh, restore onto any other.

A checkpoint is one orbax step directory holding two items:

* ``state`` — the array pytree (params, optimizer state, step, RNG keys, ...),
  written by orbax's ``PyTreeCheckpointHandler`` shard by shard, each process
  writing only what it owns;
* ``meta`` — one JSON document: the step, the data-iterator position, the plan
  (``plan.to_json()``) and mesh it was saved with, user metadata, which leaves were
  typed PRNG keys, a checksum per array, the model config, and the shape and
  dtype of every zero-size array (orbax cannot write those: they hold no data and
  are rebuilt from this record at restore).

``save(items=("params",))`` writes only some top-level keys of the state (a
params-only checkpoint for export or inference); ``restore(items=("params",))``
reads only those, so parameters can go into a fresh optimizer. A state with no
array data at all (``{}``, or only zero-size arrays) is saved as metadata alone.

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
cast dtypes silently; pass ``allow_cast=True`` to ask for the cast). A parameter
that moved into a module since the save (the reference models' token table
``embed`` is now ``sk.nn.Embed``'s ``embed/embedding``) is named as such in that
error, and ``restore(rename={"embed": "embed/embedding"})`` reads it from its old
path (every saved path ending in ``embed``, so the optimizer's moments too). After
reading, each array's checksum is compared with the saved one, so a damaged file
raises :class:`CheckpointCorruptedError` instead of yielding wrong values.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from spmdkit.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from spmdkit.runtime.checksums import checksummable, checksums

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointCorruptedError",
    "Manager",
    "Restored",
    "abstract_target",
    "check_target_leaf",
    "config_metadata",
    "tree_paths",
    "mesh_metadata",
]

_FORMAT = "spmdkit.checkpoint/1"
_MAX_LISTED = 8


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

    @property
    def config(self) -> dict[str, Any] | None:
        """The model config saved with the checkpoint, as a JSON dict (or ``None``)."""
        saved = self.metadata.get("config")
        return saved["value"] if saved else None

    def config_as(self, cls: Any) -> Any:
        """The saved model config rebuilt as ``cls(**config)`` (a dataclass, usually).

        Raises:
          CheckpointError: no config was saved, or ``cls`` does not accept its fields.
        """
        value = self.config
        try:
            if value is None:
                raise TypeError("no config was saved with this checkpoint")
            return cls(**value)
        except TypeError as e:
            raise CheckpointError(
                op="checkpoint.Restored.config_as",
                must="the saved config has the fields of the given class",
                given=f"{getattr(cls, '__name__', cls)}: {e}",
                fix="save with Manager.save(..., config=cfg), and pass the config's class",
            ) from e


def _config_json(v: Any) -> Any:
    """Config values as JSON: containers walked, dtypes (``jnp.float32``,
    ``np.dtype``) by name; anything else as is (``json.dumps`` judges it)."""
    if isinstance(v, Mapping):
        return {str(k): _config_json(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_config_json(x) for x in v]
    if isinstance(v, np.dtype):
        return v.name
    if isinstance(v, type) and (
        issubclass(v, np.generic) or isinstance(getattr(v, "dtype", None), np.dtype)
    ):
        return np.dtype(v).name
    return v


def config_metadata(config: Any) -> dict[str, Any] | None:
    """A model config (dataclass, dict or ``None``) as JSON metadata:
    ``{"class": "module:QualName" or None, "value": {...}}``; dtypes are saved by
    name (``"bfloat16"``) and tuples as lists.

    Raises:
      CheckpointError: the config is neither, or not JSON-serialisable.

    Example::

        >>> config_metadata({"d_model": 64})
        {'class': None, 'value': {'d_model': 64}}
    """
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        cls = type(config)
        value = _config_json(dataclasses.asdict(config))
        out = {"class": f"{cls.__module__}:{cls.__qualname__}", "value": value}
    elif isinstance(config, Mapping):
        out = {"class": None, "value": _config_json(dict(config))}
    else:
        raise CheckpointError(
            op="checkpoint.save",
            must="the model config is a dataclass instance or a dict",
            given=type(config).__name__,
            fix="pass config=dataclasses.asdict(cfg) or the dataclass itself",
        )
    try:
        json.dumps(out)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            op="checkpoint.save",
            must="the model config is JSON-serialisable",
            given=str(e),
            fix="keep config fields to str/int/float/bool/None, lists and dicts",
        ) from e
    return out


# -- paths and keys --------------------------------------------------

_SKIP = object()


def _saved_name(path: str, rename: Mapping[str, str] | None) -> str:
    """The saved path a target leaf is read from: ``path`` with its longest suffix
    among ``rename``'s values (whole components) replaced by that rule's key."""
    best = None
    for old, new in (rename or {}).items():
        if (path == new or path.endswith("/" + new)) and (best is None or len(new) > len(best[1])):
            best = (old, new)
    return path if best is None else path[: len(path) - len(best[1])] + best[0]


def _moved_into_modules(
    missing: list[str], saved: Mapping[str, Any], target: Mapping[str, Any]
) -> dict[str, tuple[tuple[str, str], str]]:
    """Missing target paths whose parent path is a saved array of the same shape
    (a parameter that became a module's): ``{target: ((old, new) suffixes, saved)}``."""
    out = {}
    for t in missing:
        parts = t.split("/")
        for i in range(len(parts) - 1, 0, -1):
            s = "/".join(parts[:i])
            if s in saved and s not in target and saved[s].shape == tuple(target[t].shape):
                out[t] = ((parts[i - 1], "/".join(parts[i - 1 :])), s)
                break
    return out


def _read_struct(x: Any, key: bool) -> jax.ShapeDtypeStruct:
    """What orbax reads for target leaf ``x``: its shape, dtype and sharding; a
    PRNG key array as its ``uint32`` key data (``key``)."""
    if key:
        shape = jax.eval_shape(jax.random.key_data, x).shape
        return jax.ShapeDtypeStruct(shape, jnp.uint32, sharding=x.sharding)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _prune(op: str, tree: Any) -> Any:
    """``tree`` without its :data:`_SKIP` leaves (dict entries dropped; a list or
    tuple keeps all its saved elements or none: orbax restores sequences whole)."""
    if isinstance(tree, Mapping):
        kept = {k: _prune(op, v) for k, v in tree.items()}
        kept = {k: v for k, v in kept.items() if v is not _SKIP}
        return kept if kept else _SKIP
    if isinstance(tree, (list, tuple)):
        kept = [_prune(op, v) for v in tree]
        data = [v for v in kept if v is not None]  # None: nothing saved there
        if all(v is _SKIP for v in data):
            return _SKIP
        if any(v is _SKIP for v in data):
            raise CheckpointError(
                op=op,
                must="a rename restore reads a saved list or tuple whole",
                given="the target holds only some elements of a saved sequence",
                fix="put every element of that sequence in the target, or restore without rename",
            )
        return type(tree)(kept) if isinstance(tree, list) else tuple(kept)
    return tree


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


def tree_paths(tree: Any) -> dict[str, Any]:
    """A pytree's leaves keyed by their ``/``-joined paths, the names checkpoints and
    exports use (``"params/layers/0/kernel"``).

    Example::

        >>> tree_paths({"params": {"w": 1, "b": [2, 3]}})
        {'params/b/0': 2, 'params/b/1': 3, 'params/w': 1}
    """
    return _flat(tree)


def _listing(paths: list[str]) -> str:
    shown = ", ".join(paths[:_MAX_LISTED])
    return shown + (f" and {len(paths) - _MAX_LISTED} more" if len(paths) > _MAX_LISTED else "")


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


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


def _is_zero_size(x: Any) -> bool:
    shape = getattr(x, "shape", None)
    return shape is not None and hasattr(x, "dtype") and 0 in tuple(shape)


def _zeros_like(x: Any) -> jax.Array:
    """A zero-size array of ``x``'s shape and dtype laid out by its sharding (no data
    moves: every shard is empty)."""
    empty = np.zeros(x.shape, jnp.dtype(x.dtype))
    return jax.make_array_from_callback(x.shape, x.sharding, lambda index: empty[index])


def check_target_leaf(op: str, path: str, x: Any) -> None:
    """Raise a typed error unless ``x`` (a restore or import target leaf) has a
    sharding that lays out its shape evenly.

    Raises:
      CheckpointError: no sharding.
      CheckpointMismatchError: the sharding does not divide the shape.
    """
    if not isinstance(getattr(x, "sharding", None), jax.sharding.Sharding):
        raise CheckpointError(
            op=op,
            must="every target leaf carries a sharding",
            given=f"{path}: {x!r}",
            fix="build the target with abstract_target(tree, shardings)",
        )
    try:
        x.sharding.shard_shape(tuple(x.shape))
    except ValueError as e:
        raise CheckpointMismatchError(
            op=op,
            must="every target sharding divides its leaf's shape evenly",
            given=f"{path}: shape {tuple(x.shape)}, {x.sharding}: {str(e)[:160]}",
            fix="shard that dim over fewer devices, or replicate it",
        ) from e


def _select_items(op: str, tree: Any, items: Sequence[str] | None) -> Any:
    """The top-level keys ``items`` of a dict tree (all of it when ``items`` is None)."""
    if items is None:
        return tree
    if isinstance(items, str) or not isinstance(tree, Mapping):
        raise CheckpointError(
            op=op,
            must="items= is a sequence of top-level keys of a dict state",
            given=f"items={items!r} for a {type(tree).__name__}",
            fix="pass e.g. items=('params',) with a dict such as {'params': ..., 'opt_state': ...}",
        )
    missing = [k for k in items if k not in tree]
    if missing:
        raise CheckpointError(
            op=op,
            must="every key in items= is a top-level key of the state",
            given=f"missing {missing}; keys {sorted(map(str, tree))}",
            fix="drop those names from items=",
        )
    return {k: tree[k] for k in items}


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
      verify: store a checksum per array at save and check it after restore (on CPU
        computed from the shards in host memory, about 7 GB/s on two cores; elsewhere
        one device reduction per array).
      compress: zstd-compress the array chunks. Off by default: weights and
        optimizer moments are close to incompressible (random-normal fp32 shrinks
        by 7.6%), while zstd takes about a fifth of the save time and over a third of
        the restore time on a CPU-bound host. Turn it on when storage bandwidth,
        not CPU, is the limit. Restores read either kind, whatever this flag says.

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
        compress: bool = False,
        read_only: bool = False,
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
                use_compression=compress,
            ),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self.read_only = read_only
        if read_only and not os.path.isdir(self.directory):
            state = "a file" if os.path.exists(self.directory) else "missing"
            raise CheckpointNotFoundError(
                op="checkpoint.Manager(read_only=True)",
                must="the checkpoint directory exists",
                given=f"{self.directory} is {state}",
                fix="pass the directory a run saved its checkpoints to",
            )
        # read_only: orbax neither creates the directory nor starts its tmp-directory
        # cleanup (a thread close() does not wait for); save() refuses (below).
        # (orbax's own read_only option logs a warning on every open.)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_ and not read_only,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
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
        out = {
            path: jax.ShapeDtypeStruct(tuple(info["shape"]), jnp.dtype(info["dtype"]))
            for path, info in meta.get("zero_size", {}).items()
        }
        if meta.get("empty_state"):
            return out
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
        out.update(
            {
                path: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype))
                for path, m in _flat(tree).items()
                if path not in keys
            }
        )
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
        config: Any | None = None,
        items: Sequence[str] | None = None,
        force: bool = False,
    ) -> bool:
        """Save ``state`` as checkpoint ``step`` (asynchronously unless ``async_=False``).

        Args:
          step: the step number (checkpoint name).
          state: a pytree of arrays (typed PRNG keys and zero-size arrays allowed;
            an empty state is saved as metadata alone).
          plan: a plan object (its ``to_json()`` and ``mesh`` are recorded).
          mesh: the mesh, when no plan is given (recorded as axes and axis types).
          data: the data-iterator position: an object with ``state()`` or any JSON value.
          metadata: extra JSON-able user metadata.
          config: the model config (a dataclass instance or a dict), saved beside the
            plan; :attr:`Restored.config` / :meth:`Restored.config_as` give it back.
          items: save only these top-level keys of a dict ``state`` (e.g.
            ``("params",)`` for a params-only checkpoint); default all.
          force: save even when ``step`` is not on the save interval.

        Returns:
          Whether a save was started.

        Raises:
          CheckpointError: ``items`` names keys the state lacks, the metadata
            is not JSON-serialisable, or the manager is read-only.
        """
        if self.read_only:
            raise CheckpointError(
                op="checkpoint.save",
                must="the manager was opened to write",
                given=f"Manager({self.directory!r}, read_only=True)",
                fix="open it without read_only=True to save",
            )
        if not force and not self._mgr.should_save(step):
            return False
        state = _select_items("checkpoint.save", state, items)
        flat = _flat(state)
        keys = {p: v for p, v in flat.items() if _is_key(v)}
        if keys:
            state = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)
        empty = {p: v for p, v in _flat(state).items() if _is_zero_size(v)}
        if empty:  # orbax refuses zero-size arrays: recorded in the metadata instead
            state = jax.tree.map(lambda x: None if _is_zero_size(x) else x, state)
        if mesh is None and plan is not None:
            mesh = getattr(plan, "mesh", None)
        if data is not None and hasattr(data, "state") and callable(data.state):
            data = data.state()
        flat = _flat(state)
        meta = {
            "format": _FORMAT,
            "step": int(step),
            "data": data,
            "plan": plan.to_json() if plan is not None else None,
            "mesh": mesh_metadata(mesh) if mesh is not None else None,
            "config": config_metadata(config),
            "process_count": jax.process_count(),
            "user": dict(metadata) if metadata else None,
            "prng_keys": {
                p: {"impl": str(jax.random.key_impl(k)), "shape": list(k.shape)}
                for p, k in keys.items()
            },
            "zero_size": {
                p: {"shape": list(v.shape), "dtype": jnp.dtype(v.dtype).name}
                for p, v in empty.items()
            },
            "empty_state": not jax.tree.leaves(state),
            "specs": {p: _spec_str(v) for p, v in flat.items()},
            "checksums": checksums(flat) if self.verify else {},
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
        parts = {"meta": ocp.args.JsonSave(meta)}
        if not meta["empty_state"]:
            parts["state"] = ocp.args.PyTreeSave(state)
        return self._mgr.save(step, args=ocp.args.Composite(**parts), force=force)

    # restore
    def restore(
        self,
        step: int | None = None,
        *,
        target: Any,
        partial: bool = False,
        allow_cast: bool = False,
        items: Sequence[str] | None = None,
        rename: Mapping[str, str] | None = None,
    ) -> Restored:
        """Restore a checkpoint onto the layout ``target`` describes.

        Args:
          step: which step (default: the latest complete one).
          target: a pytree of ``jax.ShapeDtypeStruct`` with ``sharding=`` (or arrays);
            see :func:`abstract_target`. Any mesh, specs or device count.
          partial: restore only the keys in ``target`` (e.g. ``{"params": ...}`` for
            weights into a fresh optimizer); saved keys not in the target are skipped.
          allow_cast: let a target dtype differ from the saved one (orbax casts).
          items: restore only these top-level keys of a dict ``target`` (the others
            are neither read nor returned), e.g. ``("params",)`` to put saved
            weights into a fresh optimizer; implies ``partial=True``.
          rename: ``{saved suffix: target suffix}`` for paths renamed since the save:
            a target leaf whose path ends in a target suffix (whole ``/``-separated
            components) is read from the saved path ending in the saved suffix
            instead. ``{"embed": "embed/embedding"}`` restores a checkpoint of a
            reference model saved before its token table became ``sk.nn.Embed``
            (``params/embed`` into ``params/embed/embedding``, and the same for
            every optimizer-state mirror of it).

        Returns:
          :class:`Restored` with the state and its metadata.

        Raises:
          CheckpointNotFoundError: no such (complete) checkpoint.
          CheckpointMismatchError: keys, shapes or dtypes disagree (paths named).
          CheckpointCorruptedError: the files cannot be read back intact.
        """
        op = "checkpoint.restore"
        if items is not None:
            target, partial = _select_items(op, target, items), True
        step = self._resolve(step, op)
        meta = self._metadata(step)
        saved = self._saved_shapes(step, meta)
        target_flat = _flat(target)
        for path, x in target_flat.items():
            check_target_leaf(op, path, x)
        names = {p: _saved_name(p, rename) for p in target_flat}  # target → saved path
        flat_target = {names[p]: x for p, x in target_flat.items()}
        self._check(op, saved, flat_target, partial=partial, allow_cast=allow_cast)
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
        paths = [names[_path(p)] for p, _ in paths_leaves]
        zero = set(meta.get("zero_size", {})) & set(paths)
        if rename:
            flat_state = self._read_renamed(op, step, meta, flat_target, zero)
        else:
            flat_state = self._read(op, step, meta, target, zero, partial=partial)
        if self.verify and meta.get("checksums"):
            self._verify(op, step, meta["checksums"], flat_state, saved, flat_target)
        key_info = meta.get("prng_keys", {})
        leaves = []
        for p in paths:
            if p in zero:
                leaves.append(_zeros_like(flat_target[p]))
            elif p in key_info:
                leaves.append(jax.random.wrap_key_data(flat_state[p], impl=key_info[p]["impl"]))
            else:
                leaves.append(flat_state[p])
        return Restored(
            step=step, state=jax.tree_util.tree_unflatten(treedef, leaves), metadata=meta
        )

    def _read(
        self, op: str, step: int, meta: dict[str, Any], target: Any, zero: set, *, partial: bool
    ) -> dict[str, Any]:
        """The arrays of ``target`` (except the zero-size ones) read by orbax, by path."""
        key_info = meta.get("prng_keys", {})

        def to_restore_leaf(path: tuple, x: Any) -> Any:
            name = _path(path)
            if name in zero:
                return None
            return _read_struct(x, name in key_info)

        raw = jax.tree_util.tree_map_with_path(to_restore_leaf, target)
        if meta.get("empty_state") or not jax.tree.leaves(raw):
            return {}
        return self._restore_arrays(op, step, raw, partial=partial)

    def _read_renamed(
        self, op: str, step: int, meta: dict[str, Any], flat_target: dict[str, Any], zero: set
    ) -> dict[str, Any]:
        """Like :meth:`_read` for a target whose paths differ from the saved ones:
        the arrays are read in the saved tree's structure (from the checkpoint's
        own metadata), each laid out as the target leaf it goes to (``flat_target``
        is keyed by saved path)."""
        key_info = meta.get("prng_keys", {})
        try:
            tree = self._mgr.item_metadata(step)["state"].tree
        except Exception as e:
            raise CheckpointCorruptedError(
                op=op,
                must="the checkpoint's array metadata is readable",
                given=f"step {step} in {self.directory}: {type(e).__name__}: {e}",
                fix="restore an older step (all_steps()) or delete this one",
            ) from e

        def leaf(path: tuple, m: Any) -> Any:
            name = _path(path)
            if name in zero or name not in flat_target:
                return _SKIP
            return _read_struct(flat_target[name], name in key_info)

        raw = _prune(op, jax.tree_util.tree_map_with_path(leaf, tree))
        if raw is _SKIP or not jax.tree.leaves(raw):
            return {}
        return self._restore_arrays(op, step, raw, partial=True)

    def _restore_arrays(self, op: str, step: int, raw: Any, *, partial: bool) -> dict[str, Any]:
        """Orbax's read of the arrays ``raw`` describes (one ``ShapeDtypeStruct`` a
        leaf, :func:`_read_struct`), by path."""
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
        return _flat(out["state"])

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
            moved = _moved_into_modules(missing, saved, target)
            if moved:
                rules = {old: new for (old, new), _ in moved.values()}
                raise CheckpointMismatchError(
                    op=op,
                    must="every target key exists in the checkpoint",
                    given=f"not in the checkpoint: {_listing(missing)}; saved under the "
                    "path they had before moving into a module: "
                    + _listing([f"{s} -> {t}" for t, (_, s) in moved.items()]),
                    fix=f"restore(..., rename={rules!r}) reads them from the "
                    "old paths (e.g. the reference models' token table, now sk.nn.Embed: "
                    "rename={'embed': 'embed/embedding'})",
                )
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
        recorded: dict[str, int],
        state: dict[str, Any],
        saved: dict[str, jax.ShapeDtypeStruct],
        target: dict[str, Any],
    ) -> None:
        same_dtype = {
            p: v
            for p, v in state.items()
            if p in recorded and saved[p].dtype == target[p].dtype and checksummable(v)
        }
        got = checksums(same_dtype)
        bad = sorted(p for p, c in got.items() if c != recorded[p])
        if bad:
            raise CheckpointCorruptedError(
                op=op,
                must="restored arrays match the checksums recorded at save",
                given=f"step {step}: checksum mismatch in {_listing(bad)}",
                fix="the files are damaged: restore an older step (all_steps())",
            )
