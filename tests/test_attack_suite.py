"""``prorsa bench attack`` (docs/security.md#attack-and-chaos), small: hostile requests of
every kind against the webhook and the agent, with a legitimate trainer posting and its
token rotated twice meanwhile. The same run as the published one, with fewer requests and
short deadlines, so a regression in what the webhook or the agent answer a bad request,
or an event of the trainer lost, fails ``make test``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from prorsa.cli import main
from prorsa_lab.robustness import webhook_attacks
from prorsa_lab.robustness.attack_suite import Tally
from prorsa_lab.robustness.raw_http import Outcome
from prorsa_lab.robustness.webhook_attacks import WebhookTarget


def target() -> WebhookTarget:
    return WebhookTarget(
        host="127.0.0.1", port=1, token="t", noisy_token="n", header_timeout=2, body_timeout=2
    )


def test_a_small_attack_gets_no_5xx_loses_no_event_and_answers_each_kind_by_contract(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "attack.json"  # the figures in docs/security.md come from this JSON
    code = main(
        ["bench", "attack", "--requests", "160", "--agent-requests", "40", "--seed", "7",
         "--concurrency", "8", "--stalled", "8", "--header-timeout", "2", "--body-timeout", "2",
         "--legit-rate", "200", "--out", str(path)]
    )  # fmt: skip
    text = capsys.readouterr().out
    wire = json.loads(path.read_text())
    assert code == 0, text
    assert wire["ok"] is True and wire["requestsTried"] == 200
    assert wire["serverErrors"] == 0 and wire["unexpected"] == 0 and wire["eventsLost"] == 0
    assert wire["command"].startswith("prorsa bench attack --requests 160 --seed 7")
    assert wire["machine"] and wire["date"]
    # The trainer posted throughout and through both token rotations.
    legit = wire["legit"]
    assert legit["emitted"] > 500 and legit["appliedOnce"] == legit["emitted"], legit
    assert "token of rl/c rotated (2 so far)" in text
    # Refused requests were refused: bad tokens 401, bad bodies 400.
    assert {"401", "400"} <= set(wire["webhook"]["byStatus"]), wire["webhook"]["byStatus"]
    assert wire["agent"]["tried"] == 40 and wire["agent"]["consistent"], wire["agent"]
    # Progress lines and the summary name what a reader of docs/security.md looks for.
    assert "webhook 160/160" in text and "agent 40/40" in text
    assert "prorsa bench attack: 200 hostile requests" in text and ": OK" in text


def reply(status: int, body: bytes = b'{"error": "no", "reason": "Unauthorized"}') -> Outcome:
    return Outcome(status=status, ending="reply", body=body, seconds=0.01)


def test_the_tally_counts_a_5xx_and_an_outcome_the_contract_does_not_allow() -> None:
    """The suite can fail: a 5xx, a status outside the attack's contract (a 401 only
    while a rotation may have retired its token), a refusal without its reason."""
    attack = webhook_attacks.no_token(target(), random.Random(0))
    tally = Tally()
    tally.record(attack, reply(401), rotated=False)
    assert tally.unexpected == 0 and tally.server_errors == 0
    tally.record(attack, reply(500, b"boom"), rotated=False)
    tally.record(attack, reply(200), rotated=False)
    tally.record(attack, reply(401, b"Unauthorized"), rotated=False)
    assert tally.server_errors == 1 and tally.unexpected == 3
    problems = [e["problem"] for e in tally.wire()["unexpectedExamples"]]
    assert problems == ["500 not in ['401']", "200 not in ['401']", "a 401 whose body is not JSON"]

    garbage = webhook_attacks.malformed_json(target(), random.Random(0))
    assert "401" not in garbage.expect
    tally = Tally()
    tally.record(garbage, reply(401), rotated=True)
    assert tally.unexpected == 0  # its token was rotated out while it was in flight
    tally.record(garbage, reply(401), rotated=False)
    assert tally.unexpected == 1


def test_bench_attack_refuses_bad_options_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "attack", "--requests", "0"]) == 2
    assert "--requests must be >= 1" in capsys.readouterr().err
