"""`prorsa plan` accepts exactly the RolloutClusters the API server accepts.

Each manifest of the battery goes through the generated CRD as `kubectl apply` sends it to
an API server: kubectl turns the YAML into JSON through Go's float64, so a whole-number
float arrives as an integer; strict field validation (kubectl's default since Kubernetes
1.27) refuses an unknown field; nulls of non-nullable fields are pruned and defaults
filled; the ``openAPIV3Schema`` is checked with Kubernetes' type rules (``nullable`` admits
null, kube-openapi ``validate/type.go``); then the CEL rules, unless a type or a required
field was wrong (a rule that cannot evaluate is an error on ``spec``). It goes through
`prorsa plan` too. Both must accept it or both refuse it, and every field the API
server names must be named by `prorsa plan` too. The lab's API emulator reads the same
schema a third time and must agree.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from test_crd import BAD, GOOD, schema, with_spec

from prorsa.cli import main
from prorsa.k8s.crd_manifest import SPEC_RULES
from prorsa_lab.doubles.kube.schema import apply_structural_schema, cel_program
from prorsa_lab.doubles.kube.schema import validate as emulator_validate


def _is_integer(checker: Any, value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _type(validator: Any, types: Any, instance: Any, node: dict[str, Any]) -> Iterator[Any]:
    if instance is None and node.get("nullable"):
        return
    yield from jsonschema.Draft4Validator.VALIDATORS["type"](validator, types, instance, node)


KubeValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator,
    validators={"type": _type},
    type_checker=jsonschema.Draft4Validator.TYPE_CHECKER.redefine("integer", _is_integer),
)


def _unknown_fields(value: Any, node: dict[str, Any], path: str) -> list[str]:
    """Fields the schema does not declare: strict field validation refuses them."""
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out = []
    if isinstance(value, dict):
        properties = node.get("properties")
        additional = node.get("additionalProperties")
        for key, item in value.items():
            if properties is not None and key in properties:
                out += _unknown_fields(item, properties[key], f"{path}.{key}")
            elif isinstance(additional, dict):
                out += _unknown_fields(item, additional, f"{path}.{key}")
            elif properties is not None:
                out.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            out += _unknown_fields(item, node["items"], path)
    return out


def _as_kubectl_sends_it(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _as_kubectl_sends_it(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_kubectl_sends_it(v) for v in value]
    return value


def _cel_failures(spec: dict[str, Any]) -> list[str]:
    activation = {"self": celpy.json_to_cel(spec)}
    failed = []
    for rule in SPEC_RULES:
        try:
            ok = bool(cel_program(rule["rule"]).evaluate(activation))
        except celpy.CELEvalError:
            failed.append("spec")
            continue
        if not ok:
            failed.append("spec" + rule["fieldPath"])
    return failed


def api_server(manifest: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The fields the API server refuses, by its schema and by its CEL rules (both empty:
    it accepts the manifest)."""
    root = schema()
    manifest = _as_kubectl_sends_it(manifest)
    named = _unknown_fields(manifest.get("spec"), root["properties"]["spec"], "spec")
    stored = apply_structural_schema(copy.deepcopy(manifest), root)
    errors = list(KubeValidator(root).iter_errors(stored))
    for error in errors:
        path = ".".join(str(p) for p in error.path)
        if error.validator == "required":
            path = ".".join(p for p in (path, error.message.split("'")[1]) if p)
        named.append(path)
    # The API server skips the CEL rules once a type or a required field is wrong.
    if any(e.validator in ("type", "required") for e in errors):
        return named, []
    return named, _cel_failures(stored["spec"])


