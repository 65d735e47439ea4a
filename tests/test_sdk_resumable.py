"""ResumableGeneration against an engine that aborts mid-generation, over loopback HTTP.

The engine double speaks SGLang 0.5.23's shapes: ``/generate`` returns ``output_ids``,
``text`` and ``meta_info.finish_reason = {"type": "abort", ...}`` with the partial output
(HTTP 200), and ``/v1/chat/completions`` returns ``finish_reason: "abort"`` and honours
``continue_final_message``. Its tokens are a deterministic function of everything before
them, so a resumed generation must equal an uninterrupted one token for token.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web
from conftest import make_spec

from prorsa.clusters import ClusterRegistry
from prorsa.core.controller import Controller
from prorsa.ingest import WebhookServer
from prorsa_sdk import AsyncEventEmitter, ResumableGeneration, ResumeExhausted, weight_version_key


def next_token(seq: list[int]) -> int:
    return (seq[-1] * 31 + len(seq)) % 997 + 3 if seq else 7


@dataclass
class Engine:
    """Cuts the next requests after ``abort_after[i]`` tokens; ``faults`` fail requests."""

    abort_after: list[int | None] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    canned: list[dict[str, Any]] = field(default_factory=list)
    """``/generate`` replies given as they are, before any generated one."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    # The next requests answered as an SGLang PD prefill engine answers: one token,
    # ``{"type": "length", "length": 0}`` (a router that sent decode traffic to it).
    as_prefill: int = 0
    # Called with each request before it is answered (a test's view of the clock).
    before: Callable[[web.Request], Awaitable[None]] | None = None

    def _fault(self, request: web.Request) -> web.Response | None:
        if not self.faults:
            return None
        fault = self.faults.pop(0)
        if fault == "close":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if fault == "duplicate_rid":  # a decode engine still holding smg's first attempt
            message = f"Duplicate request ID detected: {self.requests[-1].get('rid')}"
            return web.json_response({"error": {"message": message}}, status=400)
        if fault == "model_not_found":  # smg 1.13 while no worker of the model is registered
            error = {"type": "invalid_request_error", "code": fault, "message": "Unknown model"}
            return web.json_response({"error": error}, status=404)
        return web.json_response({"detail": "engine unavailable"}, status=int(fault))

    def _budget(self) -> int | None:
        return self.abort_after.pop(0) if self.abort_after else None

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if self.before is not None:
            await self.before(request)
        if (fault := self._fault(request)) is not None:
            return fault
        if self.canned:
            return web.json_response(self.canned.pop(0))
        params = body.get("sampling_params") or {}
        limit = params.get("max_new_tokens", 16)
        # Text mode tokenizes "xxx" as id 3, so text round-trips through token ids.
        text_mode = "input_ids" not in body
        seq = [len(w) for w in body["text"].split()] if text_mode else list(body["input_ids"])
        prompt = len(seq)
        cut = self._budget()
        out: list[int] = []
        finish: dict[str, Any] = {"type": "length", "length": limit}
        if self.as_prefill:
            self.as_prefill -= 1
            limit, finish = 1, {"type": "length", "length": 0}
        while len(out) < limit:
            if cut is not None and len(out) >= cut:
                finish = {"type": "abort", "message": "Abort before role switch"}
                break
            tok = next_token(seq) % 7 + 1 if text_mode else next_token(seq)
            seq.append(tok)
            out.append(tok)
            if tok in params.get("stop_token_ids", []):
                finish = {"type": "stop", "matched": tok}
                break
        text = "".join(" " + "x" * (t if text_mode else t % 7 + 1) for t in out)
        return web.json_response(
            {
                "text": text,
                "output_ids": out,
                "meta_info": {
                    "id": body.get("rid", "r"),
                    "finish_reason": finish,
                    "prompt_tokens": prompt,
                    "completion_tokens": len(out),
                    "cached_tokens": 0,
                    "output_token_logprobs": [[-0.5, t, None] for t in out],
                },
            }
        )

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if self.before is not None:
            await self.before(request)
        if (fault := self._fault(request)) is not None:
            return fault
        messages = list(body["messages"])
        done = 0
        if body.get("continue_final_message") and messages[-1]["role"] == "assistant":
            done = len(messages[-1]["content"].split())
            messages = messages[:-1]
        prompt = sum(len(m["content"].split()) for m in messages) + 4
        limit = body.get("max_tokens", 12)
        cut = self._budget()
        words = []
        finish = "length"
        if self.as_prefill:
            self.as_prefill -= 1
            limit = 1
        for n in range(done, done + limit):
            if cut is not None and len(words) >= cut:
                finish = "abort"
                break
            words.append(f"w{n}" if n == 0 else f" w{n}")
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(words)},
                        "finish_reason": finish,
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt + done,
                    "completion_tokens": len(words),
                    "total_tokens": prompt + done + len(words),
                },
            }
        )


