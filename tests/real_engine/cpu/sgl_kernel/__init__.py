"""CPU stand-in for ``sgl_kernel`` (tests only; never in an image).

SGLang 0.5.23 imports ``sgl_kernel`` on its CPU path (``srt/mem_cache/allocation.py``
imports ``assign_req_to_token_pool_cpu`` when ``SGLANG_USE_CPU_ENGINE=1``). The CPU build of
``sgl_kernel`` is not on PyPI and the CUDA build fails to import without ``libcuda.so.1``.
Only that one op is needed on a CPU without AMX: SGLang's norms, activations, rotary and KV
stores fall back to PyTorch there. This module implements it in PyTorch; docs/testing.md
lists it with the other CPU stand-ins.
"""

from __future__ import annotations

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
