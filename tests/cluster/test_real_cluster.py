"""The operator's end-to-end scenarios on a real Kubernetes cluster (kind, k3d, a GPU-less
test cluster), with engine doubles as the engine pods. Skipped unless configured:

    KUBECONFIG=~/.kube/config            a cluster where the chart is installed, watching
                                         the test namespace (created first):
        kubectl create namespace prorsa-e2e
        helm install prorsa charts/prorsa -n prorsa-system --create-namespace \\
            --set image.repository=<your operator image> \\
            --set 'operator.watchNamespaces={prorsa-e2e}' --set webhook.tls.enabled=false
    PRORSA_E2E_IMAGE=<image>             an image with the prorsa distribution (the operator
                                         image works): engine pods run the agent in it, with
                                         the engine double in place of SGLang
    PRORSA_E2E_NAMESPACE=prorsa-e2e      (optional) where the test clusters go

    pytest tests/cluster -v

The webhook is reached through ``kubectl port-forward`` to the ``prorsa-webhook`` Service.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

IMAGE = os.environ.get("PRORSA_E2E_IMAGE")
NAMESPACE = os.environ.get("PRORSA_E2E_NAMESPACE", "prorsa-e2e")
OPERATOR_NAMESPACE = os.environ.get("PRORSA_E2E_OPERATOR_NAMESPACE", "prorsa-system")

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG") or not IMAGE or shutil.which("kubectl") is None,
        reason="real-cluster suite: set KUBECONFIG and PRORSA_E2E_IMAGE (and have kubectl)",
    ),
]

TOKEN = "e2e-" + uuid.uuid4().hex


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    done = subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=120
    )
    if check and done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
    return done.stdout


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"path": "/models/double"},
        "engine": {
            "image": IMAGE,
            "gpusPerInstance": 1,
            "tensorParallelSize": 1,
            "gpuResourceName": "",
            "env": [
                {
                    "name": "PRORSA_ENGINE_COMMAND",
                    "value": "python -m prorsa_lab.doubles.sglang_double",
                }
            ],
        },
        "gpuBudget": 4,
        "roles": {"prefill": {"min": 1, "initial": 1}, "decode": {"min": 1}},
        "capacity": {"prefillTokensPerSecond": 10_000, "decodeKvTokens": 20_000},
        "switching": {
            "cooldownSeconds": 0,
            "drainTimeoutSeconds": 2,
            "hysteresis": 0.05,
            "smoothingSeconds": 0,
        },
        "router": {"enabled": False},
        "trainer": {"tokenSecretRef": {"name": "e2e-trainer-token"}},
    } | spec
    return {
        "apiVersion": "prorsa.io/v1alpha1",
        "kind": "RolloutCluster",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": body,
    }


def apply(obj: dict[str, Any]) -> None:
    import json

    kubectl("apply", "-f", "-", stdin=json.dumps(obj))


def roles(name: str) -> dict[str, str]:
    path = "{range .items[*]}{.metadata.name}={.metadata.labels.prorsa\\.io/role}\\n{end}"
    out = kubectl(
        "get", "pods", "-n", NAMESPACE, "-l", f"prorsa.io/cluster={name}", "-o", f"jsonpath={path}"
    )
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait(check: Any, *, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    kubectl("create", "namespace", NAMESPACE, check=False)
    kubectl("-n", NAMESPACE, "delete", "secret", "e2e-trainer-token", check=False)
    kubectl("-n", NAMESPACE, "create", "secret", "generic", "e2e-trainer-token",
            f"--from-literal=token={TOKEN}")  # fmt: skip
    yield NAMESPACE
    kubectl("delete", "rolloutclusters", "--all", "-n", NAMESPACE, check=False)


@pytest.fixture(scope="module")
def webhook() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["kubectl", "-n", OPERATOR_NAMESPACE, "port-forward", "svc/prorsa-webhook",
         f"{port}:8787"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: _up(url), timeout=30, what="the port-forward to prorsa-webhook")
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def post(url: str, name: str, events: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/namespaces/{NAMESPACE}/rolloutclusters/{name}/events",
        json={"events": events},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )


def test_cluster_comes_up_and_flips_toward_prefill(namespace: str, webhook: str) -> None:
    name = "e2e-follow"
    apply(manifest(name))
    wait(lambda: len(roles(name)) == 4, timeout=300, what="4 engine pods")
    wait(lambda: sorted(roles(name).values()) == ["decode", "decode", "decode", "prefill"],
         timeout=300, what="the initial 1P:3D split")  # fmt: skip
    now = time.time()
    events = [
        {"id": f"{name}-{i}", "ts": now, "trajectory": f"t{i}", "type": "request_queued",
         "prompt_tokens": 10_000, "turn": 0}
        for i in range(30)
    ]  # fmt: skip
    assert post(webhook, name, events).status_code == 200
    wait(lambda: list(roles(name).values()).count("prefill") == 2, timeout=120,
         what="a flip to 2P:2D")  # fmt: skip
    status = kubectl("get", "rolloutcluster", name, "-n", NAMESPACE, "-o",
                     "jsonpath={.status.target.split}")  # fmt: skip
    assert status == "2P:2D"


def test_recommend_mode_changes_only_status(namespace: str, webhook: str) -> None:
    name = "e2e-recommend"
    apply(manifest(name, switching={"mode": "Recommend", "cooldownSeconds": 0}))
    wait(lambda: len(roles(name)) == 4, timeout=300, what="4 engine pods")
    time.sleep(20)
    before = roles(name)
    now = time.time()
    events = [
        {"id": f"{name}-{i}", "ts": now, "trajectory": f"t{i}", "type": "request_queued",
         "prompt_tokens": 10_000, "turn": 0}
        for i in range(60)
    ]  # fmt: skip
    assert post(webhook, name, events).status_code == 200
    time.sleep(20)
    assert roles(name) == before


def test_bad_rollout_cluster_is_refused(namespace: str) -> None:
    bad = manifest("e2e-bad", gpuBudget=3)
    done = subprocess.run(
        ["kubectl", "apply", "-f", "-"], input=__import__("json").dumps(bad),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "gpuBudget" in done.stderr
