"""Write a self-signed P-256 certificate for ``localhost`` and ``127.0.0.1``.

    python3 tests/peers/make_cert.py OUT_DIR        # writes OUT_DIR/cert.pem, OUT_DIR/key.pem

Needs the ``cryptography`` package: kvcs depends on it, so the project's own
``python3`` has it; the ``.peers`` venv does not (aiomoqt/moq-rs don't need it).
Prints one JSON line: {"event": "cert", "cert": ..., "key": ..., "sha256": ...}.
Importable too: ``write_cert(out_dir) -> (cert_path, key_path)``.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def write_cert(out_dir: str | Path, days: int = 7) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path = out / "cert.pem"
    key_path = out / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    cert_path, key_path = write_cert(argv[1])
    der_hash = x509.load_pem_x509_certificate(cert_path.read_bytes()).fingerprint(hashes.SHA256())
    print(
        json.dumps(
            {"event": "cert", "cert": str(cert_path), "key": str(key_path),
             "sha256": der_hash.hex()}
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
