"""Kubernetes objects of one RolloutCluster, as plain manifests (pure functions).

The names, labels and annotations the manifests carry are the CONTRACT of
docs/agent-api.md, defined in :mod:`prorsa_contract.labels`.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from prorsa.core import pod_bounds
from prorsa.core.spec import RolloutClusterSpec
from prorsa.engines.agent_env import AGENT_TLS_CERT_ENV
from prorsa_contract.labels import (
    AGENT_COMMAND,
    AGENT_PORT,
    BOOTSTRAP_ANNOTATION,
    BOOTSTRAP_PORT,
    CLUSTER_LABEL,
    COMPONENT_LABEL,
    ENGINE_PORT,
    INDEX_LABEL,
    MANAGED_BY,
    NODE_RANK_LABEL,
    ROLE_LABEL,
    agent_secret_name,
    agent_tls_secret_name,
    engine_key_secret_name,
    engine_name,
)

T = TypeVar("T")

ROUTER_PORT = 30000
WEBHOOK_PORT = 8787
METRICS_PORT = 8788
"""The operator's /metrics: a port of its own, apart from the trainers' webhook."""
LEADER_LABEL = "prorsa.io/leader"
"""On the leading operator's pod (value ``"true"``): the webhook Service selects it."""
TOKEN_PATH = "/var/run/prorsa/agent-token"
ENGINE_KEY_PATH = "/var/run/prorsa/engine-admin-key"
AGENT_TLS_PATH = "/var/run/prorsa/agent-tls"

