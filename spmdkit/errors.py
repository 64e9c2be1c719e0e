"""The spmdkit error family.

Every error spmdkit raises on bad input derives from :class:`SpmdError` and says
four things: the op (or function) that refused, what must hold, what was given,
and how to fix it. Errors also inherit the builtin exception a caller would
naturally catch (``ValueError``, ``LookupError``) so generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "SpmdError",
    "SpecError",
    "UnknownAxisError",
    "DuplicateAxisError",
    "PartialConflictError",
    "NoRuleError",
    "RegistrationError",
    "ShardingConflictError",
    "ReshardError",
    "RecipeError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointCorruptedError",
    "UsageError",
    "TrainError",
    "MissingDependencyError",
]


class SpmdError(Exception):
    """Root of every error spmdkit raises on bad input.

    Args:
      op: the op or public function that refused the input.
      must: what must hold.
      given: what was given instead.
      fix: how to fix it.

    Example::

        >>> raise SpmdError(op="matmul", must="k dims agree", given="(4, 3) @ (5, 2)",
        ...                 fix="transpose y or pass transpose_y=True")
    """

    def __init__(self, *, op: str, must: str, given: str, fix: str) -> None:
        self.op = op
        self.must = must
        self.given = given
        self.fix = fix
        super().__init__(f"{op}: {must}; given {given}. Fix: {fix}")

    def __reduce__(self):  # keep errors picklable (multiprocess tests, pytest-xdist)
        return (_rebuild, (type(self), self.op, self.must, self.given, self.fix))


def _rebuild(cls, op, must, given, fix):
    return cls(op=op, must=must, given=given, fix=fix)


class SpecError(SpmdError, ValueError):
    """A TensorSpec (or a PartitionSpec turned into one) is malformed.

    Broken example: ``TensorSpec((8,), P("x"), partial={"x": "sum"})``: axis
    ``x`` cannot both shard a dim and hold a pending reduction.
    """


class UnknownAxisError(SpecError):
    """A spec names a mesh axis the mesh does not have.

    Broken example: ``TensorSpec((8,), P("modle"), mesh=sk.make_mesh(model=8))``.
    """


class DuplicateAxisError(SpecError):
    """A mesh axis shards two dims of one tensor (or one dim twice).

    Broken example: ``TensorSpec((8, 8), P("x", "x"))``.
    """


class PartialConflictError(SpecError):
    """A mesh axis is both sharding a dim and partial, or has an unknown reduce op.

    Broken example: ``TensorSpec((8,), P("x"), partial={"x": "sum"})``.
    """


class NoRuleError(SpmdError, LookupError):
    """No rule is registered under that op name; the message names near matches.

    Broken example: ``sk.infer_forward("matmull", x, w, mesh=mesh)``.
    """


class RegistrationError(SpmdError, ValueError):
    """A rule could not be registered: duplicate name or malformed notation.

    Broken example: registering ``"matmul"`` a second time.
    """


class ShardingConflictError(SpmdError, ValueError):
    """An inference request is impossible or ambiguous (shapes disagree, a
    required layout cannot be built, attributes contradict the inputs).

    Broken example: ``sk.infer_forward("matmul", TensorSpec((4, 3)), TensorSpec((5, 2)), mesh=m)``.
    """


class ReshardError(SpmdError, ValueError):
    """A reshard cannot be planned or executed as asked (e.g. uneven shards on a
    real array, or a partial reduce op JAX arrays cannot hold).

    Broken example: ``sk.reshard(jnp.ones(6), TensorSpec((6,), P("x")))`` on a
    4-device ``x`` axis.
    """


class RecipeError(SpmdError, ValueError):
    """A recipe option is invalid, or cannot run on this model or backend
    (``spmdkit.step.recipe``)."""


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


class UsageError(SpmdError, ValueError):
    """A ``spmdkit`` command-line flag or argument is invalid; ``op`` names the
    subcommand and the flag (``spmdkit train --ckpt``). Raised before any planning
    or compiling, with nothing written to disk.

    Broken example: ``spmdkit train gpt --resume`` (no ``--ckpt`` to resume from).
    """


class TrainError(SpmdError, ValueError):
    """The training loop (``spmdkit.runtime.train.train``) was configured
    inconsistently, or given a model, loss or data it cannot run.

    Broken example: ``train(info.loss_fn, params, ...)`` for a model with
    ``nnx.Dropout`` (that loss is the planner's trace, on a placeholder key):
    ``train(info, params, ...)`` runs the described model's train loss.
    """


class MissingDependencyError(SpmdError, ImportError):
    """An optional package a function needs is not installed.

    Broken example: ``plan.plot()`` where matplotlib is not installed
    (``pip install "spmdkit[plot]"``).
    """
