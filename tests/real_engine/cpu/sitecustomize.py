"""CPU stand-in patches for SGLang 0.5.23, loaded by every Python process of a test engine
(tests only; never in an image).

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``; the test launcher puts
this directory first on it, so SGLang's scheduler processes (spawned, not forked) get the
patch too. It waits for ``sglang.srt.disaggregation.mooncake.conn`` to be imported and then
sets ``MooncakeKVSender.supports_host_tensor_indices = False``: with it True, the prefill
side copies the KV page indices into pinned host memory and records a CUDA event before each
send (``srt/disaggregation/prefill.py``, ``send_kv_chunk``), which needs CUDA. With it False
SGLang computes the indices on the CPU (its path for senders without that support).

With ``PRORSA_TEST_DIE_WITH_PARENT=1`` (the test launcher sets it on the engine's first
process only: it is removed here, so SGLang's own children do not inherit it) the process
asks the kernel to kill it when the process that started it ends, so a test run killed
outright leaves no engine holding 3.5 GB. SGLang's scheduler and detokenizer already die
with their parent.

docs/testing.md lists it with the other CPU stand-ins.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.abc
import importlib.machinery
import os
import signal
import sys
from types import ModuleType
from typing import Any

_TARGET = "sglang.srt.disaggregation.mooncake.conn"


def _patch(module: ModuleType) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.pop("PRORSA_TEST_DIE_WITH_PARENT", "") == "1" and sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

if _TARGET in sys.modules:
    _patch(sys.modules[_TARGET])
else:
    sys.meta_path.insert(0, _PatchAfterLoad())