ENGINE_POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""The engine pods' default securityContext (the engine image runs as UID 10001);
spec.engine.podSecurityContext is merged over it, runAsNonRoot stays true."""
ENGINE_CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    # RDMA registers (pins) GPU and host buffers; IPC_LOCK lifts the locked-memory limit.
    "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
}
"""The engine container's default securityContext; spec.engine.securityContext is merged
over it, allowPrivilegeEscalation stays false."""


def router_name(cluster: str) -> str:
    return f"{cluster}-router"


def owned(manifest: dict[str, Any], *, cluster: str, uid: str) -> dict[str, Any]:
    """``manifest`` owned by its RolloutCluster: garbage-collected with it."""
    manifest["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "prorsa.io/v1alpha1",
            "kind": "RolloutCluster",
            "name": cluster,
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return manifest


def labels(cluster: str, component: str) -> dict[str, str]:
    return {
        MANAGED_BY: "prorsa",
        CLUSTER_LABEL: cluster,
        COMPONENT_LABEL: component,
        "app.kubernetes.io/name": "prorsa",
        "app.kubernetes.io/instance": cluster,
    }


def engine_pod(
    *, cluster: str, namespace: str, index: int, role: str, spec: RolloutClusterSpec
) -> dict[str, Any]:
    """One engine pod: SGLang under the in-pod agent.

    The agent launches every engine as decode, so decode CUDA graphs are captured at
    start-up and any later flip back to decode finds them; ``role`` is the label the pod
    is created with (the operator flips it to prefill, if wanted, once it is ready).
    """
    e = spec.engine
    name = engine_name(cluster, index)
    gpus = e.m_prefill if role == "prefill" else e.m_decode
    resources: dict[str, Any] = _copy(e.resources)
    if e.gpu_resource_name:
        resources.setdefault("limits", {})[e.gpu_resource_name] = str(gpus)
        resources.setdefault("requests", {})[e.gpu_resource_name] = str(gpus)
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PRORSA_INSTANCE", "value": name},
        {"name": "PRORSA_LAUNCH", "value": "1"},
        {"name": "PRORSA_MODEL_PATH", "value": spec.model.path},
        {"name": "PRORSA_TP_SIZE", "value": str(e.tensor_parallel_size)},
        {"name": "PRORSA_TRANSFER_BACKEND", "value": e.transfer_backend},
        {"name": "PRORSA_BOOTSTRAP_PORT", "value": str(BOOTSTRAP_PORT)},
        {"name": "PRORSA_ENGINE_PORT", "value": str(ENGINE_PORT)},
        {"name": "PRORSA_AGENT_LISTEN", "value": f"0.0.0.0:{AGENT_PORT}"},
        {"name": "PRORSA_AGENT_TOKEN_FILE", "value": TOKEN_PATH + "/token"},
        # The agent passes the key to SGLang (--admin-api-key) and sends it on its calls.
        {"name": "PRORSA_ENGINE_API_KEY_FILE", "value": ENGINE_KEY_PATH + "/key"},
        # The agent serves HTTPS with the cluster's agent certificate (agent_tls.py).
        {"name": AGENT_TLS_CERT_ENV, "value": AGENT_TLS_PATH + "/tls.crt"},
        {"name": "PRORSA_AGENT_TLS_KEY_FILE", "value": AGENT_TLS_PATH + "/tls.key"},
        {"name": "PRORSA_EXTRA_ARGS", "value": json.dumps(list(e.extra_args))},
    ]
    if spec.model.served_name:
        env.append({"name": "PRORSA_SERVED_MODEL_NAME", "value": spec.model.served_name})
    if spec.kv_store is not None:
        # The agent renders the store's SGLang flags from these (prorsa_agent.kv_store).
        env += [
            {"name": "PRORSA_KV_STORE_BACKEND", "value": spec.kv_store.backend},
            {"name": "PRORSA_KV_STORE_ENDPOINT", "value": spec.kv_store.endpoint},
            {"name": "PRORSA_KV_STORE_SIZE_GIB", "value": str(spec.kv_store.size_gib)},
        ]
    env.extend(e.env)
    volumes = [
        {"name": "agent-token", "secret": {"secretName": agent_secret_name(cluster)}},
        {"name": "engine-admin-key", "secret": {"secretName": engine_key_secret_name(cluster)}},
        {"name": "agent-tls", "secret": {"secretName": agent_tls_secret_name(cluster)}},
        # NCCL and SGLang's shared-memory transport need more than the 64 MiB default.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        *e.volumes,
    ]
    mounts = [
        {"name": "agent-token", "mountPath": TOKEN_PATH, "readOnly": True},
        {"name": "engine-admin-key", "mountPath": ENGINE_KEY_PATH, "readOnly": True},
        {"name": "agent-tls", "mountPath": AGENT_TLS_PATH, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        *e.volume_mounts,
    ]
    # The spec's labels and annotations first: the contract's win (the spec's validation
    # refuses the keys the operator owns anyway).
    pod_labels = dict(e.pod_labels) | labels(cluster, "engine")
    pod_labels |= {ROLE_LABEL: role, INDEX_LABEL: str(index)}
    annotations = dict(e.pod_annotations) | {BOOTSTRAP_ANNOTATION: str(BOOTSTRAP_PORT)}
    scheduling: dict[str, Any] = {
        "nodeSelector": dict(e.node_selector),
        "tolerations": _copy(e.tolerations),
    }
    if e.affinity:
        scheduling["affinity"] = _copy(e.affinity)
    if e.topology_spread_constraints:
        scheduling["topologySpreadConstraints"] = _copy(e.topology_spread_constraints)
    if e.scheduler_name:
        scheduling["schedulerName"] = e.scheduler_name
    if e.priority_class_name:
        scheduling["priorityClassName"] = e.priority_class_name
    if e.image_pull_secrets:
        scheduling["imagePullSecrets"] = [{"name": ref.name} for ref in e.image_pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": pod_labels,
            "annotations": annotations,
        },
        "spec": {
            "restartPolicy": "Always",
            # <pod>.<cluster>-engines.<namespace>.svc resolves in the cluster: the name the
            # agent certificate carries (the operator connects by IP and checks that name).
            **({"hostname": name, "subdomain": f"{cluster}-engines"} if len(name) <= 63 else {}),
            "terminationGracePeriodSeconds": 60,
            # Engines never call the Kubernetes API: no ServiceAccount token in the pod.
            "automountServiceAccountToken": False,
            "securityContext": _copy(
                ENGINE_POD_SECURITY | (e.pod_security_context or {}) | {"runAsNonRoot": True}
            ),
            **scheduling,
            "containers": [
                {
                    "name": "engine",
                    "image": e.image,
                    # Explicit, so any image with the agent installed (the light
                    # prorsa-agent distribution, or the whole prorsa one) can run an engine.
                    "command": [AGENT_COMMAND],
                    "env": env,
                    "ports": [
                        {"name": "http", "containerPort": ENGINE_PORT},
                        {"name": "bootstrap", "containerPort": BOOTSTRAP_PORT},
                        {"name": "agent", "containerPort": AGENT_PORT},
                    ],
                    "resources": resources,
                    "volumeMounts": mounts,
                    "securityContext": _copy(
                        ENGINE_CONTAINER_SECURITY
                        | (e.security_context or {})
                        | {"allowPrivilegeEscalation": False}
                    ),
                    # Loading a large model takes minutes: the startup probe covers it. An
                    # engine that crashed is restarted by the agent, so liveness asks only
                    # whether the agent itself runs.
                    "startupProbe": _probe("/healthz", period=10, failures=180),
                    "livenessProbe": _probe("/livez", period=10, failures=6),
                    "readinessProbe": _probe("/readyz", period=5, failures=2),
                }
            ],
            "volumes": volumes,
        },
    }


def _copy(value: T) -> T:
    """A deep copy, so a manifest never shares a dict with the spec or a default."""
    copied: T = json.loads(json.dumps(value))
    return copied


def own_secrets(cluster: str) -> frozenset[str]:
    """The Secrets an engine pod of ``cluster`` mounts: the operator's own, none other."""
    return frozenset(
        name(cluster) for name in (agent_secret_name, engine_key_secret_name, agent_tls_secret_name)
    )


