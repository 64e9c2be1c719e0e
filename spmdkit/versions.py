"""The versions spmdkit is tested with: one table, read by ``spmdkit doctor``.

:data:`TESTED` is the only place the tested range is written in code;
``pyproject.toml`` states the same range (its dependency minimums, its Python
classifiers and a ``# Tested:`` comment line, which a test compares with
:func:`range_line`). pip does not enforce the upper bounds: a newer jax may well
work, so installing it is allowed, and ``spmdkit doctor`` says that it has not
been tested. Nothing here imports jax, so the check runs even when jax is
missing or broken.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
from dataclasses import dataclass

__all__ = [
    "TESTED",
    "TestedRange",
    "VersionCheck",
    "accelerator_plugins",
    "check",
    "check_all",
    "cse_merges_through_barriers",
    "installed_version",
    "parse_version",
    "cpu_float8_held_as",
    "plugin_advice",
    "python_minors",
    "range_line",
    "reassociates_all_reduces",
]


def parse_version(text: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"0.12.0.1"`` → ``(0, 12, 0, 1)``.

    Pre-release and local suffixes are dropped (``"0.13.0.dev20250101"`` reads as
    ``(0, 13, 0)``), which is enough for the range checks here.

    Raises:
      ValueError: the text does not start with a number.

    Example::

        >>> parse_version("3.12.1")
        (3, 12, 1)
    """
    found = re.match(r"\d+(?:\.\d+)*", text.strip())
    if found is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in found.group().split("."))


@dataclass(frozen=True)
class TestedRange:
    """The versions of one distribution that spmdkit's CI runs on.

    Attributes:
      dist: the distribution's name on PyPI (``"python"`` for the interpreter).
      minimum: the lowest tested version (inclusive); pyproject's ``>=``.
      below: the first version not tested (exclusive), or ``None`` where every
        newer release is expected to work (no known break).
    """

    __test__ = False  # a value type, not a pytest class

    dist: str
    minimum: str
    below: str | None = None

    def __post_init__(self) -> None:
        low = parse_version(self.minimum)
        if self.below is not None and parse_version(self.below) <= low:
            raise ValueError(f"{self.dist}: below={self.below} is not above {self.minimum}")

    def __str__(self) -> str:
        upper = f",<{self.below}" if self.below is not None else ""
        return f">={self.minimum}{upper}"

    def contains(self, version: str) -> bool:
        """Whether ``version`` lies inside the range.

        Example::

            >>> TestedRange("jax", "0.10.2", "0.13").contains("0.12.0.1")
            True
        """
        found = parse_version(version)
        if found < parse_version(self.minimum):
            return False
        return self.below is None or found < parse_version(self.below)


