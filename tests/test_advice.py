"""Deployment advice: engines SGLang will refuse, and when colocation may win."""

from __future__ import annotations

from conftest import make_spec

from prorsa.core.advice import deployment_advice, refused_flags


def test_role_switch_refusals_are_named() -> None:
    args = ["--ep-size", "8", "--moe-a2a-backend=deepep", "--pp-size", "1", "--dp-size", "4"]
    assert refused_flags(args) == ["--ep-size 8", "--moe-a2a-backend deepep"]
    assert refused_flags(["--speculative-algorithm", "EAGLE"]) == ["--speculative-algorithm EAGLE"]
    assert refused_flags(["--moe-a2a-backend", "none", "--ep", "1"]) == []


def test_advice_for_ep_and_for_pure_tensor_parallel_attention() -> None:
    ep = make_spec(engine={"extraArgs": ["--enable-dp-attention", "--dp-size", "4", "--ep", "8"]})
    (note,) = deployment_advice(ep)
    assert "--ep 8" in note and "refuses" in note
    tp = make_spec(engine={"extraArgs": []})
    (note,) = deployment_advice(tp)
    assert "not data-parallel" in note and "colocated" in note
    dp = make_spec(engine={"extraArgs": ["--enable-dp-attention", "--dp-size", "2"]})
    assert deployment_advice(dp) == []
