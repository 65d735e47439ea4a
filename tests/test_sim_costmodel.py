"""The simulator's cost model: committed aiconfigurator tables and their interpolation."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from prorsa_lab.sim.costmodel import MODELS, StepTimes, Table2D, load_profile

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
    # TP8 rank sends its shards over its 8 GPUs' NICs at once. With 4 KV heads over 8 GPUs
    # every head lives on two GPUs, and each GPU sends its own (48,128 bytes per token).
    assert 8192 * p.kv_bytes_per_token == pytest.approx(1.58e9, rel=0.01)
    assert p.kv_bytes_per_token_per_gpu == 94 * 1 * 128 * 2 * 2
    assert p.transfer_seconds(8192) == pytest.approx(8192 * 48_128 / 50e9)


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
        data = json.loads((resources.files("prorsa_lab.sim") / "data" / f"{stem}.json").read_text())
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


# Role-switch-capable deployments (MoE tensor parallel, EP 1): benchmark name ->
# (GPUs, attention-DP ranks, chunk, attention TP, KV bytes per token on one GPU).
# KV per GPU, replicas counted: Qwen3-235B has 94 layers and 4 KV heads of 128 (FP8 KV, 1
# byte): a GPU of attention TP t holds max(1, 4 // t) heads (TP8 replicates each head on two
# GPUs). DeepSeek-V3's MLA latent (61 layers x 576, FP8) sits whole on every TP rank.
ROLE_SWITCH_CAPABLE = {
    "qwen3-tp8": (8, 1, 4096, 8, 94 * 1 * 128 * 2),
    "qwen3-dp2": (8, 2, 4096, 4, 94 * 1 * 128 * 2),
    "qwen3-fp8-tp4": (4, 1, 4096, 4, 94 * 1 * 128 * 2),
    "qwen3-fp8-dp2": (4, 2, 4096, 2, 94 * 2 * 128 * 2),
    "deepseek-v3-tp16": (16, 1, 512, 16, 61 * 576),
    "deepseek-v3-dp16": (16, 16, 512, 1, 61 * 576),
}
# Weights per GPU from the parameter counts, as a check on aiconfigurator's memory figures:
# Qwen3-235B-A22B 235.1e9 parameters, of which 6.7e9 attention (sharded by the attention TP
# only under DP attention); DeepSeek-V3 671e9 (FP8) plus its MLA down-projections (0.92e9)
# that every TP rank holds whole.
QWEN_PARAMS, QWEN_ATTN = 235.1e9, 6.7e9
DS_ROUTED = 58 * 256 * 3 * 7168 * 2048
WEIGHT_BYTES_PER_GPU = {
    "qwen3-tp8": QWEN_PARAMS * 2 / 8,
    "qwen3-dp2": (QWEN_PARAMS - QWEN_ATTN) * 2 / 8 + QWEN_ATTN * 2 / 4,
    "qwen3-fp8-tp4": QWEN_PARAMS / 4,
    "qwen3-fp8-dp2": (QWEN_PARAMS - QWEN_ATTN) / 4 + QWEN_ATTN / 2,
    "deepseek-v3-tp16": 671e9 / 16 + 0.92e9,
    # Attention DP (TP1): only the routed experts (58 MoE layers x 256 x 3 x 7168 x 2048)
    # are split over the MoE TP16; attention, shared experts, dense layers and embeddings
    # sit whole on every GPU.
    "deepseek-v3-dp16": DS_ROUTED / 16 + (671e9 - DS_ROUTED),
}
H200_BYTES = 151_397_597_184  # 141 GiB
MEM_FRACTION_STATIC = 0.85


@pytest.mark.parametrize("name", sorted(ROLE_SWITCH_CAPABLE))
def test_role_switch_capable_tables_count_kv_honestly(name: str) -> None:
    gpus, ranks, chunk, attn_tp, kv_per_gpu = ROLE_SWITCH_CAPABLE[name]
    p = load_profile(name)
    assert p.role_switch_capable
    assert (p.gpus_per_instance, p.ranks, p.chunk) == (gpus, ranks, chunk)
    assert p.nodes == (2 if gpus == 16 else 1)
    assert p.gpus_per_rank * ranks == gpus and p.gpus_per_rank == attn_tp
    # aiconfigurator's KV per GPU is the per-GPU arithmetic above, replicas included.
    assert p.kv_bytes_per_token_per_gpu == kv_per_gpu
    data = json.loads(
        (resources.files("prorsa_lab.sim") / "data" / f"{MODELS[name]}.json").read_text()
    )
    assert data["parallel"]["moeEp"] == 1 and data["parallel"]["moeTp"] == gpus
    memory = data["memory"]
    fixed = (memory["weightsGiBPerGpu"] + memory["ncclGiBPerGpu"]) * 2**30
    assert memory["weightsGiBPerGpu"] * 2**30 == pytest.approx(WEIGHT_BYTES_PER_GPU[name], rel=0.12)
    # A rank holds what ONE of its GPUs' free memory holds at that GPU's KV per token;
    # an instance holds that times its ranks (not times its GPUs).
    per_rank = (MEM_FRACTION_STATIC * H200_BYTES - fixed) / kv_per_gpu
    assert p.kv_capacity_per_rank == pytest.approx(per_rank, rel=0.05)
    assert p.kv_capacity == pytest.approx(ranks * per_rank, rel=0.05)
    # The honest capacity with the independent weight estimate, too.
    indep = (MEM_FRACTION_STATIC * H200_BYTES - WEIGHT_BYTES_PER_GPU[name]) / kv_per_gpu
    assert p.kv_capacity_per_rank == pytest.approx(indep, rel=0.08)
    # KV moves GPU by GPU (each over its own NIC), replicas included.
    assert p.transfer_seconds(8192) == pytest.approx(8192 * kv_per_gpu / 50e9)


def test_deepseek_tp16_holds_one_gpus_worth_of_mla_kv() -> None:
    """MLA's latent KV is replicated on every TP rank: 16 GPUs hold one copy's tokens."""
    p = load_profile("deepseek-v3-tp16")
    one_gpu = MEM_FRACTION_STATIC * H200_BYTES / (61 * 576)
    assert p.kv_capacity < one_gpu < 16 * p.kv_capacity
    assert p.kv_capacity == p.kv_capacity_per_rank


@pytest.mark.parametrize("name", sorted(ROLE_SWITCH_CAPABLE))
def test_role_switch_capable_step_times_grow(name: str) -> None:
    p = load_profile(name)
    for ctx in (2048, 16384, 65536):
        times = [p.decode_seconds(b, ctx) for b in (1, 4, 16, 64, 256)]
        assert times == sorted(times) and times[-1] > times[0]
    for batch in (1, 16, 128):
        times = [p.decode_seconds(batch, c) for c in (1024, 8192, 65536, 131072)]
        assert times == sorted(times) and times[-1] > times[0]
    for prefix in (0, 8192, 65536):
        times = [p.prefill_seconds(n, prefix) for n in (64, 512, 4096, 16384)]
        assert times == sorted(times) and times[-1] > times[0]
    assert p.decode_concurrency() >= p.ranks
    assert 0 < p.usable_kv_tokens() <= p.kv_capacity


def test_expert_parallel_tables_are_not_role_switch_capable() -> None:
    """SGLang refuses --enable-pd-role-switch with --ep-size > 1 (docs/sglang-role-switch.md)."""
    for name in ("qwen3-235b", "deepseek-v3", "qwen3-235b-tp8"):
        p = load_profile(name)
        assert not p.role_switch_capable
        data = json.loads(
            (resources.files("prorsa_lab.sim") / "data" / f"{MODELS[name]}.json").read_text()
        )
        assert data["parallel"]["moeEp"] > 1 and "EP" in data["title"]
