"""The per-cluster CA and serving certificate of the engine agents (docs/security.md).

Every engine pod of a RolloutCluster mounts the same ``<cluster>-agent-tls`` Secret and
serves ``https`` on the agent port with it; the operator trusts that cluster's ``ca.crt``
alone and checks the name ``<pod>.<cluster>-engines.<namespace>.svc`` (the wildcard SAN of
the certificate) while it connects to the pod IP. So an address that answers for a pod IP
without the cluster's key cannot take a bearer token, and one cluster's certificate does
not pass for another cluster's engines.

The CA's private key is never stored: the operator signs one serving certificate at
creation and throws the key away, so the Secret holds nothing that could sign another
certificate. A new certificate is a new Secret (delete it; the operator issues a new CA and
certificate, and engine pods pick the files up as the kubelet refreshes the volume).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=3650)
"""Ten years: nothing rotates these automatically, and an expired certificate stops every
switch; delete the Secret to rotate (docs/operations.md)."""


def engines_domain(*, cluster: str, namespace: str) -> str:
    """The DNS domain of a cluster's engine pods (the headless ``<cluster>-engines``
    Service is every pod's subdomain)."""
    return f"{cluster}-engines.{namespace}.svc"


def agent_server_name(*, pod: str, cluster: str, namespace: str) -> str:
    """The name the operator checks in an agent's certificate: the pod's DNS name."""
    return f"{pod}.{engines_domain(cluster=cluster, namespace=namespace)}"


@dataclass(frozen=True, kw_only=True)
class IssuedCert:
    """PEM texts: the CA certificate, and the serving certificate with its key."""

    ca: str
    cert: str
    key: str = field(repr=False)


def issue_agent_cert(*, cluster: str, namespace: str, now: dt.datetime | None = None) -> IssuedCert:
    """A fresh CA and the agents' certificate for ``*.<cluster>-engines.<namespace>.svc``
    (and its ``.cluster.local`` form), signed by it; the CA key is dropped here."""
    domain = engines_domain(cluster=cluster, namespace=namespace)
    return issue_serving_cert(
        common_name=f"{cluster} engine agents",
        dns_names=(f"*.{domain}", f"*.{domain}.cluster.local"),
        ca_name=f"prorsa agent CA {namespace}/{cluster}",
        now=now,
    )


def issue_serving_cert(
    *,
    common_name: str,
    dns_names: tuple[str, ...] = (),
    ip_addresses: tuple[str, ...] = (),
    ca_name: str = "prorsa CA",
    now: dt.datetime | None = None,
    validity: dt.timedelta = VALIDITY,
) -> IssuedCert:
    """A self-signed CA and one serving certificate it signs (ECDSA P-256, SHA-256)."""
    import ipaddress

    now = now or dt.datetime.now(dt.UTC)
    not_before = now - dt.timedelta(minutes=5)  # clocks of other nodes may lag a little
    not_after = now + validity
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_subject)
        .issuer_name(ca_subject)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return IssuedCert(
        ca=ca_cert.public_bytes(pem).decode(),
        cert=cert.public_bytes(pem).decode(),
        key=key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode(),
    )
