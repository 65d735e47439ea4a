"""Whether prefill-decode disaggregation, and so Prorsa, suits a deployment at all.

Two things decide it before any forecast does. SGLang 0.5.23 refuses to start an engine
with ``--enable-pd-role-switch`` next to expert parallelism, an MoE all-to-all backend,
pipeline or decode-context parallelism, or speculative decoding
(``srt/arg_groups/pd_disaggregation_hook.py``, ``handle_pd_disaggregation``): such engines
never come up. And disaggregation gains most where attention runs data-parallel: under
colocation a rank busy with a prefill chunk holds every decoding rank at the MoE layer
(the Prorsa paper, arXiv 2610.16592, §3.2). With attention tensor-parallel over the whole
instance there is no such stall, and colocation can beat every split (in this project's
simulator it does on the general-agent task; ``prorsa bench rollout`` prints it).
"""

from __future__ import annotations

from collections.abc import Sequence

from prorsa.core.spec import RolloutClusterSpec, flag_values

# Flags whose value above 1 (or other than "none") SGLang refuses with role switching.
_REFUSED_SIZES = ("--ep-size", "--ep", "--expert-parallel-size", "--pp-size", "--dcp-size")


def refused_flags(args: Sequence[str]) -> list[str]:
    """The engine flags SGLang 0.5.23 refuses next to ``--enable-pd-role-switch``."""
    bad = []
    for flag in _REFUSED_SIZES:
        bad += [f"{flag} {v}" for v in flag_values(args, flag) if v.isdigit() and int(v) > 1]
    bad += [f"--moe-a2a-backend {v}" for v in flag_values(args, "--moe-a2a-backend") if v != "none"]
    bad += [f"--speculative-algorithm {v}" for v in flag_values(args, "--speculative-algorithm")]
    return bad


def deployment_advice(spec: RolloutClusterSpec) -> list[str]:
    """Plain warnings for a user about to run this RolloutCluster (empty: none)."""
    notes = []
    bad = refused_flags(spec.engine.extra_args)
    if bad:
        notes.append(
            "engine.extraArgs has "
            + ", ".join(bad)
            + ": SGLang 0.5.23 refuses to start an engine with --enable-pd-role-switch and "
            "any of these; use MoE tensor parallelism (EP 1) and no speculative decoding"
        )
    if spec.engine.attention_dp_size == 1:
        notes.append(
            "attention is not data-parallel (no --enable-dp-attention in engine.extraArgs): "
            "prefill-decode disaggregation gains most where colocated prefill chunks stall "
            "the other DP ranks at the MoE layer; with one attention rank per instance, "
            "colocated engines can be faster than any prefill:decode split, so compare "
            "them on your workload before relying on Prorsa"
        )
    return notes
