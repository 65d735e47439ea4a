"""Operator pieces a user meets without a cluster: admission messages, manifests."""

from __future__ import annotations

import re
from pathlib import Path

import kopf
import kubernetes_validate
import pytest
from conftest import make_spec

from prorsa.core.spec import parse_cluster
from prorsa.k8s import objects as obj
from prorsa.shell.handlers import OperatorSettings, build_registry, parse_spec
from prorsa_contract.labels import parse_intent, switch_intent
from prorsa_lab.doubles.stack import cluster_manifest


def test_admission_refuses_bad_specs_naming_the_field() -> None:
    registry = build_registry(OperatorSettings(admission=True))
    handlers = [h for h in registry._webhooks.get_all_handlers() if h.id == "spec"]
    assert handlers, "no validating admission handler registered"
    validate = handlers[0].fn
    good = cluster_manifest()["spec"]
    validate(spec=good)
    with pytest.raises(kopf.AdmissionError) as info:
        validate(spec={**good, "gpuBudget": 30})
    assert "spec.gpuBudget: 30 is not a multiple of engine.gpusPerInstance (8)" in str(info.value)
    with pytest.raises(kopf.AdmissionError) as info:
        validate(spec={**good, "switching": {"mode": "Sometimes"}})
    assert "spec.switching.mode" in str(info.value)


def test_parse_spec_error_names_nested_fields() -> None:
    with pytest.raises(ValueError, match=r"spec\.forecast\.horizonSeconds"):
        parse_spec({**cluster_manifest()["spec"], "forecast": {"horizonSeconds": -1}})


