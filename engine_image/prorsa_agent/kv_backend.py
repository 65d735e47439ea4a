"""The HiCache storage backend of a RolloutCluster's ``kvStore``: a shared store a flip keeps.

SGLang 0.5.23 clears the whole storage backend when an engine with a radix cache flips
(``srt/disaggregation/role_switch.py`` ``_release_prefix_cache_for_role_switch`` ->
``clear_storage_backend`` -> the backend's ``clear()``): Mooncake's ``remove_all()``, every
file of a shared ``file`` directory. In a store several engines share, one flip would wipe
the others' pages (docs/sglang-role-switch.md §3). The paper's switch keeps them: the KV of
the requests it cancels is persisted and the retries resume from it (Prorsa, arXiv
2610.16592, Appendix C).

:class:`SharedKVStore` is loaded through SGLang's ``dynamic`` backend
(``--hicache-storage-backend dynamic``, ``backend_name``/``module_path``/``class_name`` in
``--hicache-storage-backend-extra-config``; ``srt/mem_cache/storage/backend_factory.py``
``_create_dynamic_backend``). It hands every read and write to SGLang's own backend for the
store (``HiCacheFile`` for a shared directory, ``MooncakeStore`` for a Mooncake store) and
refuses one thing: ``clear()``. Pages age out by the store's own eviction (the file
backend's LRU cap, Mooncake's eviction), never by a flip.

Why keeping them is safe across weight updates: the page keys are a hash chain seeded with
the request's ``extra_key`` (``srt/mem_cache/utils.py`` ``storage_namespace_seed``), and a
Prorsa trainer sends its weight version there (``prorsa_sdk.weight_version_key``). A page
written under one version is then never found under another. A request without an
``extra_key`` is not protected: see docs/kv-store.md.

This module runs inside SGLang's scheduler process only (it imports SGLang and torch); the
agent imports :mod:`prorsa_agent.kv_store`, never this.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

log = logging.getLogger("prorsa_agent.kv_backend")

STORE_KEY = "prorsa_store"
"""The extra-config key naming the wrapped store: ``file`` or ``mooncake``."""


def _inner_backend(storage_config: HiCacheStorageConfig) -> HiCacheStorage:
    extra = storage_config.extra_config or {}
    store = extra.get(STORE_KEY)
    if store == "file":
        return HiCacheFile(storage_config)
    if store == "mooncake":
        # Imported here: the Mooncake client library is present only where Mooncake is.
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

        if extra.get("standalone_storage"):
            raise ValueError(
                f"{STORE_KEY}=mooncake: standalone_storage needs the host pool at construction, "
                "which SGLang's dynamic backend does not pass; leave it off"
            )
        return MooncakeStore(storage_config, None)
    raise ValueError(
        f"--hicache-storage-backend-extra-config {STORE_KEY} must be 'file' or 'mooncake', "
        f"got {store!r}"
    )


class SharedKVStore(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped here
    """SGLang's backend for the store, with ``clear()`` keeping every entry."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.inner = _inner_backend(storage_config)
        self.store = (storage_config.extra_config or {}).get(STORE_KEY)
        self.kept_clears = 0
        """Flips (or other clears) that left the store as it was."""

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        self.inner.register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self.inner.register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        self.inner.on_host_pools_registered()

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        return self.inner.batch_exists_v2(keys, pool_transfers, extra_info)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        result: dict[str, list[bool]] = self.inner.batch_get_v2(transfers, extra_info)
        return result

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        result: dict[str, list[bool]] = self.inner.batch_set_v2(transfers, extra_info)
        return result

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        result: list[bool] = self.inner.batch_get_v1(keys, host_indices, extra_info)
        return result

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        result: list[bool] = self.inner.batch_set_v1(keys, host_indices, extra_info)
        return result

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.inner.get(key, target_location, target_sizes)

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> Any:
        return self.inner.batch_get(keys, target_locations, target_sizes)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return bool(self.inner.set(key, value, target_location, target_sizes))

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return bool(self.inner.batch_set(keys, values, target_locations, target_sizes))

    def exists(self, key: str) -> bool:
        return bool(self.inner.exists(key))

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return int(self.inner.batch_exists(keys, extra_info))

    def clear(self) -> None:
        """Keep the store: other engines' pages live there (the module's docstring)."""
        self.kept_clears += 1
        log.info(
            "kept the shared %s KV store through a clear (a role flip); %d kept so far",
            self.store,
            self.kept_clears,
        )

    def get_stats(self) -> Any:
        return self.inner.get_stats()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
