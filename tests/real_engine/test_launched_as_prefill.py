"""Engines launched as prefill and flipped to decode: states the operator never makes.

The operator launches every engine as decode (the agent's ``--disaggregation-mode decode``;
admission refuses another launch mode and any ``engine.env`` that would carry one). This
module runs the other states on the real SGLang 0.5.23 and records what SGLang does there:
three engines, one launched as decode and flipped to prefill (the only prefill), one
launched as prefill with the agent's flags (``--disaggregation-decode-enable-radix-cache``
among them) and one launched as prefill without that flag, as a hand-made launch would be;
both prefill-launched engines are flipped to decode and take the same requests through smg,
idle in between (SGLang checks its memory pools when idle,
``srt/managers/scheduler_components/invariant_checker.py``). docs/sglang-role-switch.md,
section 6, says what the results mean: the engine launched as prefill without the decode
radix cache flag dies in SGLang's idle memory check after its first requests. The same
engines time SGLang's own flip, without the agent, both ways (section 7).

A study behind a finding of the docs, not a check of the product (the product never makes
these states, and admission and a unit test hold that): marked ``study``, it is left out of
``make test-engine`` and run by ``make engine-study`` (three more engines, about 8 minutes).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio

from prorsa_agent.config import DECODE_RADIX_CACHE
from prorsa_lab.sglang_cpu.environment import CpuEngineEnv
from prorsa_lab.sglang_cpu.sglang_pod import SglangPod

from .engine_helpers import PdRouter, Timings, running

pytestmark = [
    pytest.mark.real_engine,
    pytest.mark.study,
    pytest.mark.asyncio(loop_scope="module"),
]
TIMINGS = Timings("study")


@pytest.fixture(scope="module", autouse=True)
def _write_timings() -> Iterator[None]:
    yield
    TIMINGS.write()


TOKEN = "agent-token-leak"
KEY = "k-leak"
ADMIN = {"Authorization": f"Bearer {KEY}"}
LEAK = re.compile(r"memory leak detected!.*")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pods(engine_env: CpuEngineEnv, tmp_path_factory) -> AsyncIterator[list[SglangPod]]:
    logs = tmp_path_factory.mktemp("launched-as-prefill")

    def pod(name: str, *flags: str, without: tuple[str, ...] = ()) -> SglangPod:
        return SglangPod(
            env=engine_env,
            instance=name,
            token=TOKEN,
            engine_api_key=KEY,
            log_dir=logs,
            extra_flags=flags,
            without=without,
            # The flips here are SGLang's own, not the agent's: SGLang serves its bootstrap
            # port (behind the agent's gate, it would stay closed to the decode engines).
            bootstrap_gate=False,
        )

    prefill_mode = ("--disaggregation-mode", "prefill")
    started = [
        pod("launched-decode"),
        pod("launched-prefill", *prefill_mode),
        pod("launched-prefill-bare", *prefill_mode, without=(DECODE_RADIX_CACHE,)),
    ]
    async with running(started) as ready:
        yield list(ready)


async def _flip(client: httpx.AsyncClient, pod: SglangPod, role: str) -> None:
    body: dict[str, object] = {"new_role": role}
    if role == "decode":
        body["decode_cuda_graph_memory_gb"] = 0
    for _ in range(20):
        reply = await client.post(f"{pod.engine_url}/pd_role_switch", json=body, headers=ADMIN)
        # The agent's health probe (a one-token generation every 5 s) may be running: SGLang
        # refuses a flip of a busy engine, untouched; ask again, as the agent itself does.
        if reply.status_code != 400 or "not idle" not in reply.text:
            break
        await asyncio.sleep(0.5)
    assert reply.status_code == 200 and reply.json()["success"], reply.text


def _leak(pod: SglangPod) -> str | None:
    assert pod.log_path is not None
    found = LEAK.search(pod.log_path.read_text(errors="replace"))
    return found.group(0)[:400] if found else None


async def test_what_sglang_does_with_prefill_launched_engines_flipped_to_decode(pods):
    launched_decode, launched_prefill, bare = pods
    assert launched_decode.log_path is not None
    router = PdRouter(log_dir=launched_decode.log_path.parent)
    await router.start()
    outcome: dict[str, dict[str, object]] = {}
    try:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            # SGLang's own flip, idle, without the agent: the decode launch both ways twice.
            for role in ("prefill", "decode", "prefill"):
                started = time.monotonic()
                await _flip(client, launched_decode, role)
                TIMINGS.add(f"raw_flip_to_{role}", time.monotonic() - started)
            for pod in (launched_prefill, bare):
                await _flip(client, pod, "decode")
            await router.add(launched_decode, "prefill")
            for decode in (launched_prefill, bare):
                # One decode engine at a time behind smg: each takes every request.
                await router.add(decode, "decode")
                answers = 0
                for i in range(4):
                    body = {
                        "input_ids": [1, 30, 40, 50, 60, 70, 80, 90 + i % 2],
                        "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
                    }
                    try:
                        reply = await client.post(f"{router.url}/generate", json=body)
                    except httpx.HTTPError:
                        break
                    if reply.status_code != 200:
                        break
                    answers += 1
                    await asyncio.sleep(2.0)  # idle: the scheduler checks its pools
                await asyncio.sleep(5.0)
                sup = decode.agent.supervisor if decode.agent else None
                outcome[decode.instance] = {
                    "answers": answers,
                    "leak": _leak(decode),
                    "engine restarts": sup.restarts if sup else None,
                }
                await router.remove(decode)
    finally:
        router.stop()
    print("\nprefill-launched engines flipped to decode:", outcome)
    # The engine launched as decode (the operator's only launch) stays clean.
    assert _leak(launched_decode) is None
    # Launched as prefill without the decode radix cache flag and flipped to decode: SGLang's
    # own idle check finds KV slots that are neither free nor cached, and the engine dies
    # (seen on every run here: "[full] total=16384, available=16336, evictable=41").
    assert outcome[bare.instance]["leak"] is not None, outcome
    # With the agent's flags the prefill launch served every request here; the operator
    # still never makes it (docs/sglang-role-switch.md, section 6).
    assert outcome[launched_prefill.instance]["answers"] == 4, outcome
