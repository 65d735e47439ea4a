"""The simulator's cost model: committed aiconfigurator tables and their interpolation."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from prorsa.sim.costmodel import MODELS, StepTimes, Table2D, load_profile

ROOT = Path(__file__).resolve().parent.parent


def test_tp8_table_reproduces_the_anchor_figures_of_the_notes() -> None:
    """aiconfigurator's figures for Qwen3-235B TP8 BF16 on H200 (docs/benchmarks.md)."""
    p = load_profile("qwen3-235b-tp8")
    assert p.ranks == 1 and p.gpus_per_instance == 8
    for tokens, ms in ((1024, 65), (4096, 199), (8192, 379), (16384, 827)):
        assert p.prefill_seconds(tokens, 0) * 1e3 == pytest.approx(ms, rel=0.02)
    for batch, ctx, ms in ((1, 8192, 7.5), (64, 8192, 33.1), (256, 4096, 47.5)):
        assert p.decode_seconds(batch, ctx) * 1e3 == pytest.approx(ms, rel=0.03)
    # "An 8xH200 instance holds on the order of 1.3-1.5 M tokens of KV for Qwen3-235B."
    assert 1_300_000 <= p.kv_capacity <= 1_500_000
    # "an 8k-token Qwen3 prompt's KV (~1.5 GB) moves in ~30 ms" over one 50 GB/s NIC; a
    # TP8 rank sends its shards over its 8 GPUs' NICs at once.
    assert 8192 * p.kv_bytes_per_token == pytest.approx(1.58e9, rel=0.01)
    assert p.transfer_seconds(8192) == pytest.approx(8192 * 192_512 / (8 * 50e9))


def test_benchmark_deployments_follow_the_paper() -> None:
    """Paper §5.1: Qwen3 attention TP2 (4 DP ranks, chunk 4096); DeepSeek DP16, chunk 512."""
    q = load_profile("qwen3-235b")
    assert (q.gpus_per_instance, q.ranks, q.chunk) == (8, 4, 4096)
    assert q.kv_bytes_per_token == 94 * 4 * 128 * 2  # FP8 KV: layers x kv heads x dim x K,V
    d = load_profile("deepseek-v3")
    assert (d.gpus_per_instance, d.ranks, d.chunk) == (16, 16, 512)
    assert d.kv_bytes_per_token == 61 * 576  # MLA latent, FP8
    for p in (q, d):
        # A rank runs one chunk per step: the profiled speed is exactly ranks x chunk / step.
        step = p.prefill_seconds(p.chunk, 0)
        assert p.prefill_tokens_per_second == pytest.approx(p.ranks * p.chunk / step)
        assert p.kv_capacity == p.ranks * p.kv_capacity_per_rank


def test_decode_is_non_linear_in_batch_and_grows_with_context() -> None:
    p = load_profile("qwen3-235b-tp8")
    # MoE decode: 64x the batch costs far less than 64x the time (notes: do not fit a line).
    assert p.decode_seconds(64, 8192) < 8 * p.decode_seconds(1, 8192)
    for batch in (1, 16, 128):
        times = [p.decode_seconds(batch, c) for c in (1024, 8192, 65536)]
        assert times == sorted(times)
    # A cached prefix makes a chunk dearer than the same chunk alone (attention over it).
    assert p.prefill_seconds(1024, 32768) > p.prefill_seconds(1024, 0)


def test_bilinear_interpolation_and_linear_extension() -> None:
    t = Table2D((0.0, 10.0), (0.0, 100.0), ((0.0, 100.0), (10.0, 110.0)))
    assert t(0, 0) == 0 and t(10, 100) == 110
    assert t(5, 50) == pytest.approx(55.0)
    assert t(20, 0) == pytest.approx(20.0)  # extended along the last segment
    with pytest.raises(ValueError, match="increasing"):
        Table2D((1.0, 0.0), (0.0, 1.0), ((0.0, 0.0), (0.0, 0.0)))
    with pytest.raises(ValueError, match="match"):
        Table2D((0.0, 1.0), (0.0, 1.0), ((0.0, 0.0),))


def test_memoised_step_times_stay_within_a_bucket_of_the_table() -> None:
    p = load_profile("deepseek-v3")
    memo = StepTimes(p)
    for batch, ctx in ((3, 5000), (40, 20000), (200, 70000)):
        assert memo.decode(batch, ctx) == pytest.approx(p.decode_seconds(batch, ctx), rel=0.01)
    assert memo.prefill(512, 8192) == p.prefill_seconds(512, 8192)


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="qwen3-235b"):
        load_profile("gpt-9")


def test_committed_tables_say_how_they_were_made() -> None:
    for stem in set(MODELS.values()):
        data = json.loads((resources.files("prorsa.sim") / "data" / f"{stem}.json").read_text())
        assert data["generatedBy"] == "scripts/gen_cost_tables.py"
        assert data["system"] == "h200_sxm" and data["backend"] == "sglang"
        assert len(data["prefill"]["ms"]) == len(data["prefill"]["newTokens"])
        assert all(v > 0 for row in data["decode"]["ms"] for v in row)


def test_generator_script_explains_the_missing_optional_dependency() -> None:
    """aiconfigurator is an optional extra; the script says how to get it (exit 2)."""
    try:
        import aiconfigurator  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover - only where the extra is installed
        pytest.skip("aiconfigurator is installed here")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_cost_tables.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "prorsa[aiconfigurator]" in proc.stderr


def test_profiled_prefill_cost_doubling_matches_the_table() -> None:
    # capacity.prefillCostDoublingTokens: a token's cost c0·(1 + prefix/L) stays within
    # 15% of the table's cost of a chunk at that prefix, across the context.
    for name in ("qwen3-235b", "deepseek-v3"):
        p = load_profile(name)
        L = p.prefill_cost_doubling_tokens()
        assert 10_000 < L < 200_000
        base = p.prefill_seconds(p.chunk, 0.0)
        for prefix in (16_384, 65_536, 120_000):
            model = base * (1 + prefix / L)
            assert p.prefill_seconds(p.chunk, prefix) == pytest.approx(model, rel=0.15)
