"""What an attacker on the cluster network could send to an engine pod's agent (port 8080).

The agent's API (docs/agent-api.md) takes one write, ``POST /v1/role``, with the agent
token; everything else reads. Hostile requests: no or wrong token, bodies declared or sent
past 64 KiB, bodies that stall, garbage and wrong types, header floods, unknown paths; and,
among them, real switches with the right token, so the flips run while the attack does.
Outcomes are named as in :mod:`prorsa_lab.robustness.webhook_attacks`.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass

from prorsa_lab.robustness.raw_http import RawRequest, chunked, request_bytes
from prorsa_lab.robustness.webhook_attacks import Attack, Kind

ROLE = "/v1/role"
MAX_ROLE_BODY = 64 << 10


@dataclass(kw_only=True)
class AgentTarget:
    host: str
    port: int
    token: str
    header_timeout: float
    body_timeout: float


def _role(token: bytes | None, body: bytes, *, length: int | bool | None = True) -> bytes:
    headers = [(b"Content-Type", b"application/json")]
    if token is not None:
        headers.insert(0, (b"Authorization", b"Bearer " + token))
    return request_bytes("POST", ROLE, headers=headers, body=body, length=length)


def _one(kind: str, raw: bytes, *expect: str) -> Attack:
    return Attack(kind=kind, request=RawRequest(pieces=(raw,)), expect=frozenset(expect))


def bad_token(t: AgentTarget, rng: random.Random) -> Attack:
    token = rng.choice(
        [
            None,
            "".join(rng.choices(string.ascii_letters, k=rng.randint(1, 64))).encode(),
            t.token.encode()[:-1],
            t.token.encode() + b"\xff",
            b"\xc3\x28" + t.token.encode(),
        ]
    )
    return _one("agent-bad-token", _role(token, b'{"role": "prefill"}'), "401", "400")


def oversized(t: AgentTarget, rng: random.Random) -> Attack:
    """Past 64 KiB, declared (refused before reading) or sent chunked; without the token
    the body is never read at all (401)."""
    token = t.token.encode() if rng.random() < 0.8 else None
    if rng.random() < 0.5:
        declared = rng.choice([MAX_ROLE_BODY + 1, 100 << 20, 2**62])
        raw = _role(token, b'{"role": ', length=declared)
        return _one("agent-oversized", raw, "413" if token else "401", "reset")
    body = b'{"role": "prefill", "pad": "' + b"x" * (MAX_ROLE_BODY + 10) + b'"}'
    head = request_bytes(
        "POST",
        ROLE,
        headers=[
            (b"Authorization", b"Bearer " + (token or b"x")),
            (b"Transfer-Encoding", b"chunked"),
        ],
        length=None,
    )
    return _one("agent-oversized", head + chunked(body), "413" if token else "401", "reset")


def stalled_body(t: AgentTarget, rng: random.Random) -> Attack:
    """A body that stops: 408 at the agent's body deadline."""
    del rng
    body = b'{"role": "prefill"}'
    req = RawRequest(
        pieces=(_role(t.token.encode(), b"", length=len(body) + 50), body[:5]),
        pause=0.1,
        hold=t.body_timeout + 30,
    )
    return Attack(kind="agent-stalled-body", request=req, expect=frozenset({"408"}))


def stalled_headers(t: AgentTarget, rng: random.Random) -> Attack:
    head = b"POST /v1/role HTTP/1.1\r\nHost: a\r\n"
    trickle = tuple(b"X-a: b\r\n"[i : i + 1] for i in range(8)) * rng.randint(1, 3)
    req = RawRequest(pieces=(head, *trickle), pause=0.5, hold=t.header_timeout + 30)
    return Attack(
        kind="agent-stalled-headers",
        request=req,
        expect=frozenset({"closed", "reset", "400", "408"}),
    )


def garbage(t: AgentTarget, rng: random.Random) -> Attack:
    body = rng.choice(
        [
            rng.randbytes(rng.randint(1, 2048)),
            b"",
            b"null",
            b"[" * 30_000 + b"]" * 30_000,
            b'{"role": "prefill"',
            b"\xef\xbb\xbf{}",
        ]
    )
    return _one("agent-garbage", _role(t.token.encode(), body), "400", "422")


def wrong_types(t: AgentTarget, rng: random.Random) -> Attack:
    body = rng.choice(
        [
            {"role": "both"},
            {"role": 1},
            {"role": None},
            {},
            {"role": "prefill", "drain_timeout_seconds": -1},
            {"role": "prefill", "drain_timeout_seconds": "soon"},
            {"role": "prefill", "surprise": True},
            ["prefill"],
        ]
    )
    return _one("agent-wrong-types", _role(t.token.encode(), json.dumps(body).encode()), "422")


def switch(t: AgentTarget, rng: random.Random) -> Attack:
    """A real switch with the right token: 200 (done, or already in that role), 202 (the
    same switch runs), 409 (another one runs)."""
    role = rng.choice(["prefill", "decode"])
    body = json.dumps({"role": role, "drain_timeout_seconds": 0.5}).encode()
    return _one("agent-switch", _role(t.token.encode(), body), "200", "202", "409")


def reads(t: AgentTarget, rng: random.Random) -> Attack:
    del t
    method, path = rng.choice(
        [
            ("GET", "/v1/state"),
            ("GET", "/v1/role"),
            ("GET", "/livez"),
            ("GET", "/metrics"),
            ("GET", "/healthz"),
        ]
    )
    return _one("agent-reads", request_bytes(method, path, length=None), "200")


def probes(t: AgentTarget, rng: random.Random) -> Attack:
    method, path = rng.choice(
        [
            ("PUT", ROLE),
            ("DELETE", "/v1/state"),
            ("GET", "/"),
            ("GET", "/../../etc/passwd"),
            ("GET", "/" + "a" * 20_000),
            ("POST", "/v1/state"),
            ("BREW", "/"),
        ]
    )
    raw = request_bytes(method, path, headers=[(b"Authorization", b"Bearer " + t.token.encode())])
    return _one("agent-probes", raw, "400", "404", "405", "414")


def header_flood(t: AgentTarget, rng: random.Random) -> Attack:
    head = b"POST /v1/role HTTP/1.1\r\nHost: a\r\nConnection: close\r\n"
    if rng.random() < 0.5:
        extra = b"".join(b"X-Flood-%d: v\r\n" % i for i in range(rng.choice([200, 5000])))
    else:
        extra = b"X-Big: " + b"v" * 100_000 + b"\r\n"
    raw = head + b"Authorization: Bearer " + t.token.encode() + b"\r\n" + extra + b"\r\n"
    return _one("agent-header-flood", raw, "400", "413", "431", "closed", "reset")


KINDS: dict[str, Kind] = {
    "agent-bad-token": Kind(6, bad_token),
    "agent-oversized": Kind(5, oversized),
    "agent-stalled-body": Kind(1, stalled_body),
    "agent-stalled-headers": Kind(1, stalled_headers),
    "agent-garbage": Kind(5, garbage),
    "agent-wrong-types": Kind(5, wrong_types),
    "agent-switch": Kind(2, switch),
    "agent-reads": Kind(4, reads),
    "agent-probes": Kind(3, probes),
    "agent-header-flood": Kind(3, header_flood),
}
STALLED = frozenset({"agent-stalled-body", "agent-stalled-headers"})
