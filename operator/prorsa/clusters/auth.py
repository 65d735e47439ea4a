"""Bearer-token checks for the trainer webhook (the header is parsed by
:func:`prorsa_contract.bearer.bearer_token`).

The comparison is constant-time (:func:`hmac.compare_digest` over bytes), so response
timing does not reveal how many leading characters of a guess were right.
"""

from __future__ import annotations

import hmac


def token_matches(presented: str | None, expected: bytes) -> bool:
    """Constant-time check of a presented token against the cluster's token."""
    if presented is None or not expected:
        return False
    try:
        candidate = presented.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates cannot be the token
        return False
    return hmac.compare_digest(candidate, expected)


def normalize_token(token: str | bytes) -> bytes:
    """A token as stored: surrounding whitespace (a trailing newline in a file) removed."""
    raw = token.encode("utf-8") if isinstance(token, str) else token
    raw = raw.strip()
    if not raw:
        raise ValueError("the trainer token is empty")
    if any(b < 0x21 or b == 0x7F for b in raw):
        raise ValueError("the trainer token must not contain spaces or control characters")
    return raw
