"""Pod security bounds (docs/security.md): whoever may write a RolloutCluster gets no more
than a non-root, unprivileged engine pod with the cluster's own Secrets.

Every spec that asks for more is refused naming the field, the same way everywhere a spec
is read: the API server (the CRD's schema and CEL rules, on the emulator over HTTP),
`prorsa plan`, the operator's admission handler and its own parse. The operator also checks
each pod it renders right before creating it. Within the bounds, the pod template fields a
platform team needs (item 10) reach every engine pod, multi-node groups and
LeaderWorkerSets included, and never override the contract's labels and annotations.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kopf
import kubernetes
import kubernetes_validate
import pytest
import yaml
from conftest import cluster_runtime

from prorsa.cli import main
from prorsa.core.spec import GROUP, PLURAL, VERSION, SpecError, parse_cluster
from prorsa.k8s import crd_manifest, groups, lws
from prorsa.k8s import objects as obj
from prorsa.shell.handlers import OperatorSettings, build_registry
from prorsa_contract.labels import (
    BOOTSTRAP_ANNOTATION,
    CLUSTER_LABEL,
    COMPONENT_LABEL,
    MANAGED_BY,
    ROLE_LABEL,
)
from prorsa_lab.doubles.kube.emulator import KubeEmulator, KubeEmulatorServer
from prorsa_lab.doubles.kube.schema import apply_structural_schema
from prorsa_lab.doubles.kube.schema import validate as _validate
from prorsa_lab.doubles.stack import cluster_manifest

HOST = {"name": "root", "hostPath": {"path": "/"}}
# case: (spec.engine changes, the field a refusal must name)
OUT_OF_BOUNDS: dict[str, tuple[dict[str, Any], str]] = {
    "hostPath volume": ({"volumes": [HOST]}, "volumes.0.hostPath"),
    "secret volume": (
        {"volumes": [{"name": "s", "secret": {"secretName": "other-cluster-agent-token"}}]},
        "volumes.0.secret",
    ),
    "projected secret": (
        {
            "volumes": [
                {
                    "name": "p",
                    "projected": {
                        "sources": [
                            {"configMap": {"name": "ok"}},
                            {"secret": {"name": "trainer-token"}},
                        ]
                    },
                }
            ]
        },
        "volumes.0.projected.sources",
    ),
    "csi secret": (
        {"volumes": [{"name": "c", "csi": {"driver": "x", "nodePublishSecretRef": {"name": "s"}}}]},
        "volumes.0.csi.nodePublishSecretRef",
    ),
    "env from a secret": (
        {"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "t", "key": "k"}}}]},
        "env.0.valueFrom.secretKeyRef",
    ),
    "privileged": ({"securityContext": {"privileged": True}}, "securityContext.privileged"),
    "privilege escalation": (
        {"securityContext": {"allowPrivilegeEscalation": True}},
        "securityContext.allowPrivilegeEscalation",
    ),
    "unmasked proc": ({"securityContext": {"procMount": "Unmasked"}}, "securityContext.procMount"),
    "SYS_ADMIN": (
        {"securityContext": {"capabilities": {"add": ["IPC_LOCK", "SYS_ADMIN"]}}},
        "securityContext.capabilities.add",
    ),
    "root user": ({"podSecurityContext": {"runAsUser": 0}}, "podSecurityContext.runAsUser"),
    "root allowed": (
        {"podSecurityContext": {"runAsNonRoot": False}},
        "podSecurityContext.runAsNonRoot",
    ),
    "root container": ({"securityContext": {"runAsUser": 0}}, "securityContext.runAsUser"),
    "role label": ({"podLabels": {ROLE_LABEL: "prefill"}}, "podLabels"),
    "managed-by label": ({"podLabels": {MANAGED_BY: "me"}}, "podLabels"),
    "bootstrap annotation": ({"podAnnotations": {BOOTSTRAP_ANNOTATION: "1"}}, "podAnnotations"),
}


def manifest(engine: dict[str, Any]) -> dict[str, Any]:
    m = cluster_manifest()
    m["spec"]["engine"] = {**m["spec"]["engine"], **copy.deepcopy(engine)}
    return m


def schema_issues(m: dict[str, Any], schema: dict[str, Any]) -> list[Any]:
    """What the API server says about ``m`` after pruning and defaulting it."""
    return _validate(apply_structural_schema(copy.deepcopy(m), schema), schema)


def leaf(field: str) -> str:
    """The last name of a dotted field path, indexes dropped (what every refusal names)."""
    return next(p for p in reversed(field.split(".")) if not p.isdigit())


@pytest.mark.parametrize("case", sorted(OUT_OF_BOUNDS))
def test_the_operators_validation_refuses_naming_the_field(case: str) -> None:
    engine, field = OUT_OF_BOUNDS[case]
    with pytest.raises(SpecError) as info:
        parse_cluster(manifest(engine))
    parent, _, rest = field.partition(".")
    message = str(info.value)
    assert f"spec.engine.{parent}" in message, message
    assert leaf(field) in message or leaf(rest or parent) in message, message


@pytest.mark.parametrize("case", sorted(OUT_OF_BOUNDS))
def test_the_crd_refuses_the_same_specs_naming_the_field(case: str) -> None:
    engine, field = OUT_OF_BOUNDS[case]
    schema = crd_manifest.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema_issues(cluster_manifest(), schema) == []
    issues = schema_issues(manifest(engine), schema)
    # The emulator's paths index lists as [i]; the operator's as .i.
    wanted = "spec.engine." + ".".join(
        f"[{p}]" if p.isdigit() else p for p in field.split(".")
    ).replace(".[", "[")
    assert any(i.field == wanted for i in issues), (wanted, issues)


@pytest.mark.parametrize("case", sorted(OUT_OF_BOUNDS))
def test_prorsa_plan_and_admission_refuse_them(case: str, tmp_path: Path, capsys) -> None:
    engine, field = OUT_OF_BOUNDS[case]
    bad = manifest(engine)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(bad))
    events = tmp_path / "events.ndjson"
    events.write_text("")
    assert main(["plan", "--cluster", str(path), "--events", str(events), "--at", "1"]) == 2
    err = capsys.readouterr().err
    assert f"spec.engine.{field.split('.')[0]}" in err, err
    registry = build_registry(OperatorSettings(admission=True))
    (handler,) = [h for h in registry._webhooks.get_all_handlers() if h.id == "spec"]
    with pytest.raises(kopf.AdmissionError) as info:
        handler.fn(spec=bad["spec"])
    assert f"spec.engine.{field.split('.')[0]}" in str(info.value)


def test_the_api_server_refuses_them_at_admission_over_http() -> None:
    """What `kubectl apply` meets: 422 from the API server naming the field, no operator
    and no admission webhook involved (the CRD's CEL rules, on the emulator)."""
    emulator = KubeEmulator(namespaces=["rl"])
    emulator.add_crd(crd_manifest.crd())
    with KubeEmulatorServer(emulator) as kube, kube.api_client() as api:
        custom = kubernetes.client.CustomObjectsApi(api)
        for case, (engine, field) in sorted(OUT_OF_BOUNDS.items()):
            with pytest.raises(kubernetes.client.exceptions.ApiException) as info:
                custom.create_namespaced_custom_object(
                    GROUP, VERSION, "rl", PLURAL, manifest(engine)
                )
            assert info.value.status == 422, case
            assert leaf(field) in json.loads(info.value.body)["message"], (case, info.value.body)
        created = custom.create_namespaced_custom_object(
            GROUP, VERSION, "rl", PLURAL, manifest(PASSTHROUGH)
        )
        assert created["spec"]["engine"]["podAnnotations"] == PASSTHROUGH["podAnnotations"]


# -- within the bounds: the pod template passthrough -----------------------------------------------

PASSTHROUGH: dict[str, Any] = {
    "imagePullSecrets": [{"name": "registry-creds"}],
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "topology.kubernetes.io/zone",
                                "operator": "In",
                                "values": ["a"],
                            }
                        ]
                    }
                ]
            }
        }
    },
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {CLUSTER_LABEL: "demo"}},
        }
    ],
    "schedulerName": "volcano",
    "priorityClassName": "rl-rollout",
    "podLabels": {"team": "rl", "example.com/cost-center": "42"},
    "podAnnotations": {
        "k8s.v1.cni.cncf.io/networks": "rdma-net-1, rdma-net-2",
        "example.com/note": "anything",
    },
    "volumes": [
        {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
        {"name": "cfg", "configMap": {"name": "nccl"}},
        {"name": "scratch", "emptyDir": {}},
    ],
    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    "env": [
        {"name": "NCCL_IB_HCA", "value": "mlx5"},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ],
    "podSecurityContext": {"runAsUser": 10001, "fsGroup": 10001},
    "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK", "SYS_RESOURCE"]}},
}


