"""CPU stand-in for ``sgl_kernel`` (tests only; never in an image).

SGLang 0.5.23 imports ``sgl_kernel`` on its CPU path when ``SGLANG_USE_CPU_ENGINE=1``:
``srt/mem_cache/allocation.py`` imports ``assign_req_to_token_pool_cpu`` and
``kernels/ops/kvcache/cache_move.py`` imports ``copy_all_layer_kv_cache_cpu``. The CPU build
of ``sgl_kernel`` is not on PyPI and the CUDA build fails to import without
``libcuda.so.1``. Only these two ops are needed for a plain attention model on a CPU without
AMX: SGLang's norms, activations, rotary and KV stores fall back to PyTorch there. This
module implements them with PyTorch and NumPy (speculative decoding's CPU ops are left out:
role switching refuses speculative decoding); docs/testing.md lists it with the other CPU
stand-ins.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

__version__ = "0.0.0+prorsa-cpu-stand-in"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req, start:end] = out_cache_loc[k:k + end - start]`` for each request
    of the batch in turn, ``k`` running over ``out_cache_loc`` (the Triton kernel's
    ``assign_req_to_token_pool`` in ``srt/mem_cache/allocation.py``, one row per program)."""
    del pool_len  # the row length; req_to_token's shape carries it
    offset = 0
    for req, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        length = end - start
        req_to_token[req, start:end] = out_cache_loc[offset : offset + length].to(
            req_to_token.dtype
        )
        offset += length


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every KV buffer ``b`` (its base address ``data_ptrs[b]``, ``strides[b]`` bytes a
    row): row ``tgt_loc[i]`` = row ``src_loc[i]``, every source row read before any is
    written (the Triton kernel ``copy_all_layer_kv_cache_tiled`` in
    ``kernels/ops/kvcache/cache_move.py``, which is safe for in-place copies)."""
    if src_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64).numpy()
    tgt = tgt_loc.to(torch.int64).numpy()
    rows = int(max(src.max(), tgt.max())) + 1
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        memory = (ctypes.c_uint8 * (rows * stride)).from_address(base)
        table = np.frombuffer(memory, dtype=np.uint8).reshape(rows, stride)
        table[tgt] = table[src]


def __getattr__(name: str) -> object:
    """Any other op SGLang imports on its CPU path (speculative decoding's tree building
    and verification, AMX attention metadata) imports, and raises if it is ever called:
    nothing Prorsa's engines run uses them."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"sgl_kernel.{name} is not in the CPU stand-in (tests only)")

    missing.__name__ = name
    return missing
