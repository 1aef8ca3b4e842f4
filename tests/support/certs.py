"""Certificates for TLS tests, made with `cryptography`: a CA, a server certificate for
127.0.0.1 / localhost and a client certificate, all signed by the CA, written as PEM files
(`make_certs`), or laid out as `kvswitch up --tls-dir` wants them (`tls_dir`)."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvswitch.tls_dir import TlsDir


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def make_certs(directory: Path) -> Certs:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("kvswitch test CA"))
          .issuer_name(_name("kvswitch test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(common: str, usage: x509.ObjectIdentifier, stem: str) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(_name(common))
                   .issuer_name(ca.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if usage == ExtendedKeyUsageOID.SERVER_AUTH:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        cert_path = directory / f"{stem}.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cert_path, _write_key(key, directory / f"{stem}-key.pem")

    server_cert, server_key = leaf("localhost", ExtendedKeyUsageOID.SERVER_AUTH, "server")
    client_cert, client_key = leaf("client", ExtendedKeyUsageOID.CLIENT_AUTH, "client")
    return Certs(directory / "ca.pem", server_cert, server_key, client_cert, client_key)


def tls_dir(directory: Path) -> TlsDir:
    """`make_certs`' certificates laid out as `--tls-dir` wants them."""
    certs = make_certs(directory)
    for source, name in ((certs.ca, "ca.crt"), (certs.server_cert, "server.crt"),
                         (certs.server_key, "server.key"), (certs.client_cert, "client.crt"),
                         (certs.client_key, "client.key")):
        shutil.copy(source, directory / name)
    return TlsDir(directory)
