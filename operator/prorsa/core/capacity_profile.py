"""``capacity.*`` of a RolloutCluster from measurements of one engine (``prorsa profile``).

Pure: the measurements come in as numbers, the fields go out. The definitions are those the
Controller uses (docs/crd-reference.md, ``capacity``) and the simulator profiles
(docs/deployments.md, "Decode knee and usable KV"):

* ``prefillCostDoublingTokens`` L and ``prefillTokensPerSecond`` θ_P. Prefilling the token
  at prompt position p costs c₀·(1 + p/L), so an uncached prompt of n tokens costs
  c₀·n·(1 + n/2L): the busy time per token of n-token prompts is c₀ + (c₀/2L)·n, a line in
  n. Fitted to prompts of several lengths (least squares), θ_P is the instance's
  short-prompt speed, its attention-DP ranks over c₀, and L = c₀ / (2·slope).
* ``decodeConcurrency``: the half-saturation knee of decode throughput, the smallest batch
  whose tokens/s reach half of the best the batches measured reached.
* ``decodeKvTokens`` C_KV: the KV pool less the room SGLang keeps for each running request
  to grow, at the knee: its new-token ratio decays to ``SGLANG_INIT_NEW_TOKEN_RATIO`` (0.7)
  × ``SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR`` (0.14) of the clipped max-new-tokens estimate
  (``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``, 4096): SGLang 0.5.23 ``srt/environ.py``,
  ``srt/managers/scheduler_components/new_token_ratio_tracker.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Tokens SGLang 0.5.23 keeps per running request for it to grow (see the module docstring).
GROWTH_RESERVE_TOKENS = round(0.7 * 0.14 * 4096)

# A slope this small next to the intercept (L beyond this many times the longest prompt
# measured) is no attention growth the measurements can tell from noise.
_UNMEASURABLE_L = 20.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillPoint:
    """Uncached prompts of ``prompt_tokens`` each: tokens computed and busy seconds, per rank
    summed over the ranks that computed them."""

    prompt_tokens: int
    tokens: int
    busy_seconds: float

    @property
    def seconds_per_token(self) -> float:
        return self.busy_seconds / self.tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillFit:
    tokens_per_second: float  # θ_P of the instance: ranks / c₀
    doubling_tokens: int | None  # L; None when the cost does not measurably grow
    seconds_per_token: float  # c₀ of one rank


def fit_prefill(points: Sequence[PrefillPoint], *, ranks: int) -> PrefillFit:
    """θ_P and L from prefill measurements at two or more prompt lengths."""
    if len({p.prompt_tokens for p in points}) < 2:
        raise ValueError("need prefill measurements at two prompt lengths at least")
    xs = [float(p.prompt_tokens) for p in points]
    ys = [p.seconds_per_token for p in points]
    weights = [float(p.tokens) for p in points]
    total = sum(weights)
    mx = sum(w * x for w, x in zip(weights, xs, strict=True)) / total
    my = sum(w * y for w, y in zip(weights, ys, strict=True)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(weights, xs, strict=True))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    longest = max(xs)
    if slope <= 0 or intercept <= 0 or intercept / (2 * slope) > _UNMEASURABLE_L * longest:
        # Flat (or noise): every computed token costs the mean.
        c0 = sum(p.busy_seconds for p in points) / sum(p.tokens for p in points)
        return PrefillFit(tokens_per_second=ranks / c0, doubling_tokens=None, seconds_per_token=c0)
    return PrefillFit(
        tokens_per_second=ranks / intercept,
        doubling_tokens=max(1, round(intercept / (2 * slope))),
        seconds_per_token=intercept,
    )


def half_saturation_knee(rates: dict[int, float]) -> int:
    """The smallest batch whose decode tokens/s reach half the best measured."""
    if not rates:
        raise ValueError("no decode measurements")
    peak = max(rates.values())
    return min(b for b, r in rates.items() if r >= 0.5 * peak)


def knee_bracket(rates: dict[int, float]) -> tuple[int, int] | None:
    """The two measured batches around the knee with no batch measured between them
    (below half the peak, at or above it); None when the knee is pinned (adjacent batches,
    or the smallest batch measured already reaches half the peak)."""
    knee = half_saturation_knee(rates)
    below = [b for b, r in rates.items() if b < knee]
    if not below:
        return None
    lo = max(below)
    return None if knee - lo <= 1 else (lo, knee)


def usable_kv_tokens(pool_tokens: int, *, knee: int) -> int:
    """C_KV: the KV pool less SGLang's growth reserve for ``knee`` running requests."""
    return max(1, pool_tokens - knee * GROWTH_RESERVE_TOKENS)


def prompt_ladder(*, chunk: int, longest: int, shortest: int = 256) -> list[int]:
    """Prompt lengths to measure prefill at: a quarter chunk up to ``longest``, doubling."""
    start = max(shortest, chunk // 4)
    if longest < 2 * start:
        start = max(1, longest // 4)
    out = []
    n = start
    while n <= longest:
        out.append(n)
        n *= 2
    if len(out) < 3 and longest > 0:
        out = sorted({max(1, longest // 4), max(1, longest // 2), longest})
    return out


def batch_ladder(top: int) -> list[int]:
    """Decode batches to measure: 1, 2, 4, ... and ``top`` (the most the KV holds)."""
    out = [1 << k for k in range(int(math.log2(max(top, 1))) + 1)]
    if out[-1] != top:
        out.append(top)
    return out


def capacity_snippet(
    *,
    prefill: PrefillFit,
    kv_pool_tokens: int,
    knee: int,
    comment: str,
) -> str:
    """The ``spec.capacity`` block of a RolloutCluster, as YAML with what each value is."""
    lines = [
        f"# {comment}",
        "capacity:",
        f"  prefillTokensPerSecond: {round(prefill.tokens_per_second)}"
        "  # θ_P: uncached prompt tokens/s, short prompts",
    ]
    if prefill.doubling_tokens is not None:
        lines.append(
            f"  prefillCostDoublingTokens: {prefill.doubling_tokens}"
            "  # a token at this position costs 2x (attention)"
        )
    else:
        lines.append(
            "  # prefillCostDoublingTokens: unset, no measurable growth with prompt length"
        )
    lines += [
        f"  decodeKvTokens: {usable_kv_tokens(kv_pool_tokens, knee=knee)}"
        f"  # C_KV: KV pool {kv_pool_tokens} less {GROWTH_RESERVE_TOKENS} per request at the knee",
        f"  decodeConcurrency: {knee}  # decoding requests at half the peak decode tokens/s",
    ]
    return "\n".join(lines) + "\n"
