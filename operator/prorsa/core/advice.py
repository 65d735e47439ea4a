"""Whether prefill-decode disaggregation, and so Prorsa, suits a deployment at all.

Read from the manifest alone, before any forecast. Two things decide it. SGLang 0.5.23
refuses to start an engine with ``--enable-pd-role-switch`` next to expert parallelism,
an MoE all-to-all backend, pipeline or decode-context parallelism, speculative decoding,
or DP attention's local control broadcast (``srt/arg_groups/pd_disaggregation_hook.py``,
``handle_pd_disaggregation``): such engines never come up. DP attention itself is allowed.
And disaggregation gains most where attention runs data-parallel: under colocation a rank
busy with a prefill chunk holds every decoding rank at the MoE layer (the Prorsa paper,
arXiv 2610.16592, §3.2). With attention tensor-parallel over the whole instance there is
no such stall, and colocation can beat every split (in this project's simulator it does on
the asynchronous agentic runs; ``prorsa bench rollout`` prints it).

The checks here are about SGLang's command line, which the CRD cannot see into: they are
advice, never a refusal of the manifest.
"""

from __future__ import annotations

from collections.abc import Sequence

from prorsa.core.spec import RolloutClusterSpec, flag_values

# Flags whose value above 1 SGLang refuses with role switching (aliases from
# srt/arg_groups/fields/parallel.py).
_REFUSED_SIZES = (
    "--ep-size",
    "--ep",
    "--expert-parallel-size",
    "--pp-size",
    "--pipeline-parallel-size",
    "--dcp-size",
    "--decode-context-parallel-size",
)
_TRUE = ("true", "1", "yes", "y")  # SGLang's EnvBool (srt/environ.py)


def refused_flags(args: Sequence[str]) -> list[str]:
    """The engine flags SGLang 0.5.23 refuses next to ``--enable-pd-role-switch``."""
    bad = []
    for flag in _REFUSED_SIZES:
        bad += [f"{flag} {v}" for v in flag_values(args, flag) if v.isdigit() and int(v) > 1]
    bad += [f"--moe-a2a-backend {v}" for v in flag_values(args, "--moe-a2a-backend") if v != "none"]
    bad += [f"--speculative-algorithm {v}" for v in flag_values(args, "--speculative-algorithm")]
    if "--enable-dp-attention-local-control-broadcast" in args:
        bad.append("--enable-dp-attention-local-control-broadcast")
    return bad


def _env(spec: RolloutClusterSpec, name: str) -> str | None:
    values = [e.get("value") for e in spec.engine.env if e.get("name") == name]
    value = values[-1] if values else None
    return value if isinstance(value, str) else None


def deployment_advice(spec: RolloutClusterSpec) -> list[str]:
    """Plain warnings for a user about to run this RolloutCluster (empty: none)."""
    notes = []
    engine = spec.engine
    args = engine.extra_args
    bad = refused_flags(args)
    if bad:
        notes.append(
            "engine.extraArgs has "
            + ", ".join(bad)
            + ": SGLang 0.5.23 refuses to start an engine with --enable-pd-role-switch and "
            "any of these; use MoE tensor parallelism (EP 1), no speculative decoding and "
            "no local control broadcast"
        )
    dp = engine.attention_dp_size
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
    replicas = [
        int(v)
        for v in flag_values(args, "--dp-size", "--data-parallel-size")
        if v.isdigit() and int(v) > 1
    ]
    if replicas and "--enable-dp-attention" not in args:
        notes.append(
            f"engine.extraArgs has --dp-size {replicas[-1]} next to --attn-dp-size {dp}: "
            "SGLang refuses data-parallel replicas combined with attention DP; an instance "
            "is one replica (drop --dp-size)"
        )
    rust = _env(spec, "SGLANG_RUST_SERVER")
    if rust is not None and rust.lower() in _TRUE:
        notes.append(
            "engine.env sets SGLANG_RUST_SERVER: with attention DP SGLang then turns on "
            "the local control broadcast, which --enable-pd-role-switch refuses; unset it"
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
