"""The simulator's engine model for a replay: from the manifest's ``capacity.*``, or a table.

``prorsa profile`` measures four things of one engine (docs/crd-reference.md,
"Profiling the capacity"), and each becomes part of a :class:`ModelProfile`:

- ``prefillTokensPerSecond`` θ_P and ``prefillCostDoublingTokens`` L: a token at prompt
  position p costs c₀·(1 + p/L) on a rank, c₀ = ranks / θ_P (the profile's own fit,
  :mod:`prorsa.core.capacity_profile`); a prefill step of n new tokens over a prefix P
  therefore costs c₀·n·(1 + (P + n/2)/L);
- ``decodeConcurrency`` K, the half-saturation knee of decode throughput measured with
  requests of 8192 tokens (``prorsa profile --decode-context``'s default): a decode step of
  b requests of context c on a rank costs s₀·(1 + b·c / (K_r·8192)), K_r = K / ranks, the
  one curve whose throughput b/step reaches half its peak at b = K_r, with the per-request
  part read from the KV (attention), so proportional to context;
- ``decodeKvTokens`` C_KV: the KV pool less SGLang's growth reserve per request at the
  knee, so the pool is C_KV + K·GROWTH_RESERVE_TOKENS (the profile's arithmetic undone).

What the capacity does not hold is s₀, the lone request's decode step. It is taken from
``--decode-step-ms`` when given, else measured in the recording itself: every generation
whose prefill end it shows gives a time per token, and with the requests decoding beside
it (over the decode instances the recording leaves, split over the ranks) the model above
gives s₀; the median over generations is used. KV transfer between instances is not
modelled (``capacity.*`` does not measure it); ``--model NAME`` uses a committed cost table
(:mod:`prorsa_lab.sim.costmodel`) that does.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from prorsa.core.capacity_profile import GROWTH_RESERVE_TOKENS
from prorsa.core.engine_flags import flag_values
from prorsa.core.spec import RolloutClusterSpec
from prorsa_lab.replay.recording import DecodeSample, Recording
from prorsa_lab.sim.costmodel import ModelProfile, Table2D, load_profile

KNEE_CONTEXT = 8192  # prorsa profile --decode-context default: the knee's request length
# SGLang's --chunked-prefill-size on an H200 when the engine args leave it out (SGLang
# 0.5.23 memory_hook._handle_gpu_memory_settings), divided over the attention-DP ranks.
DEFAULT_CHUNK = 8192
_NEW = (1, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class EngineModelError(ValueError):
    """The manifest cannot give an engine model (a capacity field is missing)."""


@dataclass(frozen=True, slots=True)
class _Span:
    start: float
    end: float
    tokens: int
    context: float


@dataclass(frozen=True, slots=True)
class EngineModel:
    profile: ModelProfile
    sources: tuple[str, ...]  # where each figure comes from, printed with the replay


def from_table(name: str) -> EngineModel:
    profile = load_profile(name)
    return EngineModel(profile, (f"cost table {name}: {profile.title}",))


def from_capacity(
    spec: RolloutClusterSpec,
    recording: Recording,
    *,
    raw_capacity: dict[str, object],
    decode_step_ms: float | None = None,
    knee_context: int = KNEE_CONTEXT,
    kv_pool_tokens: int | None = None,
    source: str = "manifest",
) -> EngineModel:
    """The engine of ``spec`` as its ``capacity.*`` describes it (module docstring)."""
    missing = [
        name
        for name in ("prefillTokensPerSecond", "decodeKvTokens", "decodeConcurrency")
        if name not in raw_capacity
    ]
    if missing:
        raise EngineModelError(
            f"{source}: capacity.{', capacity.'.join(missing)} missing: the replay's engine "
            "model is built from the fields `prorsa profile` prints (or pass --model NAME "
            "for a committed cost table)"
        )
    cap = spec.capacity
    assert cap.decode_kv_tokens is not None and cap.decode_concurrency is not None
    ranks = spec.engine.attention_dp_size
    chunks = [v for v in flag_values(spec.engine.extra_args, "--chunked-prefill-size")]
    chunk = int(chunks[-1]) if chunks and chunks[-1].isdigit() else DEFAULT_CHUNK
    chunk = max(1, chunk // ranks)
    knee_rank = max(1.0, cap.decode_concurrency / ranks)
    pool = kv_pool_tokens or cap.decode_kv_tokens + cap.decode_concurrency * GROWTH_RESERVE_TOKENS
    max_context = max(
        (s.context_after(len(s.turns) - 1) for s in recording.scripts if s.turns),
        default=KNEE_CONTEXT,
    )
    c0 = ranks / cap.prefill_tokens_per_second  # seconds per token on one rank
    doubling = cap.prefill_cost_doubling_tokens
    if knee_context < 1:
        raise EngineModelError(f"knee context {knee_context}: must be >= 1 token")
    prefixes = (0.0, float(max(max_context, 2 * KNEE_CONTEXT)))

    def prefill_ms(new: float, prefix: float) -> float:
        growth = (prefix + new / 2) / doubling if doubling else 0.0
        return 1e3 * c0 * new * (1 + growth)

    sources = [
        f"prefill: θ_P {cap.prefill_tokens_per_second:,.0f} tokens/s per instance over "
        f"{ranks} rank(s), "
        + (f"L {doubling:,} tokens" if doubling else "no growth with the prefix (L unset)")
        + f", chunk {chunk} per rank",
        f"decode KV: C_KV {cap.decode_kv_tokens:,} + {cap.decode_concurrency} x "
        f"{GROWTH_RESERVE_TOKENS} reserve = {pool:,} tokens per instance"
        if kv_pool_tokens is None
        else f"decode KV: a pool of {pool:,} tokens per instance (--kv-pool-tokens)",
    ]
    if decode_step_ms is not None:
        s0 = decode_step_ms * 1e-3
        sources.append(f"decode: lone step {decode_step_ms:.2f} ms (--decode-step-ms)")
    else:
        decode_instances = spec.instances - recording.prefill_instances
        if recording.prefill_instances == 0 or decode_instances < 1:
            decode_instances = max(1, spec.instances // 2)
        s0, n, queued = lone_step(
            recording.decode_samples,
            decode_instances * ranks,
            knee_rank,
            prefill_seconds=lambda new, prefix: prefill_ms(new, prefix) * 1e-3,
            knee_context=knee_context,
        )
        if n == 0:
            raise EngineModelError(
                f"{source}: the recording shows no generation of 16 tokens or more to "
                "measure the lone decode step from: pass --decode-step-ms or --model NAME"
            )
        how = (
            f" ({queued} timed from request_queued less the modelled prefill: no "
            "prefill_finished for them)"
            if queued
            else ""
        )
        sources.append(
            f"decode: lone step {s0 * 1e3:.2f} ms, the median over {n} recorded generations "
            f"over {decode_instances} decode instance(s){how}"
        )
    sources.append(
        f"decode: knee {cap.decode_concurrency} requests per instance at {knee_context} tokens"
    )
    sources.append("KV transfer: not modelled (capacity.* does not measure it)")
    batches = (1.0, 2.0)
    contexts = (0.0, float(knee_context))
    decode = tuple(
        tuple(1e3 * s0 * (1 + b * c / (knee_rank * knee_context)) for c in contexts)
        for b in batches
    )
    profile = ModelProfile(
        name="capacity",
        title=f"capacity.* of {source}",
        gpus_per_instance=spec.engine.gpus_per_instance,
        ranks=ranks,
        chunk=chunk,
        max_context=max_context,
        kv_bytes_per_token=0,
        kv_capacity_per_rank=max(1, pool // ranks),
        transfer_bytes_per_second=1.0,
        prefill_ms=Table2D(
            tuple(float(n) for n in _NEW),
            prefixes,
            tuple(tuple(prefill_ms(n, p) for p in prefixes) for n in _NEW),
        ),
        decode_ms=Table2D(batches, contexts, decode),
        source="; ".join(sources),
        role_switch_capable=True,
    )
    return EngineModel(profile, tuple(sources))


def lone_step(
    recorded: tuple[DecodeSample, ...],
    decode_ranks: int,
    knee_rank: float,
    *,
    prefill_seconds: Callable[[float, float], float],
    knee_context: int = KNEE_CONTEXT,
) -> tuple[float, int, int]:
    """s₀ from recorded generations: each one's seconds per token over the model's factor
    (1 + b·c/(K_r·knee_context)) at its rank batch b (the generations decoding beside it, averaged
    over its span, over ``decode_ranks``) and context c. A generation decodes from its
    prefill's end; where the trainer sent none, from its queueing plus the modelled prefill
    of its uncached tokens (its wait for a prefill engine then counts as decode time).
    Returns (s₀, generations used, of which timed from their queueing)."""
    samples: list[_Span] = []
    from_queue = 0
    for r in recorded:
        start = r.prefill_end
        if start is None:
            start = r.queued + prefill_seconds(r.new_tokens, r.prefix)
        if r.end > start:
            samples.append(_Span(start, r.end, r.tokens, r.context))
            from_queue += r.prefill_end is None
    if not samples:
        return 0.0, 0, 0
    edges = sorted({s.start for s in samples} | {s.end for s in samples})
    delta = [0] * (len(edges) + 1)
    for s in samples:
        delta[bisect.bisect_left(edges, s.start)] += 1
        delta[bisect.bisect_left(edges, s.end)] -= 1
    # Integral of the number decoding, at each edge.
    area = [0.0] * len(edges)
    live = 0
    for i in range(len(edges) - 1):
        live += delta[i]
        area[i + 1] = area[i] + live * (edges[i + 1] - edges[i])
    values = []
    for s in samples:
        span = s.end - s.start
        if span <= 0:
            continue
        mean = area[bisect.bisect_left(edges, s.end)] - area[bisect.bisect_left(edges, s.start)]
        batch = max(1.0, mean / span / decode_ranks)
        factor = 1 + batch * s.context / (knee_rank * knee_context)
        values.append(span / s.tokens / factor)
    if not values:
        return 0.0, 0, 0
    return statistics.median(values), len(values), from_queue
