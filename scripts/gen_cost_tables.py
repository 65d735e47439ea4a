#!/usr/bin/env python3
"""Generate the rollout simulator's latency tables with NVIDIA aiconfigurator.

The simulator (``prorsa_lab.sim``) must not make up GPU speeds: every step time it uses is read
from a table that this script asks aiconfigurator (PyPI ``aiconfigurator==0.12.0``, Apache-2.0;
measured per-operation data for H200 under SGLang) to predict. The generated JSON files are
committed under ``tools/prorsa_lab/sim/data/`` so that the simulator and the benchmarks run
without aiconfigurator installed; it stays an optional extra (``prorsa[aiconfigurator]``).

Run (3-4 minutes per table on a free laptop core; about 12 when two run side by side on two
cores; ``--only NAME`` for one table)::

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
DEFAULT_OUT = ROOT / "tools" / "prorsa_lab" / "sim" / "data"

# Grids. Prefill chunks are at most the chunked-prefill size, but whole unchunked prompts
# and long cached prefixes (coding contexts reach 100k tokens) must be covered too.
PREFILL_NEW = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PREFILL_PREFIX = [0, 2048, 8192, 16384, 32768, 65536, 98304, 126976]
DECODE_BATCH = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
DECODE_CONTEXT = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]

GIB = 1 << 30
# H200 servers of the paper's testbed: 8 GPUs per node (NVLink inside, RDMA between).
GPUS_PER_NODE = 8
# SGLang reserves this fraction of GPU memory for weights plus KV (--mem-fraction-static is
# picked per GPU size; about 0.85 on 141 GB parts); the rest holds activations and graphs.
MEM_FRACTION_STATIC = 0.85
# One 400 Gbps RDMA NIC per GPU on the paper's testbed (§5.1): about 50 GB/s each.
NIC_BYTES_PER_SECOND_PER_GPU = 50e9


# BF16 weights with an FP8 KV cache (--kv-cache-dtype fp8_e4m3). SGLang's FA3 backend (the
# Hopper default) then casts the queries to FP8 too, in prefill and decode
# (FlashAttentionBackend: q = q.to(self.kv_cache_dtype)), so the attention kernels are FP8.
BF16_WEIGHTS_FP8_KV = {"kvcache_quant_mode": "fp8", "fmha_quant_mode": "fp8"}


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
    kv_bytes_per_token: int  # the model's unique KV per token (what one copy of it weighs)
    source: str
    moe_tp: int = 1
    # SGLang 0.5.23 refuses --enable-pd-role-switch with --ep-size > 1 (and MoE all-to-all
    # backends, PP, DCP, speculative decoding): see docs/sglang-role-switch.md.
    role_switch_capable: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tp * self.dp != self.gpus or self.moe_tp * self.moe_ep != self.gpus:
            raise ValueError(f"{self.name}: parallel sizes do not cover {self.gpus} GPUs")
        if self.role_switch_capable and self.moe_ep > 1:
            raise ValueError(f"{self.name}: SGLang refuses role switching with EP > 1")


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
    # kept so that its aiconfigurator anchors (docs/deployments.md) can be checked (tests do).
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
        source="aiconfigurator anchors of Qwen3-235B at TP8, BF16 (docs/deployments.md)",
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
    # ---- Role-switch-capable deployments (MoE tensor parallel, EP = 1) ------------------
    # SGLang 0.5.23 flips an instance between prefill and decode only without expert
    # parallelism (pd_disaggregation_hook.handle_pd_disaggregation). The MoE layer must
    # then be tensor parallel across the instance. Qwen3-235B-A22B's experts are
    # 1536 wide: at MoE TP8 a GPU holds 192 columns, which the FP8 checkpoint's 128x128
    # weight blocks do not divide (SGLang's Fp8MoEMethod.create_weights refuses it, and
    # so does aiconfigurator's _validate_fp8_block_quantized_moe_config). So the 8-GPU
    # Qwen3 instances below serve the BF16 checkpoint, with an FP8 KV cache
    # (--kv-cache-dtype fp8_e4m3), and the FP8 checkpoint gets 4-GPU instances (MoE TP4,
    # 384 columns = 3 blocks). Qwen3 has 4 KV heads: at attention TP8 each GPU holds one,
    # every head twice over (SGLang replicates KV heads when TP > KV heads); at TP4 each
    # GPU holds one distinct head. aiconfigurator's KV per GPU (kvBytesPerTokenPerGpu)
    # counts the replicas, and the capacity per rank is the free memory of a GPU over it.
    Deployment(
        name="qwen3-235b-bf16-tp8",
        model_path="Qwen/Qwen3-235B-A22B",
        title="Qwen3-235B-A22B (BF16 weights), 8xH200, attention TP8, MoE TP8 (EP1), "
        "FP8 KV; role-switch-capable",
        gpus=8,
        tp=8,
        dp=1,
        moe_tp=8,
        moe_ep=1,
        chunk=4096,
        max_context=131072,
        kv_bytes_per_token=94 * 4 * 128 * 2 * 1,
        source="role-switch-capable Qwen3 at TP8 (the FP8 checkpoint cannot run MoE TP8)",
        role_switch_capable=True,
        extra=BF16_WEIGHTS_FP8_KV,
    ),
    # Shaped like the paper's Qwen3 instance (several attention-DP ranks on 8 GPUs), with
    # 2 ranks (--attn-dp-size 2, formerly --enable-dp-attention --dp-size 2) of attention
    # TP4 and the MoE tensor parallel over all 8 GPUs.
    Deployment(
        name="qwen3-235b-bf16-dp2",
        model_path="Qwen/Qwen3-235B-A22B",
        title="Qwen3-235B-A22B (BF16 weights), 8xH200, attention TP4 x DP2, MoE TP8 (EP1), "
        "FP8 KV; role-switch-capable",
        gpus=8,
        tp=4,
        dp=2,
        moe_tp=8,
        moe_ep=1,
        chunk=4096,
        max_context=131072,
        kv_bytes_per_token=94 * 4 * 128 * 2 * 1,
        source="role-switch-capable, paper-shaped (2 attention-DP ranks, chunk 4096)",
        role_switch_capable=True,
        extra=BF16_WEIGHTS_FP8_KV,
    ),
    # The FP8 checkpoint (the paper's "all models use FP8"), role-switch-capable: MoE TP4.
    Deployment(
        name="qwen3-235b-fp8-tp4",
        model_path="Qwen/Qwen3-235B-A22B-FP8",
        title="Qwen3-235B-A22B-FP8, 4xH200, attention TP4, MoE TP4 (EP1), FP8 KV; "
        "role-switch-capable",
        gpus=4,
        tp=4,
        dp=1,
        moe_tp=4,
        moe_ep=1,
        chunk=4096,
        max_context=131072,
        kv_bytes_per_token=94 * 4 * 128 * 2 * 1,
        source="role-switch-capable FP8 Qwen3 (MoE TP4: 1536/4 = 3 FP8 blocks)",
        role_switch_capable=True,
    ),
    Deployment(
        name="qwen3-235b-fp8-tp2dp2",
        model_path="Qwen/Qwen3-235B-A22B-FP8",
        title="Qwen3-235B-A22B-FP8, 4xH200, attention TP2 x DP2, MoE TP4 (EP1), FP8 KV; "
        "role-switch-capable",
        gpus=4,
        tp=2,
        dp=2,
        moe_tp=4,
        moe_ep=1,
        chunk=4096,
        max_context=131072,
        kv_bytes_per_token=94 * 4 * 128 * 2 * 1,
        source="role-switch-capable FP8 Qwen3 with the paper's attention TP2 (2 DP ranks)",
        role_switch_capable=True,
    ),
    # DeepSeek-V3 at attention TP16 over two 8-GPU servers, MoE TP16 (EP1), FP8 (2048-wide
    # experts / 16 = 128: one FP8 block), chunk 512 as in §5.1. MLA keeps one latent KV per
    # token (61 x 576 bytes in FP8) and every TP rank holds all of it (replicated), so an
    # instance holds as many tokens as ONE GPU's free memory does. aiconfigurator has
    # measured all-reduce data for 2, 4 and 8 GPUs only; past a node it models the
    # all-reduce from its system file (50 GB/s per GPU between nodes, 10 us per hop).
    Deployment(
        name="deepseek-v3-tp16",
        model_path="deepseek-ai/DeepSeek-V3",
        title="DeepSeek-V3, 16xH200 (2 nodes), attention TP16, MoE TP16 (EP1), FP8; "
        "role-switch-capable",
        gpus=16,
        tp=16,
        dp=1,
        moe_tp=16,
        moe_ep=1,
        chunk=512,
        max_context=131072,
        kv_bytes_per_token=61 * 576 * 1,
        source="role-switch-capable DeepSeek (TP16 over 2 nodes, chunk 512 as paper §5.1)",
        role_switch_capable=True,
    ),
    # ---- Attention data parallel over a tensor-parallel MoE (role-switch-capable) ------
    # SGLang 0.5.23 allows DP attention with --enable-pd-role-switch (only EP, MoE
    # all-to-all, PP, DCP, speculative decoding and DP-attention local control broadcast
    # are refused: pd_disaggregation_hook.handle_pd_disaggregation). Each attention-DP rank
    # runs its own requests and all ranks meet in the MoE layer, the shape where colocated
    # prefill stalls every decoding rank (paper §3.2). Chunk per rank: SGLang's H200
    # default --chunked-prefill-size 8192 (memory_hook._handle_gpu_memory_settings),
    # divided by the attention-DP size (parallel_hook._handle_data_parallelism).
    #
    # SGLang's DeepSeek recipe on one 8-GPU node: --tp 8 --dp 8 --enable-dp-attention,
    # no EP, so the MoE runs TP8 (2048-wide experts / 8 = 256 columns = two FP8 blocks).
    # Attention TP1: each rank keeps its own MLA latent (61 x 576 bytes, FP8), unreplicated.
    Deployment(
        name="deepseek-v3-dp8",
        model_path="deepseek-ai/DeepSeek-V3",
        title="DeepSeek-V3, 8xH200, attention DP8 (TP1 each), MoE TP8 (EP1), FP8; "
        "role-switch-capable",
        gpus=8,
        tp=1,
        dp=8,
        moe_tp=8,
        moe_ep=1,
        chunk=1024,
        max_context=131072,
        kv_bytes_per_token=61 * 576 * 1,
        source="SGLang's one-node DeepSeek recipe (--tp 8 --dp 8 --enable-dp-attention), "
        "MoE TP8, chunk 8192/8",
        role_switch_capable=True,
    ),
    # The paper's DeepSeek instance size (16 attention modules per engine, §5.1) in the
    # shape SGLang runs DeepSeek across two nodes without EP: --tp 16 --dp 16
    # --enable-dp-attention --nnodes 2, so attention DP16 (TP1 each) over an MoE TP16
    # (2048-wide experts / 16 = 128 columns: one FP8 block). The MoE all-reduce spans both
    # nodes; aiconfigurator has measured all-reduce data up to 8 GPUs and models the
    # cross-node part from its system file, as for deepseek-v3-tp16. Chunk per rank:
    # 8192 / 16 = 512, which is also the paper's DeepSeek chunk.
    Deployment(
        name="deepseek-v3-dp16",
        model_path="deepseek-ai/DeepSeek-V3",
        title="DeepSeek-V3, 16xH200 (2 nodes), attention DP16 (TP1 each), MoE TP16 (EP1), "
        "FP8; role-switch-capable",
        gpus=16,
        tp=1,
        dp=16,
        moe_tp=16,
        moe_ep=1,
        chunk=512,
        max_context=131072,
        kv_bytes_per_token=61 * 576 * 1,
        source="SGLang's two-node DeepSeek DP attention (--tp 16 --dp 16 "
        "--enable-dp-attention --nnodes 2) without EP: MoE TP16, chunk 8192/16",
        role_switch_capable=True,
    ),
    # Qwen3-235B-A22B with attention DP8 over MoE TP8: the BF16 checkpoint (the FP8 one's
    # 1536-wide experts / 8 = 192 columns do not divide into 128-wide blocks; aiconfigurator
    # refuses it, "Invalid quantized MoE configuration"), FP8 KV cache as the other BF16
    # Qwen3 tables. Attention TP1: each rank holds all 4 KV heads once (96,256 B/token).
    Deployment(
        name="qwen3-235b-bf16-dp8",
        model_path="Qwen/Qwen3-235B-A22B",
        title="Qwen3-235B-A22B (BF16 weights), 8xH200, attention DP8 (TP1 each), MoE TP8 "
        "(EP1), FP8 KV; role-switch-capable",
        gpus=8,
        tp=1,
        dp=8,
        moe_tp=8,
        moe_ep=1,
        chunk=1024,
        max_context=131072,
        kv_bytes_per_token=94 * 4 * 128 * 2 * 1,
        source="attention DP8 over MoE TP8 (BF16: FP8 blocks do not divide 1536/8), chunk 8192/8",
        role_switch_capable=True,
        extra=BF16_WEIGHTS_FP8_KV,
    ),
    # The paper's Qwen3 attention shape (TP2 x DP4) with the MoE tensor parallel over the
    # node instead of EP8, so SGLang can flip it; BF16 for the same reason as DP8.
    Deployment(
        name="qwen3-235b-bf16-dp4",
        model_path="Qwen/Qwen3-235B-A22B",
        title="Qwen3-235B-A22B (BF16 weights), 8xH200, attention TP2 x DP4, MoE TP8 (EP1), "
        "FP8 KV; role-switch-capable",
        gpus=8,
        tp=2,
        dp=4,
        moe_tp=8,
        moe_ep=1,
        chunk=2048,
        max_context=131072,
        kv_bytes_per_token=94 * 4 * 128 * 2 * 1,
        source="paper §5.1's attention TP2 x DP4 with MoE TP8 instead of EP8 (BF16), chunk 8192/4",
        role_switch_capable=True,
        extra=BF16_WEIGHTS_FP8_KV,
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
        moe_tp_size=dep.moe_tp,
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
    # One rank's GPUs hold at least one copy of the model's KV between them; more where
    # KV is replicated (KV heads < attention TP, or MLA's latent on every TP rank).
    if kv_per_gpu * gpus_per_rank < dep.kv_bytes_per_token * 0.999:
        raise RuntimeError(f"{dep.name}: aiconfigurator's KV per GPU {kv_per_gpu} is short")
    static = MEM_FRACTION_STATIC * capacity
    fixed = (memory["weights"] + memory["nccl"]) * GIB
    kv_tokens_per_rank = int((static - fixed) / kv_per_gpu)
    return {
        "name": dep.name,
        "title": dep.title,
        "model": dep.model_path,
        "system": "h200_sxm",
        # The system file aiconfigurator read (GPU, NVLink, NIC figures) and its data set.
        "systemFile": "aiconfigurator_core/systems/h200_sxm.yaml",
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
            "moeTp": dep.moe_tp,
            "moeEp": dep.moe_ep,
            "nodes": -(-dep.gpus // GPUS_PER_NODE),
        },
        "roleSwitchCapable": dep.role_switch_capable,
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
