"""The simulator's deployments: where each number comes from, and what the operator would run.

Each role-switch-capable table must be one SGLang 0.5.23 can flip in place (no expert
parallelism), carry its provenance (aiconfigurator version, system file, SGLang data
version), and the engine command line the operator renders for it (engine pod env, the
agent's flags) must hold nothing SGLang refuses next to ``--enable-pd-role-switch``.
"""

from __future__ import annotations

import json
from importlib import resources

import pytest

from prorsa.core.engine_flags import engine_problems
from prorsa.k8s.objects import engine_pod, router_args
from prorsa_agent.config import args_from_env, engine_argv
from prorsa_lab.sim.costmodel import MODELS, load_profile
from prorsa_lab.sim.simulator import Scenario

CAPABLE = sorted(m for m in MODELS if load_profile(m).role_switch_capable)
ATTENTION_DP = ("deepseek-v3-dp8", "qwen3-dp8", "qwen3-dp4", "qwen3-dp2")


def table(model: str) -> dict[str, object]:
    path = resources.files("prorsa_lab.sim") / "data" / f"{MODELS[model]}.json"
    data: dict[str, object] = json.loads(path.read_text())
    return data


def rendered_argv(model: str) -> list[str]:
    """SGLang's command line in the engine pod the operator renders for this deployment."""
    spec = Scenario(model=model, task="coding").spec()
    pod = engine_pod(cluster="sim", namespace="rl", index=0, role="decode", spec=spec)
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
    return engine_argv(
        command=["python", "-m", "sglang.launch_server"],
        engine_url="http://127.0.0.1:30000",
        env_args=args_from_env(env),
    )


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_attention_dp_deployments_are_in_the_grid_and_role_switch_capable() -> None:
    assert set(ATTENTION_DP) <= set(CAPABLE)
    for model in ATTENTION_DP:
        p = load_profile(model)
        assert p.ranks > 1 and p.gpus_per_instance == 8
        parallel = table(model)["parallel"]
        assert isinstance(parallel, dict)
        # EP 1, the MoE tensor parallel over the whole instance: what SGLang can flip.
        assert (parallel["moeEp"], parallel["moeTp"]) == (1, 8)
        assert parallel["attentionTp"] * parallel["attentionDp"] == 8


@pytest.mark.parametrize("model", ["deepseek-v3-dp8", "qwen3-dp8", "qwen3-dp4", "deepseek-v3-dp16"])
def test_every_new_table_names_its_source(model: str) -> None:
    data = table(model)
    assert data["aiconfiguratorVersion"] == "0.12.0"
    assert data["systemFile"] == "aiconfigurator_core/systems/h200_sxm.yaml"
    assert (data["system"], data["backend"], data["backendVersion"]) == (
        "h200_sxm",
        "sglang",
        "0.5.14",
    )
    assert data["generatedBy"] == "scripts/gen_cost_tables.py" and data["source"]
    # SGLang's H200 default chunk (8192) divided over the attention-DP ranks.
    assert data["chunkedPrefillSize"] == 8192 // load_profile(model).ranks


def test_qwen3_at_moe_tp8_is_bf16_and_deepseek_is_fp8() -> None:
    # Qwen3's 1536-wide experts over MoE TP8 leave 192 columns, which FP8's 128-wide
    # blocks do not divide: the BF16 checkpoint (with an FP8 KV cache).
    for model in ("qwen3-dp8", "qwen3-dp4"):
        quant = table(model)["quant"]
        assert quant == {"gemm": "bfloat16", "kvcache": "fp8", "fmha": "fp8", "moe": "bfloat16"}
        assert table(model)["model"] == "Qwen/Qwen3-235B-A22B"
    assert table("deepseek-v3-dp8")["quant"] == {
        "gemm": "fp8_block",
        "kvcache": "fp8",
        "fmha": "fp8",
        "moe": "fp8_block",
    }