def pod_violations(pod: dict[str, Any], *, cluster: str, spec: RolloutClusterSpec) -> list[str]:
    """Whether a rendered engine pod stays within the spec's bounds (the re-check the
    operator makes before it creates a pod: :mod:`prorsa.core.pod_bounds`)."""
    return pod_bounds.pod_violations(
        pod,
        secrets=own_secrets(cluster),
        pull_secrets={ref.name for ref in spec.engine.image_pull_secrets},
    )


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        # The kubelet does not verify the certificate of an HTTPS probe.
        "httpGet": {"path": path, "port": AGENT_PORT, "scheme": "HTTPS"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def agent_secret(*, cluster: str, namespace: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": agent_secret_name(cluster),
            "namespace": namespace,
            "labels": labels(cluster, "agent-token"),
        },
        "type": "Opaque",
        "stringData": {"token": token},
    }


def engine_key_secret(*, cluster: str, namespace: str, key: str) -> dict[str, Any]:
    """The engines' SGLang admin key (``/pd_role_switch``, ``/abort_request``, ...).

    Only the engine pods mount it: the operator creates it and never reads it back, and the
    router needs no key (SGLang leaves ``/generate`` open when only an admin key is set).
    """
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": engine_key_secret_name(cluster),
            "namespace": namespace,
            "labels": labels(cluster, "engine-admin-key"),
        },
        "type": "Opaque",
        "stringData": {"key": key},
    }


def agent_tls_secret(
    *, cluster: str, namespace: str, ca: str, cert: str, key: str
) -> dict[str, Any]:
    """The agents' serving certificate and its CA; engine pods mount it, the operator
    reads ``ca.crt`` back to verify them (:mod:`prorsa.engines.agent_tls`)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": agent_tls_secret_name(cluster),
            "namespace": namespace,
            "labels": labels(cluster, "agent-tls"),
        },
        "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": cert, "tls.key": key, "ca.crt": ca},
    }


def engines_service(*, cluster: str, namespace: str) -> dict[str, Any]:
    """Headless: stable DNS for every engine pod, whatever its role."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": f"{cluster}-engines",
            "namespace": namespace,
            "labels": labels(cluster, "engine"),
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {CLUSTER_LABEL: cluster, COMPONENT_LABEL: "engine"},
            "ports": [
                {"name": "http", "port": ENGINE_PORT},
                {"name": "bootstrap", "port": BOOTSTRAP_PORT},
                {"name": "agent", "port": AGENT_PORT},
            ],
        },
    }


