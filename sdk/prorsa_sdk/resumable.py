"""Generation that survives a role switch: aborted requests resume where they stopped.

When Prorsa flips an engine between prefill and decode, the in-pod agent drains it and,
at the drain deadline, aborts what is still running (``/abort_request``). SGLang then
answers those requests normally, HTTP 200, with ``finish_reason.type == "abort"`` and the
tokens produced so far. :class:`ResumableGeneration` sends the prompt plus that partial
output back through the router (which now routes to the remaining engines) and stitches
the pieces together, so the caller gets one complete answer and no generated token is
lost or generated twice.

Two endpoints, non-streaming:

* SGLang native ``POST /generate``: with ``input_ids`` the resume is token-exact
  (``input_ids + output_ids so far``), which is what RL needs; with ``text`` it resumes
  from ``text + partial text`` (the boundary may tokenize differently).
* OpenAI-compatible ``POST /v1/chat/completions``: the partial answer is appended as an
  assistant message with ``continue_final_message: true`` (SGLang appends it to the
  prompt after the generation prompt). The continuation re-tokenizes the partial text, and
  tool calls / reasoning that straddle the abort are parsed from the last piece only; use
  ``/generate`` when token identity matters.

In both cases the token budget (``max_new_tokens`` / ``max_tokens`` /
``max_completion_tokens``) shrinks by what the resumed request carries (the ids returned).
Resumes are bounded (``max_resumes``). An abort that carried no new token is not a switch's
drain cutting a generation short but an engine refusing the request (SGLang aborts a PD
request whose KV transfer its transport turned away, e.g. Mooncake's TCP "lane queue-full"),
so the resume waits first, with the same capped exponential backoff as a retry, doubling
over consecutive empty aborts: sent at once, the resumes would all be spent in the seconds
the refusal lasts. Transient failures (no partial output) are retried with capped
exponential backoff, bounded by ``max_retries``: connection errors, 5xx, 429,
smg's 404 ``model_not_found``, which a router answers while no worker of the model is
registered (right after the router restarts, until its discovery finds the engines again;
a model name that is simply wrong then fails after the retries), and an engine's 400
"Duplicate request ID" (smg's own retry of a PD pair whose prefill pod went away).

An answer that says ``length`` but stopped short of its token budget is resumed like an
abort: SGLang reports ``length`` only once ``max_new_tokens`` is used up (or the budget
clamped to the context window, which its ``length`` field then names), so a shorter one is
not the answer that was asked for. A PD prefill engine answers that way (one token,
``{"type": "length", "length": 0}``), and a router that routes decode traffic to an engine
that just became prefill would otherwise hand it back as a complete answer.

With ``weight_version``, every request sent (the first, each resume, each retry) carries the
trainer's weight version as SGLang's ``extra_key`` (a field of SGLang 0.5.23's
``GenerateReqInput`` and of its OpenAI-compatible requests). SGLang scopes its prefix cache
and seeds its HiCache storage namespace with it, so KV computed on one version of the
weights is never reused on another, and a request resumed after a role switch on the same
version finds its prefix again. It is read at each send: a request aborted by a weight
update resumes under the new version.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import httpx

log = logging.getLogger("prorsa_sdk")

_BUDGET_KEYS_GENERATE = ("max_new_tokens",)
_BUDGET_KEYS_CHAT = ("max_tokens", "max_completion_tokens")


def weight_version_key(version: int) -> str:
    """The ``extra_key`` of a request generated on weight ``version`` (the version the
    trainer reports in ``weight_update_started``): one prefix-cache namespace per version."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weight version must be an int >= 0, got {version!r}")
    return f"weights-v{version}"


@dataclass(frozen=True, kw_only=True)
class ResumePrefill:
    """The prefill the resumed requests cost, as the engines that served them report it.

    A request a role switch cancelled is sent again as ``prompt + output so far``; the engine
    answers with how many of those tokens it found cached (``meta_info.cached_tokens``:
    its GPU radix cache, its host tier, or the cluster's shared KV store). Without a store
    that survives the flip, a resume on another engine recomputes nearly all of it; with
    ``spec.kvStore`` at most the last partial page (docs/kv-store.md)."""

    resumes: int = 0
    prompt_tokens: int = 0
    """Tokens the resumed requests carried (their prompt plus the output before the cut)."""
    cached_tokens: int = 0
    """Of those, what the engines found cached instead of prefilling."""

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def add(self, meta: Mapping[str, Any]) -> ResumePrefill:
        prompt = int(meta.get("prompt_tokens") or 0)
        cached = min(int(meta.get("cached_tokens") or 0), prompt)
        return replace(
            self,
            resumes=self.resumes + 1,
            prompt_tokens=self.prompt_tokens + prompt,
            cached_tokens=self.cached_tokens + cached,
        )

    def summary(self) -> dict[str, int]:
        """The demo's summary keys (``resume_*``)."""
        return {
            "resume_requests": self.resumes,
            "resume_prompt_tokens": self.prompt_tokens,
            "resume_cached_tokens": self.cached_tokens,
            "resume_recomputed_prefill_tokens": self.recomputed_tokens,
        }


