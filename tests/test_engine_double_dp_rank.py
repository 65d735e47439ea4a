"""The engine double places requests on attention-DP ranks as SGLang 0.5.23 does.

Without a rank in the request its DP controller round-robins (the method an engine launched
as decode resolves to, and keeps after a flip); smg ``--dp-aware`` sends ``routed_dp_rank``
(``data_parallel_rank`` is the deprecated alias), which the DP controller honours and the
tokenizer manager checks against the engine's ranks first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as c:
        yield c


async def prefilled(client: httpx.AsyncClient, url: str) -> list[int]:
    """Prompt tokens each rank has prefilled (``total_prefill_uncached_tokens``)."""
    reply = await client.get(f"{url}/v1/loads", params={"include": "core"})
    return [load["total_prefill_uncached_tokens"] for load in reply.json()["loads"]]


async def generate(client: httpx.AsyncClient, url: str, words: int, **extra: object) -> int:
    body = {"text": "w " * words, "sampling_params": {"max_new_tokens": 1}, **extra}
    reply = await client.post(f"{url}/generate", json=body)
    return reply.status_code


async def test_requests_without_a_rank_go_round_robin(client: httpx.AsyncClient) -> None:
    async with EngineDouble(EngineConfig(role="null", dp_size=2)) as engine:
        for words in (100, 10, 100, 10):
            assert await generate(client, engine.url, words) == 200
        first, second = await prefilled(client, engine.url)
        assert first > 150 and 0 < second < 50  # 100 + 100 on rank 0, 10 + 10 on rank 1


async def test_a_routed_rank_is_honoured_and_leaves_the_round_robin_alone(
    client: httpx.AsyncClient,
) -> None:
    async with EngineDouble(EngineConfig(role="null", dp_size=2)) as engine:
        assert await generate(client, engine.url, 100, routed_dp_rank=1) == 200
        assert await generate(client, engine.url, 100, data_parallel_rank=1) == 200
        assert (await prefilled(client, engine.url))[0] == 0
        # The router's placements did not advance the round robin: rank 0 is next.
        assert await generate(client, engine.url, 10) == 200
        first, second = await prefilled(client, engine.url)
        assert 0 < first < 50 and second > 150


async def test_a_rank_outside_the_engine_is_refused(client: httpx.AsyncClient) -> None:
    async with EngineDouble(EngineConfig(role="null", dp_size=2)) as engine:
        reply = await client.post(f"{engine.url}/generate", json={"text": "w", "routed_dp_rank": 2})
        assert reply.status_code == 400
        assert "routed_dp_rank=2 out of range [0, 2)" in reply.text
        assert await prefilled(client, engine.url) == [0, 0]
    async with EngineDouble(EngineConfig(role="null", dp_size=1)) as engine:
        # Rank 0 of a single-rank engine is ignored, not refused.
        assert await generate(client, engine.url, 5, routed_dp_rank=0) == 200
