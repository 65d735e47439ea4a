"""``prorsa bench chaos`` (docs/security.md#attack-and-chaos), small: two operator
replicas, three engine pods, the real smg and the demo trainer on the API emulator; two
rounds, each forcing a switch and injecting a fault in it: the leading replica killed
mid-switch (the other must take over and finish or roll back the switch) and an engine
crashing mid-switch (smg breaks the stream off; the trainer must get its tokens, not a
short answer). A regression leaves a round unconverged or tokens lost, and fails ``make
test``. (The restarted router of the full suite has its own tests: tests/test_smg_router.py
and tests/test_smg_client.py.)"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from prorsa.cli import main
from prorsa_lab.doubles.smg_router import smg_binary
from prorsa_lab.robustness.chaos_faults import Replica, supervise
from prorsa_lab.robustness.chaos_suite import ChaosOptions

needs_smg = pytest.mark.skipif(smg_binary() is None, reason="smg is not installed")


@pytest.mark.slow  # the whole operator: left out by `make test-fast`
@needs_smg
def test_two_chaos_rounds_converge_and_the_trainer_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["bench", "chaos", "--rounds", "2", "--seed", "5", "--instances", "3",
         "--trajectories", "8", "--faults", "kill-leader,kill-engine",
         "--out", str(tmp_path)]
    )  # fmt: skip
    text = capsys.readouterr().out
    wire = json.loads((tmp_path / "summary.json").read_text())
    assert code == 0, text
    assert wire["ok"] is True and wire["roundsConverged"] == wire["roundsRun"] == 2, text
    assert {r["fault"] for r in wire["rounds"]} == {"kill-leader", "kill-engine"}
    trainer = wire["trainer"]
    assert trainer["requestsCompleted"] == trainer["requestsSent"] > 0, trainer
    assert trainer["tokensLost"] == 0 and trainer["requestsFailed"] == 0, trainer
    assert trainer["eventsDelivered"] == trainer["eventsEmitted"] > 0, trainer
    assert wire["command"] == (
        "prorsa bench chaos --rounds 2 --seed 5 --faults kill-leader,kill-engine"
    )
    # Progress per round, then the summary.
    assert "round 1/2" in text and "round 2/2" in text
    assert "prorsa bench chaos: 2/2 rounds converged" in text and ": OK" in text
    assert (tmp_path / "chaos.log").stat().st_size > 0


def test_bench_chaos_refuses_an_unknown_fault_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "chaos", "--faults", "kill-leader,unplug-datacenter"]) == 2
    err = capsys.readouterr().err
    assert "unknown faults ['unplug-datacenter']" in err and "kill-leader" in err


def test_chaos_options_bound_what_a_round_needs() -> None:
    with pytest.raises(ValueError, match="--instances"):
        # Each round moves roles.*.min so the split must change: prefill >= 2 and
        # decode >= 1 need three engines.
        ChaosOptions(instances=2)


async def test_a_replica_that_exits_is_started_again_as_the_kubelet_would(tmp_path: Path) -> None:
    """A replica that loses the Lease exits on purpose (`prorsa operator --leader-elect`);
    in a cluster the kubelet starts its container again. Without that the suite ran on
    with no replica left (found by its own 15-round run on a loaded machine)."""

    class Exiting(Replica):
        async def start(self) -> None:  # a process that ends at once, as on a lost Lease
            if self.alive:
                return
            self.starts += 1
            self.process = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")

    replica = Exiting(pod="prorsa-a", env=cast(Any, None), log_dir=tmp_path)
    await replica.start()
    supervisor = asyncio.create_task(supervise([replica], delay=0.1))
    try:
        for _ in range(200):
            if replica.starts >= 3:
                break
            await asyncio.sleep(0.05)
        assert replica.starts >= 3
        replica.stopped = True  # the suite's own stop: never started again
        await asyncio.sleep(0.3)
        if replica.process is not None:
            await replica.process.wait()
        starts = replica.starts
        await asyncio.sleep(0.6)
        assert replica.starts == starts
    finally:
        supervisor.cancel()