class ResumeExhausted(RuntimeError):
    """Still aborted after ``max_resumes`` resumes; ``partial`` holds everything so far."""

    def __init__(self, message: str, *, partial: dict[str, Any]) -> None:
        super().__init__(message)
        self.partial = partial


class _RequestEvents(Protocol):
    def decode_finished(
        self, trajectory: str, *, output_tokens: int, finish: Any, ts: float | None = None
    ) -> str: ...

    def request_queued(
        self,
        trajectory: str,
        *,
        prompt_tokens: int,
        turn: int,
        request: str | None = None,
        ts: float | None = None,
    ) -> str: ...


def _finish_type(finish: Any) -> str | None:
    if isinstance(finish, Mapping):
        kind = finish.get("type")
        return kind if isinstance(kind, str) else None
    return finish if isinstance(finish, str) else None


def _stopped_short(
    finish: Any, *, generated: int, params: Mapping[str, Any], keys: tuple[str, ...]
) -> bool:
    """A ``length`` finish with budget left: the engine did not finish this request."""
    if _finish_type(finish) != "length":
        return False
    if isinstance(finish, Mapping) and finish.get("length") == generated:
        return False  # the budget SGLang clamped to the context window, all of it used
    budgets = [params[k] for k in keys if isinstance(params.get(k), int)]
    return bool(budgets) and generated < min(budgets)


def _shrink_budget(params: dict[str, Any], keys: tuple[str, ...], used: int) -> bool:
    """Lower the remaining token budget by ``used``; False when nothing is left."""
    for key in keys:
        value = params.get(key)
        if isinstance(value, int):
            params[key] = max(value - used, 0)
            if params[key] == 0:
                return False
    for key in ("min_new_tokens", "min_tokens"):
        value = params.get(key)
        if isinstance(value, int):
            params[key] = max(value - used, 0)
    return True


