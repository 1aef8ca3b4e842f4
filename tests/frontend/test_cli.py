"""`kvswitch frontend` as a process: `--workers N` shares one port, SIGTERM stops it cleanly."""

from __future__ import annotations

import re
import signal
import threading
from pathlib import Path

import httpx

from tests.support.frontend_stack import Stack, frontend_argv, wait_ready
from tests.support.processes import free_port, running

MESSAGES = [{"role": "user", "content": "hello"}]


def test_workers_share_the_port_and_stop_on_sigterm(stack: Stack, tmp_path: Path) -> None:
    port = free_port()
    argv = frontend_argv(port, f"127.0.0.1:{stack.engine_port}", "--workers", "2")
    with running(argv, port, tmp_path / "frontend.log", timeout=60) as frontend:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        pids = set()
        for _ in range(24):  # a new connection each time: the kernel spreads them
            reply = httpx.post(base + "/v1/chat/completions", timeout=30,
                               json={"messages": MESSAGES, "max_tokens": 4})
            assert reply.status_code == 200
            pids |= set(re.findall(r'pid="(\d+)"', httpx.get(base + "/metrics").text))
        assert len(pids) == 2
        frontend.signal(signal.SIGTERM)
        assert frontend.wait(timeout=20) == 0


def test_sigterm_lets_a_stream_in_flight_finish(slow_stack: Stack) -> None:
    body = {"messages": MESSAGES, "max_tokens": 40, "stream": True}
    lines: list[str] = []

    def sigterm_once_streaming() -> None:
        while not lines:
            threading.Event().wait(0.01)
        slow_stack.frontend.signal(signal.SIGTERM)

    killer = threading.Thread(target=sigterm_once_streaming)
    killer.start()
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", slow_stack.base_url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                lines.append(line)  # the first one sends the SIGTERM
    killer.join()
    assert lines[-1] == "data: [DONE]"
    assert slow_stack.frontend.wait(timeout=20) == 0


def test_an_unknown_parser_name_stops_the_frontend_at_once() -> None:
    import subprocess

    from tests.support.processes import kvswitch_argv
    result = subprocess.run(kvswitch_argv("frontend", "--target", "127.0.0.1:1", "--port",
                                          str(free_port()), "--tool-call-parser", "nope"),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "unknown tool-call parser 'nope'" in result.stderr and "hermes" in result.stderr
