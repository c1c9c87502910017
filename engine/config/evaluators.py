"""Load evaluator specs from a Python file that exposes ``build_evaluators(args)``.

The file is imported by path (it need not be on ``sys.path``) under a module name derived from
its resolved path, so loading the same file twice reuses nothing and two files never collide.
``build_evaluators(args)`` must return a non-empty list (or tuple) of ``EvaluatorSpec`` with
distinct ``evaluator_id``s. Anything else, including an exception raised while importing the
file or building the specs, is a ``ConfigError`` naming the file.

The result maps evaluator id to spec in the order the file returned them; that order matters
because spec resolution falls back to the first spec for an unknown task type.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from engine.domain import EvaluatorSpec
from engine.errors import ConfigError

__all__ = ["BUILD_FUNCTION", "load_evaluators"]

BUILD_FUNCTION = "build_evaluators"


def load_evaluators(path: str | Path, args: object) -> Mapping[str, EvaluatorSpec]:
    """Import ``path``, call its ``build_evaluators(args)`` and index the specs by id."""
    source = str(path)
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{source}: evaluator config not found")
    resolved = file.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    module_name = f"_rollout_evaluators_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{source}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    # Registered only while it runs: dataclasses defined in the file look their module up.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ConfigError(
            f"{source}: importing the evaluator config failed: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        sys.modules.pop(module_name, None)
    build = getattr(module, BUILD_FUNCTION, None)
    if build is None:
        raise ConfigError(f"{source}: defines no {BUILD_FUNCTION}(args) function")
    if not callable(build):
        raise ConfigError(f"{source}: {BUILD_FUNCTION} is not callable")
    try:
        specs = build(args)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {BUILD_FUNCTION}(args) refused its config: {exc}") from exc
    except Exception as exc:
        raise ConfigError(
            f"{source}: {BUILD_FUNCTION}(args) raised {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(specs, list | tuple):
        raise ConfigError(
            f"{source}: {BUILD_FUNCTION}(args) must return a list of EvaluatorSpec, "
            f"got {type(specs).__name__}"
        )
    if not specs:
        raise ConfigError(f"{source}: {BUILD_FUNCTION}(args) returned no evaluators")
    by_id: dict[str, EvaluatorSpec] = {}
    for i, item in enumerate(specs):
        if not isinstance(item, EvaluatorSpec):
            raise ConfigError(
                f"{source}: {BUILD_FUNCTION}(args) item {i} must be an EvaluatorSpec, "
                f"got {type(item).__name__}"
            )
        if item.evaluator_id in by_id:
            raise ConfigError(
                f"{source}: evaluator id {item.evaluator_id!r} is returned more than once"
            )
        by_id[item.evaluator_id] = item
    return MappingProxyType(by_id)
