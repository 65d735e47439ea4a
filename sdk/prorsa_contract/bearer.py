"""The token of an ``Authorization: Bearer <token>`` header, parsed one way everywhere.

The trainer webhook, the in-pod agent, the engine double and the Kubernetes API emulator
all take a bearer token (RFC 6750); each asks this function for it and then compares it
its own way (constant time where it guards anything).
"""

from __future__ import annotations

SCHEME = "bearer"  # compared case-insensitively (RFC 7235 auth-scheme)


def bearer_token(header: str | None) -> str | None:
    """The token of ``header``, without surrounding whitespace; None when the header is
    absent, of another scheme, or carries no token."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != SCHEME:
        return None
    return token.strip() or None
