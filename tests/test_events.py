"""The webhook CONTRACT models refuse bad input precisely (event index + field)."""

from __future__ import annotations

import json

import pytest

from prorsa_contract.events import (
    EVENT_TYPES,
    BatchError,
    WeightUpdateFinished,
    WeightUpdateStarted,
    dump_events,
    parse_batch,
    parse_events,
    parse_ndjson,
    parse_snapshot,
)


def body(*events: dict) -> bytes:
    return json.dumps({"events": list(events)}).encode()


GOOD = {
    "id": "a",
    "ts": 1.5,
    "trajectory": "t",
    "type": "request_queued",
    "prompt_tokens": 10,
    "turn": 0,
}


def errors_of(raw: bytes) -> list[tuple[int | None, str]]:
    with pytest.raises(BatchError) as info:
        parse_batch(raw)
    return [(e.index, e.field) for e in info.value.errors]


def test_every_event_type_parses() -> None:
    events = [
        {"type": "sample_dispatched", "group": "g", "task": "swe", "prompt_tokens": 5},
        {"type": "sandbox_started", "mode": "cold", "image": "img", "node_class": "cpu"},
        {"type": "request_queued", "prompt_tokens": 5, "turn": 0, "request": "r"},
        {"type": "prefill_started", "request": "r", "instance": "i"},
        {"type": "prefill_finished", "request": "r", "instance": "i"},
        {"type": "decode_finished", "output_tokens": 3, "finish": "tool"},
        {"type": "tool_started", "tool": "bash"},
        {"type": "tool_finished", "result_tokens": 7},
        {"type": "reward_started"},
        {"type": "reward_finished", "accepted": True},
        {"type": "trajectory_dropped", "reason": "staleness"},
    ]
    raw = [{"id": str(i), "ts": 1.0, "trajectory": "t"} | e for i, e in enumerate(events)]
    parsed = parse_batch(body(*raw))
    assert [e.type for e in parsed] == [e["type"] for e in events]


def test_float_token_count_names_index_and_field() -> None:
    assert errors_of(body(GOOD, GOOD | {"id": "b", "prompt_tokens": 1.5})) == [(1, "prompt_tokens")]


def test_string_number_is_not_coerced() -> None:
    assert errors_of(body(GOOD | {"turn": "3"})) == [(0, "turn")]


def test_negative_tokens_and_nan_timestamp() -> None:
    raw = b'{"events": [' + json.dumps(GOOD | {"prompt_tokens": -1}).encode() + b","
    raw += json.dumps(GOOD | {"id": "c"}).encode().replace(b'"ts": 1.5', b'"ts": NaN') + b"]}"
    assert errors_of(raw) == [(0, "prompt_tokens"), (1, "ts")]


def test_unknown_type_missing_field_and_extra_field() -> None:
    errs = errors_of(
        body(
            GOOD | {"type": "teleport"},
            {k: v for k, v in GOOD.items() if k != "turn"},
            GOOD | {"prompt_token": 3},
            {k: v for k, v in GOOD.items() if k != "type"},
        )
    )
    assert errs == [(0, "type"), (1, "turn"), (2, "prompt_token"), (3, "type")]


def test_unknown_enum_value() -> None:
    bad = {"id": "x", "ts": 1, "trajectory": "t", "type": "sandbox_started", "mode": "warm"}
    assert errors_of(body(bad)) == [(0, "mode")]


def test_string_lengths_are_bounded() -> None:
    assert errors_of(body(GOOD | {"trajectory": "t" * 10_000})) == [(0, "trajectory")]
    assert errors_of(body(GOOD | {"id": ""})) == [(0, "id")]


def test_message_reads_well() -> None:
    with pytest.raises(BatchError) as info:
        parse_batch(body(GOOD | {"prompt_tokens": 1.5}))
    assert "event 0: prompt_tokens:" in str(info.value)


def test_not_json_and_wrong_shape_are_batch_errors() -> None:
    assert errors_of(b"{not json")[0][0] is None
    assert errors_of(b'{"events": 3}') == [(None, "events")]


