"""The demo's phase lag, cut into parts a user reads on the summary and the dashboard."""

from __future__ import annotations

import pytest

from prorsa_lab.demo.lag_parts import SwitchSpan, lag_parts


def _span(
    pod: str, draining: float, dropped: float, drained: float, relabelled: float
) -> SwitchSpan:
    return SwitchSpan(
        pod=pod, draining=draining, dropped=dropped, drained=drained, relabelled=relabelled
    )


def test_a_switch_after_the_forecast_crossed_is_cut_into_its_parts() -> None:
    # Phase change at 100 s from 2P:2D, Eq. 1 reads 1P:3D from 104 s, the Controller
    # starts draining at 110 s, smg drops the pod at 116 s, drained at 117 s, relabelled at 118 s.
    parts = lag_parts(
        at=100.0,
        lag=18.0,
        before=(2, 2),
        target=(1, 3),
        best=[(101.0, (2, 2)), (104.0, (1, 3)), (105.0, (1, 3))],
        spans=[_span("e1", 110.0, 116.0, 117.0, 118.0)],
    )
    assert parts is not None
    assert (parts.detection, parts.decision, parts.router, parts.drain, parts.flip) == (
        4.0,
        6.0,
        6.0,
        1.0,
        1.0,
    )
    assert parts.switches == 1 and parts.total() == pytest.approx(18.0)


def test_a_pod_already_draining_at_the_change_counts_its_remaining_switch() -> None:
    # The split was 1P:2D with a pod draining toward decode when the phase changed at 40 s;
    # Eq. 1 already read 1P:3D. The lag is the rest of that switch, not detection (CI saw
    # every second put in detection, and the switch's router time lost).
    parts = lag_parts(
        at=40.0,
        lag=5.0,
        before=(1, 2),
        target=(1, 3),
        best=[(40.5, (1, 3)), (41.5, (1, 3))],
        spans=[_span("e2", 37.0, 42.0, 44.0, 45.0)],
    )
    assert parts is not None
    assert parts.detection == 0.5
    assert (parts.router, parts.drain, parts.flip) == (1.5, 2.0, 1.0)
    assert parts.switches == 1 and parts.total() == pytest.approx(5.0)


def test_no_crossing_and_no_reach_leave_the_parts_out() -> None:
    assert lag_parts(at=0.0, lag=None, before=(2, 2), target=(1, 3), best=[], spans=[]) is None
    assert lag_parts(at=0.0, lag=3.0, before=(2, 2), target=None, best=[], spans=[]) is None
    # Never crossed within the lag (the labels moved before the monitor read): all detection.
    parts = lag_parts(at=0.0, lag=3.0, before=(2, 2), target=(1, 3), best=[], spans=[])
    assert parts is not None and parts.detection == 3.0 and parts.switches == 0


def test_an_unread_drain_stays_in_flip() -> None:
    span = SwitchSpan(pod="e1", draining=2.0, dropped=8.0, drained=None, relabelled=10.0)
    parts = lag_parts(
        at=0.0, lag=10.0, before=(2, 2), target=(3, 1), best=[(1.0, (3, 1))], spans=[span]
    )
    assert parts is not None
    assert parts.drain is None and parts.router == 6.0 and parts.flip == 2.0
    assert parts.decision == 1.0