@dataclass
class Running:
    engine: Engine
    http: httpx.AsyncClient


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    engine = Engine()
    app = web.Application()
    app.router.add_post("/generate", engine.generate)
    app.router.add_post("/v1/chat/completions", engine.chat)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        yield Running(engine=engine, http=http)
    await runner.cleanup()


PROMPT = [11, 22, 33, 44, 55]


async def test_generate_resumes_token_exact_after_aborts(running: Running) -> None:
    gen = ResumableGeneration(running.http)
    payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40}, "rid": "req-1"}
    whole = await gen.generate(payload)  # uninterrupted reference
    assert whole["meta_info"]["finish_reason"]["type"] == "length"

    running.engine.requests.clear()
    running.engine.abort_after = [7, 12]  # a role switch aborts it twice
    resumed = await gen.generate(payload)
    assert resumed["output_ids"] == whole["output_ids"]  # no token lost or repeated
    assert resumed["text"] == whole["text"]
    meta = resumed["meta_info"]
    assert meta["completion_tokens"] == 40 and meta["resumes"] == 2
    assert meta["finish_reason"]["type"] == "length"
    assert meta["prompt_tokens"] == len(PROMPT)
    assert [x[1] for x in meta["output_token_logprobs"]] == whole["output_ids"]
    sent = running.engine.requests
    assert [len(r["input_ids"]) for r in sent] == [5, 5 + 7, 5 + 19]
    assert [r["sampling_params"]["max_new_tokens"] for r in sent] == [40, 33, 21]
    assert [r["rid"] for r in sent] == ["req-1", "req-1-resume1", "req-1-resume2"]
    assert payload["input_ids"] == PROMPT  # the caller's payload is untouched
    assert gen.resumes == 2


async def test_a_short_length_answer_is_resumed_not_accepted(running: Running) -> None:
    """A decode request that reached an engine which had just become prefill comes back
    HTTP 200 with one token and ``length`` (chaos suite, restart-router round): that is
    not the answer asked for, and the caller gets the whole one."""
    gen = ResumableGeneration(running.http)
    payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40}}
    whole = await gen.generate(payload)
    running.engine.as_prefill = 1
    resumed = await gen.generate(payload)
    assert resumed["output_ids"] == whole["output_ids"]
    assert resumed["meta_info"]["completion_tokens"] == 40
    assert resumed["meta_info"]["resumes"] == 1
    sent = running.engine.requests[-2:]
    assert [r["sampling_params"]["max_new_tokens"] for r in sent] == [40, 39]

    running.engine.as_prefill = 1
    chat = await gen.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12})
    assert chat["usage"]["completion_tokens"] == 12
    assert chat["choices"][0]["finish_reason"] == "length"


async def test_a_budget_clamped_to_the_context_is_a_finish(running: Running) -> None:
    """SGLang clamps ``max_new_tokens`` to the context window and names the clamped budget
    in ``finish_reason.length``: all of it used is a complete answer."""

    async def clamped(request: httpx.Request) -> httpx.Response:
        finish = {"type": "length", "length": 3}
        meta = {"finish_reason": finish, "prompt_tokens": 5, "completion_tokens": 3}
        return httpx.Response(200, json={"text": "abc", "output_ids": [1, 2, 3], "meta_info": meta})

    async with httpx.AsyncClient(transport=httpx.MockTransport(clamped), base_url="http://e") as h:
        out = await ResumableGeneration(h).generate(
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40}}
        )
    assert out["output_ids"] == [1, 2, 3] and out["meta_info"]["resumes"] == 0


