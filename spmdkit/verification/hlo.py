"""Read the collectives out of compiled (post-partitioning) HLO text.

``jax.jit(f).lower(*args).compile().as_text()`` is the per-device program XLA
will run. This module finds its collectives and normalizes them:

- kinds: ``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all`` and
  ``collective-permute`` become ``all_gather``, ``all_reduce``, ``reduce_scatter``,
  ``all_to_all``, ``collective_permute`` (a ``ragged-all-to-all``, a GPU's or TPU's
  exchange of routed rows, is an ``all_to_all`` of its receiving buffer). Async
  ``-start``/``-done`` pairs count
  once (the ``-start``); the ``async-start`` wrappers GPUs use around other
  collectives are skipped, since the wrapped op is printed in its own computation.
- ``replica_groups`` in all three text forms are expanded to explicit groups:
  lists ``{{0,1},{2,3}}``; iota ``[2,4]<=[8]`` or ``[4,2]<=[2,4]T(1,0)`` (arange
  over the reshape dims, transposed, reshaped to ``[groups, group_size]``); and
  the mesh form ``mesh['a'=2,'b'=4] {'b'}`` (optionally with
  ``device_ids=(...)`` and sub-axes ``'a':(2)2``: pre-size 2, size 2). Empty
  ``{}`` means one group of all devices (``num_partitions`` from the module
  header).
- ``payload_bytes`` follows :class:`spmdkit.resharding.Collective`: the all-gather
  output, the all-reduce operand (= its output), the reduce-scatter input
  (= output × group size), the all-to-all operand (= the sum of its outputs), the
  collective-permute operand.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmdkit.errors import SpmdError
from spmdkit.util import is_own_source

if TYPE_CHECKING:
    from spmdkit.resharding.plan import ReshardPlan

__all__ = [
    "HloCollective",
    "parse_collectives",
    "parse_replica_groups",
    "compiled_collectives",
    "dtype_bytes",
    "summarize",
    "check_plan",
]

_OPCODES = {
    "all-gather": "all_gather",
    "all-reduce": "all_reduce",
    "reduce-scatter": "reduce_scatter",
    "all-to-all": "all_to_all",
    # a GPU's or TPU's exchange of the rows routed (the moe_experts op's there): its
    # result is the receiving buffer, the payload the plan counts
    "ragged-all-to-all": "all_to_all",
    "collective-permute": "collective_permute",
}

_REDUCERS = {
    "add": "sum",
    "maximum": "max",
    "minimum": "min",
    "multiply": "prod",
    "and": "and",
    "or": "or",
}

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f16": 2,
    "bf16": 2,
    "f32": 4,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1,
    "f8e3m4": 1,
    "f8e8m0fnu": 1,
    "f4e2m1fn": 1,
    "token": 0,
}

# `%name = TYPE opcode(`; TYPE is an array type or a (nested) tuple of them.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[\d,\s]*)\](?:\{[^}]*\})?")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_ROOT = re.compile(r"^\s*ROOT\s+%?[\w.\-]+\s*=\s*\S+\s+(?P<op>[\w\-]+)\(")
_NUM_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_REPLICA_COUNT = re.compile(r"replica_count=(\d+)")


@dataclass(frozen=True)
class HloCollective:
    """One collective instruction of a compiled HLO module.

    Attributes:
      kind: ``"all_gather"``, ``"all_reduce"``, ``"reduce_scatter"``,
        ``"all_to_all"`` or ``"collective_permute"``.
      shapes: result shapes; a combined (tuple-shaped) collective gives several.
        For async ``-start`` ops, the shapes of the eventual results.
      dtypes: element types of ``shapes`` (HLO names: ``f32``, ``bf16``…).
      payload_bytes: per-device bytes (module docstring convention).
      group_size: devices per replica group (permute: devices involved).
      replica_groups: explicit groups of device ids (permute: empty).
      op_name: the JAX op from ``metadata={op_name=...}`` (``""`` if none).
      is_backward: ``op_name`` contains ``transpose(`` (a backward-pass op).
      reduce_op: ``"sum"``, ``"max"``, ``"min"``… for all-reduce /
        reduce-scatter when the ``to_apply`` computation is recognized, else None.
      name: the instruction name.
      source_target_pairs: collective-permute ``(source, target)`` pairs.
      frames: the Python frames that made it, innermost first, as
        ``file:line (function)``: from the metadata's ``source_file`` and
        ``source_line``, or its ``stack_frame_id`` in the module's stack-frame
        tables (``()`` when the metadata has neither).
      nearest: for an instruction without metadata (one XLA's partitioner made
        to reach a layout no equation asked for), the ``op_name`` of the nearest
        instruction that has one (:func:`nearest_named`); ``""`` otherwise.
      nearest_role: how that instruction relates to this one: ``"result"`` (this
        reshards its result), ``"output"`` (reshards its result into a step
        output's layout) or ``"input"`` (reshards a value it reads that no
        instruction with metadata made, a step input); ``""`` with no ``nearest``.
    """

    kind: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    payload_bytes: int
    group_size: int
    replica_groups: tuple[tuple[int, ...], ...]
    op_name: str = ""
    is_backward: bool = False
    reduce_op: str | None = None
    name: str = ""
    source_target_pairs: tuple[tuple[int, int], ...] = ()
    frames: tuple[str, ...] = ()
    nearest: str = ""
    nearest_role: str = ""

    @property
    def source(self) -> str:
        """The innermost of :attr:`frames` outside spmdkit (the user's line; the
        innermost frame when all are spmdkit's; ``""`` when none)."""
        for f in self.frames:
            if not is_own_source(f):
                return f
        return self.frames[0] if self.frames else ""

    @property
    def dtype(self) -> str:
        """Element type of the first result."""
        return self.dtypes[0]

    @property
    def is_combined(self) -> bool:
        """True when XLA merged several collectives into this one (tuple result).

        An all-to-all with a tuple result is one exchange split per peer, not a
        combination, so it is never combined in this sense.
        """
        return len(self.shapes) > 1 and self.kind != "all_to_all"

    def __str__(self) -> str:
        shapes = ",".join(
            f"{t}[{','.join(map(str, s))}]" for t, s in zip(self.dtypes, self.shapes, strict=True)
        )
        op = f"[{self.reduce_op}]" if self.reduce_op else ""
        return f"{self.kind}{op} {shapes} {self.group_size}×: {self.payload_bytes} B"


# -- replica groups ------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"-?\d+", text)]


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
    arr = np.arange(math.prod(reshape)).reshape(reshape)
    if perm is not None:
        arr = arr.transpose(perm)
    return arr.reshape(-1)


_IOTA_FORM = re.compile(
    r"^\[(?P<dims>[\d,\s]*)\]\s*<=\s*\[(?P<reshape>[\d,\s]*)\](?:\s*T\((?P<perm>[\d,\s]*)\))?$"
)
_DEVICE_IDS = re.compile(
    r"^(?:\[(?P<dims>[\d,\s]*)\]\s*<=\s*)?\[(?P<reshape>[\d,\s]*)\](?:\s*T\((?P<perm>[\d,\s]*)\))?$"
)
_MESH_FORM = re.compile(
    r"^mesh\[(?P<axes>[^\]]*)\]\s*(?:,\s*device_ids=\((?P<ids>[^)]*(?:\([^)]*\))?[^)]*)\))?"
    r"\s*\{(?P<group>[^}]*)\}$"
)


def _mesh_devices(ids: str | None, total: int) -> np.ndarray:
    if ids is None:
        return np.arange(total)
    ids = ids.strip()
    m = _DEVICE_IDS.match(ids)
    if m:
        perm = _ints(m["perm"]) if m["perm"] is not None else None
        flat = _iota(_ints(m["reshape"]), perm)
    else:
        flat = np.array(_ints(ids))
    if flat.size != total:
        raise SpmdError(
            op="parse_replica_groups",
            must="a mesh's device_ids list one id per mesh position",
            given=f"{flat.size} ids for {total} positions: {ids!r}",
            fix="pass the replica_groups text exactly as XLA printed it",
        )
    return flat


def _mesh_groups(m: re.Match) -> np.ndarray:
    axes = []
    for raw in m["axes"].split(","):
        part = raw.strip()
        if not part:
            continue
        name, _, size = part.rpartition("=")
        axes.append((name.strip().strip("'\""), int(size)))
    names = [a for a, _ in axes]
    sizes = [s for _, s in axes]
    devices = _mesh_devices(m["ids"], math.prod(sizes)).reshape(sizes)
    # Each group axis is a full axis or a sub-axis `name:(pre)size`: view that mesh
    # axis of size N as [pre, size, N / (pre × size)] (major → minor) and group
    # over the middle factor; several sub-axes of one axis split it further.
    refs: dict[int, list[tuple[int, int]]] = {}
    order: list[tuple[int, int]] = []
    for raw in m["group"].split(","):
        token = raw.strip()
        if not token:
            continue
        sub = re.match(
            r"^['\"]?(?P<name>[^'\":]+)['\"]?(?::\((?P<pre>\d+)\)(?P<size>\d+))?$", token
        )
        if sub is None or sub["name"] not in names:
            raise SpmdError(
                op="parse_replica_groups",
                must=f"group axes name mesh axes {names}",
                given=repr(m.group(0)),
                fix="pass the replica_groups text exactly as XLA printed it",
            )
        idx = names.index(sub["name"])
        full = sizes[idx]
        pre, size = (int(sub["pre"]), int(sub["size"])) if sub["pre"] else (1, full)
        refs.setdefault(idx, []).append((pre, size))
        order.append((idx, pre))
    new_sizes: list[int] = []
    grouped: dict[tuple[int, int], int] = {}
    for idx, full in enumerate(sizes):
        if idx not in refs:
            new_sizes.append(full)
            continue
        covered = 1
        for pre, size in sorted(refs[idx]):
            if pre != covered:
                new_sizes.append(pre // covered)
                covered = pre
            grouped[(idx, pre)] = len(new_sizes)
            new_sizes.append(size)
            covered *= size
        if covered != full:
            new_sizes.append(full // covered)
    group_dims = [grouped[key] for key in order]
    rest = [d for d in range(len(new_sizes)) if d not in group_dims]
    arranged = devices.reshape(new_sizes).transpose(rest + group_dims)
    n = math.prod(new_sizes[d] for d in group_dims)
    return arranged.reshape(-1, n)


def parse_replica_groups(
    text: str, *, num_devices: int | None = None
) -> tuple[tuple[int, ...], ...]:
    """Expand a ``replica_groups=`` value to explicit groups of device ids.

    Args:
      text: the value after ``replica_groups=``: ``{{0,1},{2,3}}``, ``{}``,
        ``[2,4]<=[8]``, ``[4,2]<=[2,4]T(1,0)``, or ``mesh['a'=2,'b'=4] {'b'}``
        (with optional ``device_ids=(...)`` and sub-axes ``'a':(2)2``).
      num_devices: devices in the program, used for ``{}`` (all devices).

    Returns:
      The groups, each a tuple of device ids in group order.

    Raises:
      SpmdError: the text is in none of the forms, or ``{}`` without
        ``num_devices``.

    Example::

        >>> parse_replica_groups("[4,2]<=[2,4]T(1,0)")
        ((0, 4), (1, 5), (2, 6), (3, 7))
        >>> parse_replica_groups("mesh['a'=2,'b'=4] {'b'}")
        ((0, 1, 2, 3), (4, 5, 6, 7))
    """
    text = text.strip()
    if text.startswith("{"):
        inner = text[1:-1].strip()
        if not inner:
            if num_devices is None:
                raise SpmdError(
                    op="parse_replica_groups",
                    must="replica_groups={} (all devices) comes with the device count",
                    given=repr(text),
                    fix="pass num_devices= (parse_collectives reads num_partitions)",
                )
            return (tuple(range(num_devices)),)
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", inner))
    m = _IOTA_FORM.match(text)
    if m:
        dims = _ints(m["dims"])
        perm = _ints(m["perm"]) if m["perm"] is not None else None
        flat = _iota(_ints(m["reshape"]), perm)
        return tuple(tuple(int(d) for d in g) for g in flat.reshape(dims[0], -1))
    m = _MESH_FORM.match(text)
    if m:
        return tuple(tuple(int(d) for d in g) for g in _mesh_groups(m))
    raise SpmdError(
        op="parse_replica_groups",
        must="replica_groups is a list {{..}}, iota [n,k]<=[..], or mesh[...] {...} form",
        given=repr(text),
        fix="pass the replica_groups text exactly as XLA printed it",
    )


# -- instructions --------------------------------------------------------------


def _split_type(rest: str) -> tuple[str, str] | None:
    """Split ``TYPE opcode(...)...`` into the type text and the remainder."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
        return None
    m = re.match(r"[a-z][a-z0-9]*\[[\d,\s]*\](?:\{[^}]*\})?|[a-z][a-z0-9]*(?=\s)", rest)
    if m is None:
        return None
    return m.group(0), rest[m.end() :].lstrip()


def _type_tree(text: str) -> Any:
    """Nested lists of ``(dtype, dims)`` for a (tuple) type text."""
    text = re.sub(r"/\*.*?\*/", "", text).strip()
    if text.startswith("("):
        items, depth, start = [], 0, 1
        for i, ch in enumerate(text):
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
                part = text[start:i].strip()
                if part:
                    items.append(_type_tree(part))
                start = i + 1
        return items
    m = _ARRAY.match(text)
    if m is None:
        return (text, ())
    return (m["dtype"], tuple(_ints(m["dims"])))


def _leaves(tree: Any) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(tree, tuple):
        return [tree]
    return [leaf for item in tree for leaf in _leaves(item)]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of an HLO element type (``"bf16"`` → 2; 4 when unknown)."""
    return _DTYPE_BYTES.get(dtype, 4)


def _nbytes(leaf: tuple[str, tuple[int, ...]]) -> int:
    dtype, dims = leaf
    return math.prod(dims) * _DTYPE_BYTES.get(dtype, 4)


def _attr(text: str, key: str) -> str | None:
    """The value of ``key=`` in an attribute list, balancing brackets."""
    m = re.search(rf"(?:^|[\s,]){re.escape(key)}=", text)
    if m is None:
        return None
    i = m.end()
    depth = 0
    out = []
    while i < len(text):
        ch = text[i]
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        if depth < 0:
            break
        # the mesh form of replica_groups has a comma before device_ids=(...)
        if depth == 0 and ch == "," and not text[i + 1 :].lstrip().startswith("device_ids="):
            break
        out.append(ch)
        i += 1
    return "".join(out).strip()


def _reducers(lines: list[str]) -> dict[str, str]:
    """Computation name → reduce op, from each computation's ROOT opcode."""
    out: dict[str, str] = {}
    current = None
    for line in lines:
        m = _COMPUTATION.match(line)
        if m:
            current = m["name"]
            continue
        m = _ROOT.match(line)
        if m and current is not None and m["op"] in _REDUCERS:
            out[current] = _REDUCERS[m["op"]]
    return out


def parse_collectives(hlo_text: str) -> list[HloCollective]:
    """Every collective instruction of post-partitioning HLO text, in text order.

    Args:
      hlo_text: ``jax.jit(f).lower(...).compile().as_text()`` (or any HLO module
        text).

    Returns:
      One :class:`HloCollective` per instruction (async pairs once).

    Example::

        >>> text = jax.jit(f).lower(x).compile().as_text()
        >>> [c.kind for c in parse_collectives(text)]
        ['all_gather']
    """
    lines = hlo_text.splitlines()
    num_devices = _num_devices(lines)
    reducers = _reducers(lines)
    frames: dict[int, tuple[str, ...]] | None = None
    graph: _Graph | None = None
    out = []
    for line in lines:
        m = _INSTR.match(line)
        if m is None:
            continue
        collective = _collective(m, num_devices, reducers)
        if collective is None:
            continue
        src = _SOURCE.search(line)
        fid = _FRAME_ID.search(line)
        if src is not None:
            where = (f"{src.group(1)}:{src.group(2)}",)
            collective = dataclasses.replace(collective, frames=where)
        elif fid is not None:
            frames = stack_frames(lines) if frames is None else frames
            collective = dataclasses.replace(collective, frames=frames.get(int(fid.group(1)), ()))
        if not collective.op_name and not collective.frames:
            graph = _Graph.of(lines) if graph is None else graph
            near, role = graph.nearest_named(collective.name)
            collective = dataclasses.replace(collective, nearest=near, nearest_role=role)
        out.append(collective)
    return out


_OPERAND = re.compile(r"%([\w.\-]+)")


def _operands(rest: str) -> tuple[str, ...]:
    """The instruction names in the operand list of ``TYPE opcode(operands), ...``
    (not the computations its attributes name: ``calls=``, ``to_apply=``)."""
    split = _split_type(rest)
    if split is None:
        return ()
    remainder = split[1]
    start, depth = remainder.find("("), 0
    if start < 0:
        return ()
    for i in range(start, len(remainder)):
        depth += remainder[i] == "("
        depth -= remainder[i] == ")"
        if depth == 0:
            return tuple(_OPERAND.findall(remainder[start:i]))
    return ()


_OP_NAME = re.compile(r'op_name="([^"]*)"')
#: Instructions walked from an unnamed collective before giving up.
_NEAREST_WALK = 256


@dataclass
class _Graph:
    """A module's instructions: each one's ``op_name`` and operands, its users, and
    the entry computation's root."""

    op_names: dict[str, str]
    operands: dict[str, tuple[str, ...]]
    users: dict[str, list[str]]
    root: str

    @classmethod
    def of(cls, lines: list[str]) -> _Graph:
        op_names: dict[str, str] = {}
        operands: dict[str, tuple[str, ...]] = {}
        users: dict[str, list[str]] = {}
        root, in_entry = "", False
        for line in lines:
            if line.startswith("ENTRY"):
                in_entry = True
            m = _INSTR.match(line)
            if m is None:
                continue
            name, rest = m["name"], m["rest"]
            if in_entry and not root and line.lstrip().startswith("ROOT"):
                root = name
            named = _OP_NAME.search(rest)
            op_names[name] = named.group(1) if named else ""
            args = _operands(rest)
            operands[name] = args
            for a in args:
                users.setdefault(a, []).append(name)
        return cls(op_names, operands, users, root)

    def _walk(self, start: str, step: Mapping[str, Sequence[str]]) -> Iterable[str]:
        """Instructions reached from ``start`` along ``step`` (operands or users),
        nearest first, each once."""
        seen, todo = {start}, list(step.get(start, ()))
        while todo and len(seen) < _NEAREST_WALK:
            name = todo.pop(0)
            if name in seen or name not in self.op_names:
                continue
            seen.add(name)
            yield name
            if not self.op_names[name]:
                todo.extend(step.get(name, ()))

    def nearest_named(self, name: str) -> tuple[str, str]:
        """``(op_name, role)`` of the instruction with metadata nearest ``name``
        (:attr:`HloCollective.nearest`): its producers first, then its users."""
        for near in self._walk(name, self.operands):
            if self.op_names[near]:
                to_root = any(u == self.root for u in self._walk(name, self.users))
                return self.op_names[near], "output" if to_root else "result"
        for near in self._walk(name, self.users):
            if self.op_names[near]:
                return self.op_names[near], "input"
        return "", ""


def stack_frames(lines: list[str]) -> dict[int, tuple[str, ...]]:
    """``stack_frame_id`` → its frames, innermost first (``file:line (function)``),
    from the ``FileNames``, ``FunctionNames``, ``FileLocations`` and ``StackFrames``
    tables XLA prints after the computations."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        name = line.strip()
        if name in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(name, {})
            continue
        m = _TABLE_ROW.match(name) if current is not None else None
        if m is None:
            current = None if not name or name.startswith(("%", "ROOT", "ENTRY")) else current
            continue
        current[int(m.group(1))] = m.group(2)
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locs: dict[int, str] = {}
    for k, v in tables.get("FileLocations", {}).items():
        f = re.search(r"file_name_id=(\d+)", v)
        fn = re.search(r"function_name_id=(\d+)", v)
        ln = re.search(r"\bline=(\d+)", v)
        if f and ln:
            func = funcs.get(int(fn.group(1)), "") if fn else ""
            locs[k] = f"{files.get(int(f.group(1)), '?')}:{ln.group(1)}" + (
                f" ({func})" if func else ""
            )
    parent: dict[int, tuple[int, int]] = {}
    for k, v in tables.get("StackFrames", {}).items():
        loc = re.search(r"file_location_id=(\d+)", v)
        up = re.search(r"parent_frame_id=(\d+)", v)
        if loc:
            parent[k] = (int(loc.group(1)), int(up.group(1)) if up else 0)
    out: dict[int, tuple[str, ...]] = {}
    for k in parent:
        chain, seen, at = [], set(), k
        while at in parent and at not in seen:
            seen.add(at)
            loc, up = parent[at]
            if loc in locs:
                chain.append(locs[loc])
            at = up
        out[k] = tuple(chain)
    return out


def _num_devices(lines: list[str]) -> int | None:
    """Devices of the module (``num_partitions``, else ``replica_count``) from its header."""
    header = "\n".join(line for line in lines[:3] if line.startswith("HloModule"))
    m = _NUM_PARTITIONS.search(header)
    num_devices = int(m.group(1)) if m else None
    if num_devices == 1 or num_devices is None:
        m = _REPLICA_COUNT.search(header)
        if m and int(m.group(1)) > 1:
            num_devices = int(m.group(1))
    return num_devices


def _collective(
    m: re.Match, num_devices: int | None, reducers: dict[str, str]
) -> HloCollective | None:
    """The collective one matched instruction line is (None when it is not one)."""
    split = _split_type(m["rest"])
    if split is None:
        return None
    type_text, remainder = split
    op = re.match(r"(?P<op>[\w\-]+)\(", remainder)
    if op is None:
        return None
    opcode = op["op"]
    is_start = opcode.endswith("-start")
    base = opcode[: -len("-start")] if is_start else opcode
    if base not in _OPCODES:
        return None
    kind = _OPCODES[base]
    tree = _type_tree(type_text)
    if is_start and kind == "all_gather" and isinstance(tree, list) and len(tree) == 2:
        tree = tree[1]  # (operands, results)
    elif is_start and kind == "collective_permute" and isinstance(tree, list):
        tree = tree[1] if len(tree) > 1 else tree[0]  # (operand, result, contexts…)
    leaves = _leaves(tree)
    attrs = remainder[op.end() :]
    groups: tuple[tuple[int, ...], ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()
    if kind == "collective_permute":
        raw = _attr(attrs, "source_target_pairs") or "{}"
        nums = _ints(raw)
        pairs = tuple(zip(nums[::2], nums[1::2], strict=True))
        group_size = len({d for p in pairs for d in p})
    else:
        raw = _attr(attrs, "replica_groups")
        groups = parse_replica_groups(raw if raw is not None else "{}", num_devices=num_devices)
        group_size = len(groups[0]) if groups else 1
    payload = sum(_nbytes(leaf) for leaf in leaves)
    if kind == "reduce_scatter":
        payload *= group_size
    op_name_m = re.search(r'op_name="([^"]*)"', attrs)
    op_name = op_name_m.group(1) if op_name_m else ""
    to_apply = _attr(attrs, "to_apply")
    reduce_op = None
    if kind in ("all_reduce", "reduce_scatter") and to_apply:
        reduce_op = reducers.get(to_apply.lstrip("%"))
    return HloCollective(
        kind=kind,
        shapes=tuple(dims for _, dims in leaves),
        dtypes=tuple(dtype for dtype, _ in leaves),
        payload_bytes=payload,
        group_size=group_size,
        replica_groups=groups,
        op_name=op_name,
        is_backward="transpose(" in op_name,
        reduce_op=reduce_op,
        name=m["name"],
        source_target_pairs=pairs,
    )


def compiled_collectives(fn: Callable, *args: Any, **jit_kwargs: Any) -> list[HloCollective]:
    """Compile ``fn`` for ``args`` and return its collectives.

    Args:
      fn: the function (jitted or not).
      *args: arrays or ``jax.ShapeDtypeStruct`` (with shardings) to compile for.
      **jit_kwargs: passed to ``jax.jit`` (e.g. ``out_shardings=``).

    Example::

        >>> compiled_collectives(lambda y: reshard(y, P()), x)
        [HloCollective(kind='all_gather', ...)]
    """
    text = jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text()
    return parse_collectives(text)


def summarize(collectives: Iterable[Any]) -> dict[str, dict[str, int]]:
    """Count and total payload bytes per kind.

    Works on :class:`HloCollective` and on plan steps
    (:class:`spmdkit.resharding.Collective`; local steps are skipped).

    Example::

        >>> summarize(parse_collectives(text))
        {'all_gather': {'count': 1, 'payload_bytes': 512}}
    """
    out: dict[str, dict[str, int]] = {}
    for c in collectives:
        if getattr(c, "is_local", False):
            continue
        entry = out.setdefault(c.kind, {"count": 0, "payload_bytes": 0})
        entry["count"] += 1
        entry["payload_bytes"] += c.payload_bytes
    return dict(sorted(out.items()))


def _logical(collectives: Iterable[HloCollective]) -> list[tuple[str, int, int]]:
    """(kind, payload_bytes, group_size) per logical collective; combined ones split."""
    out = []
    for c in collectives:
        if c.group_size <= 1 and c.kind != "collective_permute":
            continue
        if c.is_combined:
            factor = c.group_size if c.kind == "reduce_scatter" else 1
            for dtype, dims in zip(c.dtypes, c.shapes, strict=True):
                out.append((c.kind, _nbytes((dtype, dims)) * factor, c.group_size))
        else:
            out.append((c.kind, c.payload_bytes, c.group_size))
    return out


def _per_axis_match(step: Any, unmatched: list[tuple[str, int, int]]) -> list | None:
    """``len(step.axes)`` unmatched all-reduces of the step's payload whose groups
    multiply to its group size, or None."""
    candidates = [
        key for key in unmatched if key[0] == "all_reduce" and key[1] == step.payload_bytes
    ]
    for combo in itertools.combinations(candidates, len(step.axes)):
        if math.prod(group for _, _, group in combo) == step.group_size:
            return list(combo)
    return None


def check_plan(
    plan: ReshardPlan,
    collectives: Iterable[HloCollective],
    *,
    reduce_scatter_as_all_reduce: bool = False,
    all_reduce_per_axis: bool = False,
) -> list[str]:
    """Differences between a reshard plan and the collectives XLA compiled.

    Every communicating plan step must match one HLO collective of the same kind,
    group size and payload bytes, and every HLO collective must be matched. A
    combined (tuple-shaped) HLO collective counts as one collective per result.
    Group-of-one collectives are ignored (they move nothing).

    What XLA's CPU backend emitted, measured with jax 0.10.2 on 8 virtual devices:

    - :func:`spmdkit.resharding.reshard` runs each step as one ``shard_map``
      collective, and the compiled program holds exactly those: ``all_gather`` →
      all-gather, ``psum`` → all-reduce, ``psum_scatter`` → reduce-scatter,
      ``all_to_all`` → one all-to-all with a per-peer tuple result. No
      equivalence is needed there; the default is exact matching.
    - XLA's own partitioner (``jax.sharding.reshard``, ``with_sharding_constraint``,
      ``out_shardings``) agrees with the plan on one-axis moves (s→r all-gather,
      r→s local dynamic-slice, s→s all-to-all, p→r all-reduce, padded bytes of
      uneven dims included) except **p→s, which CPU lowers as all-reduce plus a
      local dynamic-slice** where the plan (and a GPU) reduce-scatters. Pass
      ``reduce_scatter_as_all_reduce=True`` to accept that: the all-reduce operand
      is the reduce-scatter input, so payload bytes and group size still agree
      (the wire bytes do not: an all-reduce sends twice as much).
    - Pending reductions over several axes: the plan resolves them in one
      all-reduce over all the axes. XLA does the same when the partial axes come
      from one dim sharded over several axes (a matmul contracting
      ``f32[8@(a,b)]``), but emits one all-reduce per axis, each of the full
      payload, when they come from different dims (``sum`` of ``f32[8@a,8@b]``).
      A spec does not record where a partial axis came from, so pass
      ``all_reduce_per_axis=True`` to accept either.
    - On multi-axis moves XLA's partitioner also re-orders devices with
      collective-permutes (``P(('a','b')) -> P('b')`` = permute + 2-way
      all-gather). A plan's ``collective_permute`` step, the last into a finer
      goal, matches XLA's permute there (``P('a') -> P('b')`` on ``a=2, b=4``);
      a permute XLA makes before a gather, or its gather over part of an axis
      (``P('b') -> P('a')``), has no plan step.

    Args:
      plan: a :class:`spmdkit.resharding.ReshardPlan` (or any iterable of steps).
      collectives: parsed HLO collectives.
      reduce_scatter_as_all_reduce: let a planned reduce-scatter match an
        all-reduce of the same payload and group size.
      all_reduce_per_axis: let a planned all-reduce over ``k`` axes match ``k``
        all-reduces of the same payload whose group sizes multiply to its own.

    Returns:
      Human-readable differences; empty when plan and program agree.

    Example::

        >>> check_plan(plan, compiled_collectives(lambda y: reshard(y, dst), x))
        []
    """
    if hasattr(plan, "collectives"):
        steps = plan.collectives
    else:
        steps = [s for s in plan if not s.is_local]
    unmatched = _logical(collectives)
    problems = [
        f"planned {step} has no matching collective in the HLO"
        for step in steps
        if not _match(step, unmatched, reduce_scatter_as_all_reduce, all_reduce_per_axis)
    ]
    problems.extend(
        f"HLO {kind} {group}×: {payload} B is not in the plan" for kind, payload, group in unmatched
    )
    return problems


def _match(
    step: Any,
    unmatched: list[tuple[str, int, int]],
    reduce_scatter_as_all_reduce: bool,
    all_reduce_per_axis: bool,
) -> bool:
    """Remove the HLO collectives that one plan step matches from ``unmatched``
    (:func:`check_plan`'s equivalences); False when none does."""
    wanted = [(step.kind, step.payload_bytes, step.group_size)]
    if reduce_scatter_as_all_reduce and step.kind == "reduce_scatter":
        wanted.append(("all_reduce", step.payload_bytes, step.group_size))
    for key in wanted:
        if key in unmatched:
            unmatched.remove(key)
            return True
    split = None
    if all_reduce_per_axis and step.kind == "all_reduce" and len(step.axes) > 1:
        split = _per_axis_match(step, unmatched)
    if split is None:
        return False
    for key in split:
        unmatched.remove(key)
    return True
