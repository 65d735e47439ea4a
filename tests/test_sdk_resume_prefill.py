"""What a resume costs in prefill, per switch, before and after the shared KV store.

A generation is cut at a switch's drain deadline (``/abort_request``) on one engine double
and :class:`prorsa_sdk.ResumableGeneration` resends it to another engine, which reports how
much of ``prompt + output so far`` it found cached. Without a store (before) the other
engine recomputes all of it; with ``spec.kvStore`` (after) at most the last partial page.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble, TimingModel
from prorsa_sdk import ResumableGeneration, ResumePrefill

PAGE = 16
PROMPT = list(range(10, 310))  # 300 tokens: above SGLang's store prefetch threshold (256)
NEW = 80


async def _cut_and_resume(store: Path | None) -> tuple[ResumePrefill, dict]:
    config = EngineConfig(
        role="null",
        kv_store_dir=str(store) if store is not None else None,
        kv_page_size=PAGE,
        timing=TimingModel(decode_step_seconds=0.005),
    )
    async with (
        EngineDouble(config) as first,
        EngineDouble(config) as other,
        httpx.AsyncClient(base_url=first.url, timeout=30) as http,
        httpx.AsyncClient() as control,
    ):
        gen = ResumableGeneration(http, weight_version=lambda: 3)
        body = {"input_ids": PROMPT, "rid": "t1", "sampling_params": {"max_new_tokens": NEW}}
        task = asyncio.create_task(gen.generate(body))
        while not (await http.get("/v1/loads")).json()["loads"][0]["num_running_reqs"]:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.15)  # some tokens out
        http.base_url = httpx.URL(other.url)  # the router now sends it elsewhere
        await control.post(f"{first.url}/abort_request", json={"rid": "t1"})
        out = await task
    return gen.resume_prefill, out


@pytest.mark.parametrize("shared", [False, True], ids=["before: no store", "after: kvStore"])
async def test_a_resume_recomputes_the_context_before_and_one_page_after(
    shared: bool, tmp_path: Path
) -> None:
    cost, out = await _cut_and_resume(tmp_path / "kv" if shared else None)
    assert out["meta_info"]["resumes"] == 1 and len(out["output_ids"]) == NEW
    assert cost.resumes == 1
    assert cost.prompt_tokens > len(PROMPT)  # the prompt and the output before the cut
    if shared:
        assert 0 < cost.recomputed_tokens <= PAGE
    else:
        assert cost.recomputed_tokens == cost.prompt_tokens
    summary = cost.summary()
    assert summary["resume_recomputed_prefill_tokens"] == cost.recomputed_tokens
    assert (
        summary["resume_cached_tokens"] + cost.recomputed_tokens == summary["resume_prompt_tokens"]
    )