async def test_generate_from_text_resumes_from_prompt_plus_partial_text(running: Running) -> None:
    gen = ResumableGeneration(running.http)
    payload = {"text": "solve this task", "sampling_params": {"max_new_tokens": 10}}
    whole = await gen.generate(payload)
    running.engine.abort_after = [4]
    resumed = await gen.generate(payload)
    assert resumed["text"] == whole["text"]
    partial = "".join(" " + w for w in whole["text"].split()[:4])
    assert running.engine.requests[-1]["text"] == "solve this task" + partial


async def test_stop_inside_the_resumed_piece_is_reported(running: Running) -> None:
    ref = list(PROMPT)
    for _ in range(9):
        ref.append(next_token(ref))
    stop = ref[-1]  # the 9th generated token
    gen = ResumableGeneration(running.http)
    running.engine.abort_after = [3]
    params = {"max_new_tokens": 50, "stop_token_ids": [stop]}
    out = await gen.generate({"input_ids": PROMPT, "sampling_params": params})
    assert out["output_ids"] == ref[len(PROMPT) :]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


async def test_chat_resumes_with_continue_final_message(running: Running) -> None:
    gen = ResumableGeneration(running.http)
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 9}
    whole = await gen.chat(payload)
    running.engine.requests.clear()
    running.engine.abort_after = [4]
    resumed = await gen.chat(payload)
    content = resumed["choices"][0]["message"]["content"]
    assert (
        content == whole["choices"][0]["message"]["content"] == " ".join(f"w{i}" for i in range(9))
    )
    assert resumed["choices"][0]["finish_reason"] == "length"
    assert resumed["usage"]["completion_tokens"] == 9
    assert resumed["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    second = running.engine.requests[1]
    assert second["continue_final_message"] is True
    assert second["messages"][-1] == {"role": "assistant", "content": "w0 w1 w2 w3"}
    assert second["max_tokens"] == 5


async def test_transient_failures_are_retried_with_the_output_so_far(running: Running) -> None:
    gen = ResumableGeneration(running.http, retry_base=0.01)
    payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 20}}
    whole = await gen.generate(payload)
    running.engine.abort_after = [None, 6]  # the faulted request consumes the first entry
    running.engine.faults = ["503", "close"]
    out = await gen.generate(payload)
    assert out["output_ids"] == whole["output_ids"]


async def test_a_retry_carries_a_new_request_id(running: Running) -> None:
    """The first try may still run at the engine after its connection broke (a router
    restart, chaos suite); SGLang refuses a second request with its id (400)."""
    gen = ResumableGeneration(running.http, retry_base=0.01)
    running.engine.faults = ["close", "502"]
    payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}, "rid": "t@0"}
    await gen.generate(payload)
    assert [r["rid"] for r in running.engine.requests] == ["t@0", "t@0-retry1", "t@0-retry2"]


async def test_persistent_failure_raises_after_bounded_retries(running: Running) -> None:
    gen = ResumableGeneration(running.http, max_retries=2, retry_base=0.01)
    running.engine.faults = ["503"] * 5
    before = len(running.engine.requests)
    with pytest.raises(httpx.HTTPStatusError):
        await gen.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}})
    assert len(running.engine.requests) - before == 3


async def test_client_errors_are_not_retried(running: Running) -> None:
    gen = ResumableGeneration(running.http, retry_base=0.01)
    running.engine.faults = ["400"]
    with pytest.raises(httpx.HTTPStatusError):
        await gen.generate({"input_ids": PROMPT})
    assert len(running.engine.requests) == 1


async def test_resumes_are_bounded_and_the_partial_output_is_kept(running: Running) -> None:
    gen = ResumableGeneration(running.http, max_resumes=2)
    running.engine.abort_after = [2, 2, 2, 2]
    with pytest.raises(ResumeExhausted) as info:
        await gen.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30}})
    assert len(running.engine.requests) == 3
    ref = list(PROMPT)
    for _ in range(6):
        ref.append(next_token(ref))
    assert info.value.partial["output_ids"] == ref[len(PROMPT) :]


