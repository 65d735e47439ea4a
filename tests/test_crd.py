"""The checked-in CRD is what `prorsa crd` generates, is structural, and its rules (CEL)
refuse exactly the specs the operator's own validation refuses."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

from prorsa.core.spec import SpecError, parse_cluster
from prorsa.k8s.crd_manifest import SPEC_RULES, crd, render
from prorsa_lab.doubles.kube.schema import cel_program

ROOT = Path(__file__).resolve().parents[1]

GOOD: dict[str, Any] = {
    "apiVersion": "prorsa.io/v1alpha1",
    "kind": "RolloutCluster",
    "metadata": {"name": "qwen3-coder", "namespace": "rl"},
    "spec": {
        "model": {"path": "/models/Qwen3-235B-A22B-FP8", "servedName": "qwen3"},
        "engine": {
            "image": "registry.example/prorsa-engine:0.5.23",
            "gpusPerInstance": 8,
            "tensorParallelSize": 8,
            "transferBackend": "mooncake",
            "extraArgs": ["--chunked-prefill-size", "4096"],
            "resources": {"limits": {"memory": "900Gi"}},
            "nodeSelector": {"gpu": "h200"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        },
        "gpuBudget": 64,
        "roles": {"prefill": {"min": 1, "initial": 4}, "decode": {"min": 1}},
        "forecast": {
            "horizonSeconds": 10,
            "toolEmaAlpha": 0.1,
            "biasCorrection": True,
            "injection": {"policy": "replaceOnReward", "groupSize": 32},
        },
        "capacity": {"prefillTokensPerSecond": 20000, "decodeKvTokens": 1300000},
        "switching": {
            "mode": "Auto",
            "cooldownSeconds": 30,
            "maxConcurrent": 1,
            "drainTimeoutSeconds": 30,
        },
        "router": {"enabled": True, "policy": "cache_aware"},
        "trainer": {"tokenSecretRef": {"name": "trainer-token", "key": "token"}},
    },
}


def with_spec(**changes: Any) -> dict[str, Any]:
    m = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        node = m["spec"]
        *path, last = dotted.split("__")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return m


BAD = {
    "budget not a multiple": with_spec(gpuBudget=60),
    "tp above gpus": with_spec(engine__tensorParallelSize=16),
    "minimums over budget": with_spec(roles__decode__min=8),
    "initial leaves no decode": with_spec(roles__prefill__initial=8),
    "nixl cannot switch": with_spec(engine__transferBackend="nixl"),
    "nodes split an instance's gpus unevenly": with_spec(engine__nodesPerInstance=3),
    "nodes split the prefill gpus unevenly": with_spec(
        engine__nodesPerInstance=2, engine__prefillGpusPerInstance=3
    ),
    "fixedRate without a rate": with_spec(forecast__injection={"policy": "fixedRate"}),
}


def schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_checked_in_crd_is_generated() -> None:
    assert (ROOT / "crds" / "rolloutcluster.yaml").read_text() == render(), (
        "crds/rolloutcluster.yaml is stale: run `prorsa crd --write crds/rolloutcluster.yaml`"
    )


def test_schema_is_structural() -> None:
    def walk(node: dict[str, Any], path: str) -> None:
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "definitions", "$defs"):
            assert banned not in node, f"{path}: {banned}"
        if node.get("x-kubernetes-preserve-unknown-fields"):
            return
        assert "type" in node, f"{path}: no type"
        for key, child in node.get("properties", {}).items():
            walk(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}{{}}")

    walk(schema()["properties"]["spec"], "spec")
    walk(schema()["properties"]["status"], "status")


def test_subresource_printer_columns_and_short_names() -> None:
    version = crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert {"Prefill", "Decode", "Target", "Margin", "Age"} <= set(names)
    assert crd()["spec"]["names"]["shortNames"]


# What `kubectl api-resources` lists as SHORTNAMES on a Kubernetes 1.32 API server (every
# built-in group, beta APIs included), and the short names of common add-ons a GPU cluster
# may run (Argo Rollouts, Tekton, cert-manager, KEDA, Argo Workflows).
BUILTIN_SHORT_NAMES = {
    "cs", "cm", "ep", "ev", "limits", "ns", "no", "pvc", "pv", "po", "rc", "quota", "sa",
    "svc", "crd", "crds", "ds", "deploy", "rs", "sts", "hpa", "cj", "csr", "ing", "netpol",
    "pdb", "pc", "sc", "vac",
}  # fmt: skip
ADDON_SHORT_NAMES = {"ro", "rollout", "rollouts", "pr", "prs", "tr", "trs", "cr", "crs",
                     "cert", "certs", "so", "wf", "cwf"}  # fmt: skip


def test_short_names_collide_with_no_builtin_or_common_resource() -> None:
    """`kubectl get rc` lists ReplicationControllers on every real cluster: a RolloutCluster
    short name must not be one a built-in (or a common add-on) already answers to."""
    from prorsa_lab.doubles.kube.resources import BUILTIN_RESOURCES

    names = crd()["spec"]["names"]
    ours = set(names["shortNames"])
    assert len(ours) >= 1
    assert not ours & BUILTIN_SHORT_NAMES, ours & BUILTIN_SHORT_NAMES
    assert not ours & ADDON_SHORT_NAMES, ours & ADDON_SHORT_NAMES
    emulated = {n for r in BUILTIN_RESOURCES for n in (*r.short_names, r.plural, r.singular)}
    assert not (ours | {names["singular"], names["plural"]}) & emulated
    assert {n for r in BUILTIN_RESOURCES for n in r.short_names} <= BUILTIN_SHORT_NAMES


def test_openapi_schema_accepts_good_and_rejects_bad_types() -> None:
    validator = jsonschema.Draft4Validator(schema())
    validator.validate(GOOD)
    errors = list(validator.iter_errors(with_spec(gpuBudget="64")))
    assert errors and list(errors[0].path) == ["spec", "gpuBudget"]
    errors = list(validator.iter_errors(with_spec(switching__mode="Sometimes")))
    assert errors and list(errors[0].path) == ["spec", "switching", "mode"]


def defaulted(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the API server would hold after structural defaulting (no validation)."""

    def fill(node: dict[str, Any], value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        out = dict(value)
        for key, child in node.get("properties", {}).items():
            if key not in out and "default" in child:
                out[key] = copy.deepcopy(child["default"])
            if key in out:
                out[key] = fill(child, out[key])
        return out

    return fill(schema()["properties"]["spec"], manifest["spec"])


def cel_failures(manifest: dict[str, Any]) -> list[str]:
    activation = {"self": celpy.json_to_cel(defaulted(manifest))}
    failed = []
    for rule in SPEC_RULES:
        result = cel_program(rule["rule"]).evaluate(activation)
        if not bool(result):
            failed.append(rule["fieldPath"])
    return failed


def test_cel_rules_accept_the_good_spec() -> None:
    assert cel_failures(GOOD) == []
    minimal = {
        "apiVersion": "prorsa.io/v1alpha1",
        "kind": "RolloutCluster",
        "metadata": {"name": "m"},
        "spec": {"model": {"path": "/m"}, "gpuBudget": 16},
    }
    assert cel_failures(minimal) == []
    parse_cluster(minimal)


@pytest.mark.parametrize("case", sorted(BAD))
def test_cel_and_operator_validation_agree(case: str) -> None:
    manifest = BAD[case]
    with pytest.raises(SpecError):
        parse_cluster(manifest)
    if case == "nixl cannot switch":  # the enum refuses it before CEL runs
        errors = list(jsonschema.Draft4Validator(schema()).iter_errors(manifest))
        assert errors and list(errors[0].path) == ["spec", "engine", "transferBackend"]
    else:
        assert cel_failures(manifest), f"{case}: no CEL rule refused it"


def test_manifests_in_the_repo_validate() -> None:
    checked = []
    for path in ROOT.glob("examples/*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "RolloutCluster":
                jsonschema.Draft4Validator(schema()).validate(doc)
                assert cel_failures(doc) == [], path
                parse_cluster(doc)
                checked.append(path.name)
    assert "rolloutcluster.yaml" in checked
