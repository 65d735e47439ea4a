"""The RolloutCluster CustomResourceDefinition, generated from the pydantic models.

The spec models in :mod:`prorsa.core.spec` are the one source of truth: this module turns their
JSON Schema into a Kubernetes structural schema (no ``$ref``, no ``anyOf`` with null,
defaults kept, free-form objects marked ``x-kubernetes-preserve-unknown-fields``) and adds
the cross-field rules as CEL validations, so the API server refuses a bad spec before the
operator ever sees it.
"""

from __future__ import annotations

from typing import Any

import yaml

from prorsa.core import engine_flags
from prorsa.core.spec import (
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    RolloutClusterSpec,
    RolloutClusterStatus,
)

# `kubectl get rollc` / `prc`. Never a name a built-in resource answers to (`rc` is
# ReplicationController's on every cluster) nor one of common add-ons (Argo Rollouts' `rollout`,
# `ro`; Tekton's PipelineRun `pr`).
SHORT_NAMES = ["rollc", "prc"]

# Cross-field rules (CEL). Each mirrors a rule of prorsa.core.spec.cross_field_problems;
# the engine-flag rules are generated from prorsa.core.engine_flags, which runs them in Python.
SPEC_RULES: list[dict[str, str]] = [
    {
        "rule": "self.gpuBudget % self.engine.gpusPerInstance == 0",
        "message": "gpuBudget must be a multiple of engine.gpusPerInstance",
        "fieldPath": ".gpuBudget",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.engine.gpusPerInstance % self.engine.nodesPerInstance == 0 && "
        "(!has(self.engine.prefillGpusPerInstance) || "
        "self.engine.prefillGpusPerInstance % self.engine.nodesPerInstance == 0)",
        "message": "engine.nodesPerInstance must divide engine.gpusPerInstance (and "
        "engine.prefillGpusPerInstance): every node of an instance holds the same GPUs",
        "fieldPath": ".engine.nodesPerInstance",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.engine.tensorParallelSize <= self.engine.gpusPerInstance",
        "message": "engine.tensorParallelSize must not exceed engine.gpusPerInstance",
        "fieldPath": ".engine.tensorParallelSize",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.roles.prefill.min * (has(self.engine.prefillGpusPerInstance) ? "
        "self.engine.prefillGpusPerInstance : self.engine.gpusPerInstance) + "
        "self.roles.decode.min * self.engine.gpusPerInstance <= self.gpuBudget",
        "message": "roles.prefill.min and roles.decode.min need more GPUs than gpuBudget",
        "fieldPath": ".roles",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "!has(self.roles.prefill.initial) || "
        "(self.roles.prefill.initial >= self.roles.prefill.min && "
        "self.gpuBudget / self.engine.gpusPerInstance - self.roles.prefill.initial "
        ">= self.roles.decode.min)",
        "message": "roles.prefill.initial must leave both roles at their minimums",
        "fieldPath": ".roles.prefill.initial",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.engine.transferBackend in ['mooncake', 'mori']",
        "message": "engine.transferBackend must be mooncake or mori: only these can switch "
        "roles in place",
        "fieldPath": ".engine.transferBackend",
        "reason": "FieldValueNotSupported",
    },
    {
        "rule": "self.forecast.injection.policy != 'fixedRate' || "
        "self.forecast.injection.ratePerSecond > 0",
        "message": "forecast.injection.ratePerSecond must be > 0 when policy is fixedRate",
        "fieldPath": ".forecast.injection.ratePerSecond",
        "reason": "FieldValueInvalid",
    },
    *engine_flags.cel_rules(),
]

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Prefill", "type": "integer", "jsonPath": ".status.instances.prefill"},
    {"name": "Decode", "type": "integer", "jsonPath": ".status.instances.decode"},
    {"name": "Target", "type": "string", "jsonPath": ".status.target.split"},
    {"name": "Margin", "type": "number", "jsonPath": ".status.target.safetyMargin"},
    # Ready and Phase by default: an engine lost shrinks the split, which must show.
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    },
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Mode", "type": "string", "jsonPath": ".status.target.mode", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROP = {"title", "$defs"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """JSON Schema (pydantic) -> a Kubernetes structural OpenAPI v3 schema node."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(options) == 1:
            one = _structural({**options[0], **rest}, defs)
            if len(options) < len(node["anyOf"]):
                one["nullable"] = True
            return one
        raise ValueError(f"cannot express anyOf {node['anyOf']} structurally")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum" and not isinstance(value, bool):
            out["maximum"] = value
            out["exclusiveMaximum"] = True
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out["additionalProperties"] = _structural(value, defs)
            # False: a structural schema prunes unknown fields anyway.
        elif key == "properties":
            out["properties"] = {k: _structural(v, defs) for k, v in value.items()}
        elif key == "default":
            if value is not None:
                out["default"] = _no_nulls(value)
        else:
            out[key] = _structural(value, defs)
    if (
        out.get("type") == "object"
        and "properties" not in out
        and "additionalProperties" not in out
    ):
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _no_nulls(value: Any) -> Any:
    """Defaults without null members: the API server defaults them as absent."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_nulls(v) for v in value]
    return value


def spec_schema() -> dict[str, Any]:
    raw = RolloutClusterSpec.model_json_schema(by_alias=True, mode="validation")
    schema: dict[str, Any] = _structural(raw, raw.get("$defs", {}))
    schema["x-kubernetes-validations"] = SPEC_RULES
    return schema


def status_schema() -> dict[str, Any]:
    raw = RolloutClusterStatus.model_json_schema(by_alias=True, mode="serialization")
    schema: dict[str, Any] = _structural(raw, raw.get("$defs", {}))
    schema.pop("required", None)
    return schema


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "prorsa", "app.kubernetes.io/part-of": "prorsa"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": SHORT_NAMES,
                "categories": ["prorsa"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A set of SGLang engines whose prefill:decode split "
                            "Prorsa keeps matched to forecast demand.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `prorsa crd` from prorsa.core.spec; do not edit by hand.\n"
    body: str = yaml.safe_dump(crd(), sort_keys=False, width=100)
    return header + body
