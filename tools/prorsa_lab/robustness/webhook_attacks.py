"""What a user could send or an attacker could try against the trainer webhook, by kind.

Each kind builds one or more :class:`Attack` (a burst is sent at once) from the
attacker's view of the target (:class:`WebhookTarget`) and a seeded ``random.Random``. An
attack names the outcomes the webhook's contract allows (docs/webhook-events.md): a status
such as ``"401"``, or ``"closed"`` for a connection the server drops without a reply (its
header deadline), ``"reset"`` where the server may hang up while a body is still being sent.
Any other outcome is *unexpected*, and a 5xx is always a failure.

Two clusters are served: ``c``, where the legitimate trainer posts, and ``noisy``, a
neighbour on the same operator whose token the attacker holds (a broken or hostile trainer
with a token of its own). Token-holding abuse that the contract lets a token holder do
(fill the live-trajectory limit, send snapshots without an emitter id, flood batches) goes
to ``noisy``; what may go to ``c`` with its token is what must leave the legitimate
trainer's events alone: bad bodies, replays of its own batches (duplicates, never applied
again), snapshots under other emitter ids (they replace only their own trajectories).
"""

from __future__ import annotations

import gzip
import json
import random
import string
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from prorsa_lab.robustness.raw_http import Outcome, RawRequest, chunked, request_bytes

NAMESPACE = "rl"
SNAPSHOT_ROWS = (10, 1000, 20_000)  # the neighbour's snapshots; past its limit: 422
CLUSTER = "c"
NOISY = "noisy"
LEGIT_PREFIX = "legit-"  # the legitimate trainer's trajectories
EMITTER_HEADER = "X-Prorsa-Emitter"
SENT_AT_HEADER = "X-Prorsa-Sent-At"

Check = Callable[[Outcome], str | None]  # a problem with a reply the status allows, or None


@dataclass(frozen=True, slots=True, kw_only=True)
class Attack:
    kind: str
    request: RawRequest
    expect: frozenset[str]
    check: Check | None = None


@dataclass(kw_only=True)
class WebhookTarget:
    """What the attacker knows and holds, updated as the run goes (token rotations, the
    legitimate trainer's batches it captured)."""

    host: str
    port: int
    token: str  # c's token now
    noisy_token: str
    header_timeout: float
    body_timeout: float
    rotations_started: int = 0
    rotations_done: int = 0
    retired: list[str] = field(default_factory=list)  # c's tokens rotated out
    captured: deque[tuple[bytes, tuple[tuple[str, str], ...]]] = field(
        default_factory=lambda: deque(maxlen=256)
    )
    serial: int = 0
    _big: dict[str, bytes] = field(default_factory=dict)

    def next_id(self, prefix: str = "atk") -> str:
        self.serial += 1
        return f"{prefix}-{self.serial}"

    def path(self, cluster: str = CLUSTER, what: str = "events") -> str:
        return f"/v1/namespaces/{NAMESPACE}/rolloutclusters/{cluster}/{what}"

    def cached(self, key: str, make: Callable[[], bytes]) -> bytes:
        """Large bodies are built once per run and sent many times."""
        if key not in self._big:
            self._big[key] = make()
        return self._big[key]

    def prepare(self) -> None:
        """Build the large bodies up front (seconds of CPU), not in the middle of the run."""
        self.cached("gzip-bomb", partial(_zeros_gzip, 256 << 20))
        self.cached("snapshot-33m", lambda: b"[" + b"1," * (33 << 19) + b"1]")
        self.cached("batch-5m", lambda: b"{" + b" " * (5 << 20) + b"}")
        self.cached("batch-4m", partial(_largest_batch, self))
        for rows in SNAPSHOT_ROWS:
            self.cached(f"snap-{rows}", partial(snapshot, rows, prefix="noisy"))


# -- bodies --------------------------------------------------------------------------------


def queued(t: WebhookTarget, trajectory: str, *, ts: float | None = None) -> dict[str, object]:
    return {
        "id": t.next_id(),
        "type": "request_queued",
        "trajectory": trajectory,
        "ts": time.time() if ts is None else ts,
        "prompt_tokens": 1000,
        "turn": 0,
    }


def dropped(t: WebhookTarget, trajectory: str) -> dict[str, object]:
    return {
        "id": t.next_id(),
        "type": "trajectory_dropped",
        "trajectory": trajectory,
        "ts": time.time(),
    }


