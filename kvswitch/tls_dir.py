"""A directory of PEM files that puts every hop of a gateway on TLS, and a self-signed one.

`TlsDir(path)` holds `ca.crt` (the CA every side trusts), `server.crt` / `server.key` (what
every kvswitch server and Envoy's listener present; its names must include `sni`) and
`client.crt` / `client.key` (what Envoy, the EPP and the frontend present to the servers they
call, which require it: mTLS). `server(...)` and `client()` are those files as `TlsFiles` and
`UpstreamTls`, `listener()` what the public listener serves (asking clients for a certificate
only with `client_auth`), and `server_flags(...)` / `client_flags(prefix)` the same as
command-line flags of kvswitch's processes. `write_self_signed(path, sni)` makes such a
directory: a fresh CA (valid a day unless told otherwise, P-256), a server certificate for
`sni` and 127.0.0.1, and a client certificate (`kvswitch up --tls-self-signed`).
`check_server_name` says whether a name can be `sni`: a DNS name or an IPv4 address.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from kvswitch.tls import HANDSHAKE_TIMEOUT, TlsFiles, UpstreamTls

__all__ = ["FILES", "SNI", "TlsDir", "check_server_name", "write_self_signed"]

FILES = ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")
SNI = "localhost"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_SERVER_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")


def check_server_name(name: str) -> None:
    """Raise ValueError unless `name` is a DNS name (letters, digits and hyphens in dot-separated
    labels) or an IPv4 address, at most 253 characters."""
    if len(name) > 253 or not _SERVER_NAME.fullmatch(name):
        raise ValueError(f"server name {name!r} is not a DNS name or an IPv4 address")


@dataclass(frozen=True, slots=True)
class TlsDir:
    path: Path
    sni: str = SNI
    """The name callers verify the servers' certificate against."""
    handshake_timeout: float = HANDSHAKE_TIMEOUT
    """Seconds every server gives a client to finish its TLS handshake."""
    client_auth: bool = False
    """The public listener too requires a client certificate signed by `ca.crt`."""

    @property
    def ca(self) -> Path:
        return self.path / "ca.crt"

    def missing(self) -> list[str]:
        return [name for name in FILES if not (self.path / name).is_file()]

    def server(self, *, client_certificates: bool = True) -> TlsFiles:
        """What a server presents; with `client_certificates`, it requires the client's."""
        return TlsFiles(self.path / "server.crt", self.path / "server.key",
                        self.ca if client_certificates else None, self.handshake_timeout)

    def listener(self) -> TlsFiles:
        """What the public listener serves."""
        return self.server(client_certificates=self.client_auth)

    def client(self) -> UpstreamTls:
        """How a client calls the servers: verify them against `ca.crt`, present its own."""
        return UpstreamTls(self.ca, self.path / "client.crt", self.path / "client.key", self.sni)

    def server_flags(self) -> list[str]:
        """`kvswitch engine/epp/frontend` flags to serve mTLS with these files."""
        tls = self.server()
        return ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
                "--tls-client-ca", str(tls.client_ca),
                "--tls-handshake-timeout", f"{tls.handshake_timeout:g}"]

    def client_flags(self, prefix: str) -> list[str]:
        """The `--{prefix}-tls-*` flags (`kvswitch.tls.add_upstream_tls_flags`) to call a
        server with these files."""
        tls = self.client()
        return [f"--{prefix}-tls-ca", str(tls.ca), f"--{prefix}-tls-cert", str(tls.cert),
                f"--{prefix}-tls-key", str(tls.key), f"--{prefix}-tls-sni", tls.sni]


def write_self_signed(path: Path, sni: str = SNI, *, valid_days: int = 1) -> TlsDir:
    """A fresh CA and the server (for `sni` and 127.0.0.1) and client certificates it signs,
    valid `valid_days`, written into `path`."""
    check_server_name(sni)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(key: ec.EllipticCurvePrivateKey, file: str) -> None:
        target = path / file
        target.touch(mode=0o600)
        target.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                             serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))

    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=valid_days))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("kvswitch self-signed CA"))
          .issuer_name(name("kvswitch self-signed CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    path.mkdir(parents=True, exist_ok=True)
    (path / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for stem, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH),
                        ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder()
                   .subject_name(name(sni if stem == "server" else "kvswitch client"))
                   .issuer_name(ca.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(valid[0]).not_valid_after(valid[1])
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if stem == "server":
            names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            if sni != "127.0.0.1":
                try:
                    names.insert(0, x509.IPAddress(ipaddress.ip_address(sni)))
                except ValueError:
                    names.insert(0, x509.DNSName(sni))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        (path / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(key, f"{stem}.key")
    return TlsDir(path, sni)
