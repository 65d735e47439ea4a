#!/usr/bin/env python3
"""Generate the rollout simulator's latency tables with NVIDIA aiconfigurator.

The simulator (``prorsa.sim``) must not make up GPU speeds: every step time it uses is read
from a table that this script asks aiconfigurator (PyPI ``aiconfigurator==0.12.0``, Apache-2.0;
measured per-operation data for H200 under SGLang) to predict. The generated JSON files are
committed under ``operator/prorsa/sim/data/`` so that the simulator and the benchmarks run
without aiconfigurator installed; it stays an optional extra (``prorsa[aiconfigurator]``).

Run (about 8 minutes on a laptop CPU)::

    python -m venv /tmp/aic-venv && /tmp/aic-venv/bin/pip install aiconfigurator==0.12.0
    /tmp/aic-venv/bin/python scripts/gen_cost_tables.py [--only NAME] [--out DIR]

Each table is per attention-DP rank: ``prefill.ms[i][j]`` is one step in which every DP rank
of the instance prefills ``newTokens[i]`` tokens on top of ``prefixTokens[j]`` cached tokens
(aiconfigurator ``static_ctx`` with ``isl = new + prefix`` and ``prefix``), and
``decode.ms[i][j]`` is one decode step in which every rank holds ``batch[i]`` requests of
``contextTokens[j]`` tokens each (``static_gen``, ``tpot``). The simulator derives the
colocation interference from these by letting each step last as long as its slowest rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "operator" / "prorsa" / "sim" / "data"

# Grids. Prefill chunks are at most the chunked-prefill size, but whole unchunked prompts
# and long cached prefixes (coding contexts reach 100k tokens) must be covered too.
PREFILL_NEW = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PREFILL_PREFIX = [0, 2048, 8192, 16384, 32768, 65536, 98304, 126976]
DECODE_BATCH = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
DECODE_CONTEXT = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]

GIB = 1 << 30
# SGLang reserves this fraction of GPU memory for weights plus KV (--mem-fraction-static is
# picked per GPU size; about 0.85 on 141 GB parts); the rest holds activations and graphs.
MEM_FRACTION_STATIC = 0.85
# One 400 Gbps RDMA NIC per GPU on the paper's testbed (§5.1): about 50 GB/s each.
NIC_BYTES_PER_SECOND_PER_GPU = 50e9


@dataclass(frozen=True)
class Deployment:
    """One engine instance configuration, as the paper's §5.1 deploys it."""

    name: str
    model_path: str
    title: str
    gpus: int
    tp: int
    dp: int
    moe_ep: int
    chunk: int
    max_context: int
    kv_bytes_per_token: int
    source: str
    extra: dict[str, Any] = field(default_factory=dict)


DEPLOYMENTS = [
    # Paper §5.1: Qwen3-235B with attention TP=2 (so 4 attention-DP ranks on 8 GPUs),
    # chunked prefill 4096, the FP8 checkpoint ("all models use FP8 quantization"), with the
    # quantization aiconfigurator infers for it (FP8 GEMM/MoE and an FP8 KV cache, as for
    # DeepSeek below). KV per token: 94 layers x 4 KV heads x 128 x 2 (K,V) x 1 byte.
    Deployment(
        name="qwen3-235b-a22b",
        model_path="Qwen/Qwen3-235B-A22B-FP8",
        title="Qwen3-235B-A22B-FP8, 8xH200, attention TP2 x DP4, MoE EP8, FP8 KV",
        gpus=8,
        tp=2,
        dp=4,
        moe_ep=8,
        chunk=4096,
        max_context=131072,
        kv_bytes_per_token=94 * 4 * 128 * 2 * 1,
        source="paper §5.1 (attention TP=2, chunk 4096, FP8)",
    ),
    # BF16 at plain TP8 (one attention rank): the configuration the project notes quote;
    # kept so that the anchors in shared/notes/performance.md can be checked (tests do).
    Deployment(
        name="qwen3-235b-a22b-tp8",
        model_path="Qwen/Qwen3-235B-A22B",
        title="Qwen3-235B-A22B, 8xH200, TP8, MoE EP8, BF16",
        gpus=8,
        tp=8,
        dp=1,
        moe_ep=8,
        chunk=4096,
        max_context=131072,
        kv_bytes_per_token=94 * 4 * 128 * 2 * 2,
        source="shared/notes/performance.md anchors (TP8)",
    ),
    # Paper §5.1: DeepSeek with EP16 and no attention TP, i.e. 16 attention-DP ranks on two
    # 8-GPU servers, chunk 512. MLA KV per token: 61 layers x 576 x 1 byte (aiconfigurator's
    # H200/SGLang wide-EP data exists only for an FP8 KV cache; BF16 would be 70,272 bytes).
    Deployment(
        name="deepseek-v3",
        model_path="deepseek-ai/DeepSeek-V3",
        title="DeepSeek-V3, 16xH200, attention DP16, MoE EP16, FP8",
        gpus=16,
        tp=1,
        dp=16,
        moe_ep=16,
        chunk=512,
        max_context=131072,
        kv_bytes_per_token=61 * 576 * 1,
        source="paper §5.1 (EP16, attention TP disabled, chunk 512)",
    ),
]


