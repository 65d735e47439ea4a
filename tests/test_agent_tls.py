"""The agent over HTTPS on loopback, and the operator's client verifying it.

The certificates are the ones the operator issues for a cluster (prorsa.engines.agent_tls):
a per-cluster CA and a wildcard certificate for ``*.<cluster>-engines.<namespace>.svc``.
The operator connects to the pod IP and checks the pod's DNS name; a certificate of
another cluster, an untrusted CA or plain HTTP must each fail before a token is sent.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from prorsa.control.credentials import AgentCredentials
from prorsa.engines.agent_tls import IssuedCert, agent_server_name, issue_agent_cert
from prorsa.engines.agents import AgentClient, agent_address
from prorsa.k8s import objects
from prorsa_agent.agent_cli import build_config, configure
from prorsa_agent.config import ConfigError
from prorsa_contract.agent_api import RoleRequest
from prorsa_contract.serving_tls import ServingCert
from prorsa_lab.doubles.sglang_double import EnginePod

TOKEN = "agent-token-tls"
CLUSTER, NAMESPACE = "qwen", "rl"
POD = f"{CLUSTER}-engine-0"


@pytest.fixture(scope="module")
def issued() -> IssuedCert:
    return issue_agent_cert(cluster=CLUSTER, namespace=NAMESPACE)


@pytest.fixture
async def pod(issued: IssuedCert) -> AsyncIterator[EnginePod]:
    async with EnginePod(instance=POD, token=TOKEN, tls_cert=issued.cert, tls_key=issued.key) as p:
        yield p


def pod_manifest(pod: EnginePod, *, cluster: str = CLUSTER) -> dict:
    """The engine pod as the API server holds it, at the agent's loopback address."""
    from prorsa.core.spec import parse_cluster

    spec = parse_cluster(
        {
            "apiVersion": "prorsa.io/v1alpha1",
            "kind": "RolloutCluster",
            "metadata": {"name": cluster, "namespace": NAMESPACE},
            "spec": {"model": {"path": "/m"}, "gpuBudget": 16},
        }
    ).spec
    manifest = objects.engine_pod(
        cluster=cluster, namespace=NAMESPACE, index=0, role="decode", spec=spec
    )
    manifest["metadata"]["name"] = pod.instance
    manifest["status"] = {"podIP": "127.0.0.1"}
    return manifest


def port_of(pod: EnginePod) -> int:
    return int(pod.agent_url.rsplit(":", 1)[1])


async def test_the_agent_serves_https_with_the_cluster_certificate(pod, issued):
    assert pod.agent_url.startswith("https://")
    context = ssl.create_default_context(cadata=issued.ca)
    name = agent_server_name(pod=POD, cluster=CLUSTER, namespace=NAMESPACE)
    async with httpx.AsyncClient(verify=context, timeout=5) as client:
        reply = await client.get(f"{pod.agent_url}/v1/state", extensions={"sni_hostname": name})
    assert reply.status_code == 200 and reply.json()["instance"] == POD
    # Plain HTTP to the TLS port gets no answer at all.
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(httpx.HTTPError):
            await client.get(f"http://127.0.0.1:{port_of(pod)}/v1/state")


async def test_the_operator_verifies_the_agent_and_flips_it_over_tls(pod, issued):
    address = agent_address(pod_manifest(pod), port=port_of(pod), ca=issued.ca)
    assert address is not None and address.url.startswith("https://")
    assert address.server_name == f"{POD}.{CLUSTER}-engines.{NAMESPACE}.svc"
    agents = AgentClient()
    try:
        state = await agents.state(address)
        assert state is not None and state.role == "decode"
        request = RoleRequest(role="prefill", drain_timeout_seconds=1.0)
        result = await agents.set_role(address, request=request, token=TOKEN)
        assert result.ok, result
        state = await agents.state(address)
        assert state is not None and state.role == "prefill"
    finally:
        await agents.aclose()


async def test_the_operator_refuses_an_agent_it_cannot_verify(pod, issued):
    """Another cluster's CA, another cluster's name, or no CA: no state, no token sent."""
    other = issue_agent_cert(cluster=CLUSTER, namespace=NAMESPACE)
    agents = AgentClient()
    try:
        untrusted = agent_address(pod_manifest(pod), port=port_of(pod), ca=other.ca)
        assert untrusted is not None
        assert await agents.state(untrusted) is None

        # The right CA, but the name of another cluster's pod: the wildcard does not cover it.
        elsewhere = agent_address(
            pod_manifest(pod, cluster="other"), port=port_of(pod), ca=issued.ca
        )
        assert elsewhere is not None and elsewhere.server_name is not None
        assert "other-engines" in elsewhere.server_name
        assert await agents.state(elsewhere) is None

        unknown = agent_address(pod_manifest(pod), port=port_of(pod), ca=None)
        assert unknown is not None and unknown.url.startswith("https://")
        assert await agents.state(unknown) is None

        trusted = agent_address(pod_manifest(pod), port=port_of(pod), ca=issued.ca)
        assert trusted is not None and await agents.state(trusted) is not None
    finally:
        await agents.aclose()


