"""``prorsa profile``: measure ``capacity.*`` against a running engine; print the snippet.

Speaks SGLang 0.5.23's own endpoints, so it measures a real engine or the engine double
alike: ``GET /server_info`` (launch arguments, mode, version), ``GET /v1/loads`` (each
attention-DP rank's KV pool, running and waiting requests, and the cumulative counters
``total_prefill_uncached_tokens``, ``total_prefill_busy_us`` and ``decode_moments``, the
engine's own busy time, so HTTP and queueing are not measured) and ``POST /generate``
(``input_ids`` of random tokens, unique per request so no prefix is cached). Point it at
one idle engine launched as the RolloutCluster's are (model, parallelism, memory flags)
but without ``--disaggregation-mode``: such an engine serves ``/generate`` alone.

Prefill: uncached prompts of doubling length, many at once; the busy time per token
against the prompt length gives θ_P and L (:mod:`prorsa.core.capacity_profile`). Decode:
batches of 1, 2, 4, ... requests of ``--decode-context`` tokens decoding together, up to
what the KV pool holds; tokens/s of each (from ``decode_moments``, else the KV pool's
growth) gives the knee, then bisection between the two batches around it. Progress goes to
stderr, the snippet to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

    from prorsa.core.capacity_profile import PrefillFit, PrefillPoint

HELP = "measure capacity.* of a running SGLang engine and print the RolloutCluster snippet"
TOKEN_IDS = (3, 500)  # random prompt tokens from here: inside any model's vocabulary


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        required=True,
        help="the engine's HTTP address (one engine, not the router), e.g. http://10.0.0.7:30000",
    )
    parser.add_argument(
        "--api-key-file", type=Path, help="file holding the engine's --api-key, if it has one"
    )
    parser.add_argument(
        "--decode-context",
        type=int,
        default=8192,
        metavar="TOKENS",
        help="prompt tokens of each decoding request (default 8192; lowered to what the KV "
        "pool holds 16 of)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=65536,
        metavar="TOKENS",
        help="longest prompt of the prefill ladder (default 65536, within the context)",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how long each decode batch is measured (default 2)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, metavar="SECONDS", help="per request"
    )
    parser.add_argument("--seed", type=int, default=0, help="of the random prompts")


class ProfileError(Exception):
    """The engine cannot be profiled (unreachable, busy, in a PD role, ...)."""


def _say(message: str) -> None:
    print(f"prorsa profile: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Engine:
    """What ``/server_info`` and ``/v1/loads`` say of the engine before measuring."""

    version: str
    model: str
    mode: str
    ranks: int
    kv_pool: int  # tokens, all ranks
    max_running: int  # requests, all ranks
    chunk: int  # chunked-prefill size of a rank
    max_input: int  # longest prompt it takes


@dataclass(frozen=True, slots=True)
class Reading:
    at: float
    loads: list[dict[str, Any]]

    def total(self, key: str) -> float:
        return float(sum(load.get(key) or 0 for load in self.loads))


class Probe:
    """The HTTP side: reads and generations against one engine."""

    def __init__(self, client: httpx.AsyncClient, *, seed: int) -> None:
        self.client = client
        self.rng = random.Random(seed)

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        import httpx

        try:
            r = await self.client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise ProfileError(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise ProfileError(f"{method} {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    async def engine(self) -> Engine:
        info = await self._json("GET", "/server_info")
        loads = (await self.read()).loads
        state = (info.get("internal_states") or [{}])[0]
        mode = str(state.get("disaggregation_mode") or info.get("disaggregation_mode") or "null")
        chunk = int(info.get("chunked_prefill_size") or 0)
        return Engine(
            version=str(info.get("version", "?")),
            model=str(info.get("served_model_name") or info.get("model_path") or "?"),
            mode=mode,
            ranks=len(loads),
            kv_pool=sum(int(load["max_total_num_tokens"]) for load in loads),
            max_running=sum(int(load.get("max_running_requests") or 0) for load in loads),
            chunk=chunk if chunk > 0 else 8192,
            max_input=int(info.get("max_req_input_len") or info.get("context_length") or 0),
        )

    async def read(self) -> Reading:
        body = await self._json("GET", "/v1/loads", params={"include": "core"})
        loads = body.get("loads") if isinstance(body, dict) else None
        if not loads:
            raise ProfileError("GET /v1/loads: no per-rank loads (SGLang 0.5.23 or later?)")
        return Reading(at=time.monotonic(), loads=list(loads))

    def prompts(self, count: int, tokens: int) -> list[list[int]]:
        lo, hi = TOKEN_IDS
        return [[self.rng.randrange(lo, hi) for _ in range(tokens)] for _ in range(count)]

    async def generate(self, prompts: list[list[int]], *, max_new_tokens: int) -> None:
        params = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0.0}
        body = {"input_ids": prompts, "sampling_params": params}
        replies = await self._json("POST", "/generate", json=body)
        for reply in replies if isinstance(replies, list) else [replies]:
            reason = (reply.get("meta_info") or {}).get("finish_reason") or {}
            if reason.get("type") == "abort":
                raise ProfileError(f"POST /generate: a request was aborted: {reason}")


def _per_rank_delta(before: Reading, after: Reading, key: str) -> list[float]:
    return [
        float(a.get(key) or 0) - float(b.get(key) or 0)
        for b, a in zip(before.loads, after.loads, strict=True)
    ]


async def measure_prefill(probe: Probe, engine: Engine, prompt_tokens: int) -> PrefillPoint:
    """Uncached ``prompt_tokens``-token prompts, enough to keep every rank busy."""
    from prorsa.core.capacity_profile import PrefillPoint

    target = max(2 * engine.chunk * engine.ranks, 2 * prompt_tokens)
    count = max(2 * engine.ranks, math.ceil(target / prompt_tokens))
    prompts = probe.prompts(count, prompt_tokens)
    before = await probe.read()
    await probe.generate(prompts, max_new_tokens=1)
    after = await probe.read()
    tokens = _per_rank_delta(before, after, "total_prefill_uncached_tokens")
    busy_us = _per_rank_delta(before, after, "total_prefill_busy_us")
    computed = sum(tokens)
    if computed <= 0:
        raise ProfileError("the engine counted no prefill tokens (total_prefill_uncached_tokens)")
    if computed < 0.9 * count * prompt_tokens:
        _say(
            f"note: {computed:,.0f} of {count * prompt_tokens:,} prompt tokens computed; the "
            "rest came from the prefix cache"
        )
    busy = sum(busy_us) / 1e6
    if busy <= 0:
        busy = (after.at - before.at) * sum(1 for t in tokens if t > 0)
        _say("note: no prefill busy time reported (total_prefill_busy_us); timing the requests")
    point = PrefillPoint(prompt_tokens=prompt_tokens, tokens=round(computed), busy_seconds=busy)
    _say(
        f"prefill {prompt_tokens:,}-token prompts: {count} requests, {computed:,.0f} tokens in "
        f"{busy:.2f} s busy: {engine.ranks / point.seconds_per_token:,.0f} tokens/s"
    )
    return point


@dataclass(frozen=True, slots=True)
class DecodeRun:
    tokens_per_second: float
    step_seconds: float


async def measure_decode(
    probe: Probe,
    engine: Engine,
    *,
    batch: int,
    context: int,
    max_new: int,
    window: float,
    settle_timeout: float,
) -> DecodeRun | None:
    """``batch`` requests decoding together; None if some finished inside the window (the
    caller retries with more new tokens)."""
    prompts = probe.prompts(batch, context)
    job = asyncio.create_task(probe.generate(prompts, max_new_tokens=max_new))
    try:
        deadline = time.monotonic() + settle_timeout
        while True:
            first = await probe.read()
            if first.total("num_running_reqs") >= batch and first.total("num_waiting_reqs") == 0:
                break
            if job.done():
                job.result()  # an error surfaces here
                return None  # all done before they ran together
            if time.monotonic() > deadline:
                raise ProfileError(
                    f"{batch} requests of {context} tokens never ran together (running "
                    f"{first.total('num_running_reqs'):.0f}, waiting "
                    f"{first.total('num_waiting_reqs'):.0f}); lower --decode-context"
                )
            await asyncio.sleep(0.05)
        decoding = await _first_decode_step(probe, first, job, deadline=deadline, window=window)
        if decoding is None:
            await job
            return None
        first = decoding
        await asyncio.sleep(window)
        last = await probe.read()
        # A short window (a KV-bounded batch's) can close before the engine has counted a
        # step in it (batch 46 of the real CPU engine once read none): it runs on until one
        # is counted, while the batch still runs together.
        counted = any(load.get("decode_moments") for load in first.loads)
        while (
            counted
            and _decode_steps(last) <= _decode_steps(first)
            and last.total("num_running_reqs") >= batch
            and not job.done()
        ):
            await asyncio.sleep(0.02)
            last = await probe.read()
        if last.total("num_running_reqs") < batch or job.done():
            await job
            return None
        rate = _rate_from_moments(first, last)
        if rate is None:  # engines without decode_moments: the KV pool grows a token a step
            rate = sum(_per_rank_delta(first, last, "num_used_tokens")) / (last.at - first.at)
        await job
    except BaseException:
        job.cancel()
        raise
    if rate <= 0:
        raise ProfileError(f"decode batch {batch}: no tokens generated in the window")
    return DecodeRun(tokens_per_second=rate, step_seconds=batch / rate)


def _decode_steps(reading: Reading) -> float:
    """Decode steps SGLang has counted (``decode_moments[0]``, summed over the ranks)."""
    return sum(float((load.get("decode_moments") or [0.0])[0]) for load in reading.loads)


async def _first_decode_step(
    probe: Probe, running: Reading, job: asyncio.Task[None], *, deadline: float, window: float
) -> Reading | None:
    """The first reading after the batch's first decode step (None: the batch finished).

    SGLang counts a request running from its first prefill chunk, so the batch is
    "running together" while the last prompts are still prefilling: on a CPU engine that
    took longer than a KV-bounded batch's window, which then saw no decode step at all.
    Waits until ``deadline``; an engine that has reported no ``decode_moments`` yet (none
    before its first decode step, or none at all) only for one ``window``."""
    steps = _decode_steps(running)
    if not any(load.get("decode_moments") for load in running.loads):
        deadline = min(deadline, time.monotonic() + window)
    while True:
        reading = await probe.read()
        if _decode_steps(reading) > steps:
            return reading
        if time.monotonic() > deadline:
            if not steps:
                return reading
            raise ProfileError(
                f"{running.total('num_running_reqs'):.0f} requests ran without a decode step "
                "until the settle timeout"
            )
        if job.done():
            return None
        await asyncio.sleep(0.02)


def _rate_from_moments(first: Reading, last: Reading) -> float | None:
    """Decode tokens/s between two readings from SGLang's ``decode_moments`` (steps, Σ
    batch, Σ step µs, Σ batch², Σ batch·step µs, Σ generated): each rank's tokens over its
    own decode time, summed over the ranks. None when the engine does not report them."""
    rate = 0.0
    for a, b in zip(first.loads, last.loads, strict=True):
        m0, m1 = a.get("decode_moments") or [0.0] * 6, b.get("decode_moments")
        if not m1 or len(m1) < 6 or len(m0) < 6:
            return None
        busy_us, generated = m1[2] - m0[2], m1[5] - m0[5]
        if busy_us > 0:
            rate += generated / (busy_us / 1e6)
    return rate if rate > 0 else None


async def profile(args: argparse.Namespace) -> str:
    import httpx

    from prorsa.core.capacity_profile import (
        capacity_snippet,
        fit_prefill,
        half_saturation_knee,
        prompt_ladder,
    )

    headers = {}
    if args.api_key_file is not None:
        headers["Authorization"] = f"Bearer {args.api_key_file.read_text().strip()}"
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=timeout) as client:
        probe = Probe(client, seed=args.seed)
        engine = await probe.engine()
        _say(
            f"{args.url}: SGLang {engine.version}, model {engine.model}, {engine.ranks} "
            f"attention-DP rank(s), KV pool {engine.kv_pool:,} tokens, chunk {engine.chunk:,}, "
            f"up to {engine.max_running} running"
        )
        if engine.mode != "null":
            raise ProfileError(
                f"the engine runs in disaggregation mode {engine.mode!r} and serves /generate "
                "only behind a PD router: profile an engine launched the same way without "
                "--disaggregation-mode"
            )
        idle = await probe.read()
        if idle.total("num_running_reqs") or idle.total("num_waiting_reqs"):
            raise ProfileError("the engine is serving requests: profile an idle engine")
        await probe.generate(probe.prompts(1, min(256, engine.max_input // 2)), max_new_tokens=4)

        longest = min(args.max_prompt_tokens, engine.max_input - 8, engine.kv_pool // 4)
        points = [
            await measure_prefill(probe, engine, n)
            for n in prompt_ladder(chunk=engine.chunk, longest=longest)
        ]
        prefill = fit_prefill(points, ranks=engine.ranks)
        _say(
            f"prefill: θ_P {prefill.tokens_per_second:,.0f} tokens/s, "
            + (
                f"L {prefill.doubling_tokens:,} tokens"
                if prefill.doubling_tokens
                else "no measurable growth with prompt length"
            )
        )
        rates = await _decode_sweep(probe, engine, prefill, args)
        knee = half_saturation_knee(rates)
        _say(f"decode knee: {knee} requests (half of the peak {max(rates.values()):,.0f} tokens/s)")
    comment = (
        f"prorsa profile of {args.url} (SGLang {engine.version}, {engine.model}, "
        f"{engine.ranks} attention-DP rank(s)), {time.strftime('%Y-%m-%d')}"
    )
    return capacity_snippet(
        prefill=prefill, kv_pool_tokens=engine.kv_pool, knee=knee, comment=comment
    )


async def _decode_sweep(
    probe: Probe, engine: Engine, prefill: PrefillFit, args: argparse.Namespace
) -> dict[int, float]:
    from prorsa.core.capacity_profile import batch_ladder, knee_bracket

    context = min(args.decode_context, engine.max_input // 2, engine.kv_pool // 32)
    if context < args.decode_context:
        _say(f"decode contexts of {context:,} tokens, so that the KV pool holds 32 of them")
    step = 0.01  # a guess until the first batch is measured (then 4x more tokens each retry)
    rates: dict[int, float] = {}

    async def run(batch: int) -> bool:
        """Measure ``batch``; False when the KV pool cannot hold it decoding long enough."""
        nonlocal step
        prefill_seconds = batch * context * prefill.seconds_per_token / engine.ranks
        window = args.window
        wanted = max(16, math.ceil(1.5 * (prefill_seconds + window + 0.5) / step))
        room = min(engine.max_input - context, int(0.9 * engine.kv_pool) // batch - context)
        while True:
            max_new = min(wanted, room)
            if max_new < wanted:
                # The KV pool bounds how long they decode together: a shorter window, of
                # what is left once the last prompt is in (the first ones decode meanwhile).
                left = max_new * step - prefill_seconds
                window = min(args.window, 0.6 * left)
                if window < 10 * step:
                    return False
            result = await measure_decode(
                probe,
                engine,
                batch=batch,
                context=context,
                max_new=max_new,
                window=window,
                settle_timeout=60.0 + 4 * prefill_seconds,
            )
            if result is not None:
                break
            if max_new == room:
                return False  # finished inside the window with all the room there is
            wanted = 4 * max_new
        rates[batch] = result.tokens_per_second
        step = result.step_seconds if batch == 1 else max(step, result.step_seconds)
        _say(
            f"decode batch {batch} ({context:,}-token contexts): "
            f"{result.tokens_per_second:,.0f} tokens/s, {result.step_seconds * 1e3:.1f} ms a step"
        )
        return True

    top = int(0.9 * engine.kv_pool // (context + 64))
    if engine.max_running:
        top = min(top, engine.max_running)
    for batch in batch_ladder(max(1, top)):
        if not await run(batch):
            break
    for _ in range(4):  # bisect between the batches around the knee
        bracket = knee_bracket(rates)
        if bracket is None:
            break
        lo, hi = bracket
        if not await run((lo + hi) // 2):
            break
    return rates


def run(args: argparse.Namespace) -> int:
    import yaml

    from prorsa.core.spec import CapacitySpec

    try:
        snippet = asyncio.run(profile(args))
    except ProfileError as exc:
        print(f"prorsa profile: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"prorsa profile: error: {exc}", file=sys.stderr)
        return 2
    # The snippet is what goes into a RolloutCluster: it must validate as one would.
    CapacitySpec.model_validate(yaml.safe_load(snippet)["capacity"], by_alias=True, by_name=False)
    sys.stdout.write(snippet)
    return 0