def _estimate(dep: Deployment, *, mode: str, isl: int, batch: int, prefix: int = 0) -> Any:
    from aiconfigurator.cli.api import cli_estimate

    return cli_estimate(
        model_path=dep.model_path,
        system_name="h200_sxm",
        backend_name="sglang",
        mode=mode,
        isl=isl,
        osl=1 if mode == "static_ctx" else 2,
        batch_size=batch,
        prefix=prefix,
        tp_size=dep.tp,
        attention_dp_size=dep.dp,
        moe_ep_size=dep.moe_ep,
        moe_tp_size=1,
        **dep.extra,
    )


def build(dep: Deployment) -> dict[str, Any]:
    import aiconfigurator

    started = time.monotonic()
    prefill: list[list[float]] = []
    for new in PREFILL_NEW:
        row = []
        for prefix in PREFILL_PREFIX:
            res = _estimate(dep, mode="static_ctx", isl=new + prefix, batch=1, prefix=prefix)
            row.append(round(float(res.ttft), 4))
        prefill.append(row)
        print(f"  {dep.name}: prefill new={new} done", file=sys.stderr, flush=True)
    decode: list[list[float]] = []
    memory: dict[str, float] = {}
    kv_per_gpu = 0.0
    version = ""
    quant: dict[str, str] = {}
    for batch in DECODE_BATCH:
        row = []
        for ctx in DECODE_CONTEXT:
            res = _estimate(dep, mode="static_gen", isl=ctx, batch=batch)
            row.append(round(float(res.tpot), 4))
            if not memory:
                memory = {k: float(v) for k, v in res.summary.get_memory().items()}
                kv_bytes, tokens = res.summary.get_kv_per_seq()
                kv_per_gpu = float(kv_bytes) / float(tokens)
                version = str(res.backend_version)
                quant = {k: str(res.raw[k]) for k in ("gemm", "kvcache", "fmha", "moe")}
                capacity = float(res.summary.get_mem_capacity_bytes())
        decode.append(row)
        print(f"  {dep.name}: decode batch={batch} done", file=sys.stderr, flush=True)
    gpus_per_rank = dep.gpus // dep.dp
    static = MEM_FRACTION_STATIC * capacity
    fixed = (memory["weights"] + memory["nccl"]) * GIB
    kv_tokens_per_rank = int((static - fixed) / kv_per_gpu)
    return {
        "name": dep.name,
        "title": dep.title,
        "model": dep.model_path,
        "system": "h200_sxm",
        "backend": "sglang",
        "backendVersion": version,
        "aiconfiguratorVersion": aiconfigurator.__version__
        if hasattr(aiconfigurator, "__version__")
        else "0.12.0",
        "source": dep.source,
        "quant": quant,
        "parallel": {
            "gpusPerInstance": dep.gpus,
            "attentionTp": dep.tp,
            "attentionDp": dep.dp,
            "moeEp": dep.moe_ep,
        },
        "chunkedPrefillSize": dep.chunk,
        "maxContextTokens": dep.max_context,
        "kvBytesPerToken": dep.kv_bytes_per_token,
        "kvBytesPerTokenPerGpu": kv_per_gpu,
        "kvCapacityTokensPerRank": kv_tokens_per_rank,
        "memory": {
            "capacityBytesPerGpu": capacity,
            "memFractionStatic": MEM_FRACTION_STATIC,
            "weightsGiBPerGpu": memory["weights"],
            "ncclGiBPerGpu": memory["nccl"],
        },
        "transferBytesPerSecondPerRank": NIC_BYTES_PER_SECOND_PER_GPU * gpus_per_rank,
        "prefill": {"newTokens": PREFILL_NEW, "prefixTokens": PREFILL_PREFIX, "ms": prefill},
        "decode": {"batch": DECODE_BATCH, "contextTokens": DECODE_CONTEXT, "ms": decode},
        "generatedBy": "scripts/gen_cost_tables.py",
        "generationSeconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", action="append", help="deployment name (repeatable)")
    args = parser.parse_args(argv)
    try:
        import aiconfigurator  # noqa: F401
    except ImportError:
        print(
            "aiconfigurator is not installed: pip install 'prorsa[aiconfigurator]' "
            "(or aiconfigurator==0.12.0 in a separate venv)",
            file=sys.stderr,
        )
        return 2
    logging.disable(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    for dep in DEPLOYMENTS:
        if args.only and dep.name not in args.only:
            continue
        table = build(dep)
        path = args.out / f"{dep.name}.json"
        path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {path} ({table['generationSeconds']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
