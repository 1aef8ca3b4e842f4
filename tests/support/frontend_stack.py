"""An engine and a frontend process on loopback for the frontend's tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import Process, kvswitch_argv


@dataclass
class Stack:
    engine_port: int
    frontend_port: int
    engine: Process
    frontend: Process

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.frontend_port}"


def engine_argv(port: int, *extra: str) -> list[str]:
    return kvswitch_argv("engine", "--port", str(port), "--mode", "echo", "--profile", "tiny",
                         "--log-level", "WARNING", *extra)


def frontend_argv(port: int, target: str, *extra: str) -> list[str]:
    return kvswitch_argv("frontend", "--target", target, "--port", str(port),
                         "--log-level", "warning", *extra)


def wait_ready(base_url: str) -> None:
    import time

    import httpx
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base_url} never became healthy")


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
