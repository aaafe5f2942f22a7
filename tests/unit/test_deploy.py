"""Cluster YAMLs validate against Ray's own schema, offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deploy.cli import Topology
from deploy.cluster import ClusterConfigError, validate_cluster_yaml
from deploy.launcher import placement_options
from engine.config import Role

CLUSTERS = sorted((Path(__file__).resolve().parents[2] / "deploy" / "clusters").glob("*.yaml"))


def test_there_are_cluster_yamls():
    assert {p.name for p in CLUSTERS} >= {"local.yaml", "aws-gpu.yaml"}


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_cluster_yaml_validates_against_rays_schema(path):
    config = validate_cluster_yaml(path)
    assert config["cluster_name"].startswith("pdcluster")


def test_gpu_cluster_has_role_node_types_with_bounds():
    config = validate_cluster_yaml(Path(CLUSTERS[0].parent / "aws-gpu.yaml"))
    types = config["available_node_types"]
    assert types["prefill_gpu"]["resources"]["prefill"] >= 1
    assert types["decode_gpu"]["resources"]["decode"] >= 1
    assert types["decode_gpu"]["min_workers"] == 0  # decode scales from zero
    assert types["decode_gpu"]["max_workers"] > 0


def test_a_broken_yaml_is_reported_with_its_path(tmp_path):
    config = yaml.safe_load(CLUSTERS[0].read_text())
    config["provider"]["no_such_field"] = 1
    config["nonsense"] = True
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(config))
    with pytest.raises(ClusterConfigError, match="broken.yaml"):
        validate_cluster_yaml(broken)


def test_pools_are_placed_by_role_resources():
    assert placement_options(Role.PREFILL, gpus=1) == {
        "num_cpus": 0,
        "num_gpus": 1,
        "resources": {"prefill": 1},
    }
    assert placement_options(Role.COLOCATED, gpus=0) == {"num_cpus": 0, "num_gpus": 0}


def test_topology_from_flags():
    assert Topology.from_args(2, 0, 0).roles() == [
        ("colocated-0", Role.COLOCATED),
        ("colocated-1", Role.COLOCATED),
    ]
    assert [r for _, r in Topology.from_args(1, 1, 2).roles()] == [Role.PREFILL, Role.DECODE, Role.DECODE]
    with pytest.raises(ValueError, match="prefill"):
        Topology.from_args(1, 1, 0)
