"""The package foundation: CLI, error table, bundled tokenizer."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys

import grpc
import pytest

from kvswitch import errors
from kvswitch.cli import build_parser
from kvswitch.tokenization import load_tokenizer
from kvswitch.tokenization.bundle import bundled_tokenizer_dir


def test_cli_help_lists_every_subcommand() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvswitch", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in ("up", "engine", "epp", "frontend", "envoy-config", "bench"):
        assert name in out


@pytest.mark.parametrize("command", ["engine", "epp", "bench"])
def test_subcommand_help_states_each_default_once(command: str) -> None:
    parser = build_parser(command)
    sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    text = " ".join(sub.format_help().split())
    assert "(default: None)" not in text  # unset options say what unset means instead
    assert re.search(r"\(default: [^)]*\) \(default: ", text) is None  # help already says it
    assert "(default: " in text  # real defaults are still shown


@pytest.mark.parametrize(
    ("error", "code", "status"),
    [
        (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, 400),
        (errors.RateLimited, grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (errors.Unavailable, grpc.StatusCode.UNAVAILABLE, 503),
        (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (errors.NotFound, grpc.StatusCode.NOT_FOUND, 404),
    ],
)
def test_error_faces_agree_with_the_table(error: type[errors.KvswitchError],
                                          code: grpc.StatusCode, status: int) -> None:
    assert error.grpc_code == code
    assert error.http_status == status
    assert errors.http_status_for_grpc(code) == status
    assert errors.grpc_code_for_http(status) == code


def test_every_error_class_maps_consistently() -> None:
    for cls in errors.KvswitchError.__subclasses__():
        # HTTP-only statuses without a gRPC twin: 413 and 431 (gRPC says RESOURCE_EXHAUSTED),
        # 414 (INVALID_ARGUMENT) and 408 (a client that stalled mid-request; gRPC would say
        # DEADLINE_EXCEEDED).
        if cls in (errors.PayloadTooLarge, errors.RequestTimeout, errors.HeadersTooLarge,
                   errors.UriTooLong):
            continue
        assert errors.http_status_for_grpc(cls.grpc_code) == cls.http_status, cls


def test_bundled_tokenizer_reads_the_same_unpacked(tmp_path) -> None:
    bundled = load_tokenizer()
    source = bundled_tokenizer_dir()
    (tmp_path / "tokenizer.json").write_bytes(
        gzip.decompress((source / "tokenizer.json.gz").read_bytes()))
    shutil.copy(source / "tokenizer_config.json", tmp_path)
    shared = load_tokenizer(str(tmp_path))
    text = "Hello, wörld! 你好 <|im_start|>user"
    assert bundled.encode("Hello") == [9707]
    assert bundled.encode(text) == shared.encode(text)
    assert bundled.vocab_size == 151669
    assert bundled.eos_token_ids == (151645,)
    assert json.loads(json.dumps(bundled.config))["eos_token"] == "<|im_end|>"


def test_missing_tokenizer_directory_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(errors.InvalidRequest, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel may give two binds in a row the same free port; the children bind them later.
    import socket
    from typing import Self

    from kvswitch import launcher

    picks = iter([41001, 41001, 41002, 41001, 41003])

    class FakeSocket:
        def __init__(self, *args: object) -> None:
            self.port = next(picks)

        def __enter__(self) -> Self:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(socket, "socket", FakeSocket)
    monkeypatch.setattr(launcher, "_HANDED_OUT", set())
    assert [launcher.free_port() for _ in range(3)] == [41001, 41002, 41003]
