"""Whether prefill-decode disaggregation, and so Prorsa, suits a deployment at all.

Read from the manifest alone, before any forecast. What SGLang 0.5.23 refuses to start with
``--enable-pd-role-switch`` (expert parallelism, an MoE all-to-all backend, pipeline or
decode-context parallelism, speculative decoding, DP attention's local control broadcast)
never gets this far: the spec refuses it, naming the field (``prorsa.core.engine_flags``).
DP attention itself is allowed. Disaggregation gains most where attention runs
data-parallel: under colocation a rank busy with a prefill chunk holds every decoding rank at
the MoE layer (the Prorsa paper, arXiv 2610.16592, §3.2). With attention tensor-parallel
over the whole instance there is no such stall, and colocation can beat every split (in
this project's simulator it does on the asynchronous agentic runs; ``prorsa bench rollout``
prints it).

The notes here are advice, never a refusal of the manifest: what an attention-DP deployment
changes, and one refusal the spec cannot express (``tensorParallelSize`` a multiple of the
attention-DP size needs arithmetic over a flag's value, which the CRD's rules cannot do).
"""

from __future__ import annotations

from prorsa.core.engine_flags import flag_values
from prorsa.core.spec import RolloutClusterSpec


def deployment_advice(spec: RolloutClusterSpec) -> list[str]:
    """Plain warnings for a user about to run this RolloutCluster (empty: none)."""
    notes = []
    dp = spec.engine.attention_dp_size
    if dp == 1:
        notes.append(
            "attention is not data-parallel (no --attn-dp-size in engine.extraArgs): "
            "prefill-decode disaggregation gains most where colocated prefill chunks stall "
            "the other DP ranks at the MoE layer; with one attention rank per instance, "
            "colocated engines can be faster than any prefill:decode split, so compare "
            "them on your workload before relying on Prorsa"
        )
        return notes
    return notes + _dp_attention_checks(spec, dp)


def _dp_attention_checks(spec: RolloutClusterSpec, dp: int) -> list[str]:
    """What to check for attention DP: SGLang's refusals and what it changes
    (``srt/arg_groups/parallel_hook.py``, ``handle_data_parallelism``)."""
    engine = spec.engine
    args = engine.extra_args
    notes = []
    tp = engine.tensor_parallel_size
    if tp % dp:
        notes.append(
            f"engine.tensorParallelSize ({tp}) is not a multiple of the attention-DP size "
            f"({dp}): SGLang refuses to start (each DP rank runs attention over tp/dp GPUs)"
        )
    chunks = [v for v in flag_values(args, "--chunked-prefill-size") if v.isdigit()]
    if chunks:
        chunk = int(chunks[-1])
        notes.append(
            f"attention DP over {dp} ranks: SGLang divides --chunked-prefill-size {chunk} by "
            f"{dp}, so each rank prefills chunks of {chunk // dp} tokens; check that is the "
            "per-rank chunk you meant"
        )
    else:
        notes.append(
            f"attention DP over {dp} ranks: SGLang divides its chunked-prefill size by {dp}; "
            f"give --chunked-prefill-size as {dp} x the per-rank chunk you want"
        )
    notes.append(
        f"attention DP over {dp} ranks: each request prefills and decodes on one rank, so "
        f"a long prompt takes {dp}x as long as capacity.prefillTokensPerSecond suggests, and "
        "a trajectory's prefix cache is on the rank that served its last turn (SGLang "
        "calls the decode radix cache with DP attention experimental: hits need DP-rank "
        "routing); profile capacity on this deployment (prorsa profile)"
    )
    return notes
