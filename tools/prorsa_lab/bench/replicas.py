"""Operator replicas as processes of their own for the operator benches, and what the
benches read of them: who leads (the Lease), their ``/metrics``, and from ``/proc`` their
resident memory, open files and CPU time (Linux only, as the operator's image).

A replica is ``prorsa operator --leader-elect`` started from a :class:`~prorsa_lab.doubles.
stack.Stack`'s settings (its kubeconfig, webhook address, agent port), so only the leader
binds the webhook, as in a Deployment of two behind the webhook Service.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prorsa.k8s.leader import LeaderElection
from prorsa_lab.doubles.kubelet import free_port
from prorsa_lab.doubles.processes import terminate
from prorsa_lab.doubles.stack import Stack

OPERATOR_NAMESPACE = "prorsa-system"
# Shorter terms than the chart's (client-go's 15/10/2 s), as tests/test_operator_ha.py, so
# a standby takes over quickly; long enough for a replica on a loaded 2-core machine.
ELECTION = LeaderElection(lease_duration=8.0, renew_deadline=6.0, retry_period=0.5)
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Replica:
    name: str
    process: asyncio.subprocess.Process
    metrics_port: int
    log_path: Path
    _log: IO[str] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    async def stop(self, sig: int = signal.SIGTERM, *, timeout: float = 60.0) -> None:
        await terminate(self.process, grace=timeout, sig=sig)
        if self._log is not None:
            self._log.close()
            self._log = None


async def start_replica(
    env: Stack, name: str, *, log_dir: Path, extra_env: dict[str, str] | None = None
) -> Replica:
    """``prorsa operator`` as replica ``name`` (its pod created first, as a Deployment's)."""
    await env.create_operator_pod(name)
    metrics_port = free_port()
    argv = env.operator_argv(pod_name=name, metrics_port=metrics_port, liveness_port=free_port())
    log_path = log_dir / f"{name}.log"
    log = log_path.open("w")
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})},
    )
    return Replica(
        name=name, process=process, metrics_port=metrics_port, log_path=log_path, _log=log
    )


async def leader(env: Stack, replicas: list[Replica]) -> Replica | None:
    """The replica holding the Lease now (holder identities are ``<pod>_<id>``)."""
    assert env.operator_namespace is not None
    lease = await env.kube.read_lease(env.operator_namespace, ELECTION.lease_name)
    holder = str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")
    for replica in replicas:
        if holder.startswith(f"{replica.name}_") and replica.process.returncode is None:
            return replica
    return None


# -- /proc -------------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` now."""
    fields = Path(f"/proc/{pid}/statm").read_text().split()
    return int(fields[1]) * PAGE_SIZE


def open_files(pid: int) -> int:
    """File descriptors process ``pid`` holds open (sockets included)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time process ``pid`` has used."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    after = stat[stat.rindex(")") + 2 :].split()
    return (int(after[11]) + int(after[12])) / CLOCK_TICKS


# -- /metrics ----------------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(url: str) -> Samples:
    """Every sample of a Prometheus text page, by (name, sorted labels)."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(url)).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def quantile(
    before: Samples, after: Samples, name: str, q: float, **labels: str
) -> tuple[float | None, float | None]:
    """The ``q`` quantile of histogram ``name`` over what it observed between two scrapes:
    interpolated within its bucket as PromQL's ``histogram_quantile`` does, and that
    bucket's upper bound (None, None when it observed nothing)."""
    want = set(labels.items())
    buckets: dict[float, float] = {}
    for source, sign in ((after, 1.0), (before, -1.0)):
        for (n, lab), v in source.items():
            if n != f"{name}_bucket" or not want <= set(lab):
                continue
            le = float(dict(lab)["le"])
            buckets[le] = buckets.get(le, 0.0) + sign * v
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None, None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if upper == float("inf"):
                return lower, None
            share = (rank - below) / (count - below) if count > below else 1.0
            return lower + (upper - lower) * share, upper
        lower, below = upper, count
    return None, None
