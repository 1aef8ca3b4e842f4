"""Real processes for the frontend's integration tests: echo engines and frontends on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.frontend_stack import (
    Stack,
    echo_template_tokenizer,
    engine_argv,
    frontend_argv,
    wait_ready,
)
from tests.support.processes import free_port, running


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A fast echo engine and a frontend in front of it (bodies over 200 kB get 413)."""
    logs: Path = tmp_path_factory.mktemp("frontend")
    engine_port, frontend_port = free_port(), free_port()
    with (
        running(engine_argv(engine_port, "--time-scale", "1000", "--max-num-seqs", "64",
                            "--max-model-len", "4096", "--num-gpu-blocks", "2048"),
                engine_port, logs / "engine.log", timeout=60) as engine,
        running(frontend_argv(frontend_port, f"127.0.0.1:{engine_port}",
                              "--max-body-bytes", "200000", "--user-as-fairness-id"),
                frontend_port, logs / "frontend.log", timeout=60) as frontend,
    ):
        stack = Stack(engine_port, frontend_port, engine, frontend)
        wait_ready(stack.base_url)
        yield stack


@pytest.fixture(scope="module")
def echo_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An echo engine and a frontend whose chat template is `ECHO_TEMPLATE`, parsing Qwen3's
    reasoning and hermes tool calls (named by flag: the template names no format)."""
    logs: Path = tmp_path_factory.mktemp("echo-frontend")
    tokenizer = echo_template_tokenizer(logs / "tokenizer")
    engine_port, frontend_port = free_port(), free_port()
    engine = engine_argv(engine_port, "--time-scale", "1000", "--max-model-len", "4096",
                         "--num-gpu-blocks", "2048")
    frontend = frontend_argv(frontend_port, f"127.0.0.1:{engine_port}", "--tokenizer",
                             str(tokenizer), "--tool-call-parser", "hermes",
                             "--reasoning-parser", "qwen3")
    with running(engine, engine_port, logs / "engine.log", timeout=60) as engine_process, \
            running(frontend, frontend_port, logs / "frontend.log", timeout=60) as frontend_process:
        stack = Stack(engine_port, frontend_port, engine_process, frontend_process)
        wait_ready(stack.base_url)
        yield stack


@pytest.fixture()
def slow_stack(tmp_path: Path) -> Iterator[Stack]:
    """An engine slowed to real time (a few ms per token) and a frontend: streams last."""
    engine_port, frontend_port = free_port(), free_port()
    with (
        running(engine_argv(engine_port, "--time-scale", "0.2"), engine_port,
                tmp_path / "engine.log", timeout=60) as engine,
        running(frontend_argv(frontend_port, f"127.0.0.1:{engine_port}"),
                frontend_port, tmp_path / "frontend.log", timeout=60) as frontend,
    ):
        stack = Stack(engine_port, frontend_port, engine, frontend)
        wait_ready(stack.base_url)
        yield stack
