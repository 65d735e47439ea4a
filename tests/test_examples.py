"""The example RolloutCluster's sizes follow from the deployment it declares.

Its engine memory is the HiCache host tier SGLang builds next to the GPU KV pool
(docs/engine-flags.md): twice the pool's bytes on each of the 8 ranks, fitted into 0.8 x
0.95 of what the limit leaves after a 10 GiB reserve (SGLang 0.5.23
``srt/mem_cache/hicache_auto_size.py``). The pool's bytes come from the profiled cost
table of the same deployment, FP8 KV included, which the simulator also uses.
"""

from __future__ import annotations

import json
from pathlib import Path

from prorsa.core.engine_flags import flag_values
from prorsa.k8s.manifest_file import load_cluster

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
# Qwen3-235B-A22B's config.json: 94 layers, 4 KV heads of 128 dims; TP8 gives each rank one.
LAYERS, KV_HEADS_PER_RANK, HEAD_DIM = 94, 1, 128
FP8_BYTES = 1
HICACHE_RATIO = 2.0
HOST_FRACTION, SLACK, RESERVE = 0.8, 0.05, 10 * GIB


def _gib(quantity: str) -> float:
    assert quantity.endswith("Gi"), quantity
    return float(quantity[:-2])


def test_the_example_engine_memory_holds_the_fp8_host_pool() -> None:
    spec = load_cluster(ROOT / "examples" / "rolloutcluster.yaml").spec
    engine = spec.engine
    assert flag_values(engine.extra_args, "--kv-cache-dtype") == ["fp8_e4m3"]
    table = json.loads((ROOT / "tools/prorsa_lab/sim/data/qwen3-235b-bf16-tp8.json").read_text())
    assert "FP8 KV" in table["title"] and table["roleSwitchCapable"]
    per_token = 2 * LAYERS * KV_HEADS_PER_RANK * HEAD_DIM * FP8_BYTES
    assert per_token == table["kvBytesPerTokenPerGpu"] == 24_064  # 23.5 KiB per rank
    pool = table["kvCapacityTokensPerRank"] * per_token  # bytes of one rank's GPU pool
    ranks = engine.gpus_per_instance
    host_pools = HICACHE_RATIO * pool * ranks
    assert round(host_pools / GIB) == 1035
    need = host_pools / (HOST_FRACTION * (1 - SLACK)) + RESERVE
    assert round(need / GIB) == 1372
    request = _gib(engine.resources["requests"]["memory"])
    limit = _gib(engine.resources["limits"]["memory"])
    assert request == limit
    # The pool at the full ratio, plus room for the ranks' own processes (~20 GiB each),
    # without asking for a node and a half.
    assert need / GIB + 16 * ranks <= limit <= 1.25 * need / GIB
    # The decode capacity the manifest declares is the pool it sized the memory for.
    assert spec.capacity.decode_kv_tokens is not None
    assert spec.capacity.decode_kv_tokens <= table["kvCapacityTokensPerRank"]
