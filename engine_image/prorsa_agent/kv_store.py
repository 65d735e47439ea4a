"""The shared KV store of a RolloutCluster (``spec.kvStore``), as the agent sees it.

The operator passes the section to every engine pod as ``PRORSA_KV_STORE_*`` variables.
From them the agent renders SGLang's flags (:meth:`KvStoreConfig.engine_flags`): HiCache's
storage tier through SGLang's ``dynamic`` backend, loading
:class:`prorsa_agent.kv_backend.SharedKVStore` (a store a flip does not clear), and decode-side
KV offload, so the pages a request generated before a switch cancelled it land in the store
too. Before each flip the agent checks that the store answers (:func:`unreachable`): a flip
cancels requests whose resume depends on it (Prorsa, arXiv 2610.16592, Appendix C).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

BACKEND_ENV = "PRORSA_KV_STORE_BACKEND"
ENDPOINT_ENV = "PRORSA_KV_STORE_ENDPOINT"
SIZE_ENV = "PRORSA_KV_STORE_SIZE_GIB"
KV_STORE_ENV = frozenset({BACKEND_ENV, ENDPOINT_ENV, SIZE_ENV})
"""What the operator sets on engine pods for ``spec.kvStore`` (absent: no store)."""

BACKENDS = ("mooncake", "file")

BACKEND_NAME = "prorsa_shared"
MODULE_PATH = "prorsa_agent.kv_backend"
CLASS_NAME = "SharedKVStore"

DEFAULT_MOONCAKE_PORT = 50051
"""The Mooncake master's default RPC port (``mooncake_master --port``)."""

FLAGS = (
    "--hicache-storage-backend",
    "--hicache-storage-backend-extra-config",
    "--disaggregation-decode-enable-offload-kvcache",
)
"""The SGLang flags :meth:`KvStoreConfig.engine_flags` sets (a user may not give them too)."""


class KvStoreError(ValueError):
    """A ``PRORSA_KV_STORE_*`` setting the agent cannot run with; the message names it."""


@dataclass(frozen=True, kw_only=True)
class KvStoreConfig:
    backend: Literal["mooncake", "file"]
    endpoint: str
    """The Mooncake master (``host:port``) or the shared directory's path in the pod."""
    size_gib: int
    """What each engine rank gives the store: Mooncake's ``global_segment_size``, or the
    file backend's cap on its own pages (``max_size``, LRU eviction)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise KvStoreError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {self.backend!r}")
        if not self.endpoint:
            raise KvStoreError(f"{ENDPOINT_ENV} is empty")
        if self.backend == "file" and not self.endpoint.startswith("/"):
            raise KvStoreError(f"{ENDPOINT_ENV} must be an absolute path for the file backend")
        if self.backend == "mooncake":
            _host_port(self.endpoint)
        if self.size_gib < 1:
            raise KvStoreError(f"{SIZE_ENV} must be >= 1, got {self.size_gib}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KvStoreConfig | None:
        """The store the pod's environment asks for, or None (no ``PRORSA_KV_STORE_BACKEND``)."""
        backend = env.get(BACKEND_ENV, "")
        if not backend:
            return None
        size = env.get(SIZE_ENV, "")
        if not size.isdigit():
            raise KvStoreError(f"{SIZE_ENV} must be a whole number of GiB, got {size!r}")
        if backend not in BACKENDS:
            raise KvStoreError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {backend!r}")
        return cls(
            backend="mooncake" if backend == "mooncake" else "file",
            endpoint=env.get(ENDPOINT_ENV, ""),
            size_gib=int(size),
        )

    def extra_config(self) -> dict[str, object]:
        """``--hicache-storage-backend-extra-config``: SGLang's dynamic loader's three keys,
        then the wrapped backend's own settings (``HiCacheFile``: ``file_storage_path``,
        ``max_size``; ``MooncakeStoreConfig.load_from_extra_config``:
        ``master_server_address``, ``global_segment_size``)."""
        size = self.size_gib * 2**30
        extra: dict[str, object] = {
            "backend_name": BACKEND_NAME,
            "module_path": MODULE_PATH,
            "class_name": CLASS_NAME,
            "prorsa_store": self.backend,
        }
        if self.backend == "file":
            extra |= {"file_storage_path": self.endpoint, "max_size": size}
        else:
            # MooncakeStore reads and writes through the zero-copy v1 interface; SGLang picks
            # it for a dynamic backend only with interface_v1 (managers/cache_controller.py).
            host, port = _host_port(self.endpoint)
            extra |= {
                "master_server_address": f"{host}:{port}",
                "global_segment_size": size,
                "interface_v1": 1,
            }
        return extra

    def engine_flags(self) -> list[str]:
        """The SGLang flags of the store (docs/engine-flags.md, "The shared KV store")."""
        return [
            "--hicache-storage-backend",
            "dynamic",
            "--hicache-storage-backend-extra-config",
            json.dumps(self.extra_config(), sort_keys=True),
            "--disaggregation-decode-enable-offload-kvcache",
        ]

    def env(self) -> dict[str, str]:
        """The pod variables that carry this store (what :meth:`from_env` reads)."""
        return {
            BACKEND_ENV: self.backend,
            ENDPOINT_ENV: self.endpoint,
            SIZE_ENV: str(self.size_gib),
        }


def _host_port(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint, DEFAULT_MOONCAKE_PORT
    if not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise KvStoreError(f"{ENDPOINT_ENV} must be host[:port], got {endpoint!r}")
    return host.strip("[]"), int(port)


async def unreachable(store: KvStoreConfig, *, timeout: float) -> str | None:
    """Why the store cannot be used now, or None when it answers.

    File: the shared directory exists and this pod can write to it. Mooncake: the master
    accepts a TCP connection (what the engine's client opens first)."""
    if store.backend == "file":
        path = Path(store.endpoint)
        if not path.is_dir():
            return f"the KV store directory {store.endpoint} does not exist"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"the KV store directory {store.endpoint} is not writable"
        return None
    host, port = _host_port(store.endpoint)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError) as exc:
        return f"the Mooncake master {store.endpoint} does not answer: {exc or 'timed out'}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None
