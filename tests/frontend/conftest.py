"""Real processes for the frontend's integration tests: echo engines and frontends on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.frontend_stack import Stack, engine_argv, frontend_argv, wait_ready
from tests.support.processes import free_port, running


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A fast echo engine and a frontend in front of it (bodies over 200 kB get 413)."""
    logs: Path = tmp_path_factory.mktemp("frontend")
    engine_port, frontend_port = free_port(), free_port()
    with running(engine_argv(engine_port, "--time-scale", "1000", "--max-num-seqs", "64",
                              "--max-model-len", "4096", "--num-gpu-blocks", "2048"),
                 engine_port, logs / "engine.log", timeout=60) as engine:
        with running(frontend_argv(frontend_port, f"127.0.0.1:{engine_port}",
                                    "--max-body-bytes", "200000", "--user-as-fairness-id"),
                     frontend_port, logs / "frontend.log", timeout=60) as frontend:
            stack = Stack(engine_port, frontend_port, engine, frontend)
            wait_ready(stack.base_url)
            yield stack


ECHO_TEMPLATE = "{{- messages[-1]['content'] -}}"
"""A chat template that renders only the last message: the echo engine then answers with that
message's text, so a test can play a model's raw output (reasoning, tool calls) through."""


def echo_template_tokenizer(directory: Path) -> Path:
    """The bundled Qwen3 tokenizer with `ECHO_TEMPLATE` as its chat template."""
    import json
    import shutil

    from kvswitch.tokenization import bundled_tokenizer_dir
    shutil.copytree(bundled_tokenizer_dir(), directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = ECHO_TEMPLATE
    config_path.write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def echo_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An echo engine and a frontend whose chat template is `ECHO_TEMPLATE`, parsing Qwen3's
    reasoning and hermes tool calls (named by flag: the template names no format)."""
    logs: Path = tmp_path_factory.mktemp("echo-frontend")
    tokenizer = echo_template_tokenizer(logs / "tokenizer")
    engine_port, frontend_port = free_port(), free_port()
    engine_argv = _engine_argv(engine_port, "--time-scale", "1000", "--max-model-len", "4096",
                               "--num-gpu-blocks", "2048")
    frontend_argv = _frontend_argv(frontend_port, f"127.0.0.1:{engine_port}", "--tokenizer",
                                   str(tokenizer), "--tool-call-parser", "hermes",
                                   "--reasoning-parser", "qwen3")
    with running(engine_argv, engine_port, logs / "engine.log", timeout=60) as engine, \
            running(frontend_argv, frontend_port, logs / "frontend.log", timeout=60) as frontend:
        stack = Stack(engine_port, frontend_port, engine, frontend)
        _wait_ready(stack.base_url)
        yield stack


@pytest.fixture()
def slow_stack(tmp_path: Path) -> Iterator[Stack]:
    """An engine slowed to real time (a few ms per token) and a frontend: streams last."""
    engine_port, frontend_port = free_port(), free_port()
    with running(engine_argv(engine_port, "--time-scale", "0.2"), engine_port,
                 tmp_path / "engine.log", timeout=60) as engine:
        with running(frontend_argv(frontend_port, f"127.0.0.1:{engine_port}"),
                     frontend_port, tmp_path / "frontend.log", timeout=60) as frontend:
            stack = Stack(engine_port, frontend_port, engine, frontend)
            wait_ready(stack.base_url)
            yield stack
