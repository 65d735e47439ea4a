"""How every part of a cluster's control loop reports to ``kubectl describe``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

EventPoster = Callable[[str, str, str], Awaitable[None]]
"""Posts a Kubernetes Event on the RolloutCluster: (type, reason, message)."""
