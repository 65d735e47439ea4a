"""How late the split follows demand, the Controller's part (issue 34 item 1).

After the forecast crosses (Eq. 1's best split leans away from the split in use), the hold
rules, the switch pricing and the instances' cooldowns decide when a switch toward it
starts. Each switch's Decision says how long that took (``decision_seconds``), and the
operator exports it as ``prorsa_switch_decision_seconds``.
"""

from __future__ import annotations

from test_controller import engines, queue, spec8

from prorsa.control.metrics import OperatorMetrics
from prorsa.core.controller import Controller
from prorsa.core.types import TickInput


def test_a_switch_says_how_long_it_waited_after_the_forecast_crossed(log) -> None:
    c = Controller(spec8())
    queue(log, 60, 10_000, 1.0)  # 6 instances of prefill demand at a 2P:6D split
    c.observe(log.take())
    c.observe_engines(engines(2, 6))
    for name in (f"c-engine-{i}" for i in range(2, 8)):
        c.record_switch(name, at=-10.0)  # every decode instance cools down until 20 s
    first = c.tick(TickInput(now=2.0))
    assert first.diagnostics is not None and first.diagnostics.best[0] > 2
    assert first.switches == () and first.diagnostics.decision_seconds is None
    for now in (10.0, 18.0):
        log("request_queued", f"late{now}", now, prompt_tokens=10_000, turn=0)
        c.observe(log.take())
        held = c.tick(TickInput(now=now))
        assert held.switches == () and held.diagnostics is not None
        assert held.diagnostics.decision_seconds is None
    log("request_queued", "late22", 22.0, prompt_tokens=10_000, turn=0)
    c.observe(log.take())
    moved = c.tick(TickInput(now=22.0))
    assert [s.to for s in moved.switches] == ["prefill"]
    assert moved.diagnostics is not None
    assert moved.diagnostics.decision_seconds == 20.0  # crossed at 2 s, out of cooldown at 20 s
    metrics = OperatorMetrics()
    metrics.record_decision_wait("ns", "c", moved.diagnostics)
    count = metrics.registry.get_sample_value(
        "prorsa_switch_decision_seconds_count", {"namespace": "ns", "cluster": "c"}
    )
    assert count == 1.0
    # The next switch toward the same lean is not counted again from the same crossing.
    c.observe_engines(engines(2, 6))
    again = c.tick(TickInput(now=32.0))
    assert again.diagnostics is not None and again.diagnostics.decision_seconds is None