def batch(events: list[dict[str, object]]) -> bytes:
    return json.dumps({"events": events}, separators=(",", ":")).encode()


def snapshot(rows: int, *, prefix: str, ts: float | None = None) -> bytes:
    now = time.time() if ts is None else ts
    trajectories = [
        {"trajectory": f"{prefix}-{i}", "state": "tool", "since": now, "context_tokens": 100}
        for i in range(rows)
    ]
    return json.dumps({"ts": now, "trajectories": trajectories}, separators=(",", ":")).encode()


def _bearer(token: str) -> tuple[str, str]:
    return ("Authorization", f"Bearer {token}")


def _json(token: str | None, *extra: tuple[str, str]) -> list[tuple[str, str]]:
    headers = [("Content-Type", "application/json"), *extra]
    return [_bearer(token), *headers] if token is not None else headers


def _post(path: str, headers: list[tuple[str, str]], body: bytes) -> RawRequest:
    return RawRequest(pieces=(request_bytes("POST", path, headers=headers, body=body),))


def _attack(
    kind: str,
    request: RawRequest,
    *expect: str,
    check: Check | None = None,
) -> Attack:
    return Attack(kind=kind, request=request, expect=frozenset(expect), check=check)


def _applied_none(outcome: Outcome) -> str | None:
    """A replay's reply: 200 must say nothing was applied again."""
    if outcome.status != 200:
        return None
    try:
        reply = json.loads(outcome.body)
    except ValueError:
        return "a 200 whose body is not JSON"
    if reply.get("applied"):
        return f"a replay applied {reply['applied']} event(s) again"
    return None


def _json_error(outcome: Outcome) -> str | None:
    """A refusal of the webhook's own handlers carries an ErrorReply with its reason."""
    if outcome.status is None or outcome.status < 400:
        return None
    try:
        reply = json.loads(outcome.body)
    except ValueError:
        return f"a {outcome.status} whose body is not JSON"
    if not isinstance(reply, dict) or "error" not in reply or "reason" not in reply:
        return f"a {outcome.status} without error and reason"
    return None


# -- credentials ---------------------------------------------------------------------------


def no_token(t: WebhookTarget, rng: random.Random) -> Attack:
    what = rng.choice(["events", "snapshot"])
    body = batch([queued(t, "x")]) if what == "events" else snapshot(1, prefix="x")
    return _attack(
        "no-token", _post(t.path(what=what), _json(None), body), "401", check=_json_error
    )


def bad_token(t: WebhookTarget, rng: random.Random) -> Attack:
    token = "".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(1, 64)))
    return _attack(
        "bad-token",
        _post(t.path(), _json(token), batch([queued(t, "x")])),
        "401",
        check=_json_error,
    )


def other_cluster_token(t: WebhookTarget, rng: random.Random) -> Attack:
    """The neighbour's valid token against ``c``: 401, as any wrong token."""
    del rng
    body = batch([queued(t, "x")])
    return _attack(
        "other-cluster-token", _post(t.path(), _json(t.noisy_token), body), "401", check=_json_error
    )


def rotated_token(t: WebhookTarget, rng: random.Random) -> Attack:
    """A token of ``c`` that was rotated out: refused at once, no overlap."""
    if not t.retired:
        return bad_token(t, rng)
    body = batch([queued(t, "x")])
    return _attack(
        "rotated-token",
        _post(t.path(), _json(rng.choice(t.retired)), body),
        "401",
        check=_json_error,
    )


def token_variants(t: WebhookTarget, rng: random.Random) -> Attack:
    """The right token, presented wrongly: never accepted, never an error."""
    tok = t.token.encode()
    value = rng.choice(
        [
            b"bearer  " + tok + b" extra",
            b"Basic " + tok,
            b"Bearer " + tok + b"\xff",
            b"Bearer " + tok[:-1],
            b"Bearer " + tok * 200,
            b"Bearer \xc3\x28" + tok,
            b"Token " + tok,
            b"Bearer",
            b"",
        ]
    )
    headers = [(b"Authorization", value), (b"Content-Type", b"application/json")]
    req = RawRequest(
        pieces=(request_bytes("POST", t.path(), headers=headers, body=batch([queued(t, "x")])),)
    )
    return _attack("token-variants", req, "401", "400", check=None)


