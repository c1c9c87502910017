from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.config.layout import ClusterLayout, NodeSpec, parse_cluster_layout
from engine.errors import ConfigError


def test_full_dict_form() -> None:
    layout = parse_cluster_layout(
        '{"127.0.0.1": {"gpus": [0, 1, 2, 3], "cpu": 96, "memory_gb": 384}}'
    )
    assert layout == ClusterLayout(
        nodes=(NodeSpec(name="127.0.0.1", gpus=(0, 1, 2, 3), cpu=96, memory_gb=384),)
    )
    assert layout.total_gpus == 4


def test_shorthand_takes_cpu_and_memory_from_defaults() -> None:
    layout = parse_cluster_layout(
        '{"a": [0, 1], "b": {"gpus": [0], "cpu": 8}}', default_cpu=32, default_memory_gb=128
    )
    assert layout.node("a") == NodeSpec(name="a", gpus=(0, 1), cpu=32, memory_gb=128)
    assert layout.node("b") == NodeSpec(name="b", gpus=(0,), cpu=8, memory_gb=128)
    assert (layout.total_cpu, layout.total_memory_gb) == (40, 256)


def test_cpu_only_node_and_file_form(tmp_path: Path) -> None:
    path = tmp_path / "layout.json"
    path.write_text(json.dumps({"n1": {"cpu": 16, "memory_gb": 64}}), encoding="utf-8")
    for spec in (path, str(path)):
        assert parse_cluster_layout(spec).nodes == (
            NodeSpec(name="n1", gpus=(), cpu=16, memory_gb=64),
        )


def test_node_order_is_kept() -> None:
    layout = parse_cluster_layout('{"z": [0], "a": [0]}', default_cpu=1, default_memory_gb=1)
    assert [node.name for node in layout.nodes] == ["z", "a"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ('{"n1": [0, 1]}', "node 'n1': key 'cpu' is missing and no default (--env-num-cpus)"),
        ('{"n1": {"gpus": [0], "cpu": 4}}', "node 'n1': key 'memory_gb' is missing"),
        ('{"n1": {"gpus": [0], "cpu": 4, "mem": 8}}', "node 'n1': unknown key 'mem'"),
        (
            '{"n1": {"gpus": [0, "1"], "cpu": 4, "memory_gb": 8}}',
            "key 'gpus[1]' must be an integer",
        ),
        ('{"n1": {"gpus": [0, 0], "cpu": 4, "memory_gb": 8}}', "lists GPU ids [0] more than once"),
        ('{"n1": {"gpus": [-1], "cpu": 4, "memory_gb": 8}}', "key 'gpus[0]' must be at least 0"),
        ('{"n1": {"gpus": [], "cpu": 0, "memory_gb": 8}}', "node 'n1': key 'cpu' must be greater"),
        ('{"n1": {"gpus": [], "cpu": true, "memory_gb": 8}}', "key 'cpu' must be a number"),
        ('{"n1": "0,1"}', "node 'n1': expected a list of GPU ids or an object"),
        ("{}", "the layout lists no nodes"),
        ('{"n1": [0],}', "cluster layout (inline JSON):1:12: invalid JSON"),
    ],
)
def test_bad_layouts_name_node_and_key(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_cluster_layout(spec)


def test_missing_file_and_non_object(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cluster layout file not found"):
        parse_cluster_layout(str(tmp_path / "missing.json"))
    path = tmp_path / "list.json"
    path.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: expected an object")):
        parse_cluster_layout(path)


def test_bad_default_refused() -> None:
    with pytest.raises(ConfigError, match="default for 'cpu' must be positive"):
        parse_cluster_layout('{"n1": [0]}', default_cpu=0, default_memory_gb=8)
