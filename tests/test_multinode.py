"""Multi-node engine instances: the spec, the group's pods and the engine double's worker
ranks (the operator end to end is in tests/test_multinode_e2e.py)."""

from __future__ import annotations

from typing import Any

import pytest

from prorsa.core.spec import SpecError, parse_cluster


def manifest(**engine: Any) -> dict[str, Any]:
    return {
        "apiVersion": "prorsa.io/v1alpha1",
        "kind": "RolloutCluster",
        "metadata": {"name": "big", "namespace": "rl"},
        "spec": {
            "model": {"path": "/models/kimi"},
            "engine": {"gpusPerInstance": 16, "tensorParallelSize": 16, **engine},
            "gpuBudget": 64,
        },
    }


def test_one_node_per_instance_unless_asked() -> None:
    spec = parse_cluster(manifest()).spec
    assert spec.engine.nodes_per_instance == 1
    assert spec.engine.gpus_per_node("decode") == 16


def test_the_budget_stays_per_instance_across_nodes() -> None:
    spec = parse_cluster(manifest(nodesPerInstance=2)).spec
    # Eq. 1 counts instances of m GPUs, whatever number of nodes each spans.
    assert spec.instances == 4
    assert spec.engine.m_decode == 16 and spec.engine.m_prefill == 16
    assert spec.engine.gpus_per_node("decode") == 8
    assert spec.engine.gpus_per_node("prefill") == 8


@pytest.mark.parametrize(
    ("engine", "field"),
    [
        ({"nodesPerInstance": 3}, "engine.gpusPerInstance"),
        ({"nodesPerInstance": 2, "prefillGpusPerInstance": 9}, "engine.prefillGpusPerInstance"),
        ({"nodesPerInstance": 0}, "engine.nodesPerInstance"),
    ],
)
def test_inconsistent_nodes_are_refused_naming_the_field(
    engine: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as info:
        parse_cluster(manifest(**engine))
    assert "nodesPerInstance" in str(info.value)
    assert field in str(info.value)
