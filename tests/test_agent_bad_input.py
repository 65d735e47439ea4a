"""The agent refuses bad input with a 4xx, never a 500, and drops stalled connections.

Over real HTTP on loopback, against the SGLang double; headers the HTTP clients would
refuse to send are written on a raw socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from urllib.parse import urlsplit

import httpx
import pytest

from prorsa_lab.doubles.sglang_double import FAST_TIMEOUTS, EnginePod

TOKEN = "agent-token-7c1e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PATIENCE = 30.0


@pytest.fixture
async def pod() -> AsyncIterator[EnginePod]:
    timeouts = replace(FAST_TIMEOUTS, client_headers=0.5, client_body=0.5)
    async with EnginePod(instance="e-bad", token=TOKEN, timeouts=timeouts) as p:
        yield p


async def raw_request(url: str, request: bytes) -> bytes:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=PATIENCE)
    finally:
        writer.close()


def role_request(authorization: bytes, body: bytes = b'{"role": "prefill"}') -> bytes:
    return (
        b"POST /v1/role HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n"
        b"Authorization: " + authorization + b"\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


@pytest.mark.parametrize(
    "authorization",
    [b"Bearer \xff\xfe\xfd", b"Bearer agent-token-7c1\xe9", b"\xc3\x28 " + TOKEN.encode()],
    ids=["invalid-utf8", "latin1-lookalike", "invalid-utf8-scheme"],
)
async def test_a_bearer_token_that_is_not_utf8_is_401(pod: EnginePod, authorization: bytes) -> None:
    reply = await raw_request(pod.agent_url, role_request(authorization))
    assert reply.startswith(b"HTTP/1.1 401"), reply[:300]
    assert b"WWW-Authenticate: Bearer" in reply
    assert pod.double.counters().switch_calls == 0


async def test_the_right_token_still_works_after_refusals(pod: EnginePod) -> None:
    await raw_request(pod.agent_url, role_request(b"Bearer \xff"))
    reply = await raw_request(pod.agent_url, role_request(b"Bearer " + TOKEN.encode()))
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert pod.double.role == "prefill"


async def test_a_token_file_that_is_not_utf8_accepts_only_its_bytes(pod: EnginePod) -> None:
    assert pod.agent is not None
    pod.agent.config.token_file.write_bytes(b"tok\xe9n\n")
    refused = await raw_request(pod.agent_url, role_request(b"Bearer tok\xc3\xa9n"))
    assert refused.startswith(b"HTTP/1.1 401"), refused[:300]
    accepted = await raw_request(pod.agent_url, role_request(b"Bearer tok\xe9n"))
    assert accepted.startswith(b"HTTP/1.1 200"), accepted[:300]


@pytest.mark.parametrize("depth", [10_000, 32_000])  # bodies under the 64 KiB limit
async def test_deeply_nested_json_is_400(pod: EnginePod, depth: int) -> None:
    body = b"[" * depth + b"]" * depth
    async with httpx.AsyncClient(timeout=PATIENCE) as http:
        r = await http.post(f"{pod.agent_url}/v1/role", content=body, headers=AUTH)
        assert r.status_code == 400, r.text
        assert "JSON" in r.json()["error"]
        nested = b'{"role": "prefill", "x": ' + b"[" * depth + b"]" * depth + b"}"
        r = await http.post(f"{pod.agent_url}/v1/role", content=nested, headers=AUTH)
        assert r.status_code in (400, 422), r.text
    assert pod.double.counters().switch_calls == 0


async def test_a_connection_that_never_finishes_its_headers_is_closed(pod: EnginePod) -> None:
    reply = await raw_request(pod.agent_url, b"GET /v1/state HTTP/1.1\r\nHost: agent\r\n")
    assert reply == b""  # closed by the agent, nothing answered
    async with httpx.AsyncClient(timeout=PATIENCE) as http:
        assert (await http.get(f"{pod.agent_url}/v1/state")).status_code == 200


def role_headers(length: int, authorization: bytes = b"Bearer " + TOKEN.encode()) -> bytes:
    return (
        b"POST /v1/role HTTP/1.1\r\nHost: agent\r\n"
        b"Authorization: " + authorization + b"\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(length).encode() + b"\r\n\r\n"
    )


async def reply_to(url: str, request: bytes) -> bytes:
    """What the agent answers to ``request``, sent as it is and never finished: the
    connection stays open on our side, so only the agent's own deadline or limit replies."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=PATIENCE)
    finally:
        writer.close()


async def test_a_declared_body_too_large_for_a_role_request_is_413_before_it_is_read(
    pod: EnginePod,
) -> None:
    reply = await reply_to(pod.agent_url, role_headers(100_000_000))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert pod.double.counters().switch_calls == 0


async def test_a_role_body_larger_than_it_said_is_413(pod: EnginePod) -> None:
    big = b'{"role": "prefill", "pad": "' + b"x" * 100_000 + b'"}'
    async with httpx.AsyncClient(timeout=PATIENCE) as http:

        async def chunks() -> AsyncIterator[bytes]:  # chunked: no length declared
            yield big

        r = await http.post(f"{pod.agent_url}/v1/role", content=chunks(), headers=AUTH)
    assert r.status_code == 413, r.text
    assert pod.double.counters().switch_calls == 0


async def test_a_role_body_that_stalls_is_408_at_the_body_deadline(pod: EnginePod) -> None:
    body = b'{"role": "prefill"}'
    reply = await reply_to(pod.agent_url, role_headers(len(body)) + body[:5])
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert pod.double.counters().switch_calls == 0


async def test_an_unauthenticated_huge_body_is_401_at_once(pod: EnginePod) -> None:
    reply = await reply_to(pod.agent_url, role_headers(100_000_000, b"Bearer nope"))
    assert reply.startswith(b"HTTP/1.1 401"), reply[:300]
