"""Whether prefill-decode disaggregation, and so Prorsa, suits a deployment at all.

Two things decide it before any forecast does. SGLang 0.5.23 refuses to start an engine
with ``--enable-pd-role-switch`` next to expert parallelism, an MoE all-to-all backend,
pipeline or decode-context parallelism, or speculative decoding
(``srt/arg_groups/pd_disaggregation_hook.py``, ``handle_pd_disaggregation``): the spec's
admission refuses such engine flags (``prorsa.core.engine_flags``), so a RolloutCluster
that loads has none. And disaggregation gains most where attention runs data-parallel: under
colocation a rank busy with a prefill chunk holds every decoding rank at the MoE layer
(the Prorsa paper, arXiv 2610.16592, §3.2). With attention tensor-parallel over the whole
instance there is no such stall, and colocation can beat every split (in this project's
simulator it does on the general-agent task; ``prorsa bench rollout`` prints it).
"""

from __future__ import annotations

from prorsa.core.spec import RolloutClusterSpec


def deployment_advice(spec: RolloutClusterSpec) -> list[str]:
    """Plain warnings for a user about to run this RolloutCluster (empty: none)."""
    notes = []
    if spec.engine.attention_dp_size == 1:
        notes.append(
            "attention is not data-parallel (no --enable-dp-attention in engine.extraArgs): "
            "prefill-decode disaggregation gains most where colocated prefill chunks stall "
            "the other DP ranks at the MoE layer; with one attention rank per instance, "
            "colocated engines can be faster than any prefill:decode split, so compare "
            "them on your workload before relying on Prorsa"
        )
    return notes
