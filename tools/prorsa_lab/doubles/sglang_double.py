"""A faithful HTTP double of an SGLang 0.5.23 engine with runtime PD role switching.

It speaks the wire format the in-pod agent, the router and a trainer use (field names from
the 0.5.23 wheel): ``POST /generate`` (JSON or server-sent events; ``finish_reason`` shapes
as SGLang's, aborted requests keep their partial output), ``POST /abort_request``,
``POST /pd_role_switch`` (``PdRoleSwitchReqInput`` / ``PdRoleSwitchReqOutput``, HTTP 400
with ``safe_to_restore``), ``GET /server_info`` (``internal_states``), ``GET /v1/loads``
(``LoadSnapshot``), ``GET /health`` / ``/health_generate`` / ``/ready`` and ``GET /metrics``
(``sglang:`` series). A timing model makes prefill take time by prompt length and decode
steps by batch size, so counters and queues move as on a GPU, only faster.

Use it from Python::

    from prorsa_lab.doubles.sglang_double import EngineConfig, EngineDouble, Faults, TimingModel

    async with EngineDouble(EngineConfig(role="decode", kv_capacity_tokens=50_000)) as eng:
        ...  # eng.url, eng.role, eng.counters(), eng.faults.crash_on_switch = True, ...

``EnginePod`` adds the in-pod agent in front of a double (one simulated engine pod), or run it
as a process: ``prorsa engine-double --port 0 --disaggregation-mode decode
--enable-pd-role-switch --enable-metrics`` (``python -m prorsa_lab.doubles.sglang_double`` is the
same and ignores SGLang flags it does not model).

This module is the double's one import path: nothing outside :mod:`prorsa_lab.doubles.engine`
imports that package's modules (the import contract ``engine-double-one-path``).
"""

from __future__ import annotations

import sys

from prorsa_lab.doubles.engine.model import (
    NOT_IDLE,
    SGLANG_VERSION,
    Counters,
    EngineConfig,
    EngineCore,
    EngineCrashed,
    Faults,
    Mode,
    SwitchFailure,
    TimingModel,
)
from prorsa_lab.doubles.engine.pod import FAST_TIMEOUTS, EnginePod
from prorsa_lab.doubles.engine.server import CRASH_EXIT_CODE, EngineDouble
from prorsa_lab.doubles.engine.worker import NodeGroup, WorkerRank

__all__ = [
    "CRASH_EXIT_CODE",
    "FAST_TIMEOUTS",
    "NOT_IDLE",
    "SGLANG_VERSION",
    "Counters",
    "EngineConfig",
    "EngineCore",
    "EngineCrashed",
    "EngineDouble",
    "EnginePod",
    "Faults",
    "Mode",
    "NodeGroup",
    "SwitchFailure",
    "TimingModel",
    "WorkerRank",
]

if __name__ == "__main__":
    from prorsa_lab.doubles.engine.cli import main

    sys.exit(main())