class ResumableGeneration:
    """Cancel-and-resend for aborted generations, over an ``httpx.AsyncClient``.

    >>> async with httpx.AsyncClient(base_url="http://router:30000", timeout=600) as http:
    ...     gen = ResumableGeneration(http)
    ...     out = await gen.generate({"input_ids": ids, "sampling_params": {...}})

    With ``emitter`` and a ``trajectory`` the helper also reports each resume to Prorsa
    (``decode_finished(finish="abort")`` then ``request_queued`` with the longer prompt), so
    the forecast sees the resent prefill. With ``weight_version`` (called at each send:
    the version of the weights the engines hold now) every request carries it as
    ``extra_key`` (:func:`weight_version_key`).
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        max_resumes: int = 8,
        max_retries: int = 3,
        retry_base: float = 0.2,
        max_retry_delay: float = 10.0,
        emitter: _RequestEvents | None = None,
        weight_version: Callable[[], int] | None = None,
    ) -> None:
        if max_resumes < 0 or max_retries < 0:
            raise ValueError("max_resumes and max_retries must be >= 0")
        self.client = client
        self.max_resumes = max_resumes
        self.max_retries = max_retries
        self.retry_base = retry_base
        self.max_retry_delay = max_retry_delay
        self.emitter = emitter
        self.weight_version = weight_version
        # Totals over this helper's life, for metrics and tests.
        self.resumes = 0
        self.retries = 0
        self.resume_prefill = ResumePrefill()
        """What the resumed requests (not the first sends) cost in prefill."""

    # -- SGLang /generate ----------------------------------------------------------------

    async def generate(
        self,
        payload: Mapping[str, Any],
        *,
        path: str = "/generate",
        trajectory: str | None = None,
        turn: int = 0,
    ) -> dict[str, Any]:
        """POST a single, non-streaming ``/generate`` request, resuming on abort."""
        if payload.get("stream"):
            raise ValueError("ResumableGeneration supports non-streaming requests only")
        if isinstance(payload.get("text"), list) or _is_batch(payload.get("input_ids")):
            raise ValueError("ResumableGeneration supports one prompt per request")
        request = copy.deepcopy(dict(payload))
        pieces: list[dict[str, Any]] = []
        output_ids: list[int] = []
        text = ""
        empty = 0  # consecutive aborts that carried no new token
        for resume in range(self.max_resumes + 1):
            if empty:
                await self._pause(empty)
            out = await self._post(path, request)
            pieces.append(out)
            meta = out.get("meta_info") or {}
            if resume:
                self.resume_prefill = self.resume_prefill.add(meta)
            new_ids = list(out.get("output_ids") or [])
            output_ids.extend(new_ids)
            text += out.get("text") or ""
            # The budget shrinks by what the resumed prompt carries: the ids returned (a
            # piece can count a token it never returned), or, for a text prompt from a
            # server that returns no ids, the tokens behind the text.
            if "input_ids" in request or "output_ids" in out:
                generated = len(new_ids)
            else:
                generated = int(meta.get("completion_tokens") or 0)
            params = dict(request.get("sampling_params") or {})
            finish = meta.get("finish_reason")
            short = _stopped_short(
                finish, generated=generated, params=params, keys=_BUDGET_KEYS_GENERATE
            )
            if _finish_type(finish) != "abort" and not short:
                return _merge_generate(pieces, output_ids=output_ids, text=text)
            if short:
                log.warning(
                    "/generate answered %r after %d of %s tokens; resuming",
                    finish,
                    generated,
                    params.get("max_new_tokens"),
                )
            if not _shrink_budget(params, _BUDGET_KEYS_GENERATE, generated):
                merged = _merge_generate(pieces, output_ids=output_ids, text=text)
                merged["meta_info"]["finish_reason"] = {"type": "length", "length": len(output_ids)}
                return merged
            request["sampling_params"] = params
            if "input_ids" in request:
                request["input_ids"] = list(payload["input_ids"]) + output_ids
            elif "text" in request:
                request["text"] = str(payload["text"]) + text
            else:
                raise ValueError("a /generate payload needs input_ids or text")
            if "rid" in payload:
                request["rid"] = f"{payload['rid']}-resume{resume + 1}"
            empty = 0 if generated else empty + 1
            prompt = int(meta.get("prompt_tokens") or 0)
            self._report(trajectory, turn=turn, partial=generated, prompt=prompt + generated)
            if resume < self.max_resumes:
                log.info("generation aborted after %d tokens; resuming", len(output_ids))
        raise ResumeExhausted(
            f"aborted {self.max_resumes + 1} times",
            partial=_merge_generate(pieces, output_ids=output_ids, text=text),
        )

    # -- OpenAI-compatible chat ----------------------------------------------------------

    async def chat(
        self,
        payload: Mapping[str, Any],
        *,
        path: str = "/v1/chat/completions",
        trajectory: str | None = None,
        turn: int = 0,
    ) -> dict[str, Any]:
        """POST a non-streaming chat completion (``n == 1``), resuming on abort."""
        if payload.get("stream"):
            raise ValueError("ResumableGeneration supports non-streaming requests only")
        if int(payload.get("n") or 1) != 1:
            raise ValueError("ResumableGeneration supports n == 1 only")
        request = copy.deepcopy(dict(payload))
        messages = list(request.get("messages") or [])
        prefix = ""
        if request.get("continue_final_message") and messages:
            last = messages[-1]
            if last.get("role") == "assistant" and isinstance(last.get("content"), str):
                prefix = last["content"]  # the caller's own prefix: keep it in front
                messages = messages[:-1]
        content = ""
        completion = 0
        logprobs: list[Any] = []
        first: dict[str, Any] | None = None
        empty = 0  # consecutive aborts that carried no new token
        for resume in range(self.max_resumes + 1):
            if empty:
                await self._pause(empty)
            out = await self._post(path, request)
            first = first or out
            choice = (out.get("choices") or [{}])[0]
            message = choice.get("message") or {}
            content += message.get("content") or ""
            logprobs.extend(((choice.get("logprobs") or {}).get("content")) or [])
            usage = out.get("usage") or {}
            used = int(usage.get("completion_tokens") or 0)
            if resume:
                # OpenAI's usage: cached tokens under prompt_tokens_details (SGLang reports
                # them with --enable-cache-report).
                details = usage.get("prompt_tokens_details") or {}
                self.resume_prefill = self.resume_prefill.add(
                    {
                        "prompt_tokens": usage.get("prompt_tokens"),
                        "cached_tokens": details.get("cached_tokens"),
                    }
                )
            completion += used
            merged = _merge_chat(first, out, content=content, completion=completion)
            if logprobs:
                merged["choices"][0].setdefault("logprobs", {})["content"] = logprobs
            finish = choice.get("finish_reason")
            short = _stopped_short(finish, generated=used, params=request, keys=_BUDGET_KEYS_CHAT)
            if _finish_type(finish) != "abort" and not short:
                return merged
            if short:
                log.warning("chat completion answered %r after %d tokens; resuming", finish, used)
            if not _shrink_budget(request, _BUDGET_KEYS_CHAT, used):
                merged["choices"][0]["finish_reason"] = "length"
                return merged
            resumed = {"role": "assistant", "content": prefix + content}
            request["messages"] = [*messages, resumed]
            request["continue_final_message"] = True
            request.pop("add_generation_prompt", None)
            empty = 0 if used else empty + 1
            prompt = int(usage.get("prompt_tokens") or 0)
            self._report(trajectory, turn=turn, partial=used, prompt=prompt + used)
            if resume < self.max_resumes:
                log.info("chat completion aborted after %d tokens; resuming", completion)
        raise ResumeExhausted(f"aborted {self.max_resumes + 1} times", partial=merged)

    # -- plumbing ------------------------------------------------------------------------

    def _report(self, trajectory: str | None, *, turn: int, partial: int, prompt: int) -> None:
        self.resumes += 1
        if self.emitter is None or trajectory is None:
            return
        self.emitter.decode_finished(trajectory, output_tokens=partial, finish="abort")
        self.emitter.request_queued(trajectory, prompt_tokens=prompt, turn=turn)

    def _delay(self, attempt: int) -> float:
        """Capped exponential backoff with full jitter, for retries and empty aborts."""
        return random.uniform(0.0, min(self.retry_base * 2**attempt, self.max_retry_delay))

    async def _pause(self, empty: int) -> None:
        """Wait before resuming after ``empty`` aborts in a row that carried no token."""
        delay = self._delay(empty - 1)
        log.info("aborted with no new token %d time(s) in a row; resuming in %.2fs", empty, delay)
        await asyncio.sleep(delay)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST with retries on transient failures (no partial output to keep from those).

        A retry carries a new ``rid`` (``<rid>-retryN``): a request whose connection broke
        (a router restart) may still run at its engine, which refuses a second request with
        the same id (HTTP 400, "Duplicate request ID")."""
        attempt = 0
        while True:
            sent = dict(body)
            if attempt and isinstance(body.get("rid"), str):
                sent["rid"] = f"{body['rid']}-retry{attempt}"
            if self.weight_version is not None:
                sent["extra_key"] = weight_version_key(self.weight_version())
            try:
                r = await self.client.post(path, json=sent)
                r.raise_for_status()
                data = r.json()
                if not isinstance(data, dict):
                    raise ValueError(f"{path} answered {type(data).__name__}, not an object")
                return data
            except (httpx.TransportError, httpx.HTTPStatusError) as exc:
                transient = isinstance(exc, httpx.TransportError) or _transient(exc.response)
                if not transient or attempt >= self.max_retries:
                    raise
                delay = self._delay(attempt)
                log.info("%s failed (%s); retrying in %.2fs", path, exc, delay)
                await asyncio.sleep(delay)
                attempt += 1
                self.retries += 1


