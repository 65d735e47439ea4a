"""Deployment advice: engines SGLang will refuse, when colocation may win, and what to check
for attention DP (SGLang 0.5.23's parallel_hook and pd_disaggregation_hook)."""

from __future__ import annotations

import pytest
from conftest import make_spec

from prorsa.core.advice import deployment_advice
from prorsa.core.spec import SpecError


def test_flags_sglang_refuses_are_refused_not_advised() -> None:
    """The spec refuses them, naming the field (tests/test_engine_flags.py has each rule;
    tests/real_engine/test_sglang_validation.py holds them to SGLang's own validation)."""
    with pytest.raises(SpecError, match=r"spec\.engine\.extraArgs: --ep 8: .*expert"):
        make_spec(engine={"extraArgs": ["--attn-dp-size", "4", "--ep", "8"]})


def test_advice_for_pure_tensor_parallel_attention() -> None:
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
            "extraArgs": ["--attn-dp-size", "4", "--chunked-prefill-size", "8192"],
        }
    )
    text = "\n".join(deployment_advice(spec))
    assert "engine.tensorParallelSize (6) is not a multiple of the attention-DP size (4)" in text
    assert "each rank prefills chunks of 2048 tokens" in text
