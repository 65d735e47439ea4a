"""Operator pieces a user meets without a cluster: admission messages, manifests."""

from __future__ import annotations

import kopf
import pytest
from conftest import make_spec

from prorsa.core.spec import parse_cluster
from prorsa.k8s import objects as obj
from prorsa.kopf_handlers import OperatorConfig, build_registry, parse_spec
from prorsa_contract.labels import parse_intent, switch_intent
from prorsa_lab.doubles.stack import cluster_manifest


def test_admission_refuses_bad_specs_naming_the_field() -> None:
    registry = build_registry(OperatorConfig(admission=True))
    handlers = [h for h in registry._webhooks.get_all_handlers() if h.id == "spec"]
    assert handlers, "no validating admission handler registered"
    validate = handlers[0].fn
    good = cluster_manifest()["spec"]
    validate(spec=good)
    with pytest.raises(kopf.AdmissionError) as info:
        validate(spec={**good, "gpuBudget": 30})
    assert "spec: gpuBudget (30) must be a multiple of engine.gpusPerInstance (8)" in str(
        info.value
    )
    with pytest.raises(kopf.AdmissionError) as info:
        validate(spec={**good, "switching": {"mode": "Sometimes"}})
    assert "spec.switching.mode" in str(info.value)


def test_parse_spec_error_names_nested_fields() -> None:
    with pytest.raises(ValueError, match=r"spec\.forecast\.horizonSeconds"):
        parse_spec({**cluster_manifest()["spec"], "forecast": {"horizonSeconds": -1}})


def test_engine_pod_manifest_follows_the_contract() -> None:
    spec = parse_cluster(cluster_manifest()).spec
    pod = obj.engine_pod(cluster="demo", namespace="rl", index=3, role="decode", spec=spec)
    meta = pod["metadata"]
    assert meta["name"] == "demo-engine-3"
    assert meta["labels"] == meta["labels"] | {
        "app.kubernetes.io/managed-by": "prorsa",
        "prorsa.io/cluster": "demo",
        "prorsa.io/role": "decode",
    }
    assert meta["annotations"]["sglang.ai/bootstrap-port"] == "8998"
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PRORSA_MODEL_PATH"] == "/models/double"
    assert env["PRORSA_TRANSFER_BACKEND"] == "mooncake"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_router_selects_roles_so_draining_matches_neither() -> None:
    spec = parse_cluster(cluster_manifest(router={"enabled": True})).spec
    args = obj.router_args(cluster="demo", namespace="rl", spec=spec)
    prefill = args[args.index("--prefill-selector") + 1 : args.index("--decode-selector")]
    decode = args[args.index("--decode-selector") + 1 : args.index("--policy")]
    assert prefill == ["prorsa.io/cluster=demo", "prorsa.io/role=prefill"]
    assert decode == ["prorsa.io/cluster=demo", "prorsa.io/role=decode"]
    assert "prorsa.io/role=draining" not in args
    kinds = [o["kind"] for o in obj.router_objects(cluster="demo", namespace="rl", spec=spec)]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"]


def test_switch_intent_round_trip() -> None:
    value = switch_intent(to="prefill", phase="draining", started="t0", origin="decode")
    assert parse_intent(value) == {
        "to": "prefill",
        "from": "decode",
        "phase": "draining",
        "started": "t0",
    }
    assert parse_intent("not json") is None
    assert parse_intent('{"to": "sideways"}') is None


@pytest.mark.parametrize(
    ("args", "ranks"),
    [
        ([], 1),
        (["--dp-size", "8"], 1),  # data parallel without DP attention: whole-instance speed
        (["--enable-dp-attention", "--dp-size", "8"], 8),
        (["--enable-dp-attention", "--dp=4"], 4),
        (["--tp", "8", "--enable-dp-attention", "--data-parallel-size", "2"], 2),
        (["--enable-dp-attention", "--dp-size"], 1),  # no value: nothing to go by
    ],
)
def test_attention_dp_size_is_read_from_the_engine_args(args: list[str], ranks: int) -> None:
    spec = make_spec(engine={"extraArgs": args})
    assert spec.engine.attention_dp_size == ranks
