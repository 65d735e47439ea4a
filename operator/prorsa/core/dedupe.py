"""A bounded window of recently seen event ids: replays are counted, never applied twice.

Trainers replay batches whenever a reply is lost (timeouts, a dropped connection), so the
same ids come back within seconds. The window remembers the last ``capacity`` ids and no
more, so memory stays bounded however long the job runs or whatever ids a client sends.

It stores the 64-bit ``hash()`` of each id instead of the id: an entry costs the same
whether the id has 3 or 256 characters. ``str`` hashes are salted per process, so a client
cannot craft collisions; an accidental one (a fresh event taken for a replay) has a
probability of about ``capacity / 2**64`` per event, i.e. never in practice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import Protocol, TypeVar


class _HasId(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def ts(self) -> float: ...


E = TypeVar("E", bound=_HasId)

_ID = attrgetter("id")
_ADD_CHUNK = 256  # ids per chunk when they are added one at a time


class DedupeWindow:
    """Set membership over the most recent ``capacity`` ids, in O(1) per id.

    The arrival order is kept as a queue of chunks (one list of hashes per admitted batch)
    rather than one deque entry per id, so admitting and evicting a batch are a few set
    and list operations done in C instead of a Python loop over its ids.
    """

    __slots__ = ("_capacity", "_chunks", "_held", "_seen")

    def __init__(self, *, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._seen: set[int] = set()
        self._chunks: deque[list[int]] = deque()  # hashes in arrival order, oldest first
        self._held = 0  # hashes in _chunks (a forgotten one stays there until evicted)

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, event_id: str) -> bool:
        return hash(event_id) in self._seen

    def add(self, event_id: str) -> bool:
        """Remember ``event_id``; False when it was already in the window (a replay)."""
        key = hash(event_id)
        seen = self._seen
        if key in seen:
            return False
        seen.add(key)
        chunks = self._chunks
        if chunks and len(chunks[-1]) < _ADD_CHUNK:
            chunks[-1].append(key)
        else:
            # Bounded chunks keep the partial trim below cheap when ids come one by one.
            chunks.append([key])
        self._held += 1
        if self._held > self._capacity:
            self._trim()
        return True

    def admit(
        self, events: Sequence[E], *, before: float | None = None
    ) -> tuple[list[E], int, int]:
        """Split a batch into (new events, replays, events stamped before ``before``).

        The hot path of the webhook. A batch without replays, the usual case, is checked
        and remembered by set operations over its hashed ids; a batch with replays takes
        a loop that keeps the first of each id. The window may exceed its capacity by one
        batch until the end of the call, never more.
        """
        superseded = 0
        if before is not None:
            kept = [e for e in events if not e.ts < before]
            superseded = len(events) - len(kept)
            events = kept
        keys = list(map(hash, map(_ID, events)))
        seen = self._seen
        fresh: list[E]
        if seen.isdisjoint(keys):
            size = len(seen)
            seen.update(keys)
            if len(seen) - size == len(keys):
                fresh, chunk = list(events), keys
            else:  # an id repeated within the batch; none of them was in the set before
                seen.difference_update(keys)
                fresh, chunk = self._first_of_each(events, keys)
        else:
            fresh, chunk = self._first_of_each(events, keys)
        if chunk:
            self._chunks.append(chunk)
            self._held += len(chunk)
            if self._held > self._capacity:
                self._trim()
        return fresh, len(events) - len(fresh), superseded

    def _first_of_each(self, events: Sequence[E], keys: list[int]) -> tuple[list[E], list[int]]:
        seen = self._seen
        remember = seen.add
        fresh: list[E] = []
        chunk: list[int] = []
        for e, key in zip(events, keys, strict=True):
            if key in seen:
                continue
            remember(key)
            chunk.append(key)
            fresh.append(e)
        return fresh, chunk

    def _trim(self) -> None:
        """Evict the oldest hashes until at most ``capacity`` are held."""
        excess = self._held - self._capacity
        chunks = self._chunks
        seen = self._seen
        while excess > 0:
            oldest = chunks[0]
            if len(oldest) <= excess:
                chunks.popleft()
                seen.difference_update(oldest)
                excess -= len(oldest)
                self._held -= len(oldest)
            else:
                seen.difference_update(oldest[:excess])
                del oldest[:excess]
                self._held -= excess
                excess = 0

    def forget(self, event_ids: Iterable[str]) -> None:
        """Undo :meth:`add` for ids whose batch could not be applied, so a retry applies them.

        Their slots in the eviction order stay; evicting an id that is no longer present is
        a no-op, and at worst a re-added id leaves the window a little early.
        """
        seen = self._seen
        for event_id in event_ids:
            seen.discard(hash(event_id))
