"""What an engine pod's manifest tells the agents' client about its agent.

Apart from :mod:`prorsa.engines.agent_tls` so that the pod manifests
(:mod:`prorsa.k8s.objects`) name it without loading the certificate library.
"""

from __future__ import annotations

AGENT_TLS_CERT_ENV = "PRORSA_AGENT_TLS_CERT_FILE"
"""Set on engine pods whose agent serves HTTPS: the operator then verifies it."""