def test_deepseek_dp8_matches_the_aiconfigurator_figures_the_notes_quote() -> None:
    # aiconfigurator 0.12.0 cli_estimate, h200_sxm, sglang: a 4k-token prefill step about
    # 957 ms, a decode step of 32 requests at 8k context about 71 ms; ~0.7 M tokens a rank.
    p = load_profile("deepseek-v3-dp8")
    assert p.prefill_seconds(4096, 0) == pytest.approx(0.957, abs=0.005)
    assert p.decode_seconds(32, 8192) == pytest.approx(0.0712, abs=0.001)
    assert 5_000_000 < p.kv_capacity < 7_500_000


@pytest.mark.parametrize("model", CAPABLE)
def test_the_operator_renders_flags_sglang_accepts_with_role_switching(model: str) -> None:
    argv = rendered_argv(model)
    p = load_profile(model)
    assert "--enable-pd-role-switch" in argv
    # Admission's engine-flag rules (what SGLang refuses with role switching: EP, MoE
    # all-to-all, PP, DCP, speculative decoding; what the agent refuses) pass the spec.
    spec = Scenario(model=model, task="coding").spec()
    env = [e.model_dump(by_alias=True, exclude_none=True) for e in spec.engine.env]
    assert engine_problems(spec.engine.extra_args, env) == []
    assert flag(argv, "--tp-size") == str(p.gpus_per_instance)
    if p.ranks > 1:
        # The spelling SGLang 0.5.23 still takes (handle_deprecated_dp_attention); the
        # TP size must divide over the attention-DP ranks (handle_data_parallelism).
        assert "--enable-dp-attention" in argv and flag(argv, "--dp-size") == str(p.ranks)
        assert p.gpus_per_instance % p.ranks == 0
    else:
        assert "--enable-dp-attention" not in argv
    spec = Scenario(model=model, task="coding").spec()
    assert ("--dp-aware" in router_args(cluster="sim", namespace="rl", spec=spec)) is (p.ranks > 1)


def test_deepseek_dp16_is_the_papers_instance_size_on_two_nodes_and_can_flip() -> None:
    """Paper §5.1's DeepSeek engine has 16 attention modules; without EP (which SGLang
    refuses with role switching) they run as attention DP16 over an MoE TP16."""
    p = load_profile("deepseek-v3-dp16")
    assert "deepseek-v3-dp16" in CAPABLE and p.role_switch_capable
    assert (p.gpus_per_instance, p.ranks, p.gpus_per_rank, p.nodes) == (16, 16, 1, 2)
    data = table("deepseek-v3-dp16")
    assert data["parallel"] == {
        "gpusPerInstance": 16,
        "attentionTp": 1,
        "attentionDp": 16,
        "moeTp": 16,
        "moeEp": 1,
        "nodes": 2,
    }
    assert data["quant"] == table("deepseek-v3-dp8")["quant"]
    # Each rank keeps its own MLA latent, unreplicated: 16 ranks hold 16 GPUs' worth.
    assert p.kv_capacity == 16 * p.kv_capacity_per_rank
    assert p.kv_capacity > 16 * load_profile("deepseek-v3-tp16").kv_capacity * 0.8


@pytest.mark.parametrize("name", ["deepseek-v3-dp16", "deepseek-v3-dp8"])
def test_more_tokens_are_never_faster_in_the_table(name: str) -> None:
    """Every grid point as aiconfigurator gave it: a prefill step with more new or more
    cached tokens, a decode step with more requests or longer contexts, never takes less."""
    data = table(name)
    for stage in ("prefill", "decode"):
        section = data[stage]
        assert isinstance(section, dict)
        ms = section["ms"]
        for row in ms:
            assert row == sorted(row), f"{name} {stage}: a longer context is faster"
        for col in zip(*ms, strict=True):
            assert list(col) == sorted(col), f"{name} {stage}: more tokens are faster"
