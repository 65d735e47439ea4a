"""`prorsa profile` against a running engine, as a user runs it: both are processes.

The engine double's timing model is the ground truth here: θ_P, the attention cost's
doubling length L and the decode step time are what it is configured with, so the profile
must find them (within what an asyncio double's sleeps add on a busy 2-core machine: a
millisecond or so a step). The measured engine is a parameter: the real SGLang 0.5.23 on
CPU plugs in as another :class:`Target` whose ``truth`` is None (no ground truth), and then
only the checks that hold for any engine run (`make test-engine`, "The real engine in the
loop").
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from test_ingest_cli import Proc

from prorsa.core.capacity_profile import (
    GROWTH_RESERVE_TOKENS,
    PrefillPoint,
    batch_ladder,
    fit_prefill,
    half_saturation_knee,
    knee_bracket,
    prompt_ladder,
    usable_kv_tokens,
)
from prorsa.core.spec import CapacitySpec


@dataclass(frozen=True)
class Truth:
    """The double's timing model: what a perfect profile would print."""

    prefill_tokens_per_second: float
    doubling_tokens: float
    decode_step_seconds: float
    decode_step_seconds_per_request: float
    kv_pool: int
    max_running: int

    def knee(self) -> int:
        """The half-saturation knee over the batches the pool and the engine admit."""
        s, r = self.decode_step_seconds, self.decode_step_seconds_per_request
        return half_saturation_knee({b: b / (s + r * b) for b in range(1, self.max_running + 1)})


@dataclass(frozen=True)
class Target:
    url: str
    truth: Truth | None
    args: tuple[str, ...]  # profile arguments sized for this engine


DOUBLE = Truth(
    prefill_tokens_per_second=50_000.0,
    doubling_tokens=16_000.0,
    decode_step_seconds=0.020,
    decode_step_seconds_per_request=0.00025,
    kv_pool=400_000,
    max_running=64,
)