def test_a_pod_without_the_certificate_mount_is_reached_over_http():
    """Pods an operator made before TLS keep working until they are replaced."""
    pod = {
        "metadata": {"name": "old-engine-0", "namespace": NAMESPACE, "labels": {}},
        "spec": {"containers": [{"name": "engine", "env": []}]},
        "status": {"podIP": "10.0.0.7"},
    }
    address = agent_address(pod, port=8080, ca="ignored")
    assert address is not None
    assert address.url == "http://10.0.0.7:8080" and address.server_name is None
    pod["status"] = {}
    assert agent_address(pod, port=8080, ca=None) is None


def test_engine_pods_mount_the_certificate_and_probe_over_https():
    from prorsa.core.spec import parse_cluster

    spec = parse_cluster(
        {
            "apiVersion": "prorsa.io/v1alpha1",
            "kind": "RolloutCluster",
            "metadata": {"name": CLUSTER, "namespace": NAMESPACE},
            "spec": {"model": {"path": "/m"}, "gpuBudget": 16},
        }
    ).spec
    pod = objects.engine_pod(
        cluster=CLUSTER, namespace=NAMESPACE, index=0, role="decode", spec=spec
    )
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["agent-tls"]["secret"]["secretName"] == f"{CLUSTER}-agent-tls"
    assert env["PRORSA_AGENT_TLS_CERT_FILE"] == mounts["agent-tls"] + "/tls.crt"
    assert env["PRORSA_AGENT_TLS_KEY_FILE"] == mounts["agent-tls"] + "/tls.key"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    # The pod's DNS name is the one the certificate carries.
    assert pod["spec"]["hostname"] == POD
    assert pod["spec"]["subdomain"] == f"{CLUSTER}-engines"


def test_the_agent_refuses_half_a_certificate_pair(tmp_path: Path):
    import argparse

    parser = argparse.ArgumentParser()
    configure(parser)
    token = tmp_path / "token"
    token.write_text("t")
    args = parser.parse_args(["--token-file", str(token), "--tls-cert-file", "/x/tls.crt"])
    args.tls_key_file = None
    with pytest.raises(ConfigError, match="--tls-cert-file and --tls-key-file"):
        build_config(args, env={})


async def test_a_rotated_certificate_is_served_to_new_connections(tmp_path: Path, monkeypatch):
    """The kubelet swaps the Secret's files in place: the next handshake serves them."""
    from aiohttp import web

    import prorsa_contract.serving_tls as serving_tls

    monkeypatch.setattr(serving_tls, "CHECK_EVERY", 0.0)
    first = issue_agent_cert(cluster=CLUSTER, namespace=NAMESPACE)
    second = issue_agent_cert(cluster=CLUSTER, namespace=NAMESPACE)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text(first.cert)
    key.write_text(first.key)
    serving = ServingCert(cert_file=cert, key_file=key)

    async def hello(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=serving.context)
    await site.start()
    port = runner.addresses[0][1]
    name = agent_server_name(pod=POD, cluster=CLUSTER, namespace=NAMESPACE)

    async def fetch(ca: str) -> int:
        context = ssl.create_default_context(cadata=ca)
        async with httpx.AsyncClient(verify=context, timeout=5) as client:
            reply = await client.get(
                f"https://127.0.0.1:{port}/", extensions={"sni_hostname": name}
            )
            return reply.status_code

    try:
        assert await fetch(first.ca) == 200
        cert.write_text(second.cert)
        key.write_text(second.key)
        assert await fetch(second.ca) == 200
        with pytest.raises(httpx.ConnectError):
            await fetch(first.ca)
        # A half-written pair (new key, old certificate) keeps the last good one.
        key.write_text(first.key)
        assert serving.reload() is False
        assert await fetch(second.ca) == 200
    finally:
        await runner.cleanup()

    with pytest.raises(ValueError, match="cannot load the TLS certificate"):
        ServingCert(cert_file=tmp_path / "missing.crt", key_file=key)


async def test_the_runtime_issues_the_secret_once_and_trusts_its_ca():
    """setup() issues the Secret when missing and reads the CA back; a second start (an
    operator restart) keeps the same CA, so running pods stay verifiable."""
    created: dict[str, dict] = {}

    class FakeKube:
        async def read_secret_key(self, ns: str, name: str, key: str) -> str | None:
            secret = created.get(name)
            return None if secret is None else secret["stringData"].get(key)

        async def ensure(self, manifest: dict) -> bool:
            name = manifest["metadata"]["name"]
            if name in created:
                return False
            created[name] = manifest
            return True

    async def start() -> str | None:
        credentials = AgentCredentials(
            namespace=NAMESPACE,
            name=CLUSTER,
            uid="u1",
            kube=FakeKube(),  # type: ignore[arg-type]
        )
        await credentials.ensure_tls()
        return credentials.ca

    first = await start()
    secret = created[f"{CLUSTER}-agent-tls"]
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "RolloutCluster"
    assert first and first == secret["stringData"]["ca.crt"]
    assert "PRIVATE KEY" not in first
    assert await start() == first
    # Deleted (a rotation): issued anew, under a new CA.
    del created[f"{CLUSTER}-agent-tls"]
    second = await start()
    assert second and second != first


async def test_the_client_refuses_calls_after_close(pod, issued):
    agents = AgentClient()
    address = agent_address(pod_manifest(pod), port=port_of(pod), ca=issued.ca)
    assert address is not None
    assert await agents.state(address) is not None
    await agents.aclose()
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(agents.state(address), 5)
