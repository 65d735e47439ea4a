"""What the real smg 1.13.0 does with a request while no prefill worker is listed.

Every engine pod the operator deploys starts as decode, so until the bootstrap's first flip
is listed the router of a fresh cluster has decode workers only. smg in PD mode then
refuses ``/generate`` at once, HTTP 503 ``no_available_workers`` with ``Retry-After: 1``: it
neither queues the request nor hands it to a decode engine, and its ``/readiness`` (the
router Deployment's readiness probe) fails, so a Service keeps the router out. The SDK
retries such a reply a few times and then gives up. That is why the Ready condition waits
for a serving pair (``prorsa.core.readiness``) and the simulator's trainer waits for Ready
instead of queueing its prompts at the router.

smg runs here with its worker given on the command line (``--decode URL``) rather than
found by Kubernetes discovery: the same PD router serves both, and a module without the
API emulator starts in seconds. Skipped when the ``smg`` binary is not installed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from prorsa_lab.doubles.kubelet import free_port
from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble
from prorsa_lab.doubles.smg_router import SmgRouter, smg_binary, worker_types
from prorsa_sdk.resumable import ResumableGeneration

pytestmark = [
    pytest.mark.skipif(smg_binary() is None, reason="the smg binary is not installed"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.slow,  # the real smg
]
MODEL = "prorsa/engine-double"  # the double's served model name
BODY = {"model": MODEL, "text": "w " * 50, "sampling_params": {"max_new_tokens": 4}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def decode_only(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[SmgRouter, EngineDouble]]:
    """smg in PD mode with one decode engine double and no prefill worker."""
    binary = smg_binary()
    assert binary is not None
    logs = Path(tmp_path_factory.mktemp("smg-no-prefill"))
    async with EngineDouble(EngineConfig(role="decode")) as engine:
        port = free_port()
        router = SmgRouter(
            binary=binary,
            args=[
                "launch",
                "--pd-disaggregation",
                "--decode",
                engine.url,
                "--policy",
                "cache_aware",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--prometheus-port",
                str(free_port()),
            ],
            kubeconfig=str(logs / "no-kubeconfig"),
            port=port,
            log_path=logs / "smg.log",
        )
        router.start()
        try:
            await router.wait_workers(
                lambda ws: "decode" in worker_types(ws).values(), what="smg listing the decode"
            )
            yield router, engine
        finally:
            router.stop()


async def test_smg_refuses_at_once_with_503_while_no_prefill_worker_is_listed(
    decode_only: tuple[SmgRouter, EngineDouble],
) -> None:
    router, engine = decode_only
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        reply = await client.post(f"{router.url}/generate", json=BODY | {"rid": "no-prefill"})
        ready = await client.get(f"{router.url}/readiness")
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "no_available_workers"
    assert "prefill" in reply.json()["error"]["message"]
    assert reply.headers.get("retry-after") == "1"
    # Not queued, not sent to the decode engine: nothing reached an engine.
    assert engine.counters().requests_received == 0
    # The router Deployment's readiness probe (/readiness) fails: a Service keeps it out.
    assert ready.status_code == 503, ready.text


async def test_the_sdk_retries_the_refusal_and_then_gives_up(
    decode_only: tuple[SmgRouter, EngineDouble],
) -> None:
    router, engine = decode_only
    async with httpx.AsyncClient(base_url=router.url, trust_env=False, timeout=30) as client:
        gen = ResumableGeneration(client, retry_base=0.01)
        with pytest.raises(httpx.HTTPStatusError) as refused:
            await gen.generate(BODY | {"rid": "sdk-no-prefill"})
    assert refused.value.response.status_code == 503
    assert gen.retries == gen.max_retries == 3
    assert engine.counters().requests_received == 0
