"""The server side of TLS shared by the trainer webhook and the engine agent.

Both serve a certificate and key mounted from a Secret. The kubelet replaces such files in
place when the Secret changes (cert-manager renewing, an operator issuing anew), so the
context re-reads them when their stamps change, checked at most once a second as clients
connect: a renewal reaches new connections without a restart. A pair that does not load
(a key written before its certificate) keeps the last good one.
"""

from __future__ import annotations

import logging
import ssl
import time
from pathlib import Path

from prorsa_contract.watched_files import WatchedFiles

log = logging.getLogger("prorsa.tls")

CHECK_EVERY = 1.0
"""Seconds between two looks at the files' stamps."""


def _server_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class ServingCert:
    """``context`` serves ``cert_file`` + ``key_file`` (TLS 1.2 or newer)."""

    def __init__(self, *, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.context = _server_context()
        self._files = WatchedFiles(cert_file, key_file)
        try:
            stamp = self._files.stamp()
            self.context.load_cert_chain(cert_file, key_file)
            self._files.accept(stamp)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the TLS certificate {cert_file}: {exc}") from exc
        self._checked = time.monotonic()
        self.context.sni_callback = self._on_client_hello

    def _on_client_hello(
        self, connection: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _ctx: ssl.SSLContext
    ) -> None:
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY:
            return
        self._checked = now
        fresh = self._load_if_changed()
        if fresh is not None:
            # This connection copied the old pair when it was made: hand it the new one.
            connection.context = fresh

    def reload(self) -> bool:
        """Load the files again if they changed; True when a new pair is in use."""
        return self._load_if_changed() is not None

    def _load_if_changed(self) -> ssl.SSLContext | None:
        try:
            stamp = self._files.changed()
            if stamp is None:
                return None
            fresh = _server_context()
            fresh.load_cert_chain(self.cert_file, self.key_file)
            self.context.load_cert_chain(self.cert_file, self.key_file)  # later connections
        except (OSError, ssl.SSLError) as exc:
            log.warning("keeping the current certificate: cannot load %s: %s", self.cert_file, exc)
            return None
        self._files.accept(stamp)
        log.info("serving the renewed certificate %s", self.cert_file)
        return fresh
