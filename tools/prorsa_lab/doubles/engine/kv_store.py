"""The engine double's HiCache storage tier: page files in a directory several doubles share.

It models the shipped store (``prorsa_agent.kv_backend.SharedKVStore`` over SGLang's
``HiCacheFile``) at the level a test can observe: which pages exist, found by the longest
run of a request's page keys from its first page; nothing of the KV's bytes.

* Keys: a hash chain over whole pages, seeded by the request's ``extra_key`` (SGLang 0.5.23
  ``srt/mem_cache/utils.py`` ``storage_namespace_seed`` / ``get_storage_hash_str``: no seed
  without one), so a page written under one weight version is never found under another.
  The double's own SHA-256 chain, not SGLang's byte layout: only equality matters here.
* Only whole pages are stored (SGLang backs up page-aligned KV; the last partial page of
  an aborted request is dropped, ``decode_kvcache_offload_manager.py``).
* ``clear()`` is what a role flip runs (``_release_prefix_cache_for_role_switch``); whether
  a flip calls it is the engine's choice (``EngineConfig.kv_store_clears_on_flip``: SGLang's
  own file backend does, the shipped backend does not).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)


class PageStore:
    def __init__(self, path: str | Path, *, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"kv_page_size must be >= 1, got {page_size}")
        self.path = Path(path)
        self.page_size = page_size
        self.path.mkdir(parents=True, exist_ok=True)

    def page_keys(self, tokens: Sequence[int], extra_key: str | None) -> list[str]:
        """One key per whole page of ``tokens``, each naming every token before it too."""
        prior = b"" if extra_key is None else hashlib.sha256(b"ns" + extra_key.encode()).digest()
        keys = []
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            digest = hashlib.sha256(prior + _tokens_bytes(tokens[start : start + self.page_size]))
            prior = digest.digest()
            keys.append(digest.hexdigest())
        return keys

    def _file(self, key: str) -> Path:
        return self.path / f"{key}.bin"

    def hit_pages(self, keys: Sequence[str]) -> int:
        """Pages found from the first on (the L3 prefix match stops at the first miss)."""
        for i, key in enumerate(keys):
            if not self._file(key).exists():
                return i
        return len(keys)

    def write(self, keys: Sequence[str]) -> int:
        """Store the pages; returns how many were new."""
        new = 0
        for key in keys:
            try:
                with open(self._file(key), "x"):
                    new += 1
            except FileExistsError:
                pass
        return new

    def entries(self) -> int:
        return sum(1 for name in os.listdir(self.path) if name.endswith(".bin"))

    def clear(self) -> None:
        for name in os.listdir(self.path):
            if name.endswith(".bin"):
                (self.path / name).unlink(missing_ok=True)