def plan(manifest: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The fields `prorsa plan` refuses (empty: it accepts the manifest)."""
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(manifest))
    capsys.readouterr()
    code = main(["plan", "--cluster", str(path)])
    out = capsys.readouterr()
    if code == 0:
        assert out.out.startswith("rl/qwen3-coder: "), out.out
        return []
    assert code == 2 and out.out == "", out
    *lines, last = out.err.splitlines()
    assert last.startswith(f"prorsa plan: error: {path}: "), out.err
    return [line.removeprefix(f"{path}: ").partition(": ")[0] for line in lines]


ACCEPTED: dict[str, dict[str, Any]] = {
    "the example": GOOD,
    "only the required fields": {
        **GOOD,
        "spec": {"model": {"path": "/m"}, "gpuBudget": 16},
    },
    "a whole-number float for an integer": with_spec(
        engine__tensorParallelSize=8.0, gpuBudget=64.0
    ),
    "an integer for a number": with_spec(capacity__prefillTokensPerSecond=20000),
    "a fraction for a number": with_spec(capacity__prefillTokensPerSecond=20000.5),
    "null for a defaulted field (pruned, then defaulted)": with_spec(
        switching__cooldownSeconds=None, engine__tensorParallelSize=None
    ),
    "null for a nullable field": with_spec(model__servedName=None),
    "zero where zero is allowed": with_spec(capacity__prefillCacheTokens=0),
    "bounds are inclusive": with_spec(switching__hysteresis=10, forecast__horizonSeconds=600),
    "free-form objects take anything": with_spec(
        engine__resources={"limits": {"memory": "1Gi", "x": [1, {"y": None}]}},
        engine__env=[{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}],
    ),
    "fixedRate with a rate": with_spec(
        forecast__injection={"policy": "fixedRate", "ratePerSecond": 2}
    ),
    # Engine flags SGLang runs with role switching (prorsa.core.engine_flags).
    "sizes of 1, no all-to-all, host receive at 1": with_spec(
        engine__extraArgs=[
            *("--ep-size", "1", "--pp-size=1", "--moe-a2a-backend", "none"),
            *("--disaggregation-decode-host-receive-threshold", "1"),
        ]
    ),
    "attention DP": with_spec(engine__extraArgs=["--attn-dp-size", "8"]),
    "attention DP, the deprecated spelling": with_spec(
        engine__extraArgs=["--enable-dp-attention", "--dp-size", "8"]
    ),
    "local control broadcast without attention DP": with_spec(
        engine__extraArgs=["--enable-dp-attention-local-control-broadcast"],
        engine__env=[{"name": "SGLANG_RUST_SERVER", "value": "1"}],
    ),
    "a HiCache store the engine owns": with_spec(
        engine__extraArgs=["--hicache-storage-backend=file"],
        engine__env=[{"name": "PRORSA_ALLOW_HICACHE_STORAGE", "value": "true"}],
    ),
    "a value that is a flag's name": with_spec(engine__extraArgs=["--chunked-prefill-size=8"]),
    "a Mooncake KV store": with_spec(
        kvStore={"backend": "mooncake", "endpoint": "mooncake-master.rl:50051", "sizeGiB": 64}
    ),
    "a shared-directory KV store": with_spec(
        kvStore={"backend": "file", "endpoint": "/mnt/kv", "sizeGiB": 8}
    ),
}

REFUSED: dict[str, dict[str, Any]] = {
    'tensorParallelSize "8" (a string)': with_spec(engine__tensorParallelSize="8"),
    'gpuBudget "64"': with_spec(gpuBudget="64"),
    "gpuBudget 64.5": with_spec(gpuBudget=64.5),
    "gpuBudget true": with_spec(gpuBudget=True),
    "gpuBudget null (required)": with_spec(gpuBudget=None),
    'biasCorrection "true"': with_spec(forecast__biasCorrection="true"),
    "biasCorrection 1": with_spec(forecast__biasCorrection=1),
    'prefillTokensPerSecond "2e4"': with_spec(capacity__prefillTokensPerSecond="2e4"),
    "prefillTokensPerSecond true": with_spec(capacity__prefillTokensPerSecond=True),
    'mode "auto" (case)': with_spec(switching__mode="auto"),
    "hysteresis above its maximum": with_spec(switching__hysteresis=11),
    "horizonSeconds 0 (exclusive minimum)": with_spec(forecast__horizonSeconds=0),
    "gpusPerInstance 0": with_spec(engine__gpusPerInstance=0),
    "decodeKvTokens 0": with_spec(capacity__decodeKvTokens=0),
    "nodesPerInstance above 64": with_spec(engine__nodesPerInstance=65, gpuBudget=65 * 8),
    "model without a path": with_spec(model={}),
    "an empty image": with_spec(engine__image=""),
    "an unknown field": with_spec(engine__gpus=8),
    "a field under its Python name": with_spec(engine__gpus_per_instance=8),
    "an unknown section": with_spec(autoscaling={"enabled": True}),
    "a number in nodeSelector": with_spec(engine__nodeSelector={"gpu": 1}),
    "a number in extraArgs": with_spec(engine__extraArgs=["--chunked-prefill-size", 4096]),
    "extraArgs as one string": with_spec(engine__extraArgs="--chunked-prefill-size 4096"),
    "resources as a list": with_spec(engine__resources=[]),
    "an env entry that is not an object": with_spec(engine__env=[1]),
    "tolerations as an object": with_spec(engine__tolerations={}),
    "engine as a string": with_spec(engine="sglang"),
    "tokenSecretRef without a name": with_spec(trainer__tokenSecretRef={}),
    'router.enabled "yes"': with_spec(router__enabled="yes"),
    "an env value that is not a string": with_spec(engine__env=[{"name": "A", "value": 1}]),
    # Engine flags SGLang refuses with role switching, or the operator sets.
    "--ep-size 8": with_spec(engine__extraArgs=["--ep-size", "8"]),
    "--expert-parallel-size=16": with_spec(engine__extraArgs=["--expert-parallel-size=16"]),
    "--pp-size 2": with_spec(engine__extraArgs=["--pp-size", "2"]),
    "--dcp-size=2": with_spec(engine__extraArgs=["--dcp-size=2"]),
    "--moe-a2a-backend deepep": with_spec(engine__extraArgs=["--moe-a2a-backend", "deepep"]),
    "--moe-a2a-backend non": with_spec(engine__extraArgs=["--moe-a2a-backend=non"]),
    "--speculative-algorithm": with_spec(engine__extraArgs=["--speculative-algorithm", "NGRAM"]),
    "local control broadcast with attention DP": with_spec(
        engine__extraArgs=["--attn-dp-size", "8", "--enable-dp-attention-local-control-broadcast"]
    ),
    "DWDP with attention DP": with_spec(engine__extraArgs=["--attn-dp-size=8", "--dwdp-size=8"]),
    "--dp-size with --attn-dp-size": with_spec(
        engine__extraArgs=["--attn-dp-size", "8", "--dp-size", "2"]
    ),
    "host receive threshold 0.5": with_spec(
        engine__extraArgs=["--disaggregation-decode-host-receive-threshold=0.5"]
    ),
    "SGLANG_RUST_SERVER with attention DP": with_spec(
        engine__extraArgs=["--attn-dp-size", "8"],
        engine__env=[{"name": "SGLANG_RUST_SERVER", "value": "TRUE"}],
    ),
    "a shared HiCache store": with_spec(engine__extraArgs=["--hicache-storage-backend", "file"]),
    "--tp-size": with_spec(engine__extraArgs=["--tp-size", "8"]),
    "--admin-api-key=": with_spec(engine__extraArgs=["--admin-api-key=k"]),
    "--disaggregation-mode": with_spec(engine__extraArgs=["--disaggregation-mode", "prefill"]),
    "PRORSA_EXTRA_ARGS in env": with_spec(engine__env=[{"name": "PRORSA_EXTRA_ARGS", "value": ""}]),
    "more extraArgs than the bound": with_spec(engine__extraArgs=["--x"] * 257),
    "a KV store directory that is not absolute": with_spec(
        kvStore={"backend": "file", "endpoint": "mnt/kv", "sizeGiB": 8}
    ),
    "a Mooncake master given as a URL": with_spec(
        kvStore={"backend": "mooncake", "endpoint": "http://m:50051", "sizeGiB": 8}
    ),
    "a KV store without its size": with_spec(kvStore={"backend": "file", "endpoint": "/kv"}),
    "a KV store of an unknown backend": with_spec(
        kvStore={"backend": "redis", "endpoint": "/kv", "sizeGiB": 1}
    ),
    "a KV store next to its own flags": with_spec(
        kvStore={"backend": "file", "endpoint": "/kv", "sizeGiB": 1},
        engine__extraArgs=["--disaggregation-decode-enable-offload-kvcache"],
    ),
    "a KV store without the radix cache": with_spec(
        kvStore={"backend": "file", "endpoint": "/kv", "sizeGiB": 1},
        engine__extraArgs=["--disable-radix-cache"],
    ),
    "a KV store without HiCache": with_spec(
        kvStore={"backend": "file", "endpoint": "/kv", "sizeGiB": 1},
        engine__env=[{"name": "PRORSA_DISABLE_HICACHE", "value": "1"}],
    ),
    "PRORSA_KV_STORE_ENDPOINT in env": with_spec(
        engine__env=[{"name": "PRORSA_KV_STORE_ENDPOINT", "value": "/kv"}]
    ),
    "an extra arg over its length": with_spec(engine__extraArgs=["x" * 4097]),
    **BAD,
}


def _missing(crd: list[str], ours: list[str]) -> list[str]:
    return [f for f in crd if not any(o == f or o.startswith(f + ".") for o in ours)]


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_both_accept(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = ACCEPTED[case]
    assert api_server(manifest) == ([], [])
    sent = _as_kubectl_sends_it(manifest)
    assert emulator_validate(apply_structural_schema(sent, schema()), schema()) == []
    assert plan(manifest, tmp_path, capsys) == []


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_both_refuse_naming_the_same_fields(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = REFUSED[case]
    by_schema, by_rules = api_server(manifest)
    assert by_schema or by_rules, f"{case}: the API server would accept it"
    if not _unknown_fields(manifest["spec"], schema()["properties"]["spec"], "spec"):
        stored = apply_structural_schema(_as_kubectl_sends_it(manifest), schema())
        assert emulator_validate(stored, schema()), f"{case}: the API emulator accepts it"
    ours = plan(manifest, tmp_path, capsys)
    assert ours, f"{case}: prorsa plan accepts it"
    # prorsa plan judges a cross-field rule only over fields that are valid on their own
    # (a rule over an invalid field says nothing new); with valid fields it names what the
    # rules name.
    crd = by_schema or by_rules
    assert not _missing(crd, ours), f"{case}: the API server names {crd}, prorsa plan {ours}"


def test_every_problem_in_one_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Where the API server stops at a type error, `prorsa plan` goes on to the rules."""
    manifest = with_spec(
        engine__tensorParallelSize="8",
        switching__mode="Sometimes",
        engine__gpus=8,
        gpuBudget=60,
        roles__prefill__initial=8,
    )
    assert sorted(plan(manifest, tmp_path, capsys)) == [
        "spec.engine.gpus",
        "spec.engine.tensorParallelSize",
        "spec.gpuBudget",
        "spec.roles.prefill.initial",
        "spec.switching.mode",
    ]
