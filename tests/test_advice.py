"""Deployment advice: engines SGLang will refuse, and when colocation may win."""

from __future__ import annotations

import pytest
from conftest import make_spec

from prorsa.core.advice import deployment_advice
from prorsa.core.engine_flags import role_switch_refusals
from prorsa.core.spec import SpecError


def test_role_switch_refusals_are_named() -> None:
    args = ["--ep-size", "8", "--moe-a2a-backend=deepep", "--pp-size", "1", "--dp-size", "4"]
    assert role_switch_refusals(args) == [
        "--ep-size 8 (expert parallelism)",
        "--moe-a2a-backend deepep (MoE all-to-all)",
    ]
    assert role_switch_refusals(["--speculative-algorithm", "EAGLE"]) == [
        "--speculative-algorithm EAGLE (speculative decoding)"
    ]
    assert role_switch_refusals(["--moe-a2a-backend", "none", "--ep", "1"]) == []


def test_a_spec_with_flags_sglang_refuses_does_not_load() -> None:
    """Admission refuses them, naming the field (tests/real_engine/test_sglang_validation.py
    holds every rule against SGLang's own validation)."""
    with pytest.raises(SpecError, match=r"spec\.engine\.extraArgs: .*--ep 8 \(expert"):
        make_spec(engine={"extraArgs": ["--enable-dp-attention", "--dp-size", "4", "--ep", "8"]})


def test_advice_for_pure_tensor_parallel_attention() -> None:
    tp = make_spec(engine={"extraArgs": []})
    (note,) = deployment_advice(tp)
    assert "not data-parallel" in note and "colocated" in note
    dp = make_spec(engine={"extraArgs": ["--enable-dp-attention", "--dp-size", "2"]})
    assert deployment_advice(dp) == []
