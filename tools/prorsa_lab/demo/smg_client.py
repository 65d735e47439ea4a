"""The demo trainer's way to the smg router: every ``/generate`` goes through smg, streamed.

smg picks a prefill and a decode engine, sends both the request with the bootstrap fields,
and answers with the decode engine's reply. The trainer therefore never learns which
prefill engine served a request; what it can observe, it reports:

* ``prefill_started`` (no ``instance``) when it sends the request: from then on the
  request is queued at a prefill engine or being prefilled;
* ``prefill_finished`` (no ``instance``) when the first streamed chunk arrives: the first
  token comes from the decode engine once the KV has arrived, so it marks the end of
  prefill plus transfer.

:class:`SmgClient` is an ``httpx`` transport, so :class:`prorsa_sdk.ResumableGeneration`
posts non-streaming bodies to it as to a router URL: it adds ``model`` (smg serves models by
name under Kubernetes discovery), asks smg for a stream and returns what a non-streaming
call would: the last chunk when the engines stream the whole output so far (SGLang's
default), or every chunk's tokens joined with ``incremental=True`` (engines launched with
``--incremental-streaming-output``, which the demo uses: whole-output chunks cost O(n²)).
The request id carries the trajectory: ``rid = "<trajectory>@<turn>"`` (a resume appends
``-resumeN``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx


class _PrefillEvents(Protocol):
    def prefill_started(
        self, trajectory: str, *, request: str | None = None, instance: str | None = None
    ) -> str: ...

    def prefill_finished(
        self, trajectory: str, *, request: str | None = None, instance: str | None = None
    ) -> str: ...


@dataclass(slots=True)
class PrefillJob:
    """One prompt's stay in the prefill stage (sent, until its first token or an abort)."""

    queued: float
    tokens: int
    done: float | None = None
    aborted: bool = False


# How long a request is sent again while smg answers 503 (no worker of a role to pick).
BUSY_RETRY_SECONDS = 60.0


@dataclass(slots=True)
class SmgCounters:
    requests: int = 0  # /generate posted to smg, resends after an abort included
    prefill_aborts: int = 0  # aborted before any token (in prefill or in the KV transfer)
    decode_aborts: int = 0  # aborted while decoding (partial output returned)
    errors: int = 0  # smg answered an HTTP error or could not be reached
    busy: int = 0  # 503 (no worker of a role: a switch) or not-yet-routable 404s, retried
    # "length" before the budget: a prefill engine's one-token answer to a request routed
    # to it as decode; returned as it came, ResumableGeneration resumes it
    short_answers: int = 0


def prompt_tokens(body: dict[str, Any]) -> int:
    """Tokens of the prompt as the engine counts them (ids, or whitespace-split words)."""
    ids = body.get("input_ids")
    if isinstance(ids, list):
        return len(ids)
    text = body.get("text")
    return len(text.split()) if isinstance(text, str) else 0


