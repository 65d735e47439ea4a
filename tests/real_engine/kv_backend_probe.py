"""Run by ``.venv-engine/bin/python``: the engine image's KV store backend inside SGLang 0.5.23.

It builds two backends the way SGLang's scheduler does (``StorageBackendFactory.create_backend``
with ``dynamic`` and the extra-config the agent renders, ``prorsa_agent.kv_store``) on one
shared directory, as two engines of a cluster, and keys the pages with SGLang's own storage
hash chain (``get_storage_hash_str`` of a ``RadixKey`` carrying ``extra_key``). It prints what
the test asserts as one JSON line: no engine, no GPU, about 20 s (SGLang's imports).

Usage: kv_backend_probe.py <shared dir>
"""

from __future__ import annotations

import json
import os
import sys
from array import array

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from prorsa_agent.kv_store import KvStoreConfig

PAGE = 16


def config(extra: dict[str, object]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="tiny-llama",
        extra_config=extra,
    )


def page_keys(tokens: list[int], extra_key: str | None) -> list[str]:
    keys = get_storage_hash_str(RadixKey(array("l", tokens), extra_key=extra_key), page_size=PAGE)
    assert isinstance(keys, list)
    return keys


def entries(path: str) -> int:
    return sum(1 for name in os.listdir(path) if name.endswith(".bin"))


def main() -> None:
    shared = sys.argv[1]
    store = KvStoreConfig(backend="file", endpoint=shared, size_gib=1)
    flags = store.engine_flags()
    extra = json.loads(flags[flags.index("--hicache-storage-backend-extra-config") + 1])
    a = StorageBackendFactory.create_backend("dynamic", config(extra), None)
    b = StorageBackendFactory.create_backend("dynamic", config(extra), None)
    prompt = list(range(1, 4 * PAGE + 5))  # four full pages and a partial one
    full = len(prompt) // PAGE  # SGLang stores whole pages only
    v1 = page_keys(prompt, "weights-v1")[:full]
    v2 = page_keys(prompt, "weights-v2")[:full]
    pages = [torch.full((PAGE * 8,), i + 1, dtype=torch.float16) for i in range(len(v1))]
    written = [a.set(k, p) for k, p in zip(v1, pages, strict=True)]
    other = page_keys(list(range(500, 500 + 2 * PAGE)), "weights-v1")
    b.batch_set(other, [torch.zeros(PAGE * 8, dtype=torch.float16)] * len(other))
    read = torch.empty(PAGE * 8, dtype=torch.float16)
    out = {
        "class": type(a).__name__,
        "pages": len(v1),
        "written": sum(written),
        "hit_same_version_other_engine": b.batch_exists(v1),
        "hit_next_version": b.batch_exists(v2),
        "hit_no_extra_key": b.batch_exists(page_keys(prompt, None)[:full]),
        "read_back_equal": bool(torch.equal(b.get(v1[2], read), pages[2])),
        "entries_before_flip": entries(shared),
    }
    a.clear()  # what a flip of engine a runs (clear_storage_backend)
    out["entries_after_flip"] = entries(shared)
    out["hit_after_flip"] = b.batch_exists(v1)
    out["other_engine_hit_after_flip"] = a.batch_exists(other)
    builtin = HiCacheFile(config({"file_storage_path": shared}))
    builtin.clear()  # SGLang's own file backend, for contrast
    out["entries_after_builtin_clear"] = entries(shared)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