@pytest.fixture(params=["double"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    t = DOUBLE
    engine = Proc(
        "-m", "prorsa_lab.doubles.sglang_double", "--port", "0",
        "--max-total-tokens", str(t.kv_pool), "--max-running-requests", str(t.max_running),
        "--chunked-prefill-size", "8192", "--context-length", "40000",
        "--double-prefill-tokens-per-second", str(t.prefill_tokens_per_second),
        "--double-prefill-cost-doubling-tokens", str(t.doubling_tokens),
        "--double-decode-step-ms", str(t.decode_step_seconds * 1e3),
        "--double-decode-step-ms-per-request", str(t.decode_step_seconds_per_request * 1e3),
    )  # fmt: skip
    try:
        url = engine.expect(r"engine double listening on (http://\S+) \(role=null\)").group(1)
        args = ("--max-prompt-tokens", "32768", "--decode-context", "1024", "--window", "0.6")
        yield Target(url=url, truth=t, args=args)
    finally:
        engine.kill()


def profile(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prorsa.cli", "profile", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_profile_measures_capacity_and_prints_the_snippet(target: Target) -> None:
    check_profile(target)


def check_profile(target: Target) -> tuple[CapacitySpec, str]:
    """Profile ``target`` as a user would; the checks that hold for any engine, then (with a
    ground truth) that the figures are the engine's own. The real engine runs these in
    ``tests/real_engine/test_profile_sglang.py``; returns the snippet's capacity and the
    progress the profile printed."""
    out = profile("--url", target.url, *target.args)
    assert out.returncode == 0, out.stderr
    capacity = yaml.safe_load(out.stdout)["capacity"]
    spec = CapacitySpec.model_validate(capacity, by_alias=True, by_name=False)
    assert out.stdout.startswith(f"# prorsa profile of {target.url} (SGLang 0.5.23, ")

    # Progress while it measures: each prefill length, each decode batch, the results.
    progress = out.stderr.splitlines()
    assert all(line.startswith("prorsa profile: ") for line in progress), progress
    prefill_lines = [p for p in progress if re.search(r"prefill [\d,]+-token prompts", p)]
    decode = {
        int(m.group(1)): float(m.group(2).replace(",", ""))
        for p in progress
        if (m := re.search(r"decode batch (\d+) .*: ([\d,]+) tokens/s", p))
    }
    assert len(prefill_lines) >= 3
    assert {1, 2, 4} <= set(decode), decode
    assert re.search(r"decode knee: \d+ requests", progress[-1])

    knee = spec.decode_concurrency
    assert knee is not None and knee in decode  # a batch it measured
    assert knee == half_saturation_knee(decode)
    assert spec.decode_kv_tokens is not None and spec.decode_kv_tokens < 10**9

    truth = target.truth
    if truth is None:
        return spec, out.stderr
    assert spec.prefill_tokens_per_second == pytest.approx(truth.prefill_tokens_per_second, rel=0.2)
    assert spec.prefill_cost_doubling_tokens == pytest.approx(truth.doubling_tokens, rel=0.3)
    # An asyncio double's step lasts its model's time plus the event loop's lag, per step
    # and per request (on a loaded machine, both): within 30% of the model's knee.
    assert abs(knee - truth.knee()) <= 0.3 * truth.knee(), (knee, decode)
    assert spec.decode_kv_tokens == truth.kv_pool - knee * GROWTH_RESERVE_TOKENS
    # The most requests it decoded together is what the engine admits.
    assert max(decode) == truth.max_running
    return spec, out.stderr


def test_an_engine_in_a_pd_role_is_refused_with_what_to_do(tmp_path: Path) -> None:
    engine = Proc(
        "-m", "prorsa_lab.doubles.sglang_double", "--port", "0",
        "--disaggregation-mode", "decode", "--enable-pd-role-switch",
        "--disaggregation-bootstrap-port", "0",
    )  # fmt: skip
    try:
        url = engine.expect(r"listening on (http://\S+) ").group(1)
        out = profile("--url", url)
    finally:
        engine.kill()
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines()[-1] == (
        "prorsa profile: error: the engine runs in disaggregation mode 'decode' and serves "
        "/generate only behind a PD router: profile an engine launched the same way without "
        "--disaggregation-mode"
    )


def test_an_unreachable_engine_is_one_line() -> None:
    out = profile("--url", "http://127.0.0.1:9")
    assert out.returncode == 1
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("prorsa profile: error: GET /server_info: ConnectError")


# -- the arithmetic, on numbers whose answer is known ----------------------------------------


def test_fit_recovers_theta_and_the_doubling_length() -> None:
    c0, doubling = 1 / 40_000, 30_000.0
    points = [
        PrefillPoint(
            prompt_tokens=n, tokens=4 * n, busy_seconds=4 * n * c0 * (1 + n / 2 / doubling)
        )
        for n in prompt_ladder(chunk=8192, longest=65536)
    ]
    fit = fit_prefill(points, ranks=2)
    assert fit.tokens_per_second == pytest.approx(80_000)  # two ranks at 40k each
    assert fit.doubling_tokens == pytest.approx(doubling, rel=1e-6)
    flat = [PrefillPoint(prompt_tokens=p.prompt_tokens, tokens=p.tokens, busy_seconds=p.tokens * c0)
            for p in points]  # fmt: skip
    assert fit_prefill(flat, ranks=1).doubling_tokens is None


def test_knee_bracket_and_ladders() -> None:
    rates = {1: 10.0, 2: 20.0, 4: 39.0, 8: 70.0, 16: 120.0, 32: 150.0}
    assert half_saturation_knee(rates) == 16  # the first at half the peak, 75
    assert knee_bracket(rates) == (8, 16)
    assert knee_bracket({**rates, 12: 100.0, 10: 74.0, 11: 76.0}) is None  # pinned at 11
    assert knee_bracket({1: 90.0, 2: 100.0}) is None
    assert batch_ladder(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_ladder(64) == [1, 2, 4, 8, 16, 32, 64]
    assert prompt_ladder(chunk=8192, longest=32768) == [2048, 4096, 8192, 16384, 32768]
    assert usable_kv_tokens(100_000, knee=10) == 100_000 - 10 * GROWTH_RESERVE_TOKENS
