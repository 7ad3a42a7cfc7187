"""Certificates for tests and benchmarks: a CA and leaf certificates made on the spot.

Needs the `cryptography` package (in the `test` extra); nothing shipped imports this module.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    """PEM files in one folder: `ca` signs `server` (SANs 127.0.0.1, ::1, localhost) and `client`."""

    dir: Path
    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


def _key() -> object:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: object, path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    pem = key.private_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.write_bytes(pem)
    path.chmod(0o600)


def _name(common: str) -> object:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(dir: Path, name: str = "pilotfish-test-ca") -> tuple[object, object, Path]:
    """(key, certificate, PEM path) of a new self-signed CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())  # type: ignore[attr-defined]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())  # type: ignore[arg-type]
    )
    path = dir / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


def issue(
    ca_key: object, ca_cert: object, dir: Path, name: str, *, hosts: tuple[str, ...] = ("127.0.0.1", "::1", "localhost")
) -> tuple[Path, Path]:
    """A leaf certificate signed by the CA, valid as server and client, for `hosts`; (cert, key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = _key()
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)  # type: ignore[attr-defined]
        .public_key(key.public_key())  # type: ignore[attr-defined]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    cert_path, key_path = dir / f"{name}.pem", dir / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return cert_path, key_path


def make_pki(dir: Path) -> Pki:
    """A CA, a server/client certificate for loopback, and a second client certificate."""
    dir.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert, ca = make_ca(dir)
    cert, key = issue(ca_key, ca_cert, dir, "node")
    client_cert, client_key = issue(ca_key, ca_cert, dir, "client")
    return Pki(dir, ca, cert, key, client_cert, client_key)


def serial_of(pem: bytes) -> int:
    """The serial number of a PEM certificate (to tell which one a server presented)."""
    from cryptography import x509

    return x509.load_pem_x509_certificate(pem).serial_number


def serial_of_der(der: bytes) -> int:
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number
