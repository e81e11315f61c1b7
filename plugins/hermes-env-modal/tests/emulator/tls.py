"""Self-signed TLS material for the emulated task command router.

The Modal client talks to the command router over TLS. When its server URL
points at localhost it builds an SSL context with verification switched off,
so any certificate works; we still make a proper one for 127.0.0.1/localhost.

Generated at runtime with the ``cryptography`` package when it is importable,
otherwise with the ``openssl`` command-line tool.
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import ssl
import subprocess
from pathlib import Path


def _with_cryptography(cert_path: Path, key_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

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
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _with_openssl(cert_path: Path, key_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError(
            "neither the 'cryptography' package nor the 'openssl' CLI is available"
        )
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key_path),
            "-out",
            str(cert_path),
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )


def make_server_context(directory: Path) -> tuple[ssl.SSLContext, str]:
    """Write a fresh key/cert pair into ``directory``; return (server context, tool used)."""
    cert_path, key_path = directory / "router-cert.pem", directory / "router-key.pem"
    try:
        _with_cryptography(cert_path, key_path)
        tool = "cryptography"
    except ImportError:
        _with_openssl(cert_path, key_path)
        tool = "openssl"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert_path), str(key_path))
    ctx.set_alpn_protocols(["h2"])
    return ctx, tool
