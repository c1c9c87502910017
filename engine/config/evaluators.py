"""Load evaluator profiles, and bind them to agents, from one Python config file.

The file defines ``evaluator_profiles(args)``, a non-empty list of ``EvaluatorProfile`` with
distinct ids (pure data: the scheduler calls only this, so it plans without building an agent
or loading a tokenizer), and ``build_agents(args)``, a mapping of each profile's id to the
``BaseAgent`` that runs it (called by evaluator workers only, through ``load_evaluators``).
The file is imported by path under a name derived from its resolved path, so two files never
collide. Anything that breaks this contract, including an exception while importing or calling,
is a ``ConfigError`` naming the file. Results keep the order ``evaluator_profiles`` returned:
resolution falls back to the first profile for an unknown task type.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType, ModuleType

from engine.agents.binding import EvaluatorBinding
from engine.domain import EvaluatorProfile
from engine.errors import ConfigError

__all__ = ["AGENTS_FUNCTION", "PROFILES_FUNCTION", "load_evaluators", "load_profiles"]

PROFILES_FUNCTION = "evaluator_profiles"
AGENTS_FUNCTION = "build_agents"


def load_profiles(path: str | Path, args: object) -> Mapping[str, EvaluatorProfile]:
    """The profiles of the config file at ``path``, by id."""
    return _profiles(str(path), _import(path), args)


def load_evaluators(path: str | Path, args: object) -> Mapping[str, EvaluatorBinding]:
    """Each profile of the config file at ``path`` bound to its agent, by id."""
    source = str(path)
    module = _import(path)
    profiles = _profiles(source, module, args)
    agents = _call(source, module, AGENTS_FUNCTION, args)
    if not isinstance(agents, Mapping):
        raise ConfigError(
            f"{source}: {AGENTS_FUNCTION}(args) must return a mapping of evaluator id to "
            f"BaseAgent, got {type(agents).__name__}"
        )
    missing = [eid for eid in profiles if eid not in agents]
    if missing:
        raise ConfigError(
            f"{source}: {AGENTS_FUNCTION}(args) returned no agent for evaluator(s) {missing}"
        )
    unknown = sorted(str(eid) for eid in agents if eid not in profiles)
    if unknown:
        raise ConfigError(
            f"{source}: {AGENTS_FUNCTION}(args) returned agents for {unknown}, which "
            f"{PROFILES_FUNCTION}(args) does not define (known: {list(profiles)})"
        )
    bindings: dict[str, EvaluatorBinding] = {}
    for eid, profile in profiles.items():
        try:
            bindings[eid] = EvaluatorBinding(profile=profile, agent=agents[eid])
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return MappingProxyType(bindings)


def _import(path: str | Path) -> ModuleType:
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
    return module


def _call(source: str, module: ModuleType, name: str, args: object) -> object:
    fn: Callable[[object], object] | None = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"{source}: defines no {name}(args) function")
    if not callable(fn):
        raise ConfigError(f"{source}: {name} is not callable")
    try:
        return fn(args)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {name}(args) refused its config: {exc}") from exc
    except Exception as exc:
        raise ConfigError(f"{source}: {name}(args) raised {type(exc).__name__}: {exc}") from exc


def _profiles(source: str, module: ModuleType, args: object) -> Mapping[str, EvaluatorProfile]:
    profiles = _call(source, module, PROFILES_FUNCTION, args)
    if not isinstance(profiles, list | tuple):
        raise ConfigError(
            f"{source}: {PROFILES_FUNCTION}(args) must return a list of EvaluatorProfile, "
            f"got {type(profiles).__name__}"
        )
    if not profiles:
        raise ConfigError(f"{source}: {PROFILES_FUNCTION}(args) returned no evaluators")
    by_id: dict[str, EvaluatorProfile] = {}
    for i, item in enumerate(profiles):
        if not isinstance(item, EvaluatorProfile):
            raise ConfigError(
                f"{source}: {PROFILES_FUNCTION}(args) item {i} must be an EvaluatorProfile, "
                f"got {type(item).__name__}"
            )
        if item.evaluator_id in by_id:
            raise ConfigError(
                f"{source}: evaluator id {item.evaluator_id!r} is returned more than once"
            )
        by_id[item.evaluator_id] = item
    return MappingProxyType(by_id)
