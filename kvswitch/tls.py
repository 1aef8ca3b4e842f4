"""TLS settings for kvswitch's servers and clients: certificate files, client certificates.

`TlsFiles(cert, key, client_ca, handshake_timeout)`: a PEM certificate chain and its key; with
`client_ca`, clients must present a certificate signed by it (mTLS); a client that has not
finished its TLS handshake `handshake_timeout` seconds after connecting is dropped.
`grpc_server_credentials` / `grpc_server_options` make grpcio's server credentials and
handshake deadline of them (`kvswitch engine --tls-cert ...`); `envoy_downstream_tls` the
transport socket of Envoy's listener (`kvswitch envoy-config --tls-cert ...`), which offers h2
and http/1.1 by ALPN so gRPC and the OpenAI API share the port as in plaintext.
`server_ssl_context` is the same for kvswitch's own asyncio servers (the EPP: ALPN h2; the
frontend: http/1.1). `UpstreamTls(ca, cert, key, sni)`: how a client calls a TLS upstream
(verify it against `ca` as `sni`, present `cert` for mTLS): `envoy_upstream_tls` for Envoy's
clusters, `client_ssl_context` / `h2_channel_tls` for kvswitch's own clients, and
`grpc_channel_credentials` for grpcio's. `add_tls_flags` / `tls_from_args` and
`add_upstream_tls_flags` / `upstream_tls_from_args` are the flags.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HANDSHAKE_TIMEOUT", "TlsFiles", "UpstreamTls", "add_tls_flags",
           "add_upstream_tls_flags", "client_ssl_context", "envoy_downstream_tls",
           "envoy_upstream_tls", "grpc_channel_credentials", "grpc_server_credentials",
           "grpc_server_options", "h2_channel_tls", "server_ssl_context", "tls_from_args",
           "upstream_tls_from_args"]

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a client gets from connecting to the end of its TLS handshake."""

