"""The cluster layout: the nodes the placement pool may place samples on, and their capacity.

Inline JSON (a string starting with ``{``) or a JSON file; each node a mapping or the shorthand
GPU-id list::

    {"127.0.0.1": {"gpus": [0, 1, 2, 3], "cpu": 96, "memory_gb": 384}}
    {"127.0.0.1": [0, 1, 2, 3]}

A node without ``cpu`` / ``memory_gb`` takes ``default_cpu`` / ``default_memory_gb``
(``--env-num-cpus`` / ``--env-memory-gb``), which are otherwise required; one without ``gpus``
is CPU-only.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, ValidationError, field_validator

from engine.domain import FrozenModel, NonNegInt, PosFloat
from engine.errors import ConfigError
from engine.messages import explain, unknown_key_message

__all__ = ["ClusterLayout", "NodeSpec", "parse_cluster_layout"]

_NODE_KEYS = ("gpus", "cpu", "memory_gb")


class NodeSpec(FrozenModel):
    """One node's capacity: its GPU ids (each of capacity 1.0), CPUs and memory."""

    name: str = Field(min_length=1)
    gpus: tuple[NonNegInt, ...] = ()
    cpu: PosFloat
    memory_gb: PosFloat

    @field_validator("gpus")
    @classmethod
    def _unique_gpus(cls, gpus: tuple[int, ...]) -> tuple[int, ...]:
        duplicates = sorted({gpu for gpu in gpus if gpus.count(gpu) > 1})
        if duplicates:
            raise ValueError(f"lists GPU ids {duplicates} more than once")
        return gpus


class ClusterLayout(FrozenModel):
    """The nodes in the order the layout lists them."""

    nodes: tuple[NodeSpec, ...] = Field(min_length=1)

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    @property
    def total_gpus(self) -> int:
        return sum(len(node.gpus) for node in self.nodes)

    @property
    def total_cpu(self) -> float:
        return sum(node.cpu for node in self.nodes)

    @property
    def total_memory_gb(self) -> float:
        return sum(node.memory_gb for node in self.nodes)


def parse_cluster_layout(
    spec: str | Path,
    *,
    default_cpu: float | None = None,
    default_memory_gb: float | None = None,
) -> ClusterLayout:
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        source, text = "cluster layout (inline JSON)", spec
    else:
        source = str(spec)
        try:
            text = Path(spec).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{source}: cluster layout file not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{source}: cannot read cluster layout: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected an object mapping node names to nodes, got {type(data).__name__}"
        )
    if not data:
        raise ConfigError(f"{source}: the layout lists no nodes")
    defaults = {"cpu": default_cpu, "memory_gb": default_memory_gb}
    for key, value in defaults.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{source}: the default for {key!r} must be positive, got {value}")
    return ClusterLayout(
        nodes=tuple(_parse_node(name, node, defaults, source) for name, node in data.items())
    )


def _parse_node(
    name: str, node: object, defaults: dict[str, float | None], source: str
) -> NodeSpec:
    where = f"{source}: node {name!r}"
    if isinstance(node, list):
        fields: dict[str, object] = {"gpus": node}
    elif isinstance(node, dict):
        for key in node:
            if key not in _NODE_KEYS:
                raise ConfigError(f"{where}: {unknown_key_message(key, _NODE_KEYS)}")
        fields = dict(node)
    else:
        raise ConfigError(
            f"{where}: expected a list of GPU ids or an object with keys "
            f"{', '.join(_NODE_KEYS)}, got {node!r}"
        )
    for key, default in defaults.items():
        if key in fields:
            continue
        if default is None:
            flag = "--env-num-cpus" if key == "cpu" else "--env-memory-gb"
            raise ConfigError(f"{where}: key {key!r} is missing and no default ({flag}) is set")
        fields[key] = default
    try:
        return NodeSpec.model_validate({**fields, "name": name})
    except ValidationError as exc:
        problems = [f"key {key!r} {problem}" if key else problem for key, problem in explain(exc)]
        raise ConfigError(f"{where}: " + "; ".join(problems)) from None
