"""`kvswitch up`: starts the whole gateway, answers gRPC on --port, outlives an EPP crash,
leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import grpc
import httpx

from kvswitch.launcher import frontend_available
from kvswitch.protocol import vllm_engine_pb2_grpc as rpc
from tests.support.gateway import generate, prompt
from tests.support.processes import free_port
from tests.support.up import alive, kvswitch_up


def test_up_serves_grpc_and_stops_every_child(tmp_path: Path) -> None:
    port = free_port()
    args = ["--port", str(port), "--replicas", "2", "--profile", "tiny", "--time-scale", "100",
            "--mode", "echo", "--grace-period", "1"]
    with_frontend = frontend_available()
    if not with_frontend:
        args.append("--no-frontend")
    with kvswitch_up(args, tmp_path) as up:
        text = up.output()
        assert "is up on" in text, text
        # two engines, the EPP, Envoy (and a frontend)
        assert len(up.children) == 4 + int(with_frontend)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            complete = generate(rpc.VllmEngineStub(channel), prompt(1), max_tokens=4)
        assert complete.completion_tokens == 4
        if with_frontend:
            # HTTP on the same port: Envoy → frontend → (gRPC) Envoy → EPP → engine.
            base = f"http://127.0.0.1:{port}/v1"
            model = httpx.get(f"{base}/models", timeout=20).json()["data"][0]["id"]
            reply = httpx.post(f"{base}/chat/completions", timeout=20, json={
                "model": model, "max_tokens": 3,
                "messages": [{"role": "user", "content": "Hello"}]})
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 3
        # The EPP is started again when it dies; meanwhile requests fail closed (UNAVAILABLE).
        match = re.search(r"started epp \(pid (\d+)\)", text)
        assert match is not None, text
        os.kill(int(match.group(1)), signal.SIGKILL)
        restarted = up.wait_for(r"epp \(pid \d+\) exited with -?\d+; restarted as pid (\d+)",
                                seconds=30)
        assert restarted is not None, up.output()
        up.children.append(int(restarted.group(1)))
        served = None
        waited = threading.Event()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in range(150):  # bounded: 150 x 0.2 s
                try:
                    served = generate(rpc.VllmEngineStub(channel), prompt(2), max_tokens=4)
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                    waited.wait(0.2)
        assert served is not None and served.completion_tokens == 4
        assert up.proc.poll() is None  # still up
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0
        assert [pid for pid in up.children if alive(pid)] == []


def test_up_api_sglang_serves_sglang_grpc_and_openai(tmp_path: Path) -> None:
    from kvswitch.protocol.sglang import sglang_scheduler_pb2 as spb
    from kvswitch.protocol.sglang import sglang_scheduler_pb2_grpc as srpc

    port = free_port()
    args = ["--port", str(port), "--replicas", "2", "--api", "sglang", "--page-size", "4",
            "--profile", "tiny", "--time-scale", "100", "--mode", "echo", "--grace-period", "1"]
    with kvswitch_up(args, tmp_path) as up:
        text = up.output()
        assert "sglang.grpc.scheduler.SglangScheduler/Generate" in text, text
        assert "kvswitch.dev/engine-api: sglang" in (tmp_path / "state" / "pool.yaml").read_text()
        ids = prompt(1)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = spb.GenerateRequest(
                request_id="up-sglang", tokenized=spb.TokenizedInput(input_ids=ids),
                sampling_params=spb.SamplingParams(max_new_tokens=4, temperature=1, top_p=1))
            (reply,) = list(srpc.SglangSchedulerStub(channel).Generate(request, timeout=20))
        assert list(reply.complete.output_ids) == ids[:4]
        if frontend_available():
            base = f"http://127.0.0.1:{port}/v1"
            model = httpx.get(f"{base}/models", timeout=20).json()["data"][0]["id"]
            answer = httpx.post(f"{base}/completions", timeout=20, json={
                "model": model, "max_tokens": 3, "prompt": "one two three"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == "one two three"
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0
        assert [pid for pid in up.children if alive(pid)] == []
