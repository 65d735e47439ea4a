"""RolloutCluster manifests read from files (``prorsa plan --cluster``, ``prorsa ingest``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prorsa.core.spec import SpecError
from prorsa.k8s.manifest_file import load_cluster

CLUSTER = """\
apiVersion: prorsa.io/v1alpha1
kind: RolloutCluster
metadata: {name: qwen3, namespace: rl}
spec:
  model: {path: /models/qwen3}
  gpuBudget: 64
"""


def test_the_first_rollout_cluster_of_a_multi_document_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "all.yaml"
    path.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: rl}\n---\n" + CLUSTER)
    cluster = load_cluster(path)
    assert (cluster.metadata.name, cluster.spec.gpu_budget) == ("qwen3", 64)


def test_the_example_manifest_loads() -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "rolloutcluster.yaml"
    assert load_cluster(example).kind == "RolloutCluster"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("spec: [unclosed", "not valid YAML"),
        ("apiVersion: v1\nkind: Namespace\n", "no document of kind RolloutCluster"),
        (CLUSTER.replace("gpuBudget: 64", "gpuBudget: 0"), "spec.gpuBudget"),
    ],
)
def test_a_bad_manifest_is_a_spec_error_that_says_what_is_wrong(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=message):
        load_cluster(path)


def test_a_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_cluster(tmp_path / "absent.yaml")
