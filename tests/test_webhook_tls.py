"""The trainer webhook over HTTPS on loopback, with the SDK verifying its certificate.

Throwaway certificates (a CA and a serving certificate for 127.0.0.1) are made per test
module. The SDK must deliver with the CA bundle it is given, and refuse (deliver nothing,
keep retrying) a certificate its trust store does not vouch for: the system store's
default, or another CA. ``prorsa ingest`` serves HTTPS from files and refuses plain HTTP
off loopback unless told to; the operator serves it from its ``--webhook-tls-dir``.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import make_spec
from test_ingest_cli import CLUSTER, Proc

from prorsa.clusters import ClusterRegistry, WebhookCluster
from prorsa.core.controller import Controller
from prorsa.ingest import WebhookServer
from prorsa_contract.serving_tls import ServingCert
from prorsa_lab.doubles.stack import cluster_manifest, stack, write_webhook_cert
from prorsa_sdk import AsyncEventEmitter, EventEmitter, RetryBackoff

TOKEN = "tok-tls"
FAST = RetryBackoff(base=0.01, cap=0.05)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("webhook-tls")
    write_webhook_cert(str(directory))
    return directory


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("other-tls")
    write_webhook_cert(str(directory))
    return directory / "ca.crt"


class Served:
    def __init__(self, url: str, handle: WebhookCluster) -> None:
        self.url, self.handle = url, handle


@pytest.fixture
async def served(certs: Path) -> AsyncIterator[Served]:
    registry = ClusterRegistry()
    handle = registry.add(namespace="rl", name="c", token=TOKEN, controller=Controller(make_spec()))
    tls = ServingCert(cert_file=certs / "tls.crt", key_file=certs / "tls.key")
    async with WebhookServer(registry).serving(ssl_context=tls.context) as url:
        yield Served(url, handle)


def emitter_args(url: str) -> dict:
    return {"url": url, "namespace": "rl", "name": "c", "token": TOKEN, "backoff": FAST}


async def test_the_async_emitter_delivers_over_https_trusting_the_given_ca(served, certs):
    assert served.url.startswith("https://127.0.0.1:")
    async with AsyncEventEmitter(**emitter_args(served.url), verify=certs / "ca.crt") as em:
        for i in range(5):
            em.request_queued(f"t{i}", prompt_tokens=100, turn=0)
        await em.flush(timeout=10)
        assert em.stats.sent == 5
    assert served.handle.applied == 5


async def test_the_threaded_emitter_delivers_over_https_trusting_the_given_ca(served, certs):
    em = EventEmitter(**emitter_args(served.url), verify=str(certs / "ca.crt"))
    try:
        em.request_queued("t1", prompt_tokens=100, turn=0)
        await asyncio.to_thread(em.flush, timeout=10)
        assert em.stats.sent == 1
    finally:
        await asyncio.to_thread(em.close)
    assert served.handle.applied == 1


@pytest.mark.parametrize("trust", ["system", "other CA"])
async def test_the_emitter_refuses_a_certificate_it_cannot_verify(served, other_ca, trust):
    """Nothing reaches the webhook: the token is never sent to an unverified server."""
    verify = None if trust == "system" else other_ca
    async with AsyncEventEmitter(**emitter_args(served.url), verify=verify) as em:
        em.request_queued("t1", prompt_tokens=100, turn=0)
        deadline = time.monotonic() + 10
        while em.stats.retries < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert em.stats.retries >= 3 and em.stats.sent == 0
        await em.aclose(timeout=0.2)
    assert served.handle.applied == 0 and served.handle.batches == 0


def test_a_missing_ca_bundle_is_refused_at_once(tmp_path):
    with pytest.raises(ValueError, match="no CA bundle"):
        EventEmitter(**emitter_args("https://127.0.0.1:1"), verify=tmp_path / "none.pem")
    with pytest.raises(ValueError, match="no CA bundle"):
        AsyncEventEmitter(**emitter_args("https://127.0.0.1:1"), verify=tmp_path / "none.pem")


async def test_plain_http_to_the_tls_port_is_refused(served):
    plain = served.url.replace("https://", "http://")
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(httpx.HTTPError):
            await client.get(f"{plain}/healthz")


@pytest.fixture
def cli_files(tmp_path: Path) -> tuple[Path, Path]:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER))
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    return cluster, token


def test_ingest_serves_https_from_files(cli_files, certs):
    cluster, token = cli_files
    proc = Proc(
        "-m", "prorsa.cli", "ingest", "--cluster", str(cluster), "--listen", "127.0.0.1:0",
        "--token-file", str(token), "--tick", "5",
        "--tls-cert-file", str(certs / "tls.crt"), "--tls-key-file", str(certs / "tls.key"),
    )  # fmt: skip
    try:
        url = proc.expect(r"serving rl/qwen3-coder on (https://127\.0\.0\.1:\d+)").group(1)
        context = ssl.create_default_context(cafile=certs / "ca.crt")
        reply = httpx.get(f"{url}/healthz", verify=context, timeout=5)
        assert reply.status_code == 200
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/healthz", timeout=5)
    finally:
        proc.kill()


def test_ingest_refuses_plain_http_off_loopback_unless_told(cli_files, certs):
    cluster, token = cli_files

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "prorsa.cli", "ingest", "--cluster", str(cluster),
             "--token-file", str(token), *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    r = run("--listen", "0.0.0.0:0")
    assert r.returncode == 2 and "--insecure-plain-http" in r.stderr, r.stderr
    r = run("--listen", "127.0.0.1:0", "--tls-cert-file", str(certs / "tls.crt"))
    assert r.returncode == 2 and "go together" in r.stderr
    r = run(
        "--listen", "127.0.0.1:0", "--tls-cert-file", str(certs / "nope.crt"),
        "--tls-key-file", str(certs / "tls.key"),
    )  # fmt: skip
    assert r.returncode == 2 and "cannot load the TLS certificate" in r.stderr


@pytest.mark.slow  # the whole operator: left out by `make test-fast`
async def test_the_operator_webhook_serves_https_and_the_sdk_verifies_it():
    async with stack(webhook_tls=True, tick_seconds=1.0) as env:
        assert env.webhook.startswith("https://") and env.webhook_ca is not None
        await env.create_cluster(cluster_manifest())
        ok = await env.wait_for(
            lambda: _accepted(env), timeout=30, what="the webhook to accept the cluster's events"
        )
        assert ok
        async with AsyncEventEmitter(
            url=env.webhook,
            namespace=env.namespace,
            name="demo",
            token=env.token,
            verify=env.webhook_ca,
            backoff=FAST,
        ) as em:
            em.request_queued("sdk-1", prompt_tokens=100, turn=0)
            await em.flush(timeout=10)
            assert em.stats.sent == 1 and em.stats.dropped == 0
        assert re.search(r"^prorsa_", await env.metrics(), re.M)  # /metrics over HTTPS too
        async with httpx.AsyncClient(timeout=5) as client:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await client.get(f"{env.webhook}/healthz")


async def _accepted(env) -> bool:
    reply = await env.post([env.event("request_queued", "probe", prompt_tokens=10, turn=0)])
    return reply.status_code == 200


async def test_the_verl_example_verifies_the_webhook_with_its_ca_file(
    served, certs, other_ca, monkeypatch, tmp_path
):
    """PRORSA_CA_FILE reaches both the example's emitters and its own status call."""
    from test_verl_example import install_fake_verl, load_example

    install_fake_verl(monkeypatch)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    for key, value in {
        "PRORSA_URL": served.url,
        "PRORSA_NAMESPACE": "rl",
        "PRORSA_CLUSTER": "c",
        "PRORSA_TOKEN_FILE": str(token),
        "PRORSA_CA_FILE": str(certs / "ca.crt"),
    }.items():
        monkeypatch.setenv(key, value)
    example = load_example()
    async with AsyncEventEmitter(**example._settings(), backoff=FAST) as em:
        em.request_queued("v1", prompt_tokens=100, turn=0)
        em.prefill_finished("v1")
        await em.flush(timeout=10)
    assert served.handle.applied == 2
    assert await example._reprefilling() == 1  # one trajectory decoding, over HTTPS
    monkeypatch.setenv("PRORSA_CA_FILE", str(other_ca))
    assert await example._reprefilling() == 0  # unverified: unknown, reported as 0
