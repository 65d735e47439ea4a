"""The agent's HTTPS: a server SSL context loaded from the mounted certificate files.

The files come from the cluster's ``<cluster>-agent-tls`` Secret volume. The kubelet
replaces them in place when the Secret changes (a rotation), so the context re-reads them
when their stamps change: new connections get the new certificate without a restart.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

log = logging.getLogger("prorsa_agent")


class ServingCert:
    """``context`` serves ``cert_file`` + ``key_file``; :meth:`reload` picks up changes."""

    def __init__(self, *, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._stamp = self._stat()
        self.context.load_cert_chain(cert_file, key_file)

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in (self.cert_file, self.key_file):
            st = os.stat(path)
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamps)

    def reload(self) -> bool:
        """Load the files again if they changed; a half-written pair keeps the old one."""
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return False
            self.context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            log.warning("keeping the current certificate: cannot load %s: %s", self.cert_file, exc)
            return False
        self._stamp = stamp
        log.info("loaded the renewed certificate %s", self.cert_file)
        return True
