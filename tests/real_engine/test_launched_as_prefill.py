"""An engine launched as prefill and flipped to decode: the state the operator never makes.

The operator launches every engine as decode (the agent's ``--disaggregation-mode decode``,
``prorsa.core.engine_flags`` refuses another launch mode at admission). This test shows
why, on the real SGLang 0.5.23: an engine launched as prefill, flipped to decode and given
a few requests through smg fails SGLang's own idle memory check (``pool memory leak
detected!``, ``srt/managers/scheduler_components/invariant_checker.py``) and dies, while an
engine launched as decode takes the same requests and flips back and forth
(``test_agent_sglang.py``). docs/sglang-role-switch.md, "Launched as prefill", says what
differs between the two states in SGLang's code.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from prorsa_lab.sglang_cpu.environment import CpuEngineEnv
from prorsa_lab.sglang_cpu.sglang_pod import SglangPod

from .engine_helpers import PdRouter, running

pytestmark = [pytest.mark.real_engine, pytest.mark.asyncio(loop_scope="module")]

TOKEN = "agent-token-leak"
ADMIN = {"Authorization": "Bearer k-leak"}
LEAK = re.compile(r"pool memory leak detected! ?(.*)")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pods(engine_env: CpuEngineEnv, tmp_path_factory) -> AsyncIterator[list[SglangPod]]:
    logs = tmp_path_factory.mktemp("launched-as-prefill")
    launched_prefill = SglangPod(
        env=engine_env,
        instance="launched-prefill",
        token=TOKEN,
        engine_api_key="k-leak",
        log_dir=logs,
        extra_flags=("--disaggregation-mode", "prefill"),
    )
    launched_decode = SglangPod(
        env=engine_env,
        instance="launched-decode",
        token=TOKEN,
        engine_api_key="k-leak",
        log_dir=logs,
    )
    async with running([launched_prefill, launched_decode]) as started:
        yield list(started)


async def test_a_prefill_launched_engine_flipped_to_decode_fails_its_idle_check(pods):
    launched_prefill, launched_decode = pods
    router = PdRouter(log_dir=launched_prefill.log_path.parent)  # type: ignore[union-attr]
    await router.start()
    try:
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            # Swap: the decode-launched engine serves prefill, the prefill-launched decode.
            for pod, role in ((launched_decode, "prefill"), (launched_prefill, "decode")):
                body: dict[str, object] = {"new_role": role}
                if role == "decode":
                    body["decode_cuda_graph_memory_gb"] = 0
                reply = await client.post(
                    f"{pod.engine_url}/pd_role_switch", json=body, headers=ADMIN
                )
                assert reply.status_code == 200, reply.text
            await router.add(launched_decode, "prefill")
            await router.add(launched_prefill, "decode")
            # The same prompt again and again, idle in between (the idle check runs then):
            # from the second request on, the decode side's radix cache holds the prompt and
            # the prefill side sends only the rest (``decode_prefix_len``).
            answers = 0
            body = {
                "input_ids": [1, 30, 40, 50, 60, 70, 80, 90],
                "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
            }
            for _ in range(4):
                try:
                    reply = await client.post(f"{router.url}/generate", json=body, timeout=60)
                except httpx.HTTPError:
                    break
                if reply.status_code != 200:
                    break
                answers += 1
                await asyncio.sleep(2.0)
            # The idle check runs on the next idle scheduler step.
            deadline = time.monotonic() + 60
            found = None
            while time.monotonic() < deadline and found is None:
                found = LEAK.search(launched_prefill.log_path.read_text(errors="replace"))  # type: ignore[union-attr]
                await asyncio.sleep(1.0)
            print(f"answers before the failure: {answers}; leak: {found and found.group(0)}")
            assert found is not None, "no leak reported:\n" + launched_prefill.log_tail(30)
            # The decode-launched engine (now prefill) took the same requests and is fine.
            assert "memory leak" not in launched_decode.log_path.read_text(errors="replace")  # type: ignore[union-attr]
    finally:
        router.stop()
