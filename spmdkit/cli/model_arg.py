"""The MODEL argument of ``spmdkit plan``, ``report``, ``train`` and ``import``:
a reference model's name, or the user's own model as ``pkg.module:factory``.

``pkg.module`` is imported as ``python -m`` finds modules: from ``sys.path``
with the current directory first. ``factory`` names an attribute of it (dots
reach into it: ``module:Class.method``) that is, or returns when called, one of:

- a model spec, :class:`spmdkit.models.ModelSpec` (``configs``, ``build``,
  ``loss``, ``batch``, ``batch_axes``), the form the reference models have.
  Every command runs it: ``--config`` picks one of its configs (default
  ``tiny`` when it has one, else its first), ``--batch-size`` goes to its
  ``batch(config, batch_size, rng)`` (default 8), which ``train`` also draws
  its synthetic batches from;
- a described model, :class:`spmdkit.ModelInfo` (``sk.describe(lambda:
  MyModel(rngs=nnx.Rngs(0)), loss=..., batch=...)``): ``plan`` only (it holds
  the batch's shapes, not values to compile, verify or train on).

A factory is called with the flags it declares among ``config`` and
``batch_size`` (as keyword arguments, when given on the command line; its own
defaults otherwise). A flag given to a factory that returns a described model
but does not declare it is an error: the batch it described would not be the
one asked for.

Nothing here runs before the other flags are checked: :func:`check_model_arg`
(a factory path's syntax and that its module exists, or a reference model's name
and config) runs with the flag checks, :func:`resolve_model` (the import and the
call, which may trace the model) after the devices are chosen.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

from spmdkit.errors import UsageError

__all__ = [
    "MODEL_HELP",
    "ModelArg",
    "add_model_arguments",
    "check_model_arg",
    "is_factory_path",
    "resolve_model",
]

#: The MODEL argument's help (the reference models are listed when help prints).
MODEL_HELP = (
    "a reference model: {models}; or your own model as pkg.module:factory (imported "
    "from the current directory or sys.path): a spmdkit.models.ModelSpec, or a function "
    "returning one, or returning an sk.describe(...) ModelInfo (plan only); the "
    "function is called with config= and batch_size= when it declares them (docs/cli.md)"
)

#: The flags a factory may declare, by parameter name.
_FACTORY_FLAGS = {"config": "--config", "batch_size": "--batch-size"}


def add_model_arguments(parser: argparse.ArgumentParser, *, batch_help: str = "") -> None:
    """MODEL, ``--config`` and ``--batch-size`` (the defaults are resolved with
    the model: :func:`resolve_model`)."""
    from spmdkit.cli.command import MODELS_HELP, positive_int

    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP.format(models=MODELS_HELP))
    parser.add_argument(
        "--config",
        default=None,
        help="the model's config name (default: tiny, or a model spec's first config)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="global batch size (default: 8, or the batch of a factory's ModelInfo)" + batch_help,
    )


@dataclass(frozen=True)
class ModelArg:
    """The MODEL argument resolved.

    Attributes:
      text: as given (``gpt``, ``mymodels:make``).
      spec: the model spec (a reference model's or the factory's); None for a
        described model.
      config: ``spec``'s config object (None without a spec).
      info: the described model the factory returned (None for a spec).
      batch_size: the global batch size (``--batch-size``, or the described
        model's batch rows).
    """

    text: str
    spec: Any
    config: Any
    info: Any
    batch_size: int

    def describe(self) -> Any:
        """The model as ``sk.describe`` reads it (a spec with its config and batch size)."""
        from spmdkit.introspect import describe

        if self.info is not None:
            return self.info
        return describe(self.spec, config=self.config, batch_size=self.batch_size)

    def require_spec(self, op: str) -> Any:
        """The model spec, for a command that needs batch values (``report``,
        ``train``, ``import``).

        Raises:
          UsageError: the factory returned a described model (no batch values).
        """
        if self.spec is None:
            raise UsageError(
                op=f"{op} MODEL",
                must="MODEL gives batch values to run on: a reference model or a factory "
                "returning a model spec (spmdkit.models.ModelSpec)",
                given=f"{self.text}, which returns a ModelInfo (the batch's shapes only)",
                fix="return spmdkit.models.ModelSpec(name=..., configs=..., build=..., "
                "loss=..., batch=..., batch_axes=...) from the factory (docs/cli.md), or "
                "use `spmdkit plan` for a ModelInfo",
            )
        return self.spec


def is_factory_path(text: str) -> bool:
    """Whether MODEL names the user's factory (``module:attr``) rather than a
    reference model.

    Example::

        >>> is_factory_path("mymodels:make_lm"), is_factory_path("gpt")
        (True, False)
    """
    return ":" in text


def _split(op: str, text: str) -> tuple[str, str]:
    module, _, attr = text.partition(":")
    parts = [*module.split("."), *attr.split(".")]
    if not all(p.isidentifier() for p in parts):
        raise UsageError(
            op=f"{op} MODEL",
            must="MODEL is a reference model name or pkg.module:factory (dotted Python "
            "names, one colon)",
            given=repr(text),
            fix="write e.g. mymodels:make_lm for make_lm() in mymodels.py in the current directory",
        )
    return module, attr


def check_model_arg(op: str, text: str, config: str | None) -> None:
    """MODEL and ``--config`` checked with the other flags, before anything runs:
    a factory path's syntax (it is imported later, :func:`resolve_model`), or a
    reference model's name and config (importing the models: call it last).

    Raises:
      UsageError: a malformed factory path; UnknownModelError: no such reference
        model (naming MODEL, a near match, and the factory form) or config.
    """
    if is_factory_path(text):
        _find(op, _split(op, text)[0])
        return
    must = "MODEL is a reference model or your own model as pkg.module:factory"
    if "." in text:  # no reference model has a dot: a factory written without its colon
        module, _, attr = text.rpartition(".")
        hint = f"did you mean {module}:{attr}?" if _findable(module) else ""
        raise UsageError(
            op=f"{op} MODEL",
            must=must,
            given=repr(text),
            fix=hint or "write pkg.module:factory (a colon before the function's name)",
        )
    from spmdkit.models import MODELS, UnknownModelError, get_model

    try:
        spec = get_model(text)
    except UnknownModelError as e:
        near = e.fix + " " if e.fix.startswith("did you mean") else ""
        if _findable(text):
            near = f"{text} is a module: name its factory, {text}:<function>; "
        raise UnknownModelError(
            op=f"{op} MODEL",
            must=must + f" (the reference models: {', '.join(MODELS)})",
            given=e.given,
            fix=near + "write pkg.module:factory for a model of yours (docs/cli.md)",
        ) from None
    _spec_config(op, spec, config)


def _findable(module: str) -> bool:
    """Whether ``module`` names an importable module (:func:`_find`)."""
    try:
        _find("", module)
    except UsageError:
        return False
    return True


def _spec_config(op: str, spec: Any, config: str | None) -> Any:
    """``spec``'s config called ``config`` (default ``tiny`` when it has one, else its first)."""
    import difflib

    from spmdkit.models import UnknownModelError

    names = list(spec.configs)
    if config is None:
        if not names:
            raise UsageError(
                op=f"{op} MODEL",
                must="a model spec has at least one config",
                given=f"{getattr(spec, 'name', spec)!r} with configs={{}}",
                fix="give the spec configs={'tiny': MyConfig}",
            )
        config = "tiny" if "tiny" in names else names[0]
    if config not in spec.configs:
        raise UnknownModelError(
            op=f"{op} --config",
            must="the config be one of " + ", ".join(names),
            given=repr(config),
            fix=(
                f"did you mean {near[0]!r}?"
                if (near := difflib.get_close_matches(config, names, n=1))
                else f"pick a config from {names}"
            ),
        )
    return spec.configs[config]()


def _find(op: str, module: str) -> None:
    """``module`` can be found as ``python -m`` would find it (the current
    directory first), without running it (its parent packages are imported).

    Raises:
      UsageError: no such module.
    """
    import importlib.util

    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError as e:  # a parent package is missing
        found, module = None, e.name or module
    if found is None:
        raise UsageError(
            op=f"{op} MODEL",
            must="MODEL's module is importable (on sys.path or in the current directory)",
            given=f"no module {module!r} (current directory {here})",
            fix="run from the directory holding it, or add its directory to PYTHONPATH",
        )


def _import(op: str, module: str) -> Any:
    """``module`` imported (:func:`_find` first); a module it imports that is
    missing is named."""
    _find(op, module)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise UsageError(
            op=f"{op} MODEL",
            must="MODEL's module imports",
            given=f"{module} imports {e.name!r}, which is not installed",
            fix=f"install {str(e.name).split('.')[0]!r}, or remove the import",
        ) from None


def _attribute(op: str, module: Any, attr: str) -> Any:
    import difflib

    obj = module
    for i, name in enumerate(attr.split(".")):
        if not hasattr(obj, name):
            where = ".".join([module.__name__, *attr.split(".")[:i]])
            public = [n for n in dir(obj) if not n.startswith("_")]
            near = difflib.get_close_matches(name, public, n=1)
            raise UsageError(
                op=f"{op} MODEL",
                must="MODEL's factory is an attribute of its module",
                given=f"{where} has no {name!r}",
                fix=(f"did you mean {near[0]!r}? " if near else "")
                + f"write {module.__name__}:<name of a function in it>",
            )
        obj = getattr(obj, name)
    return obj


def _call(op: str, text: str, factory: Any, given: dict[str, Any]) -> tuple[Any, set[str]]:
    """``factory(**the given flags it declares)``, and the flags it took."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: no flags
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in given.items() if takes_any or k in params}
    required = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and n not in kwargs
    ]
    if required:
        flags = [_FACTORY_FLAGS.get(n, "") for n in required]
        raise UsageError(
            op=f"{op} MODEL",
            must="MODEL's factory can be called with no arguments, or with config= and "
            "batch_size= (from --config and --batch-size) only",
            given=f"{text} requires {', '.join(required)}",
            fix=(f"pass {' and '.join(f for f in flags if f)} or " if all(flags) else "")
            + "give its parameters defaults",
        )
    return factory(**kwargs), set(kwargs)


def resolve_model(
    op: str, text: str, *, config: str | None = None, batch_size: int | None = None
) -> ModelArg:
    """MODEL resolved (module docstring): a reference model with its config, or
    the user's factory imported and called.

    Args:
      op: the command, for messages (``"spmdkit plan"``).
      text: MODEL as given.
      config: ``--config`` (None: not given).
      batch_size: ``--batch-size`` (None: not given; 8 for a spec).

    Raises:
      UsageError: the module or attribute is missing, the factory needs other
        arguments or returns something else, or a flag a described model did
        not take; UnknownModelError: no such reference model or config.

    Example::

        >>> resolve_model("spmdkit plan", "gpt").config.d_model
        64
        >>> resolve_model("spmdkit plan", "mymodels:make_lm", batch_size=16).batch_size
        16
    """
    if not is_factory_path(text):
        from spmdkit.models import get_model

        check_model_arg(op, text, config)
        spec = get_model(text)
        return ModelArg(text, spec, _spec_config(op, spec, config), None, batch_size or 8)
    module_name, attr = _split(op, text)
    obj = _attribute(op, _import(op, module_name), attr)
    given = {"config": config, "batch_size": batch_size}
    given = {k: v for k, v in given.items() if v is not None}
    took: set[str] = set()
    if not _is_model(obj) and callable(obj):
        obj, took = _call(op, text, obj, given)
    return _model_arg(op, text, obj, given, took, config, batch_size)


def _is_model(obj: Any) -> bool:
    from spmdkit.introspect.model import ModelInfo

    return isinstance(obj, ModelInfo) or _is_spec(obj)


def _is_spec(obj: Any) -> bool:
    from spmdkit.models import ModelSpec

    return isinstance(obj, ModelSpec)


def _model_arg(
    op: str,
    text: str,
    obj: Any,
    given: dict[str, Any],
    took: set[str],
    config: str | None,
    batch_size: int | None,
) -> ModelArg:
    from spmdkit.introspect.model import ModelInfo

    if _is_spec(obj):
        return ModelArg(text, obj, _spec_config(op, obj, config), None, batch_size or 8)
    if isinstance(obj, ModelInfo):
        ignored = sorted(set(given) - took)
        if ignored:
            flag = _FACTORY_FLAGS[ignored[0]]
            raise UsageError(
                op=f"{op} {flag}",
                must=f"{flag} reaches a factory that returns a ModelInfo only when the "
                f"factory declares {ignored[0]}=",
                given=f"{flag} {given[ignored[0]]}, and {text} takes no {ignored[0]}",
                fix=f"add a {ignored[0]} parameter to the factory, or drop {flag}",
            )
        import jax

        rows = [leaf.shape[0] for leaf in jax.tree.leaves(obj.batch) if leaf.shape]
        return ModelArg(text, None, None, obj, rows[0] if rows else 1)
    what = type(obj).__name__
    bare = "a bare module has no loss or batch: " if _is_module(obj) else ""
    raise UsageError(
        op=f"{op} MODEL",
        must="MODEL's factory returns a model spec (spmdkit.models.ModelSpec) or an "
        "sk.describe(...) ModelInfo",
        given=f"{text} returned {what}",
        fix=bare + "return sk.describe(lambda: MyModel(rngs=nnx.Rngs(0)), loss=..., "
        "batch=...) to plan it, or a ModelSpec to also report and train (docs/cli.md)",
    )


def _is_module(obj: Any) -> bool:
    from flax import nnx

    return isinstance(obj, nnx.Module)