def _transient(response: httpx.Response) -> bool:
    """A reply worth sending the request again for (with a new ``rid``): overload, a server
    error, the router's "no worker of this model" (smg 1.13's 404 ``model_not_found``), or
    an engine's 400 "Duplicate request ID detected": smg retries a PD pair whose prefill
    side broke (a prefill pod deleted) with the same ``rid``, and the decode engine still
    holds the first attempt, waiting for KV that will not come."""
    status = response.status_code
    if status == 429 or status >= 500:
        return True
    if status == 400:
        return DUPLICATE_RID in response.text
    if status != 404:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == "model_not_found"


DUPLICATE_RID = "Duplicate request ID"
"""SGLang 0.5.23's refusal of a ``rid`` it already holds (``tokenizer_manager.py``)."""


def _is_batch(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], list)


def _merge_generate(
    pieces: list[dict[str, Any]], *, output_ids: list[int], text: str
) -> dict[str, Any]:
    """One response out of the pieces: ids and text joined, counts summed, last finish."""
    last = pieces[-1]
    merged = copy.deepcopy(last)
    merged["text"] = text
    if any("output_ids" in p for p in pieces):
        merged["output_ids"] = output_ids
    meta = merged.setdefault("meta_info", {})
    first_meta = pieces[0].get("meta_info") or {}
    metas = [p.get("meta_info") or {} for p in pieces]
    meta["completion_tokens"] = sum(int(m.get("completion_tokens") or 0) for m in metas)
    for key in ("prompt_tokens", "cached_tokens", "id"):
        if key in first_meta:
            meta[key] = first_meta[key]
    for key, value in first_meta.items():
        # Per-output-token lists (logprobs, top logprobs, hidden states) concatenate.
        if key.startswith("output_") and isinstance(value, list):
            meta[key] = [x for m in metas for x in (m.get(key) or [])]
    meta["resumes"] = len(pieces) - 1
    return merged


def _merge_chat(
    first: dict[str, Any], last: dict[str, Any], *, content: str, completion: int
) -> dict[str, Any]:
    merged = copy.deepcopy(last)
    merged["id"] = first.get("id", merged.get("id"))
    choice = merged["choices"][0]
    choice.setdefault("message", {"role": "assistant"})["content"] = content
    prompt = int((first.get("usage") or {}).get("prompt_tokens") or 0)
    merged["usage"] = {
        **(merged.get("usage") or {}),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    return merged
