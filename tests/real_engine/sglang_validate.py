"""SGLang 0.5.23's own validation of engine command lines, without a GPU.

Run with the engine environment's interpreter; reads a JSON list of
``{"name": ..., "argv": [...]}`` (the arguments after ``python -m sglang.launch_server``) on
stdin and prints one JSON object per case: ``{"name", "ok", "error"}``.

For each case it does what ``sglang.launch_server`` does before it starts anything:
``prepare_server_args(argv)`` (SGLang's argparse), ``ServerArgs.resolve_once()`` (the
resolution pipeline: every ``srt/arg_groups/*_hook.py``, the role-switch refusals of
``pd_disaggregation_hook.py`` among them) and ``check_server_args()`` (the launch-time
checks ``srt/entrypoints/engine.py`` runs). The hooks read the GPU (compute capability,
memory): this process presents one H200 (sm90, 141 GB) to them through ``torch.cuda``, since
the deployments it checks run on such GPUs; nothing is allocated and no kernel runs.
Tests only; never in an image.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import logging
import sys
import traceback
from types import ModuleType, SimpleNamespace
from typing import Any

GPU_BYTES = 141 * 1024**3


class _Stub:
    """Anything a kernel module holds: attributes, calls and subscripts give more stubs."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> _Stub:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        return _Stub(f"{self._name}()")

    def __getitem__(self, key: Any) -> _Stub:
        return _Stub(f"{self._name}[]")


class _KernelStubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``sgl_kernel`` and its submodules as packages of stubs."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> ModuleType:
        module = ModuleType(spec.name)
        module.__path__ = []

        def attribute(name: str) -> _Stub:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Stub(f"{spec.name}.{name}")

        module.__getattr__ = attribute  # type: ignore[method-assign]
        return module

    def exec_module(self, module: ModuleType) -> None:
        return None


def _pretend_h200() -> None:
    sys.meta_path.insert(0, _KernelStubs())
    import torch

    props = SimpleNamespace(
        name="NVIDIA H200",
        major=9,
        minor=0,
        total_memory=GPU_BYTES,
        multi_processor_count=132,
        is_integrated=False,
        L2_cache_size=50 * 1024**2,
    )
    cuda: Any = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 8
    cuda.current_device = lambda: 0
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    cuda.get_device_properties = lambda *a, **k: props
    cuda.mem_get_info = lambda *a, **k: (GPU_BYTES - 2 * 1024**3, GPU_BYTES)
    cuda.is_bf16_supported = lambda *a, **k: True
    cuda.set_device = lambda *a, **k: None
    from sglang.srt.utils import common

    common.get_nvgpu_memory_capacity = lambda: GPU_BYTES / 1024**2  # MiB, as nvidia-smi
    common.get_device_memory_capacity = lambda device=None: GPU_BYTES / 1024**2


def check(argv: list[str]) -> str | None:
    """None when SGLang accepts ``argv``, else its error message."""
    from sglang.srt.server_args import prepare_server_args

    try:
        args = prepare_server_args(list(argv))
        args.resolve_once()
        args.check_server_args()
    except SystemExit as exc:  # argparse
        return f"argparse refused the command line (exit {exc.code})"
    except Exception as exc:
        last = traceback.extract_tb(exc.__traceback__)[-1]
        return f"{type(exc).__name__}: {exc} [{last.filename.split('sglang/')[-1]}:{last.lineno}]"
    return None


def main() -> int:
    logging.disable(logging.WARNING)
    cases = json.load(sys.stdin)
    _pretend_h200()
    for case in cases:
        error = check(case["argv"])
        print(json.dumps({"name": case["name"], "ok": error is None, "error": error}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