def unknown_cluster(t: WebhookTarget, rng: random.Random) -> Attack:
    name = rng.choice(["nope", "c2", "C", "c-" + "x" * 300, "%2e%2e", "c%00"])
    if rng.random() < 0.5:
        req = _post(t.path(name), _json(t.token), batch([queued(t, "x")]))
        return _attack("unknown-cluster", req, "404", "400")
    req = _post(t.path(name), _json("guess"), batch([queued(t, "x")]))
    return _attack("unknown-cluster", req, "401", "400")


def path_probes(t: WebhookTarget, rng: random.Random) -> Attack:
    method, target = rng.choice(
        [
            ("GET", "/metrics"),  # the trainers' port serves no metrics (docs/security.md)
            ("GET", "/"),
            ("GET", "/v1/namespaces/rl/rolloutclusters/c/../../../../etc/passwd"),
            ("PUT", t.path()),
            ("DELETE", t.path()),
            ("PATCH", t.path(what="snapshot")),
            ("GET", t.path()),  # events is POST only
            ("POST", t.path(what="forecast")),
            ("GET", "/v1/namespaces/rl/rolloutclusters"),
            ("OPTIONS", "*"),
            ("GET", "/" + "a" * 20_000),
            ("GET", "/%00%ff"),
            ("CONNECT", "example.com:443"),
            ("BREW", "/coffee"),
        ]
    )
    req = RawRequest(pieces=(request_bytes(method, target, headers=[_bearer(t.token)]),))
    return _attack("path-probes", req, "400", "404", "405", "414", "431", "401")


def reads(t: WebhookTarget, rng: random.Random) -> Attack:
    target, token = rng.choice(
        [
            (t.path(what="forecast"), t.token),
            (t.path(what="status"), t.token),
            (t.path(what="forecast"), "wrong"),
            (t.path(NOISY, "status"), t.noisy_token),
            ("/openapi.json", None),
            ("/healthz", None),
        ]
    )
    headers = [_bearer(token)] if token else []
    req = RawRequest(pieces=(request_bytes("GET", target, headers=headers),))
    # 404 for the forecast: "no Decision yet" until the first tick.
    return _attack("reads", req, "200", "401", "404")


# -- bodies that are not what they claim ----------------------------------------------------


def malformed_json(t: WebhookTarget, rng: random.Random) -> Attack:
    choice = rng.randrange(12)
    body = [
        b'{"events": [',
        rng.randbytes(rng.randint(1, 4096)),
        b'{"events": [{"id": "\xff\xfe"}]}',
        b'{"events": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"events": [{"id": "a", "ts": 1e999999, "trajectory": "t", "type": "tool_started"}]}',
        b'{"events": [{"id": "a", "ts": NaN, "trajectory": "t", "type": "tool_started"}]}',
        b"null",
        b"",
        b'{"events": [], "events": [1]}',
        b"\xef\xbb\xbf" + batch([queued(t, "x")]),
        b'{"events": [' + b",".join([b"1"] * 50_000) + b"]}",
        b'{"events": [{"id": "a\x00b", "ts": 1, "trajectory": "t\x00", "type": "\x00"}]}',
    ][choice]
    req = _post(t.path(), _json(t.token), body)
    return _attack("malformed-json", req, "400", "422", check=_json_error)


def malformed_ndjson(t: WebhookTarget, rng: random.Random) -> Attack:
    good = json.dumps(queued(t, "x")).encode()
    body, expect = rng.choice(
        [
            (good + b"\n{not json}\n" + good, ("400", "422")),
            (b"\n\n\n", ("200",)),  # no events: an empty batch, as {"events": []}
            (b"[1, 2, 3]\n", ("422",)),
            (good[:-5] + b"\n", ("400", "422")),
            (b'{"events": [' + good + b"]}\n", ("422",)),
            (b"\n".join([b"{}"] * 2000), ("422",)),
            (good + b"\r\n" + b"\xff" * 10, ("400",)),
        ]
    )
    content_type = rng.choice(
        ["application/x-ndjson", "application/jsonl", "application/x-jsonlines"]
    )
    headers = [_bearer(t.token), ("Content-Type", content_type)]
    return _attack("malformed-ndjson", _post(t.path(), headers, body), *expect, check=_json_error)