#: The tested range, one row per distribution. jax 0.11 and newer need Python
#: 3.12 (their ``Requires-Python``), so on Python 3.11 pip resolves jax 0.10.2;
#: CI runs both ends (``.ci/run``). jaxlib is not a direct dependency (jax pulls the
#: matching one) but a mismatched jaxlib is a common break, so it is checked too.
TESTED: tuple[TestedRange, ...] = (
    TestedRange("python", "3.11", "3.14"),
    TestedRange("jax", "0.10.2", "0.13"),
    TestedRange("jaxlib", "0.10.2", "0.13"),
    TestedRange("flax", "0.12.8"),
    TestedRange("optax", "0.2.5"),
    TestedRange("orbax-checkpoint", "0.12.8"),
    TestedRange("chex", "0.1.90"),
    TestedRange("numpy", "1.26"),
)


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution (``"python"``: the interpreter), or
    ``None`` when it is not installed.

    Example::

        >>> installed_version("no-such-distribution") is None
        True
    """
    if dist == "python":
        return platform.python_version()
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class VersionCheck:
    """One distribution's installed version against its tested range.

    Attributes:
      dist: the distribution.
      version: what is installed (``None``: nothing).
      tested: the tested range.
    """

    dist: str
    version: str | None
    tested: TestedRange

    @property
    def ok(self) -> bool:
        """Installed and inside the tested range."""
        return self.version is not None and self.tested.contains(self.version)

    def advice(self) -> str:
        """What is wrong and what to do ("" when :attr:`ok`).

        Example::

            >>> VersionCheck("jax", "0.13.1", TestedRange("jax", "0.10.2", "0.13")).advice()
            'jax 0.13.1 is outside the tested range >=0.10.2,<0.13: pip install "jax>=0.10.2,<0.13" (or run untested at your own risk)'
        """  # noqa: E501 - a doctest line
        if self.ok:
            return ""
        if self.dist == "python":
            return (
                f"Python {self.version} is outside the tested range {self.tested}: "
                f"make the virtual environment with Python {' or '.join(python_minors())}"
            )
        fix = f'pip install "{self.dist}{self.tested}"'
        if self.version is None:
            return f"{self.dist} is not installed: {fix}"
        return (
            f"{self.dist} {self.version} is outside the tested range {self.tested}: "
            f"{fix} (or run untested at your own risk)"
        )


#: The first jaxlib whose XLA:CPU keeps an ``optimization_barrier`` through common
#: subexpression elimination (:func:`cse_merges_through_barriers`).
CPU_BARRIER_KEPT_JAXLIB = "0.11"


def cse_merges_through_barriers(backend: str | None, jaxlib: str | None = None) -> bool:
    """Whether XLA merges a collective with the same collective run on an
    ``optimization_barrier`` of the same operand (computes it once).

    XLA:CPU up to jaxlib 0.10 removes optimization barriers before its common
    subexpression elimination, so the two collectives are one; from jaxlib 0.11
    (:data:`CPU_BARRIER_KEPT_JAXLIB`) it keeps the barrier through it and runs
    both. Measured: ``all_gather(x)`` and ``all_gather(optimization_barrier(x))``
    (likewise ``ppermute``) in one ``shard_map`` on 8 CPU devices compile to one
    all-gather on jaxlib 0.10.2, two on 0.11.2 and 0.12.0. A grad region's
    recomputed forward enters through such a barrier
    (:func:`spmdkit.engine.region.region_program`), so this says whether its
    collectives on the operands are the forward region's, already run. Other
    backends are taken to keep the barrier, as ``jax.checkpoint``'s remat relies on
    (not measured here): False.

    Args:
      backend: the devices' platform (``"cpu"``, ``"gpu"``…); None: unknown,
        taken as not CPU.
      jaxlib: the jaxlib version (default: the installed one).

    Example::

        >>> cse_merges_through_barriers("cpu", "0.10.2"), cse_merges_through_barriers("cpu", "0.12.0")
        (True, False)
    """  # noqa: E501 - a doctest line
    if backend != "cpu":
        return False
    version = jaxlib if jaxlib is not None else installed_version("jaxlib")
    return version is not None and parse_version(version) < parse_version(CPU_BARRIER_KEPT_JAXLIB)


#: The first jaxlib whose XLA:CPU holds a dequantized float8 operand in 16 bits
#: (:func:`cpu_float8_held_as`).
CPU_FLOAT8_NARROW_JAXLIB = "0.11"


def cpu_float8_held_as(jaxlib: str | None = None) -> str:
    """The dtype XLA:CPU holds an ``spmdkit.step.fp8`` step's float8 values in.

    XLA:CPU keeps no float8 buffer: each quantizing cast is fused with the convert
    that widens it back for the dot, so what the step keeps is the widened copy.
    Up to jaxlib 0.10 every dot of 16-bit or float8 operands runs in float32 (its
    operands converted), so that copy is float32. From jaxlib 0.11
    (:data:`CPU_FLOAT8_NARROW_JAXLIB`) XLA:CPU runs 16-bit float dots natively
    through YNNPACK when the left operand contracts its last dim (or is copied
    into that form), and the copy is a 16-bit float: ``"float16"`` is returned
    (its size is what the estimate needs). Measured on tiny GPT's float8 train step
    under fsdp on 8 CPU devices: float32 copies match the compiled peak on
    jaxlib 0.10.2, 16-bit ones on 0.11.2 and 0.12.0.

    Args:
      jaxlib: the jaxlib version (default: the installed one).

    Example::

        >>> cpu_float8_held_as("0.10.2"), cpu_float8_held_as("0.12.0")
        ('float32', 'float16')
    """
    version = jaxlib if jaxlib is not None else installed_version("jaxlib")
    old = version is not None and parse_version(version) < parse_version(CPU_FLOAT8_NARROW_JAXLIB)
    return "float32" if old else "float16"


#: The backends whose XLA pipeline runs ``AllReduceReassociate``
#: (:func:`reassociates_all_reduces`).
REASSOCIATING_BACKENDS = frozenset({"gpu", "cuda", "rocm"})


def reassociates_all_reduces(backend: str | None) -> bool:
    """Whether XLA turns ``add(all-reduce(a), all-reduce(b))`` into
    ``all-reduce(add(a, b))`` on ``backend``: one reduction where the program
    sums two partial results (a layer's column-parallel matmuls that share an
    input: q, k and v, gate and up, their input gradients added).

    XLA:GPU runs the ``AllReduceReassociate`` pass in its collective
    optimizations (``gpu_compiler.cc``; it also folds the reduce-scatter form,
    ``ReduceScatterReassociate``) when the two reductions have the same replica
    groups and reduction, each feeds only the sum, possibly through a reshape,
    slice or widening convert. XLA:CPU does not run it: on 8 CPU devices
    ``x @ wq``, ``x @ wk``, ``x @ wv`` with the weights split over their output
    dim compile to three reductions of ``x``'s gradient (one tuple all-reduce),
    on jaxlib 0.10.2, 0.11.2 and 0.12.0. TPUs are not measured here: False.

    Args:
      backend: the devices' platform (``"cpu"``, ``"gpu"``…); None: unknown.

    Example::

        >>> reassociates_all_reduces("gpu"), reassociates_all_reduces("cpu")
        (True, False)
    """
    return backend in REASSOCIATING_BACKENDS


def python_minors() -> list[str]:
    """The tested Python releases, oldest first (pyproject's classifiers).

    Example::

        >>> python_minors()
        ['3.11', '3.12', '3.13']
    """
    tested = {row.dist: row for row in TESTED}["python"]
    major, low = parse_version(tested.minimum)[:2]
    high = parse_version(tested.below)[1] if tested.below is not None else low + 1
    return [f"{major}.{minor}" for minor in range(low, high)]


#: Accelerator plugins of jax, by distribution name: each must be the same release
#: as jaxlib (jax refuses or warns about a plugin built for another jaxlib).
_PLUGIN = re.compile(r"^jax[-_](cuda|rocm)\d+[-_](plugin|pjrt)$")


def accelerator_plugins() -> dict[str, str]:
    """The installed jax accelerator plugins (``jax-cuda12-plugin``,
    ``jax-cuda13-pjrt``, ``jax-rocm7-plugin``, ...) → their versions, by name.

    Example::

        >>> sorted(accelerator_plugins())  # on a CPU-only install  # doctest: +SKIP
        []
    """
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if _PLUGIN.match(name):
            found[name] = dist.version
    return dict(sorted(found.items()))


def plugin_advice(plugins: dict[str, str], jaxlib: str | None) -> dict[str, str]:
    """Each plugin whose release differs from jaxlib's → a line saying what to install.

    Example::

        >>> plugin_advice({"jax-cuda13-plugin": "0.11.1"}, "0.11.2")
        {'jax-cuda13-plugin': 'jax-cuda13-plugin 0.11.1 is not jaxlib 0.11.2: pip install "jax-cuda13-plugin==0.11.2"'}
    """  # noqa: E501 - a doctest line
    if jaxlib is None:
        return {}
    return {
        name: f'{name} {version} is not jaxlib {jaxlib}: pip install "{name}=={jaxlib}"'
        for name, version in plugins.items()
        if parse_version(version) != parse_version(jaxlib)
    }


def check(dist: str) -> VersionCheck:
    """The installed version of one distribution of :data:`TESTED`, checked.

    Raises:
      KeyError: ``dist`` has no row in :data:`TESTED`.

    Example::

        >>> check("python").ok
        True
    """
    tested = {row.dist: row for row in TESTED}[dist]
    return VersionCheck(dist, installed_version(dist), tested)


def check_all() -> list[VersionCheck]:
    """Every row of :data:`TESTED` checked, in the table's order."""
    return [check(row.dist) for row in TESTED]


def range_line() -> str:
    """The ``# Tested:`` line ``pyproject.toml`` carries, made from :data:`TESTED`.

    Example::

        >>> range_line()[:48]
        '# Tested: python>=3.11,<3.14; jax>=0.10.2,<0.13;'
    """
    return "# Tested: " + "; ".join(f"{row.dist}{row}" for row in TESTED)
