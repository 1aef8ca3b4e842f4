"""`kvswitch up`: starts the whole gateway, answers gRPC on --port, outlives an EPP crash,
leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import httpx

from kvswitch.launcher import frontend_available
from kvswitch.protocol import vllm_engine_pb2_grpc as rpc
from tests.support.gateway import generate, prompt
from tests.support.processes import REPO, free_port


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes only once reaped; `up` reaps its children.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][:1] != "Z"


def test_up_serves_grpc_and_stops_every_child(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "up.log"
    argv = [sys.executable, "-m", "kvswitch", "up", "--port", str(port), "--replicas", "2",
            "--profile", "tiny", "--time-scale", "100", "--mode", "echo",
            "--grace-period", "1", "--log-dir", str(tmp_path / "state")]
    with_frontend = frontend_available()
    if not with_frontend:
        argv.append("--no-frontend")
    with open(log, "wb") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                              start_new_session=True)
    children: list[int] = []
    try:
        waited = threading.Event()
        for _ in range(600):  # bounded: 600 x 0.1 s
            if "is up on" in log.read_text() or up.poll() is not None:
                break
            waited.wait(0.1)
        text = log.read_text()
        assert "is up on" in text, text
        children = [int(pid) for pid in re.findall(r"started \S+ \(pid (\d+)\)", text)]
        # two engines, the EPP, Envoy (and a frontend)
        assert len(children) == 4 + int(with_frontend)
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
        restarted = None
        for _ in range(300):  # bounded: 300 x 0.1 s
            restarted = re.search(r"epp \(pid \d+\) exited with -?\d+; restarted as pid (\d+)",
                                  log.read_text())
            if restarted or up.poll() is not None:
                break
            waited.wait(0.1)
        assert restarted is not None, log.read_text()
        children.append(int(restarted.group(1)))
        served = None
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in range(150):  # bounded: 150 x 0.2 s
                try:
                    served = generate(rpc.VllmEngineStub(channel), prompt(2), max_tokens=4)
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                    waited.wait(0.2)
        assert served is not None and served.completion_tokens == 4
        assert up.poll() is None  # still up
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        assert [pid for pid in children if _alive(pid)] == []
    finally:
        if up.poll() is None:
            os.kill(up.pid, signal.SIGKILL)
            up.wait(timeout=10)
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_up_api_sglang_serves_sglang_grpc_and_openai(tmp_path: Path) -> None:
    from kvswitch.protocol.sglang import sglang_scheduler_pb2 as spb
    from kvswitch.protocol.sglang import sglang_scheduler_pb2_grpc as srpc

    port = free_port()
    log = tmp_path / "up.log"
    argv = [sys.executable, "-m", "kvswitch", "up", "--port", str(port), "--replicas", "2",
            "--api", "sglang", "--page-size", "4", "--profile", "tiny", "--time-scale", "100",
            "--mode", "echo", "--grace-period", "1", "--log-dir", str(tmp_path / "state")]
    with open(log, "wb") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                              start_new_session=True)
    children: list[int] = []
    try:
        waited = threading.Event()
        for _ in range(600):  # bounded: 600 x 0.1 s
            if "is up on" in log.read_text() or up.poll() is not None:
                break
            waited.wait(0.1)
        text = log.read_text()
        assert "sglang.grpc.scheduler.SglangScheduler/Generate" in text, text
        children = [int(pid) for pid in re.findall(r"started \S+ \(pid (\d+)\)", text)]
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
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        assert [pid for pid in children if _alive(pid)] == []
    finally:
        if up.poll() is None:
            os.kill(up.pid, signal.SIGKILL)
            up.wait(timeout=10)
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
