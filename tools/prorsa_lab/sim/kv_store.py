"""A KV store every engine shares and no role switch wipes (HiCache's L3, kept through flips).

Today's engines (``per-instance``, the default) lose both prefix-cache tiers of an instance
when it flips (SGLang 0.5.23's ``_release_prefix_cache_for_role_switch``), and every shared
L3 backend SGLang ships is wiped with them (docs/sglang-role-switch.md §3). This module models
the store the paper's switch relies on instead (Prorsa, arXiv 2610.16592, Appendix C: the
cancelled requests' KV persists in remote storage and their retries resume from it): a
backend whose ``clear()`` keeps the shared store, loaded by name
(``--hicache-storage-backend dynamic``), with decode-side KV offload
(``--disaggregation-decode-enable-offload-kvcache``) on: what ``spec.kvStore`` ships
(``prorsa_agent.kv_backend.SharedKVStore``, docs/kv-store.md).

What it holds, per trajectory, is the longest chain of whole pages written for it:
- a prefill (or colocated) engine writes the prompt it has cached (HiCache writes L3 from
  its host tier), so any engine that prefills the trajectory's next turn finds the prefix;
- a decode engine writes what it generates, page by page, under hashes that continue the
  prompt's chain, when a request finishes and when it is aborted (drain timeout of a
  switch), so the retry resumes from it and recomputes at most the last partial page.

Entries are keyed by weight version (the product's requests carry it as ``extra_key``,
``prorsa_sdk.weight_version_key``, which seeds SGLang's storage keys): KV computed under old
weights never hits after an update; old entries age out of the LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

from prorsa_lab.sim.costmodel import ModelProfile

KvStore = Literal["per-instance", "shared"]
PER_INSTANCE: KvStore = "per-instance"
SHARED: KvStore = "shared"
KV_STORES: tuple[str, ...] = (PER_INSTANCE, SHARED)

# Mooncake Transfer Engine's published bandwidth (its README: 190 GB/s for 40 GB transfers
# over 8x400 Gbps RoCE, one 400 Gbps NIC per GPU of an 8-GPU node): 23.75 GB/s per GPU, a
# little under the 25 GB/s per GPU the simulator uses for the host tier's PCIe loads
# (engine.HOST_BYTES_PER_SECOND_PER_GPU).
STORE_BYTES_PER_SECOND_PER_GPU = 190e9 / 8
# Host memory of one 8xH200 node (NVIDIA DGX H200: 2 TB system memory). The store pools
# what the nodes' HiCache host tiers leave of it (Mooncake's embedded mode: each engine
# contributes a segment of its host memory).
NODE_DRAM_BYTES = 2e12
# L3 keys whole pages: a prefix hit is a whole number of pages, and decode offload drops the
# last partial page (decode_kvcache_offload_manager). 64 tokens: the page SGLang's FlashMLA
# backend forces and the size HiCache storage deployments run.
PAGE_TOKENS = 64


def default_capacity_tokens(profile: ModelProfile, *, instances: int, hicache_ratio: float) -> int:
    """Tokens the store holds when the nodes' host memory left by HiCache pools into it.

    One token of one rank's KV costs ``kv_wire_bytes_per_token`` (each GPU its share,
    replicas included, as the host tier stores it).
    """
    per_token = profile.kv_wire_bytes_per_token
    pool = profile.kv_capacity_per_rank * profile.ranks * per_token  # one instance's GPU KV
    free = profile.nodes * NODE_DRAM_BYTES - hicache_ratio * pool
    return max(0, int(instances * free / per_token))


class SharedKVStore:
    """The shared store: trajectory -> (tokens of its longest chain, weight version), LRU."""

    def __init__(self, *, capacity_tokens: int, page_tokens: int = PAGE_TOKENS) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"kv store capacity_tokens must be >= 0, got {capacity_tokens}")
        if page_tokens < 1:
            raise ValueError(f"kv store page_tokens must be >= 1, got {page_tokens}")
        self.capacity = capacity_tokens
        self.page = page_tokens
        self.entries: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.tokens = 0
        self.version = 0
        # What the benchmark reports.
        self.loaded_tokens = 0  # tokens prefills took from the store instead of computing
        self.loads = 0
        self.stale_misses = 0  # lookups that found only an older weight version's KV
        self.offloads = 0  # decode requests whose KV the store took (finished or aborted)
        self.evicted_tokens = 0
        self.peak_tokens = 0

    def put(self, traj: str, tokens: int) -> None:
        """Write ``traj``'s chain of ``tokens`` (whole pages only) under this version."""
        pages = tokens // self.page * self.page
        if pages <= 0:
            return
        old = self.entries.pop(traj, None)
        if old is not None:
            self.tokens -= old[0]
            if old[1] == self.version and old[0] > pages:
                pages = old[0]  # a shorter chain is a prefix of the one stored
        if pages > self.capacity:
            return
        self.entries[traj] = (pages, self.version)
        self.tokens += pages
        while self.tokens > self.capacity:
            _t, (n, _v) = self.entries.popitem(last=False)
            self.tokens -= n
            self.evicted_tokens += n
        self.peak_tokens = max(self.peak_tokens, self.tokens)

    def lookup(self, traj: str) -> int:
        """Tokens of ``traj``'s prefix the store can serve now (0 for an older version's)."""
        found = self.entries.get(traj)
        if found is None:
            return 0
        tokens, version = found
        if version != self.version:
            self.stale_misses += 1
            return 0
        self.entries.move_to_end(traj)
        return tokens

    def new_weights(self) -> None:
        """A weight update: every entry written so far is of the old version."""
        self.version += 1

    def check(self) -> None:
        assert sum(n for n, _v in self.entries.values()) == self.tokens
        assert self.tokens <= self.capacity

    def summary(self) -> dict[str, int]:
        return {
            "capacityTokens": self.capacity,
            "pageTokens": self.page,
            "loadedTokens": self.loaded_tokens,
            "loads": self.loads,
            "staleMisses": self.stale_misses,
            "offloads": self.offloads,
            "evictedTokens": self.evicted_tokens,
            "peakTokens": self.peak_tokens,
        }