def test_ndjson_reports_the_bad_line() -> None:
    good = json.dumps(GOOD)
    with pytest.raises(BatchError) as info:
        parse_ndjson(f"{good}\n\n{{oops\n{good}\n".encode())
    assert [(e.index, e.field) for e in info.value.errors] == [(1, "line")]
    assert len(parse_ndjson(f"{good}\n{json.dumps(GOOD | {'id': 'z'})}\n".encode())) == 2


def test_snapshot_validation() -> None:
    snap = parse_snapshot(
        json.dumps(
            {
                "ts": 5.0,
                "trajectories": [
                    {"trajectory": "a", "state": "tool", "since": 1.0, "context_tokens": 900}
                ],
            }
        )
    )
    assert snap.trajectories[0].state == "tool"
    with pytest.raises(BatchError) as info:
        parse_snapshot(
            b'{"ts": 1, "trajectories": [{"trajectory": "a", "state": "nap", '
            b'"since": 1, "context_tokens": 1}]}'
        )
    assert info.value.errors[0].field == "trajectories.0.state"


# -- cluster events: weight updates ------------------------------------------------------------

STARTED = {"id": "w1", "ts": 9.0, "type": "weight_update_started", "version": 3}
FINISHED = {
    "id": "w2",
    "ts": 12.0,
    "type": "weight_update_finished",
    "version": 3,
    "reprefill_trajectories": 40,
}


def test_weight_update_events_parse_without_a_trajectory() -> None:
    started, finished, queued = parse_batch(
        body(STARTED | {"expected_seconds": 2.5}, FINISHED, GOOD)
    )
    assert isinstance(started, WeightUpdateStarted) and started.expected_seconds == 2.5
    assert isinstance(finished, WeightUpdateFinished) and finished.reprefill_trajectories == 40
    assert queued.type == "request_queued"
    assert parse_batch(body(STARTED))[0].expected_seconds is None  # type: ignore[union-attr]
    assert {"weight_update_started", "weight_update_finished"} <= set(EVENT_TYPES)
    # The same union serves NDJSON and Python callers; the wire form round-trips.
    lines = "\n".join(json.dumps(e) for e in (STARTED, FINISHED)).encode()
    assert parse_ndjson(lines) == parse_events(dump_events(parse_ndjson(lines)))


def test_weight_update_fields_are_strict_and_named() -> None:
    errs = errors_of(
        body(
            STARTED | {"version": -1},
            STARTED | {"version": 1.5},  # a fraction; a whole 1.0 is the integer 1
            STARTED | {"expected_seconds": 0},
            FINISHED | {"reprefill_trajectories": "4"},
            {k: v for k, v in FINISHED.items() if k != "reprefill_trajectories"},
            {k: v for k, v in STARTED.items() if k != "version"},
            STARTED | {"trajectory": "t"},  # cluster-scoped: a trajectory is a mistake
        )
    )
    assert errs == [
        (0, "version"),
        (1, "version"),
        (2, "expected_seconds"),
        (3, "reprefill_trajectories"),
        (4, "reprefill_trajectories"),
        (5, "version"),
        (6, "trajectory"),
    ]


def test_trajectory_events_still_need_their_trajectory() -> None:
    assert errors_of(body({k: v for k, v in GOOD.items() if k != "trajectory"})) == [
        (0, "trajectory")
    ]


def test_snapshot_may_carry_an_update_under_way() -> None:
    snap = parse_snapshot(
        b'{"ts": 5, "trajectories": [], '
        b'"weight_update": {"version": 2, "started_at": 4.0, "expected_seconds": 3}}'
    )
    assert snap.weight_update is not None and snap.weight_update.version == 2
    assert parse_snapshot(b'{"ts": 5, "trajectories": []}').weight_update is None
    with pytest.raises(BatchError) as info:
        parse_snapshot(b'{"ts": 5, "trajectories": [], "weight_update": {"version": 2}}')
    assert info.value.errors[0].field == "weight_update.started_at"
