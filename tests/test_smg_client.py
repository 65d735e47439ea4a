"""The demo trainer's client of smg: a streamed call answers as a non-streaming one would,
and the trainer reports what it observes (sent, first token) without an instance."""

from __future__ import annotations

import httpx
import pytest

from prorsa_lab.demo.smg_client import SmgClient
from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str | None, str | None]] = []

    def prefill_started(
        self, trajectory: str, *, request: str | None = None, instance: str | None = None
    ) -> str:
        self.calls.append(("prefill_started", trajectory, request, instance))
        return "id"

    def prefill_finished(
        self, trajectory: str, *, request: str | None = None, instance: str | None = None
    ) -> str:
        self.calls.append(("prefill_finished", trajectory, request, instance))
        return "id"


@pytest.mark.parametrize(("incremental", "interval"), [(False, 1), (True, 1), (True, 4)])
async def test_a_streamed_call_returns_the_whole_answer(incremental: bool, interval: int) -> None:
    # A unified engine stands in for smg: same /generate, same stream format.
    config = EngineConfig(
        role="null", incremental_streaming_output=incremental, stream_interval=interval
    )
    events = Recorder()
    async with EngineDouble(config) as engine:
        client = SmgClient(url=engine.url, model="m", emitter=events, incremental=incremental)
        async with httpx.AsyncClient(transport=client, base_url=engine.url) as http:
            reply = await http.post(
                "/generate",
                json={
                    "rid": "traj-1@0",
                    "text": "w " * 30,
                    "sampling_params": {"max_new_tokens": 9},
                },
            )
        await client.aclose()
    body = reply.json()
    assert reply.status_code == 200
    assert len(body["output_ids"]) == 9 and len(body["text"].split()) == 9
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 9}
    assert events.calls == [
        ("prefill_started", "traj-1", "traj-1@0", None),
        ("prefill_finished", "traj-1", "traj-1@0", None),
    ]
    assert client.counters.requests == 1 and client.jobs[0].done is not None
    assert not client.jobs[0].aborted


async def test_an_answer_aborted_before_its_first_token_is_a_prefill_abort() -> None:
    events = Recorder()
    async with EngineDouble(EngineConfig(role="decode")) as engine:
        client = SmgClient(url=engine.url, model="m", emitter=events, incremental=True)
        async with httpx.AsyncClient(transport=client, base_url=engine.url) as http:
            # A decode engine whose prefill peer cannot be reached aborts the request.
            reply = await http.post(
                "/generate",
                json={
                    "rid": "traj-2@0",
                    "text": "w w w",
                    "sampling_params": {"max_new_tokens": 4},
                    "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": 9,
                    "bootstrap_room": 1,
                },
            )
        await client.aclose()
    assert reply.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert client.counters.prefill_aborts == 1 and client.jobs[0].aborted
    assert [c[0] for c in events.calls] == ["prefill_started"]
