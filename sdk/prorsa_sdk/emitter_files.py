"""The emitter's files: the bearer token a mounted Secret holds, and the recording.

The drivers own them (the core decides, it reads and writes no file): the token is read
when a request is sent, the recording written once the webhook accepted a batch.
"""

from __future__ import annotations

import contextlib
import logging
import os

from prorsa_contract.watched_files import WatchedFiles

log = logging.getLogger("prorsa_sdk")


class TokenFile:
    """The bearer token in a file, read again whenever the file changes.

    A Secret mounted as a volume is refreshed by the kubelet after a rotation (an atomic
    swap of the files, so a new inode); the stat check keeps the read off every request.
    A file that cannot be read later keeps the last token, logged once.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file = WatchedFiles(self.path)
        self._token = ""
        self._warned = False
        if not self.token():  # at start, a missing or empty file is an error
            raise ValueError(f"token_file {self.path} holds no token")

    def token(self) -> str:
        try:
            stamp = self._file.changed()
            if stamp is not None:
                with open(self.path, encoding="utf-8") as f:
                    token = f.read().strip()
                if token:
                    self._token, self._warned = token, False
                    self._file.accept(stamp)
        except (OSError, UnicodeDecodeError) as exc:
            if not self._token:
                raise ValueError(f"cannot read token_file {self.path}: {exc}") from None
            if not self._warned:
                self._warned = True
                log.warning("prorsa token_file %s unreadable (%s); keeping its last token",
                            self.path, exc)  # fmt: skip
        return self._token


class Recording:
    """``record=``: every event the webhook accepted, appended as NDJSON in applied order.

    Opened at construction, so a path that cannot be written fails there; a write that
    fails later stops the recording (logged once) and never delivery.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file = open(self.path, "ab")  # noqa: SIM115 (closed by close())
        self.failed = False

    def write(self, batch: list[bytes]) -> bool:
        """Append ``batch`` (blocking); whether it was written."""
        if self.failed:
            return False
        try:
            self._file.write(b"\n".join(batch) + b"\n")
            self._file.flush()
        except (OSError, ValueError) as exc:  # ValueError: closed under a cancelled sender
            self.failed = True
            log.error(
                "prorsa emitter: cannot write the recording %s (%s); recording stopped, "
                "delivery goes on",
                self.path,
                exc,
            )
            return False
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
