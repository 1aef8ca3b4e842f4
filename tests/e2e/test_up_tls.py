"""`kvswitch up --tls-self-signed`: the gateway comes up on TLS, the Python lines it prints call
it as printed, and the certificates it made are gone once it stops; with `--tls-client-auth`
the listener refuses a client without a certificate, and `--tls-server-name` names the
certificate and the printed lines' SNI; `--tls-dir` checks its files before starting anything."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from kvswitch.launcher import frontend_available
from kvswitch.protocol import vllm_engine_pb2_grpc as rpc
from tests.support.gateway import generate, prompt
from tests.support.processes import REPO, free_port
from tests.support.up import kvswitch_up


def test_up_with_self_signed_certificates(tmp_path: Path) -> None:
    port = free_port()
    args = ["--port", str(port), "--replicas", "1", "--profile", "tiny", "--time-scale", "100",
            "--mode", "echo", "--grace-period", "1", "--no-frontend", "--tls-self-signed",
            "--tls-handshake-timeout", "3"]
    with kvswitch_up(args, tmp_path, ready="Ctrl-C stops everything") as up:
        text = up.output()
        found = re.search(r"TLS on every hop, CA (\S+);", text)
        assert found is not None, text
        ca = Path(found.group(1))
        assert ca.is_file()
        # The printed Python program, run as printed, streams an answer over TLS.
        program = re.search(r"<<'EOF'\n(.*?)\nEOF", text, re.DOTALL)
        assert program is not None, text
        assert f"'127.0.0.1:{port}'" in program.group(1) and str(ca) in program.group(1)
        assert "'grpc.ssl_target_name_override', 'localhost'" in program.group(1)
        run = subprocess.run([sys.executable, "-"], input=program.group(1), text=True, check=False,
                             capture_output=True, timeout=60, cwd=REPO)
        assert run.returncode == 0, run.stderr
        assert "complete {" in run.stdout, run.stdout
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=60) == 0, up.output()
        assert not ca.parent.exists()  # the self-signed files went with it


def test_up_tls_client_auth_refuses_a_client_without_a_certificate(tmp_path: Path) -> None:
    port = free_port()
    args = ["--port", str(port), "--replicas", "1", "--profile", "tiny", "--time-scale", "100",
            "--mode", "echo", "--grace-period", "1", "--tls-self-signed", "--tls-client-auth",
            "--tls-server-name", "gateway.test", "--tls-handshake-timeout", "3"]
    with_frontend = frontend_available()
    if not with_frontend:
        args.append("--no-frontend")
    with kvswitch_up(args, tmp_path, ready="Ctrl-C stops everything") as up:
        text = up.output()
        found = re.search(r"TLS on every hop, client certificate required, CA (\S+);", text)
        assert found is not None, text
        ca = Path(found.group(1))
        server = x509.load_pem_x509_certificate((ca.parent / "server.crt").read_bytes())
        names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == ["gateway.test"]
        # The printed program presents client.crt and verifies the listener as gateway.test.
        program = re.search(r"<<'EOF'\n(.*?)\nEOF", text, re.DOTALL)
        assert program is not None, text
        assert str(ca.parent / "client.crt") in program.group(1)
        run = subprocess.run([sys.executable, "-"], input=program.group(1), text=True, check=False,
                             capture_output=True, timeout=60, cwd=REPO)
        assert run.returncode == 0, run.stderr
        assert "complete {" in run.stdout, run.stdout
        # The same call without a client certificate is refused in the handshake.
        options = [("grpc.ssl_target_name_override", "gateway.test")]
        credentials = grpc.ssl_channel_credentials(ca.read_bytes())
        with (grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel,
              pytest.raises(grpc.RpcError) as refused):
            generate(rpc.VllmEngineStub(channel), prompt(1), max_tokens=4)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        if with_frontend:
            # The printed curl line (client.crt, SNI gateway.test) reaches the frontend, whose
            # own calls to the listener present client.crt; without a certificate curl fails.
            curl = re.search(r"^  (curl .*)$", text, re.MULTILINE)
            assert curl is not None, text
            answer = subprocess.run(["bash", "-c", curl.group(1)], capture_output=True,
                                    text=True, timeout=60, check=False)
            assert answer.returncode == 0 and '"completion_tokens"' in answer.stdout, answer
            bare = re.sub(r" --cert \S+ --key \S+", "", curl.group(1))
            assert bare != curl.group(1)
            refused_curl = subprocess.run(["bash", "-c", bare], capture_output=True, text=True,
                                          timeout=60, check=False)
            assert refused_curl.returncode != 0, refused_curl
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=60) == 0, up.output()


def test_up_refuses_an_incomplete_tls_dir(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_text("")
    run = subprocess.run([sys.executable, "-m", "kvswitch", "up", "--port", str(free_port()),
                          "--tls-dir", str(tmp_path), "--log-dir", str(tmp_path / "state")],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert run.returncode == 2
    assert "missing server.crt, server.key, client.crt, client.key" in run.stderr + run.stdout


@pytest.mark.parametrize(("flags", "error"), [
    (["--tls-client-auth"], "need --tls-dir or --tls-self-signed"),
    (["--tls-server-name", "gateway.test"], "need --tls-dir or --tls-self-signed"),
    (["--tls-self-signed", "--tls-server-name", "bad name"], "is not a DNS name"),
])
def test_up_refuses_tls_options_it_cannot_honour(tmp_path: Path, flags: list[str],
                                                 error: str) -> None:
    run = subprocess.run([sys.executable, "-m", "kvswitch", "up", "--port", str(free_port()),
                          *flags, "--log-dir", str(tmp_path / "state")],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert run.returncode == 2
    assert error in run.stderr + run.stdout