def test_pod_template_fields_reach_the_engine_pods_within_the_bounds() -> None:
    spec = parse_cluster(manifest(PASSTHROUGH)).spec
    pod = obj.engine_pod(cluster="demo", namespace="rl", index=0, role="decode", spec=spec)
    kubernetes_validate.validate(pod, "1.32", strict=True)
    assert obj.pod_violations(pod, cluster="demo", spec=spec) == []
    p, meta = pod["spec"], pod["metadata"]
    assert p["imagePullSecrets"] == [{"name": "registry-creds"}]
    for key in (
        "nodeSelector",
        "tolerations",
        "affinity",
        "topologySpreadConstraints",
        "schedulerName",
        "priorityClassName",
    ):
        assert p[key] == PASSTHROUGH[key], key
    assert PASSTHROUGH["podLabels"].items() <= meta["labels"].items()
    assert PASSTHROUGH["podAnnotations"].items() <= meta["annotations"].items()
    # The contract's labels and annotation are all still there.
    assert meta["labels"][MANAGED_BY] == "prorsa" and meta["labels"][CLUSTER_LABEL] == "demo"
    assert meta["labels"][ROLE_LABEL] == "decode" and meta["labels"][COMPONENT_LABEL] == "engine"
    assert meta["annotations"][BOOTSTRAP_ANNOTATION] == "8998"
    (c,) = p["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NCCL_IB_HCA"]["value"] == "mlx5" and "fieldRef" in env["NODE"]["valueFrom"]
    assert {"models", "cfg", "scratch"} <= {v["name"] for v in p["volumes"]}
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK", "SYS_RESOURCE"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert p["securityContext"]["runAsNonRoot"] is True and p["securityContext"]["fsGroup"] == 10001
    # Secrets: the cluster's own three, mounted by the operator, and the pull secret.
    mounted = {v["secret"]["secretName"] for v in p["volumes"] if "secret" in v}
    assert mounted == obj.own_secrets("demo")