_DOWNSTREAM_TLS = ("type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                   "DownstreamTlsContext")
_UPSTREAM_TLS = ("type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                 "UpstreamTlsContext")


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None
    """Require client certificates signed by this CA (mTLS); None: no client certificate."""
    handshake_timeout: float = HANDSHAKE_TIMEOUT
    """Drop a client whose TLS handshake has not ended this many seconds after it connected."""


def grpc_server_options(tls: TlsFiles | None) -> list[tuple[str, int]]:
    """grpcio server options for `tls`: the handshake deadline (grpc's default is 120 s)."""
    if tls is None:
        return []
    return [("grpc.server_handshake_timeout_ms", max(1, round(tls.handshake_timeout * 1000)))]


def grpc_server_credentials(tls: TlsFiles) -> Any:
    import grpc

    ca = tls.client_ca.read_bytes() if tls.client_ca else None
    return grpc.ssl_server_credentials([(tls.key.read_bytes(), tls.cert.read_bytes())],
                                       root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True, slots=True)
class UpstreamTls:
    ca: Path
    """Verify the upstream's certificate against this CA."""
    cert: Path | None = None
    key: Path | None = None
    """A client certificate and key to present (mTLS)."""
    sni: str = "localhost"
    """The name the upstream's certificate must carry."""


def server_ssl_context(tls: TlsFiles, alpn: str = "h2") -> ssl.SSLContext:
    """An asyncio server's TLS context: `alpn` (HTTP/2 by default) offered, client certificates
    required with `client_ca`. Pass `tls.handshake_timeout` as the server's
    `ssl_handshake_timeout`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key)
    context.set_alpn_protocols([alpn])
    if tls.client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(tls.client_ca)
    return context


def client_ssl_context(tls: UpstreamTls, alpn: str = "h2") -> ssl.SSLContext:
    """A client's TLS context: `alpn` (HTTP/2 by default) offered, the server verified against
    `ca` (connect with `server_hostname=tls.sni`), `cert` presented when set."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
    context.set_alpn_protocols([alpn])
    if tls.cert is not None and tls.key is not None:
        context.load_cert_chain(tls.cert, tls.key)
    return context


def h2_channel_tls(tls: UpstreamTls | None) -> dict[str, Any]:
    """`kvswitch.protocol.h2client.H2Channel`'s keyword arguments to call over `tls` (none: h2c)."""
    if tls is None:
        return {}
    return {"ssl": client_ssl_context(tls), "server_hostname": tls.sni}


def grpc_channel_credentials(tls: UpstreamTls) -> Any:
    import grpc

    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes(),
        private_key=tls.key.read_bytes() if tls.key else None,
        certificate_chain=tls.cert.read_bytes() if tls.cert else None)


def envoy_upstream_tls(tls: UpstreamTls, *, alpn: str = "h2") -> dict[str, Any]:
    common: dict[str, Any] = {
        "validation_context": {"trusted_ca": {"filename": str(tls.ca.resolve())},
                               "match_typed_subject_alt_names": [{
                                   "san_type": "DNS", "matcher": {"exact": tls.sni}}]},
        "alpn_protocols": [alpn],
    }
    if tls.cert is not None and tls.key is not None:
        common["tls_certificates"] = [{
            "certificate_chain": {"filename": str(tls.cert.resolve())},
            "private_key": {"filename": str(tls.key.resolve())}}]
    return {"name": "envoy.transport_sockets.tls",
            "typed_config": {"@type": _UPSTREAM_TLS, "sni": tls.sni, "common_tls_context": common}}


def envoy_downstream_tls(tls: TlsFiles) -> dict[str, Any]:
    context: dict[str, Any] = {
        "common_tls_context": {
            "tls_certificates": [{"certificate_chain": {"filename": str(tls.cert.resolve())},
                                  "private_key": {"filename": str(tls.key.resolve())}}],
            "alpn_protocols": ["h2", "http/1.1"],
        },
    }
    if tls.client_ca is not None:
        context["require_client_certificate"] = True
        context["common_tls_context"]["validation_context"] = {
            "trusted_ca": {"filename": str(tls.client_ca.resolve())}}
    return {"name": "envoy.transport_sockets.tls",
            "typed_config": {"@type": _DOWNSTREAM_TLS, **context}}


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS (all unset: plaintext)")
    group.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                       help="serve TLS with this certificate chain")
    group.add_argument("--tls-key", type=Path, default=None, metavar="PEM",
                       help="the certificate's private key")
    group.add_argument("--tls-client-ca", type=Path, default=None, metavar="PEM",
                       help="require client certificates signed by this CA (mTLS)")
    group.add_argument("--tls-handshake-timeout", type=float, default=HANDSHAKE_TIMEOUT,
                       metavar="SECONDS",
                       help="drop a client that has not finished its TLS handshake this long "
                            f"after connecting (default {HANDSHAKE_TIMEOUT:g})")


def tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    cert, key, ca = args.tls_cert, args.tls_key, args.tls_client_ca
    if cert is None and key is None and ca is None:
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    if not args.tls_handshake_timeout > 0:
        raise ValueError("--tls-handshake-timeout must be positive")
    return TlsFiles(cert, key, ca, args.tls_handshake_timeout)


def add_upstream_tls_flags(parser: argparse.ArgumentParser, prefix: str, peer: str) -> None:
    """`--{prefix}-tls-ca/-cert/-key/-sni`: call `peer` over TLS (mTLS with a certificate)."""
    group = parser.add_argument_group(f"TLS to the {peer} (unset: plaintext)")
    group.add_argument(f"--{prefix}-tls-ca", type=Path, default=None, metavar="PEM",
                       help=f"call the {peer} over TLS, verifying the certificate against "
                            "this CA")
    group.add_argument(f"--{prefix}-tls-cert", type=Path, default=None, metavar="PEM",
                       help=f"client certificate to present to the {peer} (mTLS)")
    group.add_argument(f"--{prefix}-tls-key", type=Path, default=None, metavar="PEM",
                       help="the client certificate's key")
    group.add_argument(f"--{prefix}-tls-sni", default="localhost", metavar="NAME",
                       help="the name the server certificate must carry (SNI; default "
                            "localhost)")


def upstream_tls_from_args(args: argparse.Namespace, prefix: str) -> UpstreamTls | None:
    """What `add_upstream_tls_flags(parser, prefix, ...)` parsed; None without a CA."""
    values = vars(args)
    ca = values[f"{prefix}_tls_ca"]
    if ca is None:
        return None
    return UpstreamTls(ca, values[f"{prefix}_tls_cert"], values[f"{prefix}_tls_key"],
                       values[f"{prefix}_tls_sni"])
