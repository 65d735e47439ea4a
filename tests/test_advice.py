"""Deployment advice: engines SGLang will refuse, when colocation may win, and what to check
for attention DP (SGLang 0.5.23's parallel_hook and pd_disaggregation_hook)."""

from __future__ import annotations

import pytest
from conftest import make_spec

from prorsa.core.advice import deployment_advice, refused_flags


def test_role_switch_refusals_are_named() -> None:
    args = ["--ep-size", "8", "--moe-a2a-backend=deepep", "--pp-size", "1", "--dp-size", "4"]
    assert refused_flags(args) == ["--ep-size 8", "--moe-a2a-backend deepep"]
    assert refused_flags(["--speculative-algorithm", "EAGLE"]) == ["--speculative-algorithm EAGLE"]
    assert refused_flags(["--moe-a2a-backend", "none", "--ep", "1"]) == []
    assert refused_flags(["--pipeline-parallel-size", "2"]) == ["--pipeline-parallel-size 2"]
    assert refused_flags(["--enable-dp-attention-local-control-broadcast"]) == [
        "--enable-dp-attention-local-control-broadcast"
    ]


def test_advice_for_ep_and_for_pure_tensor_parallel_attention() -> None:
    ep = make_spec(engine={"extraArgs": ["--attn-dp-size", "4", "--ep", "8"]})
    notes = deployment_advice(ep)
    assert "--ep 8" in notes[0] and "refuses" in notes[0]
    tp = make_spec(engine={"extraArgs": []})
    (note,) = deployment_advice(tp)
    assert "not data-parallel" in note and "colocated" in note


@pytest.mark.parametrize(
    "args",
    [["--attn-dp-size", "2"], ["--enable-dp-attention", "--dp-size", "2"]],
    ids=["attn-dp-size", "deprecated spelling"],
)
def test_dp_attention_is_read_in_both_spellings(args: list[str]) -> None:
    spec = make_spec(engine={"extraArgs": args})
    assert spec.engine.attention_dp_size == 2
    notes = deployment_advice(spec)
    assert not any("not data-parallel" in n for n in notes)
    assert not any("refuses" in n for n in notes), notes
    # What to check: the chunk SGLang divides, and the per-rank prefill and cache.
    assert any("give --chunked-prefill-size as 2 x the per-rank chunk" in n for n in notes)
    assert any("on one rank" in n and "prorsa profile" in n for n in notes)


def test_dp_attention_checks_name_what_sglang_refuses_or_changes() -> None:
    spec = make_spec(
        engine={
            "tensorParallelSize": 6,
            "extraArgs": [
                "--attn-dp-size",
                "4",
                "--dp-size",
                "2",
                "--chunked-prefill-size",
                "8192",
            ],
            "env": [{"name": "SGLANG_RUST_SERVER", "value": "true"}],
        }
    )
    text = "\n".join(deployment_advice(spec))
    assert "engine.tensorParallelSize (6) is not a multiple of the attention-DP size (4)" in text
    assert "--dp-size 2 next to --attn-dp-size 4" in text
    assert "SGLANG_RUST_SERVER" in text and "local control broadcast" in text
    assert "each rank prefills chunks of 2048 tokens" in text