_WRONG: list[Callable[[dict[str, object]], object]] = [
    lambda e: e | {"ts": "now"},
    lambda e: e | {"ts": True},
    lambda e: e | {"prompt_tokens": -5},
    lambda e: e | {"prompt_tokens": 1.5},
    lambda e: e | {"prompt_tokens": "100"},
    lambda e: e | {"turn": None},
    lambda e: e | {"type": "nope"},
    lambda e: e | {"type": 7},
    lambda e: e | {"id": 123},
    lambda e: e | {"id": ""},
    lambda e: e | {"id": "x" * 100_000},
    lambda e: e | {"trajectory": {"a": 1}},
    lambda e: e | {"surprise": 1},
    lambda e: {k: v for k, v in e.items() if k != "ts"},
    lambda e: {k: v for k, v in e.items() if k != "trajectory"},
    lambda e: e | {"type": "weight_update_started", "version": -1},
    lambda e: e | {"prompt_tokens": 10**30},
    lambda e: [e],
]


def wrong_types(t: WebhookTarget, rng: random.Random) -> Attack:
    event = queued(t, "x")
    if rng.random() < 0.15:
        body = rng.choice(
            [b'{"events": {}}', b'{"events": "x"}', b"[]", b'"events"', b'{"evnets": []}', b"{}"]
        )
    else:
        bad = rng.choice(_WRONG)(event)
        events = [queued(t, "y"), bad] if rng.random() < 0.5 else [bad]
        body = json.dumps({"events": events}).encode()
    return _attack(
        "wrong-types", _post(t.path(), _json(t.token), body), "400", "422", check=_json_error
    )


def out_of_window(t: WebhookTarget, rng: random.Random) -> Attack:
    now = time.time()
    if rng.random() < 0.5:
        ts = rng.choice([now * 1000, 0.0, now + 7200, now - 8 * 86400, 1e300, 42.0])
        body = batch([queued(t, "x", ts=ts)])
        if rng.random() < 0.3:
            body = snapshot(3, prefix="late", ts=ts)
            req = _post(t.path(what="snapshot"), _json(t.token), body)
            return _attack("out-of-window", req, "422", check=_json_error)
        return _attack(
            "out-of-window", _post(t.path(), _json(t.token), body), "422", check=_json_error
        )
    sent = rng.choice(["abc", "nan", "inf", "-1", str(now + 7200), "1e309", str(now * 1000), ""])
    req = _post(t.path(), _json(t.token, (SENT_AT_HEADER, sent)), batch([queued(t, "x")]))
    return _attack("out-of-window", req, "400", "422", check=_json_error)


# -- sizes ------------------------------------------------------------------------------


def huge_declared(t: WebhookTarget, rng: random.Random) -> Attack:
    """A body that says it is enormous: refused before it is read (401 without a token)."""
    declared = rng.choice([5 << 20, 64 << 20, 10 << 30, 2**62])
    what = rng.choice(["events", "snapshot"])
    start = batch([queued(t, "x")])[:100]
    if rng.random() < 0.3:
        req = RawRequest(
            pieces=(
                request_bytes(
                    "POST", t.path(what=what), headers=_json(None), body=start, length=declared
                ),
            )
        )
        return _attack("huge-declared", req, "401", "reset")
    if what == "snapshot" and declared <= 32 << 20:
        declared = 64 << 20
    req = RawRequest(
        pieces=(
            request_bytes(
                "POST", t.path(what=what), headers=_json(t.token), body=start, length=declared
            ),
        )
    )
    return _attack("huge-declared", req, "413", "reset")