def test_multi_node_groups_and_leader_worker_sets_carry_them() -> None:
    spec = parse_cluster(_two_node(PASSTHROUGH)).spec
    pods = groups.group_pods(cluster="demo", namespace="rl", index=0, role="decode", spec=spec)
    assert len(pods) == 2
    for pod in pods:
        kubernetes_validate.validate(pod, "1.32", strict=True)
        assert obj.pod_violations(pod, cluster="demo", spec=spec) == []
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"]
        assert pod["metadata"]["labels"]["team"] == "rl"
    sets = lws.leader_worker_set(cluster="demo", namespace="rl", index=0, pods=pods)
    template = sets["spec"]["leaderWorkerTemplate"]
    for part in ("leaderTemplate", "workerTemplate"):
        t = template[part]
        assert t["spec"]["imagePullSecrets"] == [{"name": "registry-creds"}]
        assert t["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"]
        assert t["metadata"]["labels"]["team"] == "rl"


def _two_node(engine: dict[str, Any]) -> dict[str, Any]:
    m = manifest(engine | {"nodesPerInstance": 2, "gpusPerInstance": 16, "tensorParallelSize": 16})
    m["spec"]["gpuBudget"] = 32
    return m


# -- the operator's own check of every pod it creates ---------------------------------------


class Kube:
    """The calls of one reconcile that finds no engine pod."""

    def __init__(self) -> None:
        self.created: list[str] = []

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return []

    async def read_secret_key(self, namespace: str, name: str, key: str) -> str:
        return "ca"

    async def ensure(self, manifest: dict[str, Any]) -> bool:
        self.created.append(manifest["metadata"]["name"])
        return True


async def test_the_operator_creates_no_pod_out_of_bounds_whatever_the_spec_says() -> None:
    """A spec that slipped past validation (an old CRD, admission off, an operator bug):
    the rendered pod is checked before it is created, and a Warning Event names why."""
    good = parse_cluster(cluster_manifest()).spec
    # model_copy does not validate: what an unchecked spec would render.
    engine = good.engine.model_copy(
        update={"volumes": [HOST], "security_context": {"privileged": True}}
    )
    bad = good.model_copy(update={"engine": engine})
    events: list[tuple[str, str, str]] = []

    async def post_event(kind: str, reason: str, message: str) -> None:
        events.append((kind, reason, message))

    kube = Kube()
    runtime = cluster_runtime(bad, kube=kube, post_event=post_event)
    await runtime.reconciler.pods(runtime.spec)
    await runtime.reconciler.pods(runtime.spec)
    assert kube.created == []
    (event,) = events  # once per cause, not once per tick
    kind, reason, message = event
    assert (kind, reason) == ("Warning", "PodRefused")
    assert "c-engine-0, c-engine-1" in message and "spec.volumes.4.hostPath" in message
    assert "securityContext.privileged" in message
    # A good spec creates its pods.
    runtime.spec = good
    await runtime.reconciler.pods(runtime.spec)
    assert kube.created == [f"c-engine-{i}" for i in range(good.instances)]


def test_every_bound_is_documented() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    for word in (
        "hostPath",
        "privileged",
        "runAsNonRoot",
        "runAsUser",
        "imagePullSecrets",
        "secretKeyRef",
        "SYS_ADMIN",
        "PodRefused",
    ):
        assert word in page, word
