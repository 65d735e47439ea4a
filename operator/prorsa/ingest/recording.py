"""Record the events a webhook applied as NDJSON, the input of ``prorsa plan --events``.

The webhook hands each batch's new events to :meth:`EventRecorder.add` in the order the
Controller applied them (duplicates and superseded events are not applied, so not
recorded; the file replays as the operator saw the stream). ``add`` only queues: the
serving loop never waits for the disk. :meth:`run` writes what is queued from a thread
every ``interval`` seconds and flushes it, so a killed recorder loses at most that much;
:meth:`close` writes the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from prorsa_contract.events import Event


class EventRecorder:
    """An NDJSON file of applied events, one JSON object per line (unset fields left out)."""

    def __init__(self, path: Path, *, append: bool = False) -> None:
        """Open ``path`` for writing; an existing file is refused unless ``append``
        (:class:`FileExistsError`), so a recording is never overwritten by accident."""
        self.path = path
        self._file: IO[str] = open(path, "a" if append else "x", encoding="utf-8")  # noqa: SIM115
        self._queue: list[Event] = []
        self._queue_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self.queued = 0
        self.written = 0

    def add(self, events: Sequence[Event]) -> None:
        """Queue ``events`` (any thread; no I/O)."""
        with self._queue_lock:
            self._queue.extend(events)
            self.queued += len(events)

    def write_pending(self) -> int:
        """Write and flush what is queued (blocking: call it from a thread)."""
        with self._write_lock:
            with self._queue_lock:
                batch, self._queue = self._queue, []
            if batch:
                self._file.write(
                    "".join(e.model_dump_json(exclude_none=True) + "\n" for e in batch)
                )
                self._file.flush()
                self.written += len(batch)
            return len(batch)

    async def run(self, *, interval: float = 0.5) -> None:
        """Write what is queued every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            await asyncio.to_thread(self.write_pending)

    def close(self) -> None:
        """Write the rest, sync it to disk and close the file (again: nothing)."""
        if self._file.closed:
            return
        self.write_pending()
        with contextlib.suppress(OSError):  # e.g. a pipe or a character device
            os.fsync(self._file.fileno())
        self._file.close()