def _zeros_gzip(size: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    chunk = b"\0" * (1 << 20)
    out = [packer.compress(chunk) for _ in range(size >> 20)]
    return b"".join(out) + packer.flush()


def huge_body(t: WebhookTarget, rng: random.Random) -> Attack:
    """More bytes than the limit, sent: with a length, chunked without one, or a gzip
    bomb that inflates to 256 MiB. 413 once the limit is passed, whatever was declared;
    a declared length past it is 413 before any byte of the body. Sent chunked, its size
    is unknown until read: while other bodies hold the in-flight budget it is 429 (busy,
    retry shortly: the retry gets its 413), and the body must arrive within the body
    deadline, which on a busy machine with a short deadline (the test's 2 s) it may not
    (408)."""
    how = rng.choice(["length", "chunked", "gzip-bomb", "snapshot"])
    headers = _json(t.token)
    if how == "gzip-bomb":
        bomb = t.cached("gzip-bomb", lambda: _zeros_gzip(256 << 20))
        headers.append(("Content-Encoding", "gzip"))
        return _attack("huge-body", _post(t.path(), headers, bomb), "413", "400", "reset")
    if how == "snapshot":
        body = t.cached("snapshot-33m", lambda: b"[" + b"1," * (33 << 19) + b"1]")
        head = request_bytes(
            "POST",
            t.path(what="snapshot"),
            headers=[*headers, ("Transfer-Encoding", "chunked")],
            length=None,
        )
        req = RawRequest(pieces=(head, chunked(*_slices(body, 1 << 20))))
        return _attack("huge-body", req, "408", "413", "429", "reset")
    body = t.cached("batch-5m", lambda: b"{" + b" " * (5 << 20) + b"}")
    if how == "length":
        return _attack("huge-body", _post(t.path(), headers, body), "413", "reset")
    head = request_bytes(
        "POST", t.path(), headers=[*headers, ("Transfer-Encoding", "chunked")], length=None
    )
    req = RawRequest(pieces=(head, chunked(*_slices(body, 1 << 16))))
    return _attack("huge-body", req, "413", "408", "429", "reset")


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _slices(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def encodings(t: WebhookTarget, rng: random.Random) -> Attack:
    good = batch([queued(t, "enc")])
    encoding, body, expect = rng.choice(
        [
            ("gzip", _half(gzip.compress(good)), ("400",)),  # cut off mid-stream
            ("gzip", b"not gzip at all", ("400",)),
            ("deflate", b"\x00\x01\x02", ("400",)),
            ("br", b"\x00\x01\x02", ("400",)),
            ("xz", good, ("400",)),
            ("gzip, gzip", gzip.compress(gzip.compress(good)), ("400",)),
            ("gzip", gzip.compress(good), ("200",)),
        ]
    )
    headers = _json(t.token, ("Content-Encoding", encoding))
    return _attack("encodings", _post(t.path(), headers, body), *expect)


# -- framing and headers -------------------------------------------------------------------


def smuggling(t: WebhookTarget, rng: random.Random) -> Attack:
    body = batch([queued(t, "smuggle")])
    auth = f"Authorization: Bearer {t.token}\r\nContent-Type: application/json\r\n".encode()
    line = f"POST {t.path()} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n".encode() + auth
    raw = rng.choice(
        [
            line
            + f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            + chunked(body),
            line
            + f"Content-Length: {len(body)}\r\nContent-Length: {len(body) + 5}\r\n\r\n".encode()
            + body,
            line + b"Content-Length: -1\r\n\r\n" + body,
            line + b"Content-Length: abc\r\n\r\n" + body,
            line + b"Transfer-Encoding: gzip, chunked\r\n\r\n" + chunked(body),
            line + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n",
            line
            + b"Transfer-Encoding: chunked\r\n\r\n5;"
            + b"e" * 20_000
            + b"\r\nhello\r\n0\r\n\r\n",
            line.replace(b"\r\n", b"\n") + f"Content-Length: {len(body)}\n\n".encode() + body,
            line
            + b"Transfer-Encoding: chunked\r\n\r\n"
            + chunked(body)
            + b"GET / HTTP/1.1\r\n\r\n",
            line + b" Content-Length: 5\r\n\r\nhello",
        ]
    )
    return _attack(
        "smuggling", RawRequest(pieces=(raw,)), "200", "400", "413", "422", "501", "reset", "closed"
    )


def header_flood(t: WebhookTarget, rng: random.Random) -> Attack:
    head = f"POST {t.path()} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n".encode()
    how = rng.randrange(4)
    if how == 0:
        extra = b"".join(f"X-Flood-{i}: {i}\r\n".encode() for i in range(rng.choice([200, 5000])))
    elif how == 1:
        extra = b"X-Big: " + b"v" * rng.choice([9000, 100_000]) + b"\r\n"
    elif how == 2:
        extra = b"Cookie: " + b"a=b; " * 20_000 + b"\r\n"
    else:
        extra = b"".join(b"Authorization: Bearer guess-%d\r\n" % i for i in range(300))
    raw = (
        head
        + f"Authorization: Bearer {t.token}\r\n".encode()
        + extra
        + b"Content-Length: 0\r\n\r\n"
    )
    return _attack(
        "header-flood", RawRequest(pieces=(raw,)), "400", "401", "413", "431", "closed", "reset"
    )


def slowloris_headers(t: WebhookTarget, rng: random.Random) -> Attack:
    """Headers that never end, a byte at a time: dropped at the header deadline."""
    head = f"POST {t.path()} HTTP/1.1\r\nHost: a\r\n".encode()
    trickle = tuple(b"X-a: b\r\n"[i : i + 1] for i in range(8)) * rng.randint(1, 3)
    req = RawRequest(pieces=(head, *trickle), pause=0.5, hold=t.header_timeout + 30)
    return _attack("slowloris-headers", req, "closed", "reset", "408", "400")


def slowloris_body(t: WebhookTarget, rng: random.Random) -> Attack:
    """A body that stops halfway: 408 at the body deadline, nothing held after it."""
    what = rng.choice(["events", "snapshot"])
    body = batch([queued(t, "slow")])
    head = request_bytes("POST", t.path(what=what), headers=_json(t.token), length=len(body) + 100)
    req = RawRequest(pieces=(head, body[:10], body[10:20]), pause=0.2, hold=t.body_timeout + 30)
    return _attack("slowloris-body", req, "408", check=_json_error)


# -- emitter ids -------------------------------------------------------------------------------


def emitter_malformed(t: WebhookTarget, rng: random.Random) -> Attack:
    value = rng.choice(
        [
            b"",
            b" ",
            b"a" * 129,
            b"-lead",
            b"has space",
            b"a/b",
            b"\xc3\xbc",
            b"\x01",
            b"a\tb",
            b"..",
            b"a" * 10_000,
        ]
    )
    headers = [
        (b"Authorization", f"Bearer {t.token}".encode()),
        (b"Content-Type", b"application/json"),
        (EMITTER_HEADER.encode(), value),
    ]
    what = rng.choice(["events", "snapshot"])
    body = batch([queued(t, "em")]) if what == "events" else snapshot(2, prefix="em")
    req = RawRequest(pieces=(request_bytes("POST", t.path(what=what), headers=headers, body=body),))
    return _attack("emitter-malformed", req, "400", "422")


def emitter_flood(t: WebhookTarget, rng: random.Random) -> Attack:
    """A new emitter id on every request (up to the cluster's 4096, then 422)."""
    cluster, token = rng.choice([(CLUSTER, t.token), (NOISY, t.noisy_token)])
    emitter = t.next_id("flood")
    headers = _json(token, (EMITTER_HEADER, emitter))
    if rng.random() < 0.3:
        body = snapshot(rng.randint(0, 5), prefix=emitter)
        req = _post(t.path(cluster, "snapshot"), headers, body)
    else:
        req = _post(t.path(cluster), headers, batch([queued(t, emitter)]))
    return _attack("emitter-flood", req, "200", "422", "429")


# -- the token holder's own abuse -----------------------------------------------------------


def replay(t: WebhookTarget, rng: random.Random) -> Attack:
    """A batch of the legitimate trainer's, sent again: as captured, with its ids but other
    contents, or under no emitter id. Duplicates: counted, never applied again."""
    if not t.captured:
        return wrong_types(t, rng)
    body, headers = rng.choice(t.captured)
    how = rng.choice(["as-is", "tampered", "unnamed"])
    if how == "tampered":
        events = json.loads(body)["events"] if body.startswith(b"{") else []
        for e in events:
            if "prompt_tokens" in e:
                e["prompt_tokens"] = int(e["prompt_tokens"]) * 100
            if "output_tokens" in e:
                e["output_tokens"] = int(e["output_tokens"]) + 10_000
        body = batch(events)
    kept = [(k, v) for k, v in headers if k.lower() not in ("authorization", "content-length")]
    if how == "unnamed":
        kept = [(k, v) for k, v in kept if k.lower() != EMITTER_HEADER.lower()]
    req = _post(t.path(), [_bearer(t.token), *kept], body)
    return _attack("replay", req, "200", "429", check=_applied_none)


def snapshot_flood(t: WebhookTarget, rng: random.Random) -> Attack:
    """Snapshots, sent several at once (a burst): on ``noisy`` any kind (more rows than its
    limit: 422); on ``c`` only under emitter ids of their own, which replace nothing of
    the legitimate trainer's."""
    if rng.random() < 0.5:
        rows = rng.choice(SNAPSHOT_ROWS)
        named = rng.random() < 0.5
        emitter = [(EMITTER_HEADER, f"noisy-{rng.randrange(4)}")] if named else []
        body = t.cached(f"snap-{rows}", partial(snapshot, rows, prefix="noisy"))
        req = _post(t.path(NOISY, "snapshot"), _json(t.noisy_token, *emitter), body)
        return _attack("snapshot-flood", req, "200", "408", "422", "429")
    rows = rng.choice([10, 500])
    emitter_id = f"other-worker-{rng.randrange(8)}"
    headers = _json(t.token, (EMITTER_HEADER, emitter_id))
    req = _post(t.path(what="snapshot"), headers, snapshot(rows, prefix=emitter_id))
    return _attack("snapshot-flood", req, "200", "408", "429")


def trajectory_cap(t: WebhookTarget, rng: random.Random) -> Attack:
    """Batches on ``noisy`` that start trajectories past its maxLiveTrajectories: 429
    trajectory_limit for those, the rest applied; some end trajectories to make room."""
    n = rng.choice([100, 1000, 3000])
    if rng.random() < 0.2:
        events = [dropped(t, f"cap-{rng.randrange(t.serial + 1)}") for _ in range(n)]
    else:
        events = [queued(t, f"cap-{t.serial}") for _ in range(n)]
    req = _post(t.path(NOISY), _json(t.noisy_token), batch(events))
    return _attack("trajectory-cap", req, "200", "408", "429")


def batch_flood(t: WebhookTarget, rng: random.Random) -> Attack:
    """Legal batches of the largest size on ``noisy``, several at once (a burst): the
    in-flight budget and the queue bound answer 429, and ``c`` is still served."""
    del rng
    body = t.cached("batch-4m", partial(_largest_batch, t))
    req = _post(t.path(NOISY), _json(t.noisy_token), body)
    return _attack("batch-flood", req, "200", "408", "429")


def _largest_batch(t: WebhookTarget) -> bytes:
    """A legal batch just under the 4 MiB limit."""
    one = len(batch([queued(t, "flood-0")]))
    n = (4 << 20) // one
    while True:
        body = batch([queued(t, f"flood-{i}") for i in range(n)])
        if len(body) <= 4 << 20:
            return body
        n = n * 95 // 100


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of hostile request: how often it is drawn, how it is built from the target
    (a :class:`WebhookTarget`, or the agent suite's), and how many go at once."""

    weight: float
    build: Callable[[Any, random.Random], Attack]
    burst: tuple[int, int] = (1, 1)  # how many are sent at once (a burst), drawn in range


KINDS: dict[str, Kind] = {
    "no-token": Kind(4, no_token),
    "bad-token": Kind(4, bad_token),
    "other-cluster-token": Kind(3, other_cluster_token),
    "rotated-token": Kind(3, rotated_token),
    "token-variants": Kind(4, token_variants),
    "unknown-cluster": Kind(3, unknown_cluster),
    "path-probes": Kind(4, path_probes),
    "reads": Kind(4, reads),
    "malformed-json": Kind(8, malformed_json),
    "malformed-ndjson": Kind(5, malformed_ndjson),
    "wrong-types": Kind(8, wrong_types),
    "out-of-window": Kind(6, out_of_window),
    "huge-declared": Kind(4, huge_declared),
    "huge-body": Kind(2, huge_body),
    "encodings": Kind(3, encodings),
    "smuggling": Kind(4, smuggling),
    "header-flood": Kind(4, header_flood),
    "slowloris-headers": Kind(2, slowloris_headers),
    "slowloris-body": Kind(2, slowloris_body),
    "emitter-malformed": Kind(4, emitter_malformed),
    "emitter-flood": Kind(4, emitter_flood),
    "replay": Kind(6, replay),
    "snapshot-flood": Kind(1, snapshot_flood, (2, 5)),
    "trajectory-cap": Kind(4, trajectory_cap),
    "batch-flood": Kind(0.4, batch_flood, (3, 8)),
}
STALLED = frozenset({"slowloris-headers", "slowloris-body"})
