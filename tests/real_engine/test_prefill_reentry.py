"""An engine that leaves prefill and comes back, with a decode engine that served with it
before: the agent's bootstrap gate (prorsa_agent.bootstrap_gate) against SGLang 0.5.23.

SGLang's decode engine keeps the prefill ranks' ports and its own KV registration per
prefill bootstrap address; a flip builds the prefill's KV manager anew on other ports, and
without the gate the next request pairing the two waited for SGLang's 300 s waiting timeout
(the operator test's final request hung so in CI, after the operator flipped an engine
prefill -> decode -> prefill within 3 s). Two engines of this module's own, launched by
their agents as an engine pod's are, behind the real smg; every flip goes through the agent.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio

from prorsa_lab.sglang_cpu.environment import CpuEngineEnv
from prorsa_lab.sglang_cpu.sglang_pod import SglangPod

from .engine_helpers import PdRouter, Timings, reference_output, running
from .shared_cluster import PROMPT

pytestmark = [pytest.mark.real_engine, pytest.mark.asyncio(loop_scope="module")]
TIMINGS = Timings("reentry")
TOKEN = "agent-token-reentry"
HOLD = 15.0  # SGLang's heartbeat: 2 failed checks 5 s apart, and one more interval


@pytest.fixture(scope="module", autouse=True)
def _write_timings() -> Iterator[None]:
    yield
    TIMINGS.write()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pods(
    engine_env: CpuEngineEnv, engines_stopped: None, tmp_path_factory
) -> AsyncIterator[tuple[SglangPod, SglangPod, PdRouter]]:
    logs = tmp_path_factory.mktemp("reentry")
    pair = [
        SglangPod(env=engine_env, instance=name, token=TOKEN, engine_api_key="k-reentry",
                  log_dir=logs)
        for name in ("reentry-x", "reentry-d")
    ]  # fmt: skip
    async with running(pair) as ready:
        router = PdRouter(log_dir=logs)
        await router.start()
        try:
            yield ready[0], ready[1], router
        finally:
            router.stop()


async def _flip(client: httpx.AsyncClient, pod: SglangPod, role: str) -> float:
    started = time.monotonic()
    reply = await client.post(
        f"{pod.agent_url}/v1/role",
        json={"role": role},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert reply.status_code == 200 and reply.json()["ok"], reply.text
    return time.monotonic() - started


async def _answer(client: httpx.AsyncClient, router: PdRouter, env: CpuEngineEnv) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    reply = await client.post(f"{router.url}/generate", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["output_ids"] == await reference_output(env, PROMPT, 8)


async def test_a_decode_engine_pairs_with_an_engine_back_in_prefill(pods, engine_env):
    x, d, router = pods
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        await _flip(client, x, "prefill")
        await router.add(x, "prefill")
        await router.add(d, "decode")
        await _answer(client, router, engine_env)  # d now keeps x's ports and registration

        await router.remove(x)
        await _flip(client, x, "decode")
        gate = f"http://{x.host}:{x.bootstrap_port}/health"
        assert (await client.get(gate)).status_code == 503  # d's heartbeats now fail
        back = await _flip(client, x, "prefill")
        TIMINGS.add("flip_back_to_prefill", back)
        assert (await client.get(gate)).status_code == 200
        await router.add(x, "prefill")
        # Within the 120 s the client waits: SGLang alone answered only after its 300 s.
        started = time.monotonic()
        await _answer(client, router, engine_env)
        TIMINGS.add("first_answer_after_reentry", time.monotonic() - started)
    d_log = d.log_path.read_text(errors="replace") if d.log_path else ""
    assert "Timed out" not in d_log and "KVTransferError" not in d_log
