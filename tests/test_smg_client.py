"""The demo trainer's client of smg: a streamed call answers as a non-streaming one would,
and the trainer reports what it observes (sent, first token) without an instance."""

from __future__ import annotations

import json

import httpx
import pytest
from aiohttp import web

from prorsa_lab.demo.smg_client import SmgClient
from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble
from prorsa_sdk import ResumableGeneration, ResumeExhausted


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


async def test_a_prefill_engines_one_token_answer_is_never_taken_as_complete() -> None:
    """smg that routes a decode request to an engine which has become prefill forwards its
    answer: HTTP 200, one token, ``length``. The trainer resumes it and, while every try
    lands there, fails loudly with what it has instead of returning one token."""
    async with EngineDouble(EngineConfig(role="prefill")) as engine:
        client = SmgClient(url=engine.url, model="m", incremental=True)
        async with httpx.AsyncClient(transport=client, base_url=engine.url) as http:
            gen = ResumableGeneration(http, max_resumes=2)
            with pytest.raises(ResumeExhausted) as failed:
                await gen.generate(
                    {
                        "rid": "traj-3@0",
                        "text": "w " * 20,
                        "sampling_params": {"max_new_tokens": 50},
                    }
                )
        await client.aclose()
    assert client.counters.short_answers == 3 and client.counters.requests == 3
    assert failed.value.partial["meta_info"]["resumes"] == 2


async def test_a_router_that_has_not_discovered_the_engines_yet_is_asked_again() -> None:
    """A started or restarted smg answers 404 model_not_found until its discovery has
    registered the engines; in a cluster its Service keeps it out meanwhile (readiness on
    /readiness), here the client sends the request again. Any other 404 is the answer."""
    not_found = 2

    async def generate(request: web.Request) -> web.StreamResponse:
        nonlocal not_found
        if (await request.json())["rid"] == "other@0":
            return web.json_response({"error": "no such route"}, status=404)
        if not_found:
            not_found -= 1
            error = {"type": "invalid_request_error", "code": "model_not_found",
                     "message": "No worker available for model 'm'"}  # fmt: skip
            return web.json_response({"error": error}, status=404)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        chunk = {"text": " t1", "output_ids": [1],
                 "meta_info": {"finish_reason": {"type": "length", "length": 1}}}  # fmt: skip
        await stream.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return stream

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = SmgClient(url=url, model="m")
    try:
        async with httpx.AsyncClient(transport=client, base_url=url) as http:
            body = {"rid": "t@0", "text": "w", "sampling_params": {"max_new_tokens": 1}}
            reply = await http.post("/generate", json=body)
            assert reply.status_code == 200 and reply.json()["output_ids"] == [1]
            assert client.counters.busy == 2
            reply = await http.post("/generate", json=body | {"rid": "other@0"})
            assert reply.status_code == 404 and client.counters.busy == 2
    finally:
        await client.aclose()
        await runner.cleanup()


@pytest.mark.parametrize(
    "tail",
    [
        b'data: {"error": {"message": "Stream error: unexpected EOF", "type": "stream_error"}}'
        b"\n\ndata: [DONE]\n\n",
        b"data: [DONE]\n\n",
        b"",
    ],
    ids=["smg-stream-error", "done-without-finish", "cut-off"],
)
async def test_a_stream_that_breaks_off_is_a_failure_not_a_short_answer(tail: bytes) -> None:
    """Found by `prorsa bench chaos`: when the decode engine dies mid-answer, smg sends an
    error chunk and then [DONE]; the client returned the tokens so far as the whole answer
    (asked 1346, got 513, nothing resumed). A stream that never finishes its answer is a
    502, which ResumableGeneration sends again."""

    async def generate(request: web.Request) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        chunk = {"text": " t1 t2", "output_ids": [1, 2], "meta_info": {"finish_reason": None}}
        await stream.write(f"data: {json.dumps(chunk)}\n\n".encode() + tail)
        return stream

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = SmgClient(url=url, model="m", incremental=True)
    try:
        async with httpx.AsyncClient(transport=client, base_url=url) as http:
            body = {"rid": "t@0", "text": "w", "sampling_params": {"max_new_tokens": 9}}
            reply = await http.post("/generate", json=body)
        assert reply.status_code == 502, reply.text
        assert client.counters.errors == 1
    finally:
        await client.aclose()
        await runner.cleanup()
