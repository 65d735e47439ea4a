"""Shared fixtures (a small RolloutCluster spec, an event builder), and the check that a test
which runs the whole operator says so.

``make test-fast`` (``pytest -m "not slow"``) leaves out the tests that run the whole
operator on loopback (kopf, the Kubernetes API emulator, engine doubles with their agents,
often the real smg or a ``prorsa operator`` process): each takes from a few seconds to a
minute. Such a test carries the mark in its own module (``pytestmark = pytest.mark.slow``,
or ``@pytest.mark.slow`` on the test). One that does not, fails: while a test without the
mark runs, starting the operator in this process (``OperatorProcess.run``) or running this
environment's ``prorsa operator``, ``prorsa demo`` or ``prorsa bench chaos|scale|soak`` as
a child process raises :class:`UnmarkedWholeOperator`, naming the test and the mark to add.
"""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from prorsa.core.spec import RolloutClusterSpec, parse_cluster
from prorsa_contract.events import Event, parse_events

pytest_plugins = ["pytester"]  # tests/test_layout.py runs the check on tests of its own

# The `prorsa` subcommands (and benchmarks) that run the whole operator.
WHOLE_OPERATOR = ("operator", "demo", "bench chaos", "bench scale", "bench soak")
# Marks that keep a test out of `make test-fast` already: the slow ones, and the suites that
# need a real engine, GPU or cluster (left out of `make test` too, run by targets of their own).
RUN_APART = ("slow", "real_engine", "study", "gpu", "cluster")
# The test running now, unless one of RUN_APART marks it (pytest_runtest_setup: before any
# of its fixtures, a module's too, are set up).
_unmarked: list[str] = []


class UnmarkedWholeOperator(AssertionError):
    """A test without the ``slow`` mark started the whole operator."""


def pytest_runtest_setup(item: pytest.Item) -> None:
    apart = any(item.get_closest_marker(mark) for mark in RUN_APART)
    _unmarked[:] = [] if apart else [item.nodeid]


def pytest_runtest_teardown(item: pytest.Item) -> None:
    _unmarked[:] = []


def _refuse(what: str) -> None:
    if _unmarked:
        raise UnmarkedWholeOperator(
            f"{_unmarked[0]} runs the whole operator ({what}) without the mark `slow`: add "
            "`pytestmark = pytest.mark.slow` to its module (or `@pytest.mark.slow` to the "
            "test), so that `make test-fast` leaves it out"
        )


def prorsa_command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` runs with this environment's ``prorsa`` (its first two words
    that are not flags), None for any other program or for ``--help``."""
    args = [str(a) for a in argv]
    own = Path(sys.executable)
    if args[:3] == [str(own), "-m", "prorsa.cli"]:
        rest = args[3:]
    elif args[:1] == [str(own.with_name("prorsa"))]:
        rest = args[1:]
    else:
        return None
    if "--help" in rest or "-h" in rest:
        return None
    return " ".join([a for a in rest if not a.startswith("-")][:2])


def runs_the_whole_operator(argv: Sequence[str]) -> bool:
    command = prorsa_command(argv)
    return command is not None and any(
        command == c or command.startswith(f"{c} ") for c in WHOLE_OPERATOR
    )


def _guarded_popen(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [args] if isinstance(args, str | Path) else args
        if runs_the_whole_operator(argv):
            _refuse(f"prorsa {prorsa_command(argv)}")
        init(self, args, *rest, **kwargs)

    return popen


def _guarded_run(run: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(run)
    async def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse("OperatorProcess.run")
        return await run(self, *args, **kwargs)

    return guarded


# Installed once for the session: every child process the tests start passes through it.
subprocess.Popen.__init__ = _guarded_popen(subprocess.Popen.__init__)  # type: ignore[method-assign]
try:
    from prorsa.shell.process import OperatorProcess
except ModuleNotFoundError:  # no operator extra (`make test-trainers`): no operator to start
    pass
else:
    OperatorProcess.run = _guarded_run(OperatorProcess.run)  # type: ignore[method-assign]


def make_spec(**spec: Any) -> RolloutClusterSpec:
    body: dict[str, Any] = {"model": {"path": "/models/m"}, "gpuBudget": 64}
    for key, value in spec.items():
        body[key] = value
    manifest = {
        "apiVersion": "prorsa.io/v1alpha1",
        "kind": "RolloutCluster",
        "metadata": {"name": "c", "namespace": "rl"},
        "spec": body,
    }
    return parse_cluster(manifest).spec


class EventLog:
    """Builds valid lifecycle events with unique ids, in the order written."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.raw: list[dict[str, Any]] = []

    def __call__(self, type: str, trajectory: str, ts: float, **fields: Any) -> EventLog:
        self.raw.append(
            {"id": f"e{next(self._ids)}", "type": type, "trajectory": trajectory, "ts": ts} | fields
        )
        return self

    def cluster(self, type: str, ts: float, **fields: Any) -> EventLog:
        """A cluster event (weight update): no trajectory."""
        self.raw.append({"id": f"e{next(self._ids)}", "type": type, "ts": ts} | fields)
        return self

    def take(self) -> list[Event]:
        out, self.raw = parse_events(self.raw), []
        return out


@pytest.fixture
def log() -> EventLog:
    return EventLog()


@pytest.fixture
def spec() -> RolloutClusterSpec:
    return make_spec()


async def _no_event(kind: str, reason: str, message: str) -> None:
    return None


def cluster_runtime(
    spec: RolloutClusterSpec,
    *,
    kube: Any = None,
    agents: Any = None,
    options: Any = None,
    post_event: Any = None,
) -> Any:
    """A ``ClusterRuntime`` for rl/c on a handle of its own, with the doubles a test passes
    (None for the parts it never reaches), real metrics and no persistence by default."""
    from prometheus_client import CollectorRegistry

    from prorsa.clusters import ClusterRegistry
    from prorsa.control.metrics import OperatorMetrics
    from prorsa.control.runtime import ClusterLoopSettings, ClusterRuntime
    from prorsa.core.controller import Controller

    handle = ClusterRegistry().add(namespace="rl", name="c", token="t", controller=Controller(spec))
    return ClusterRuntime(
        namespace="rl",
        name="c",
        spec=spec,
        uid="u",
        handle=handle,
        kube=kube,
        agents=agents,
        metrics=OperatorMetrics(CollectorRegistry()),
        options=options or ClusterLoopSettings(persist=False),
        post_event=post_event or _no_event,
    )