def _model_not_found(body: bytes) -> bool:
    """smg's 404 for a model no registered worker serves (yet)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "model_not_found"


def _finish(reply: dict[str, Any]) -> dict[str, Any]:
    finish = (reply.get("meta_info") or {}).get("finish_reason")
    return finish if isinstance(finish, dict) else {}


class SmgClient(httpx.AsyncBaseTransport):
    """``POST /generate`` through smg (module docstring)."""

    def __init__(
        self,
        *,
        url: str,
        model: str,
        emitter: _PrefillEvents | None = None,
        incremental: bool = False,
        timeout: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.emitter = emitter
        self.incremental = incremental
        self.clock = clock
        self.counters = SmgCounters()
        self.jobs: list[PrefillJob] = []
        self._http = httpx.AsyncClient(
            timeout=timeout,
            trust_env=False,
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or request.url.path != "/generate":
            return httpx.Response(404, json={"error": f"no route for {request.url.path}"})
        try:
            body = json.loads(await request.aread())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            return httpx.Response(400, json={"error": str(exc)})
        return await self.generate(body)

    @contextlib.asynccontextmanager
    async def _stream_when_served(self, body: dict[str, Any]) -> AsyncIterator[httpx.Response]:
        """The streamed reply, retrying smg's 503: while the only worker of a role drains
        for a switch, smg has none to pick, and a trainer sends the request again.

        Also its 404 ``model_not_found``, which only a router that has not yet discovered
        the engines answers (just started or restarted). In a cluster the router's Service
        keeps such a router out (its readiness probe is smg's ``/readiness``): the request
        is refused at connect and sent again. Here the trainer reaches smg itself, with no
        Service in between, so it sends the request again on that answer instead.
        """
        deadline = self.clock() + BUSY_RETRY_SECONDS
        delay = 0.25
        while True:
            async with self._http.stream(
                "POST", f"{self.url}/generate", json={**body, "model": self.model, "stream": True}
            ) as reply:
                retry = reply.status_code == 503 or (
                    reply.status_code == 404 and _model_not_found(await reply.aread())
                )
                if not retry or self.clock() + delay > deadline:
                    yield reply
                    return
                self.counters.busy += 1
                await reply.aread()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def generate(self, body: dict[str, Any]) -> httpx.Response:
        self.counters.requests += 1
        rid = str(body.get("rid") or "")
        trajectory = rid.split("@", 1)[0] if "@" in rid else None
        job = PrefillJob(queued=self.clock(), tokens=prompt_tokens(body))
        self.jobs.append(job)
        if self.emitter is not None and trajectory is not None:
            self.emitter.prefill_started(trajectory, request=rid or None)
        last: dict[str, Any] | None = None
        ids: list[Any] = []
        text: list[str] = []
        try:
            async with self._stream_when_served(body) as reply:
                if reply.status_code != 200:
                    self.counters.errors += 1
                    job.done, job.aborted = self.clock(), True
                    content = await reply.aread()
                    return httpx.Response(reply.status_code, content=content)
                async for line in reply.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data:"))
                    if not isinstance(chunk, dict):
                        continue
                    if "error" in chunk:
                        # smg's word that the stream broke (the engine died mid-answer):
                        # what came is not the answer, and [DONE] still follows.
                        raise ValueError(f"the stream broke: {str(chunk['error'])[:200]}")
                    if last is None:
                        self._first_chunk(job, chunk, trajectory, rid)
                    last = chunk
                    ids.extend(chunk.get("output_ids") or [])
                    text.append(str(chunk.get("text") or ""))
        except (httpx.HTTPError, ValueError) as exc:
            self.counters.errors += 1
            job.done, job.aborted = job.done or self.clock(), job.done is None
            return httpx.Response(502, json={"error": f"smg: {exc}"})
        if last is None or not _finish(last):
            # No chunk, or none that finished the answer: a stream cut short.
            self.counters.errors += 1
            job.done, job.aborted = job.done or self.clock(), job.done is None
            what = "no data" if last is None else "a stream that ended before its answer"
            return httpx.Response(502, json={"error": f"smg sent {what}"})
        if self.incremental:
            last = {**last, "output_ids": ids, "text": "".join(text)}
        finish = _finish(last)
        budget = (body.get("sampling_params") or {}).get("max_new_tokens")
        got = len(last.get("output_ids") or [])
        if (
            finish.get("type") == "length"
            and isinstance(budget, int)
            and got < budget
            and finish.get("length") != got
        ):
            self.counters.short_answers += 1
        if finish.get("type") == "abort":
            if last.get("output_ids"):
                self.counters.decode_aborts += 1
            else:
                self.counters.prefill_aborts += 1
        return httpx.Response(200, json=last)

    def _first_chunk(
        self, job: PrefillJob, chunk: dict[str, Any], trajectory: str | None, rid: str
    ) -> None:
        job.done = self.clock()
        if _finish(chunk).get("type") == "abort" and not chunk.get("output_ids"):
            job.aborted = True  # aborted before its KV arrived: no prefill to report
            return
        if self.emitter is not None and trajectory is not None:
            self.emitter.prefill_finished(trajectory, request=rid or None)
