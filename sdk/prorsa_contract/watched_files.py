"""Files read again when they change: a mounted Secret's token, a serving certificate.

The kubelet refreshes a Secret mounted as a volume by swapping its files atomically (a new
inode), cert-manager rewrites a certificate in place; either way the file's stamp (mtime,
size, inode) changes. A reader stats the files, which is cheap, and reads them again only
when the stamp differs from the one it last accepted. What a reader does with a file that
cannot be read (keep the last value, or drop it) is its own policy: the trainer SDK keeps
its last token, the agent accepts no token, the TLS context keeps its last pair.
"""

from __future__ import annotations

import os

Stamp = tuple[tuple[int, int, int], ...]


class WatchedFiles:
    """The stamps of ``paths``, and the stamp last accepted."""

    def __init__(self, *paths: str | os.PathLike[str]) -> None:
        self.paths = tuple(os.fspath(p) for p in paths)
        self._accepted: Stamp | None = None

    def stamp(self) -> Stamp:
        """The files' stamp now (OSError when one cannot be stat'ed)."""
        stamps = []
        for path in self.paths:
            st = os.stat(path)
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamps)

    def changed(self) -> Stamp | None:
        """The stamp now when it differs from the one accepted last, else None (OSError
        when a file cannot be stat'ed). Read the files, then :meth:`accept` it."""
        stamp = self.stamp()
        return None if stamp == self._accepted else stamp

    def accept(self, stamp: Stamp) -> None:
        """The files as of ``stamp`` are read and in use."""
        self._accepted = stamp

    def forget(self) -> None:
        """Nothing is in use: the next look reads the files again, changed or not."""
        self._accepted = None