@pytest.mark.parametrize("endpoint", ["generate", "chat"])
async def test_a_refusal_that_aborts_with_no_token_is_outwaited_not_outrun(
    running: Running, monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    """An engine that aborts every request with no token for a while (a KV transfer its
    transport turns away) is waited out: the resumes back off instead of all being spent
    at once. The wait is counted on a virtual clock (the SDK's sleeps), not the wall."""
    waited: list[float] = []
    real_sleep = asyncio.sleep

    async def virtual_sleep(delay: float) -> None:
        waited.append(delay)
        await real_sleep(0)

    monkeypatch.setattr("prorsa_sdk.resumable.asyncio.sleep", virtual_sleep)
    random.seed(7)
    gen = ResumableGeneration(running.http, max_resumes=16, retry_base=0.2)
    refused_for = 3.0  # virtual seconds during which every request is aborted empty
    engine = running.engine
    engine.abort_after = [0] * 100

    async def until_accepted(request: web.Request) -> None:
        if sum(waited) >= refused_for:
            engine.abort_after.clear()

    engine.before = until_accepted
    if endpoint == "generate":
        out = await gen.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}})
        assert len(out["output_ids"]) == 6
    else:
        out = await gen.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6})
        assert out["choices"][0]["finish_reason"] == "length"
    assert sum(waited) >= refused_for
    assert gen.resumes < 16
    assert all(d <= gen.max_retry_delay for d in waited)


async def test_an_abort_that_made_progress_is_resumed_at_once(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A switch's drain cuts a generation that was producing tokens: no wait."""
    waited: list[float] = []

    async def virtual_sleep(delay: float) -> None:
        waited.append(delay)

    monkeypatch.setattr("prorsa_sdk.resumable.asyncio.sleep", virtual_sleep)
    gen = ResumableGeneration(running.http)
    running.engine.abort_after = [3, 2]
    out = await gen.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}})
    assert len(out["output_ids"]) == 8
    assert waited == []


async def test_streaming_and_batches_are_refused(running: Running) -> None:
    gen = ResumableGeneration(running.http)
    with pytest.raises(ValueError):
        await gen.generate({"input_ids": PROMPT, "stream": True})
    with pytest.raises(ValueError):
        await gen.generate({"input_ids": [PROMPT, PROMPT]})
    with pytest.raises(ValueError):
        await gen.chat({"messages": [], "n": 2})


async def test_resumes_are_reported_to_prorsa(running: Running) -> None:
    """decode_finished(abort) + request_queued(prompt + partial): the resent prefill counts."""
    registry = ClusterRegistry()
    handle = registry.add(namespace="rl", name="c", token="t", controller=Controller(make_spec()))
    async with WebhookServer(registry).serving() as url:
        async with AsyncEventEmitter(
            url=url, namespace="rl", name="c", token="t", track=True
        ) as em:
            gen = ResumableGeneration(running.http, emitter=em)
            em.request_queued("traj", prompt_tokens=len(PROMPT), turn=3)
            em.prefill_started("traj")
            em.prefill_finished("traj")
            running.engine.abort_after = [8]
            await gen.generate(
                {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 20}},
                trajectory="traj",
                turn=3,
            )
            assert await em.flush()
            (row,) = em.snapshot_now().trajectories
            assert (row.state, row.context_tokens, row.turn) == ("ready", len(PROMPT) + 8, 3)
        await asyncio.sleep(0)
        assert handle.controller.live_trajectories()["ready"] == 1
        decision = await handle.tick(now=time.time())
        assert decision.forecast.components.ready == len(PROMPT) + 8


