"""Failure paths with real processes: target down, engine dying mid-stream, client leaving."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai
import orjson
import pytest

from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc
from tests.support.frontend_stack import Stack
from tests.support.processes import free_port, kvswitch_argv, running

MESSAGES = [{"role": "user", "content": "count slowly"}]


def _active_requests(engine_port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{engine_port}") as channel:
        info = vllm_engine_pb2_grpc.VllmEngineStub(channel).GetServerInfo(
            pb.GetServerInfoRequest(), timeout=5)
    return int(info.active_requests)


def test_target_down_is_503(tmp_path: Path) -> None:
    port, dead = free_port(), free_port()
    argv = kvswitch_argv("frontend", "--target", f"127.0.0.1:{dead}", "--port", str(port))
    with running(argv, port, tmp_path / "frontend.log", timeout=60):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as info:
                client.chat.completions.create(model="m", messages=MESSAGES, stream=stream)
            assert info.value.status_code == 503
            assert info.value.body["type"] == "ServiceUnavailableError"
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503


def test_disconnected_stream_frees_the_engine(slow_stack: Stack) -> None:
    body = {"messages": MESSAGES, "max_tokens": 800, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", slow_stack.base_url + "/v1/chat/completions",
                      json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert _active_requests(slow_stack.engine_port) == 1
        # Leaving the block closes the connection mid-stream.
    deadline = time.monotonic() + 5
    while _active_requests(slow_stack.engine_port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _active_requests(slow_stack.engine_port) == 0


def test_engine_dying_mid_stream_is_an_sse_error_event(slow_stack: Stack) -> None:
    body = {"messages": MESSAGES, "max_tokens": 800, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", slow_stack.base_url + "/v1/chat/completions",
                      json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(l for l in lines if l.startswith("data: "))
        assert "chat.completion.chunk" in first
        slow_stack.engine.signal(signal.SIGKILL)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    error = orjson.loads(rest[-2])["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert set(error) == {"message", "type", "param", "code"}


def test_disconnected_non_streamed_request_frees_the_engine(slow_stack: Stack) -> None:
    body = {"messages": MESSAGES, "max_tokens": 800}

    def call() -> None:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(slow_stack.base_url + "/v1/chat/completions", json=body, timeout=1.5)

    client = threading.Thread(target=call)
    client.start()
    deadline = time.monotonic() + 5
    while _active_requests(slow_stack.engine_port) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _active_requests(slow_stack.engine_port) == 1
    client.join()
    deadline = time.monotonic() + 5
    while _active_requests(slow_stack.engine_port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _active_requests(slow_stack.engine_port) == 0
