"""Export parameters as a single-host, inference-ready safetensors file set; import
such a set onto any plan.

An export is a directory that any safetensors reader can use without spmdkit:

* ``model.safetensors`` — or, above ``max_file_bytes``,
  ``model-00001-of-0000N.safetensors`` … — one tensor per parameter path
  (``"layers/0/attn/kernel"``, the ``/``-joined pytree path), full (unsharded)
  values, written with the ``safetensors`` library;
* ``model.safetensors.index.json`` — which file holds each tensor
  (``weight_map``) and spmdkit's metadata (format, total size, a checksum per
  tensor, the model config's class);
* ``config.json`` — the model config (when one is given).

:func:`export_params` gathers one tensor at a time to the host and writes one
file at a time, so the host holds at most one file's tensors. :func:`import_params`
builds every array straight from the file with
``jax.make_array_from_callback``: each device's shard is read from the
memory-mapped file by slice, a shard that several devices hold is read once, and
no whole tensor is put on one device unless the target places it there. Keys,
shapes and dtypes are checked against the target first, and checksums after.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmdkit.runtime.checkpoint import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    check_target_leaf,
    checksums,
    config_metadata,
    tree_paths,
)

__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "INDEX_FILE",
    "exported_config",
    "exported_shapes",
    "export_params",
    "import_params",
]

FORMAT = "spmdkit.export/1"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

#: safetensors dtype names → numpy dtypes (bfloat16 and float8 through ml_dtypes).
_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def _as_tree(params: Any) -> Any:
    """An NNX module's parameters as a pure dict; other pytrees as they are."""
    from flax import nnx

    if isinstance(params, nnx.Module):
        return nnx.to_pure_dict(nnx.state(params, nnx.Param))
    return params


def _check_leaves(flat: Mapping[str, Any]) -> None:
    bad = []
    for path, x in flat.items():
        dtype = getattr(x, "dtype", None)
        if dtype is None or not hasattr(x, "shape"):
            bad.append(f"{path}: {type(x).__name__}")
        elif jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            bad.append(f"{path}: a PRNG key")
        elif jnp.dtype(dtype).name not in _DTYPES.values():
            bad.append(f"{path}: dtype {dtype}")
    if bad or not flat:
        raise CheckpointError(
            op="export.export_params",
            must="the parameters are a non-empty pytree of numeric or bool arrays",
            given=", ".join(bad[:8]) if bad else "no arrays",
            fix="export the parameters only (no optimizer state, RNG keys or python values)",
        )