async def test_an_aborted_piece_without_output_ids_costs_no_budget(running: Running) -> None:
    """An aborted piece can count a token it did not return (``completion_tokens`` 1 with
    ``output_ids`` []: the first token of a PD request is the prefill engine's, and an abort
    while its KV is in flight leaves the decode engine with none to send). A token-exact
    resume re-sends only the ids it got, so the budget shrinks by those alone: the answer
    still has its whole budget."""
    running.engine.canned = [
        {
            "text": "",
            "output_ids": [],
            "meta_info": {
                "finish_reason": {"type": "abort", "message": "Abort before role switch"},
                "prompt_tokens": len(PROMPT),
                "completion_tokens": 1,
            },
        }
    ]
    gen = ResumableGeneration(running.http)
    out = await gen.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 20}})
    assert len(out["output_ids"]) == 20
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    sent = running.engine.requests
    assert [r["sampling_params"]["max_new_tokens"] for r in sent] == [20, 20]
    assert [len(r["input_ids"]) for r in sent] == [len(PROMPT), len(PROMPT)]


async def test_a_router_without_workers_of_the_model_yet_is_retried(running: Running) -> None:
    """smg answers 404 ``model_not_found`` while no worker of the model is registered (right
    after it restarts): retried like a 503, bounded; any other 404 is not."""
    gen = ResumableGeneration(running.http, retry_base=0.01)
    payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}}
    running.engine.faults = ["model_not_found", "model_not_found"]
    out = await gen.generate(payload)
    assert len(out["output_ids"]) == 8 and gen.retries == 2
    running.engine.faults = ["model_not_found"] * 5
    with pytest.raises(httpx.HTTPStatusError) as exc:
        await ResumableGeneration(running.http, max_retries=2, retry_base=0.01).generate(payload)
    assert exc.value.response.status_code == 404
    running.engine.faults = ["404"]
    before = len(running.engine.requests)
    with pytest.raises(httpx.HTTPStatusError):
        await gen.generate(payload)
    assert len(running.engine.requests) - before == 1


async def test_a_duplicate_request_id_is_retried_under_a_new_one(running: Running) -> None:
    """A prefill pod deleted under a PD request: smg retries the pair with the same rid, the
    decode engine still holds the first attempt and answers 400 "Duplicate request ID";
    the client sends it again under a new rid. Any other 400 is the caller's error."""
    gen = ResumableGeneration(running.http, retry_base=0.01)
    payload = {"rid": "t@1", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}}
    running.engine.faults = ["duplicate_rid"]
    before = len(running.engine.requests)
    out = await gen.generate(payload)
    assert len(out["output_ids"]) == 8 and gen.retries == 1
    assert [r["rid"] for r in running.engine.requests[before:]] == ["t@1", "t@1-retry1"]
    running.engine.faults = ["400"]
    with pytest.raises(httpx.HTTPStatusError) as exc:
        await gen.generate(payload)
    assert exc.value.response.status_code == 400


async def test_every_request_carries_the_weight_version_it_is_sent_under(running: Running) -> None:
    """SGLang's ``extra_key`` scopes the prefix cache (and HiCache's storage namespace) to
    the weights: a resume after a role switch keeps its version, one after a weight update
    carries the new one, and so does a retry."""

    def loaded() -> int:
        """The first abort is a role switch (same weights); the second a weight update:
        the trainer has loaded version 4 before the second resume is sent."""
        return 3 if len(running.engine.requests) < 2 else 4

    gen = ResumableGeneration(running.http, retry_base=0.01, weight_version=loaded)
    running.engine.abort_after = [4, 5]
    payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 20}, "rid": "r"}
    await gen.generate(payload)
    keys = [r["extra_key"] for r in running.engine.requests]
    assert keys == ["weights-v3", "weights-v3", "weights-v4"]
    assert "extra_key" not in payload  # the caller's payload is untouched

    running.engine.faults = ["503"]  # the retry is sent under the version loaded then
    await gen.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert [r["extra_key"] for r in running.engine.requests[3:]] == ["weights-v4"] * 2


def test_a_weight_version_key_names_one_version() -> None:
    assert weight_version_key(0) == "weights-v0"
    assert weight_version_key(12) != weight_version_key(1)
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ValueError, match="weight version"):
            weight_version_key(bad)  # type: ignore[arg-type]
