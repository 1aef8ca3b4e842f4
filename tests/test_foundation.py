"""The package foundation: CLI, error table, bundled tokenizer."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import grpc
import pytest

from kvswitch import errors
from kvswitch.cli import build_parser
from kvswitch.tokenization import load_tokenizer
from tests.support.processes import QWEN3_DIR


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


def test_bundled_tokenizer_matches_the_shared_one() -> None:
    bundled = load_tokenizer()
    shared = load_tokenizer(str(QWEN3_DIR))
    text = "Hello, wörld! 你好 <|im_start|>user"
    assert bundled.encode("Hello") == [9707]
    assert bundled.encode(text) == shared.encode(text)
    assert bundled.vocab_size == 151669
    assert bundled.eos_token_ids == (151645,)
    assert json.loads(json.dumps(bundled.config))["eos_token"] == "<|im_end|>"


def test_missing_tokenizer_directory_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(errors.InvalidRequest, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
