"""TLS material for QUIC endpoints: certificate files, or a self-signed pair for local use.

A QUIC server needs a certificate chain and its key; a client needs to know what
it trusts. :class:`TlsConfig` says both. :func:`self_signed` makes a P-256
server certificate for ``localhost`` and ``127.0.0.1`` signed by a throwaway
local CA (valid one day, from the ``cryptography`` package) and writes them as
PEM files into a directory, because both aioquic and qh3 load certificates
from files; the key file is created readable by its owner only (0600).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


class TlsError(ValueError):
    """A certificate, key or CA file is missing or unusable."""


@attrs.frozen
class TlsConfig:
    """Certificates for a server, trust for a client.

    ``certfile``/``keyfile``: the server's chain and key (PEM). ``cafile``: extra
    roots a client trusts. ``verify``: a client checks the server's certificate
    (turn off only for local tests with self-signed certificates).
    """

    certfile: str | None = None
    keyfile: str | None = None
    cafile: str | None = None
    verify: bool = True

    def check(self) -> None:
        """Raise :class:`TlsError` with a one-line reason if a named file is unusable
        (or the server key does not belong to the certificate: the stacks would load
        such a pair and only fail each handshake)."""
        for what, name in (
            ("certificate", self.certfile),
            ("key", self.keyfile),
            ("CA file", self.cafile),
        ):
            if name is not None and not Path(name).is_file():
                raise TlsError(f"{what} file not found: {name}")
        if self.certfile is not None:
            try:
                cert = x509.load_pem_x509_certificate(Path(self.certfile).read_bytes())
            except ValueError as exc:
                raise TlsError(f"not a PEM certificate: {self.certfile}") from exc
            keyfile = self.keyfile or self.certfile  # a PEM file may hold both
            try:
                key = serialization.load_pem_private_key(Path(keyfile).read_bytes(), None)
            except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
                raise TlsError(f"not a usable PEM private key: {keyfile}") from exc
            spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
            if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
                raise TlsError(f"the key {keyfile} does not belong to the certificate")


def self_signed(
    directory: str | Path, *, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"), days: int = 1
) -> TlsConfig:
    """Write a local CA (``ca.pem``) and a server certificate it signed (``cert.pem``,
    ``key.pem``; P-256) for ``hosts`` into ``directory``.

    A separate root keeps strict verifiers (qh3's, which refuses a CA certificate used
    as a server certificate) and lenient ones (aioquic's) equally happy: clients trust
    ``ca.pem`` (the returned config's ``cafile``).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvcs local CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
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
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cafile = directory / "ca.pem"
    certfile, keyfile = directory / "cert.pem", directory / "key.pem"
    cafile.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # readable by the owner only from its creation on (never under a looser umask)
    keyfile.unlink(missing_ok=True)
    fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    keyfile.chmod(0o600)
    return TlsConfig(certfile=str(certfile), keyfile=str(keyfile), cafile=str(cafile))