def router_args(*, cluster: str, namespace: str, spec: RolloutClusterSpec) -> list[str]:
    """smg with Kubernetes discovery; ``draining`` matches neither selector (sglang.md).

    With multi-node instances only leaders (node rank 0) are workers of the router: the
    other ranks carry the same role label but serve no HTTP API.

    With attention data parallelism (``--enable-dp-attention --dp-size N`` in the engine
    args) smg runs ``--dp-aware``: it reads each engine's ``dp_size`` from ``/server_info``,
    makes every rank a worker of its own and sends the chosen rank with the request
    (``routed_dp_rank``), so cache_aware places a trajectory's next turn on the rank that
    holds its prefix. Without it SGLang's DP controller round-robins the ranks of an
    engine launched as decode (every Prorsa engine), whatever its role, and a returning
    turn finds its prefix on 1 rank in N; SGLang itself warns that the decode radix cache
    with DP attention "requires prefix-aware DP rank routing" (pd_disaggregation_hook.py).
    No ``--sticky-sessions``: cache_aware already follows the prefix, and stays free to
    balance load, where a sticky key would pin a trajectory to a worker however busy.
    """
    base = f"{CLUSTER_LABEL}={cluster}"
    leaders = [f"{NODE_RANK_LABEL}=0"] if spec.engine.nodes_per_instance > 1 else []
    dp_aware = ["--dp-aware"] if spec.engine.attention_dp_size > 1 else []
    return [
        "launch",
        "--host",
        "0.0.0.0",
        "--port",
        str(ROUTER_PORT),
        "--pd-disaggregation",
        "--service-discovery",
        "--service-discovery-namespace",
        namespace,
        "--service-discovery-port",
        str(ENGINE_PORT),
        "--prefill-selector",
        base,
        f"{ROLE_LABEL}=prefill",
        *leaders,
        "--decode-selector",
        base,
        f"{ROLE_LABEL}=decode",
        *leaders,
        "--policy",
        spec.router.policy,
        *dp_aware,
    ]


def router_objects(
    *, cluster: str, namespace: str, spec: RolloutClusterSpec
) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding (watch pods), Deployment and Service of the router."""
    name = router_name(cluster)
    meta = {"name": name, "namespace": namespace, "labels": labels(cluster, "router")}
    selector = {CLUSTER_LABEL: cluster, COMPONENT_LABEL: "router"}
    args = router_args(cluster=cluster, namespace=namespace, spec=spec)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {"labels": labels(cluster, "router")},
                    "spec": {
                        "serviceAccountName": name,
                        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
                        "containers": [
                            {
                                "name": "router",
                                "image": spec.router.image,
                                "command": ["smg"],
                                "args": args,
                                "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
                                # /readiness, not /health: a started smg answers
                                # /generate 404 model_not_found until its discovery has
                                # registered the engines; the Service keeps it out till then.
                                "readinessProbe": {
                                    "httpGet": {"path": "/readiness", "port": ROUTER_PORT},
                                    "periodSeconds": 5,
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                            }
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {"selector": selector, "ports": [{"name": "http", "port": ROUTER_PORT}]},
        },
    ]


def webhook_service(
    *, namespace: str, name: str = "prorsa-webhook", leader: bool = True
) -> dict[str, Any]:
    """The one webhook Service shared by every cluster (in the operator's namespace).

    With ``leader`` it selects the leading operator's pod alone, the one whose webhook holds
    the clusters' state (the standby serves none); without, every operator pod.
    """
    selector = {"app.kubernetes.io/name": "prorsa", COMPONENT_LABEL: "operator"}
    if leader:
        selector[LEADER_LABEL] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {MANAGED_BY: "prorsa", "app.kubernetes.io/name": "prorsa"},
        },
        "spec": {
            "selector": selector,
            "ports": [{"name": "webhook", "port": WEBHOOK_PORT, "targetPort": WEBHOOK_PORT}],
        },
    }