def test_parse_spec_names_every_problem_at_once() -> None:
    """A field error does not hide a cross-field one: the user fixes both in one edit."""
    spec = {**cluster_manifest()["spec"], "gpuBudget": 30, "switching": {"mode": "Sometimes"}}
    with pytest.raises(ValueError) as info:
        parse_spec(spec)
    assert "spec.switching.mode: Input should be 'Auto', 'Recommend' or 'Off'" in str(info.value)
    assert "spec.gpuBudget: 30 is not a multiple of engine.gpusPerInstance (8)" in str(info.value)


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
    # The agent's token and the engine admin key: files on the cluster's two Secrets.
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for variable, secret, key in (
        ("PRORSA_AGENT_TOKEN_FILE", "demo-agent-token", "token"),
        ("PRORSA_ENGINE_API_KEY_FILE", "demo-engine-admin-key", "key"),
    ):
        assert env[variable].rpartition("/")[2] == key
        directory = env[variable].rpartition("/")[0]
        assert mounts[directory]["readOnly"] is True
        assert volumes[mounts[directory]["name"]]["secret"] == {"secretName": secret}
    manifest = obj.engine_key_secret(cluster="demo", namespace="rl", key="k")
    assert manifest["metadata"]["name"] == "demo-engine-admin-key"
    assert manifest["stringData"] == {"key": "k"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_engine_pods_run_unprivileged_and_the_spec_adds_within_bounds() -> None:
    spec = parse_cluster(cluster_manifest()).spec
    pod = obj.engine_pod(cluster="demo", namespace="rl", index=0, role="decode", spec=spec)
    kubernetes_validate.validate(pod, "1.32", strict=True)
    assert pod["spec"]["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["spec"]["automountServiceAccountToken"] is False
    (container,) = pod["spec"]["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
    }
    assert "privileged" not in container["securityContext"]
    # The engine image runs as a numeric non-root user, which runAsNonRoot needs to verify.
    dockerfile = (Path(__file__).parent.parent / "engine_image" / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", dockerfile, flags=re.MULTILINE)
    assert users and users[-1].isdigit() and int(users[-1]) != 0

    # What the spec gives is merged over the defaults; non-root and no escalation stay.
    pod_ctx = {"runAsUser": 2000, "fsGroup": 2000}
    rdma = {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK", "SYS_RESOURCE"]}}
    opted = parse_cluster(
        cluster_manifest(engine={"podSecurityContext": pod_ctx, "securityContext": rdma})
    ).spec
    pod = obj.engine_pod(cluster="demo", namespace="rl", index=0, role="decode", spec=opted)
    kubernetes_validate.validate(pod, "1.32", strict=True)
    assert pod["spec"]["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 2000,
        "fsGroup": 2000,
    }
    assert pod["spec"]["containers"][0]["securityContext"] == rdma | {
        "allowPrivilegeEscalation": False
    }
    assert obj.pod_violations(pod, cluster="demo", spec=opted) == []
    # A manifest never shares its dicts with the defaults.
    again = obj.engine_pod(cluster="demo", namespace="rl", index=1, role="decode", spec=spec)
    again["spec"]["containers"][0]["securityContext"]["capabilities"]["add"].append("NET_ADMIN")
    assert obj.ENGINE_CONTAINER_SECURITY["capabilities"]["add"] == ["IPC_LOCK"]


@pytest.mark.parametrize(
    ("extra", "dp_aware"),
    [
        ([], False),
        (["--enable-dp-attention", "--dp-size", "8"], True),
        (["--attn-dp-size", "4"], True),
        (["--dp-size", "2"], False),  # replicas, not attention DP: smg's worker is the pod
    ],
)
def test_the_router_places_requests_on_attention_dp_ranks(extra: list[str], dp_aware: bool) -> None:
    # With attention DP smg picks the rank by prefix (--dp-aware); SGLang's own DP
    # controller would round-robin it. No sticky sessions: cache_aware follows the prefix.
    spec = parse_cluster(cluster_manifest(router={"enabled": True}, engine={"extraArgs": extra}))
    args = obj.router_args(cluster="demo", namespace="rl", spec=spec.spec)
    assert ("--dp-aware" in args) is dp_aware
    assert "--sticky-sessions" not in args and "--routing-key-override" not in args


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
    # A target is enough: an origin that is no role and keys it does not know are dropped.
    assert parse_intent('{"to": "decode", "from": "up", "extra": 1}') == {"to": "decode"}
    assert parse_intent('["to", "decode"]') is None


def test_an_intent_phase_that_is_no_phase_is_dropped() -> None:
    # The phase is typed (draining | switching): another value is not carried as a string.
    assert parse_intent('{"to": "decode", "phase": "switching"}') == {
        "to": "decode",
        "phase": "switching",
    }
    assert parse_intent('{"to": "decode", "phase": "flipping"}') == {"to": "decode"}


@pytest.mark.parametrize(
    ("args", "ranks"),
    [
        ([], 1),
        (["--dp-size", "8"], 1),  # data parallel without DP attention: whole-instance speed
        (["--enable-dp-attention", "--dp-size", "8"], 8),
        (["--enable-dp-attention", "--dp=4"], 4),
        (["--tp", "8", "--enable-dp-attention", "--data-parallel-size", "2"], 2),
        (["--enable-dp-attention", "--dp-size"], 1),  # no value: nothing to go by
        (["--attn-dp-size", "8"], 8),  # SGLang 0.5.23's own spelling (TP: the spec's field)
        (["--attention-data-parallel-size=4"], 4),
    ],
)
def test_attention_dp_size_is_read_from_the_engine_args(args: list[str], ranks: int) -> None:
    spec = make_spec(engine={"extraArgs": args})
    assert spec.engine.attention_dp_size == ranks


@pytest.mark.parametrize(
    ("argv", "namespaced"),
    [(["-n", "rl", "-n", "eval"], True), (["-A"], False), ([], False)],
)
def test_operator_watching_named_namespaces_asks_nothing_cluster_wide(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], namespaced: bool
) -> None:
    """With --namespace the chart binds Roles only: kopf must not list namespaces or
    watch CRDs then (OperatorSettings.namespaced turns its scanning off)."""
    from prorsa.cli import build_parser
    from prorsa.commands import operator as command
    from prorsa.shell import process as operator_process

    seen: dict[str, object] = {}

    def run_operator(config: OperatorSettings) -> int:
        seen["config"] = config
        return 0

    monkeypatch.setattr(operator_process, "run_operator", run_operator)
    monkeypatch.setattr("prorsa.shell.gc_tuning.tune_gc", lambda: None)  # this process keeps its gc
    assert command.run(build_parser().parse_args(["operator", *argv])) == 0
    config = seen["config"]
    assert isinstance(config, OperatorSettings) and config.namespaced is namespaced
    assert config.namespaces == (("rl", "eval") if namespaced else ())
    assert config.leader_election is None


def test_leader_election_needs_the_operator_namespace_and_takes_client_gos_timings() -> None:
    from prorsa.cli import build_parser
    from prorsa.commands import operator as command

    with pytest.raises(SystemExit, match="--leader-elect needs --operator-namespace"):
        command.run(build_parser().parse_args(["operator", "--leader-elect"]))
    args = build_parser().parse_args(
        ["operator", "--leader-elect", "--operator-namespace=prorsa-system", "--pod-name=p-0"]
    )
    assert (args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
            args.leader_elect_retry_period) == (15.0, 10.0, 2.0)  # fmt: skip
    assert args.pod_name == "p-0" and args.metrics_listen == "0.0.0.0:8788"