def _host_copy(x: Any) -> np.ndarray:
    """The whole value of one tensor on this host (gathered across processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _file_groups(flat: Mapping[str, Any], max_file_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for path, x in flat.items():
        nbytes = int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(path)
        size += nbytes
    return groups


def export_params(
    params: Any,
    directory: str | os.PathLike,
    *,
    config: Any | None = None,
    max_file_bytes: int = 4 << 30,
) -> dict[str, Any]:
    """Write ``params`` as a safetensors file set in ``directory`` (see the module doc).

    Args:
      params: a pytree of arrays (sharded on any mesh, or numpy) or an NNX module.
      directory: where to write (created if missing); existing export files there
        are overwritten.
      config: the model config (dataclass instance or dict), written as ``config.json``.
      max_file_bytes: start a new file when the current one would pass this size.

    Returns:
      The index written (``{"metadata": ..., "weight_map": ...}``).

    Raises:
      CheckpointError: a leaf is not a numeric/bool array (keys, python values),
        or the config is not JSON-able.

    Example::

        >>> export_params(result.params, "/tmp/export", config=cfg)["weight_map"]
        {'l1/bias': 'model.safetensors', 'l1/kernel': 'model.safetensors', ...}
    """
    import safetensors.numpy

    flat = tree_paths(_as_tree(params))
    _check_leaves(flat)
    config_meta = config_metadata(config)
    groups = _file_groups(flat, max_file_bytes)
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    writer = jax.process_index() == 0
    directory = os.fspath(directory)
    if writer:
        os.makedirs(directory, exist_ok=True)
    weight_map: dict[str, str] = {}
    for name, group in zip(names, groups, strict=True):
        tensors = {path: _host_copy(flat[path]) for path in group}
        if writer:
            safetensors.numpy.save_file(
                tensors, os.path.join(directory, name), metadata={"format": FORMAT}
            )
        weight_map.update(dict.fromkeys(group, name))
        del tensors  # one file's tensors on the host at a time
    arrays = {p: x for p, x in flat.items() if isinstance(x, jax.Array)}
    index = {
        "metadata": {
            "format": FORMAT,
            "total_size": int(
                sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in flat.values())
            ),
            "checksums": checksums(arrays),
            "config_class": config_meta["class"] if config_meta else None,
        },
        "weight_map": weight_map,
    }
    if writer:
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=1, sort_keys=True)
        if config_meta is not None:
            with open(os.path.join(directory, CONFIG_FILE), "w") as f:
                json.dump(config_meta["value"], f, indent=1, sort_keys=True)
    return index


def _read_index(directory: str, op: str) -> dict[str, Any]:
    path = os.path.join(directory, INDEX_FILE)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(
            op=op,
            must=f"the export directory holds {INDEX_FILE}",
            given=f"no such file in {directory}",
            fix="pass a directory written by export_params (or `spmdkit export`)",
        )
    try:
        with open(path) as f:
            index = json.load(f)
        ok = index["metadata"]["format"] == FORMAT and isinstance(index["weight_map"], dict)
    except (OSError, ValueError, KeyError, TypeError) as e:
        ok, index = False, {"error": str(e)}
    if not ok:
        raise CheckpointCorruptedError(
            op=op,
            must=f"{INDEX_FILE} is JSON of format {FORMAT!r} with a weight_map",
            given=f"{path}: {str(index)[:120]}",
            fix="export again with export_params",
        )
    return index


def exported_shapes(directory: str | os.PathLike) -> dict[str, jax.ShapeDtypeStruct]:
    """Shape and dtype of every exported tensor, by parameter path (no data read).

    Raises:
      CheckpointNotFoundError: no export in ``directory``.
      CheckpointCorruptedError: the index or a file header is unreadable.
    """
    from safetensors import safe_open

    directory = os.fspath(directory)
    op = "export.exported_shapes"
    index = _read_index(directory, op)
    out: dict[str, jax.ShapeDtypeStruct] = {}
    by_file: dict[str, list[str]] = {}
    for path, name in index["weight_map"].items():
        by_file.setdefault(name, []).append(path)
    for name, paths in by_file.items():
        try:
            with safe_open(os.path.join(directory, name), framework="numpy") as f:
                for path in paths:
                    sl = f.get_slice(path)
                    dtype = jnp.dtype(_DTYPES[sl.get_dtype()])
                    out[path] = jax.ShapeDtypeStruct(tuple(sl.get_shape()), dtype)
        except Exception as e:
            raise CheckpointCorruptedError(
                op=op,
                must="every file of the export is a readable safetensors file with its tensors",
                given=f"{name}: {type(e).__name__}: {str(e)[:200]}",
                fix="export again with export_params",
            ) from e
    return out


def exported_config(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The model config written with an export (``config.json``), or ``None``."""
    path = os.path.join(os.fspath(directory), CONFIG_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointCorruptedError(
            op="export.exported_config",
            must="config.json is readable JSON",
            given=f"{path}: {e}",
            fix="export again with export_params",
        ) from e


def _check_target(op: str, saved: Mapping[str, Any], flat: Mapping[str, Any]) -> None:
    problems = []
    missing = sorted(set(flat) - set(saved))
    extra = sorted(set(saved) - set(flat))
    if missing:
        problems.append(f"not in the export: {', '.join(missing[:8])}")
    if extra:
        problems.append(f"exported but not in the target: {', '.join(extra[:8])}")
    for path, x in flat.items():
        if path in saved and (
            tuple(saved[path].shape) != tuple(x.shape) or saved[path].dtype != jnp.dtype(x.dtype)
        ):
            problems.append(
                f"{path} exported {saved[path].dtype}{list(saved[path].shape)} "
                f"target {jnp.dtype(x.dtype)}{list(x.shape)}"
            )
        if not isinstance(getattr(x, "sharding", None), jax.sharding.Sharding):
            problems.append(f"{path}: target leaf without a sharding")
    if problems:
        raise CheckpointMismatchError(
            op=op,
            must="the target has exactly the exported paths, shapes and dtypes, with shardings",
            given="; ".join(problems[:8]),
            fix="build the target from the exported model's config, e.g. "
            "abstract_target(jax.eval_shape(init), plan shardings)",
        )


def _load(file: Any, path: str, x: Any) -> jax.Array:
    """One tensor, each distinct shard read once from the file by slice."""
    shape, dtype = tuple(x.shape), jnp.dtype(x.dtype)
    if 0 in shape:
        empty = np.zeros(shape, dtype)
        return jax.make_array_from_callback(shape, x.sharding, lambda index: empty[index])
    sl = file.get_slice(path)
    read: dict[Any, np.ndarray] = {}

    def shard(index: tuple) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in read:
            read[key] = np.asarray(sl[index] if index else sl[()], dtype)
        return read[key]

    return jax.make_array_from_callback(shape, x.sharding, shard)


def import_params(directory: str | os.PathLike, target: Any, *, verify: bool = True) -> Any:
    """Load an export onto the layout ``target`` describes, shard by shard.

    Args:
      directory: an export written by :func:`export_params`.
      target: a pytree of ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` with
        the exported paths (e.g. from ``abstract_target`` and a plan's shardings).
      verify: compare each array's checksum with the one recorded at export.

    Returns:
      The parameters, laid out as ``target`` says.

    Raises:
      CheckpointNotFoundError: no export there.
      CheckpointMismatchError: paths, shapes or dtypes differ, or a leaf has no sharding.
      CheckpointCorruptedError: unreadable files or a checksum mismatch.

    Example::

        >>> target = abstract_target(jax.eval_shape(init), param_shardings)
        >>> params = import_params("/tmp/export", target)
    """
    from safetensors import safe_open

    directory = os.fspath(directory)
    op = "export.import_params"
    index = _read_index(directory, op)
    saved = exported_shapes(directory)
    treedef = jax.tree.structure(target)
    flat = tree_paths(target)
    _check_target(op, saved, flat)
    for path, x in flat.items():
        check_target_leaf(op, path, x)
    loaded: dict[str, jax.Array] = {}
    by_file: dict[str, list[str]] = {}
    for path in flat:
        by_file.setdefault(index["weight_map"][path], []).append(path)
    for name, paths in by_file.items():
        with safe_open(os.path.join(directory, name), framework="numpy") as f:
            for path in paths:
                loaded[path] = _load(f, path, flat[path])
    recorded = index["metadata"].get("checksums") or {}
    if verify and recorded:
        got = checksums({p: loaded[p] for p in recorded if p in loaded})
        bad = sorted(p for p, c in got.items() if c != recorded[p])
        if bad:
            raise CheckpointCorruptedError(
                op=op,
                must="imported tensors match the checksums recorded at export",
                given=f"checksum mismatch in {', '.join(bad[:8])}",
                fix="the files are damaged: export again",
            )
    return jax.tree_util.tree_unflatten(treedef, [loaded[p] for p in flat])
