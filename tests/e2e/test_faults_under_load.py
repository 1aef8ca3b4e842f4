"""Faults under load with real processes: while streams run through the gateway, kill -9 an
engine, the EPP, the frontend and Envoy in turn. Every stream ends within seconds (complete, or
a clear UNAVAILABLE / INTERNAL), the supervisor restarts what died (with backoff) and the
gateway serves again. An engine that goes silent (SIGSTOP: its connections stay open) stops
being routed to within seconds."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from kvswitch.launcher import frontend_available
from kvswitch.protocol import vllm_engine_pb2 as pb
from tests.support.gateway import Gateway, prompt, running_gateway

STREAM_TOKENS = 400  # several seconds a stream at time scale 1: the kill lands mid-stream
ENDED_WITHIN = 10.0
CLEAR = {"complete", "UNAVAILABLE", "INTERNAL", "http-error"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(tmp_path_factory.mktemp("faults"), replicas=2, profile="tiny",
                         time_scale=1.0, mode="echo", grace_period=1.0,
                         frontend_workers=1 if frontend_available() else 0,
                         restart_engines=True, restart_epp=True, restart_proxies=True) as gw:
        yield gw


@dataclass
class Streams:
    """Streams running in threads: each records when it ended and how."""

    started: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    outcomes: list[tuple[float, str]] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def run(self, bodies: list[Callable[[Callable[[], None]], str]]) -> None:
        """Start the streams; returns once each has had its first token."""
        def one(body: Callable[[Callable[[], None]], str]) -> None:
            try:
                outcome = body(self.started.release)
            except grpc.RpcError as exc:
                outcome = exc.code().name
            except httpx.HTTPError:
                outcome = "http-error"
            except Exception as exc:  # noqa: BLE001 - recorded, then asserted on
                outcome = f"unexpected {type(exc).__name__}: {exc}"
            self.outcomes.append((time.monotonic(), outcome))

        self.threads = [threading.Thread(target=one, args=(body,), daemon=True)
                        for body in bodies]
        for thread in self.threads:
            thread.start()
        for _ in bodies:  # every stream has its first token before the fault
            assert self.started.acquire(timeout=60), self.outcomes

    def join(self, deadline: float) -> None:
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def grpc_stream(gateway: Gateway, seed: int) -> Callable[[Callable[[], None]], str]:
    def body(first: Callable[[], None]) -> str:
        request = pb.GenerateRequest(
            tokenized=pb.TokenizedInput(input_ids=prompt(seed)), stream=True,
            sampling_params=pb.SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True))
        got_first = False
        for message in gateway.stub.Generate(request, timeout=60):
            if not got_first:
                got_first = True
                first()
            if message.HasField("complete"):
                return "complete"
        return "ended without complete"

    return body


def http_stream(gateway: Gateway, seed: int) -> Callable[[Callable[[], None]], str]:
    def body(first: Callable[[], None]) -> str:
        payload = {"model": "Qwen/Qwen3-0.6B", "prompt": prompt(seed), "stream": True,
                   "max_tokens": STREAM_TOKENS, "ignore_eos": True}
        url = f"http://{gateway.launched.address}/v1/completions"
        got_first = False
        with httpx.stream("POST", url, json=payload, timeout=60) as reply:
            if reply.status_code != 200:
                return f"status {reply.status_code}"
            for line in reply.iter_lines():
                if not got_first and line.startswith("data:"):
                    got_first = True
                    first()
                if line == "data: [DONE]":
                    return "complete"
        return "http-error"  # the body ended without [DONE]: a broken stream, seen as such

    return body


def wait_restarted(gateway: Gateway, name: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # bounded: what `kvswitch up` does every 0.2 s
        if any(e.name == name and e.restarted_pid for e in gateway.supervisor.poll()):
            gateway.supervisor.get(name).wait_ready(time.monotonic() + 60)
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} was not restarted\n{gateway.logs()}")


def serves_again(gateway: Gateway) -> None:
    deadline = time.monotonic() + 60
    while True:  # bounded by the deadline; UNAVAILABLE until the restarted part is ready
        try:
            messages = list(gateway.stub.Generate(pb.GenerateRequest(
                tokenized=pb.TokenizedInput(input_ids=prompt(99)),
                sampling_params=pb.SamplingParams(max_tokens=2)), timeout=20))
            assert messages[-1].complete.completion_tokens == 2
            return
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert time.monotonic() < deadline, gateway.logs()
            time.sleep(0.2)


@pytest.mark.parametrize("victim", ["engine-0", "epp", "frontend-0", "envoy"])
def test_kill_9_mid_stream(gateway: Gateway, victim: str) -> None:
    if victim.startswith("frontend") and not frontend_available():
        pytest.skip("needs the frontend")
    streams = Streams()
    make = http_stream if victim.startswith("frontend") else grpc_stream
    streams.run([make(gateway, seed) for seed in range(6)])
    killed_at = time.monotonic()
    os.kill(gateway.supervisor.get(victim).pid, signal.SIGKILL)
    streams.join(killed_at + ENDED_WITHIN + 5)
    assert len(streams.outcomes) == 6, f"streams still running after the kill: {streams.outcomes}"
    late = [at - killed_at for at, _ in streams.outcomes if at - killed_at > ENDED_WITHIN]
    assert not late, f"streams ended {late} s after the kill"
    assert {outcome for _, outcome in streams.outcomes} <= CLEAR, streams.outcomes
    if victim == "epp":  # routed streams do not depend on the EPP
        assert {outcome for _, outcome in streams.outcomes} == {"complete"}
    wait_restarted(gateway, victim)
    serves_again(gateway)


def test_a_silent_engine_stops_being_routed_to(gateway: Gateway) -> None:
    # SIGSTOP: the engine's TCP connections stay up but nothing answers (a half-open peer).
    victim = gateway.supervisor.get("engine-1").pid
    os.kill(victim, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        in_a_row = 0
        seed = 100
        while in_a_row < 10:  # bounded by the deadline
            assert time.monotonic() < deadline, (
                f"still routed to the silent engine\n{gateway.logs()}")
            seed += 1
            try:
                messages = list(gateway.stub.Generate(pb.GenerateRequest(
                    tokenized=pb.TokenizedInput(input_ids=prompt(seed)),
                    sampling_params=pb.SamplingParams(max_tokens=2)), timeout=2))
                in_a_row = in_a_row + 1 if messages[-1].complete.completion_tokens == 2 else 0
            except grpc.RpcError:
                in_a_row = 0
    finally:
        os.kill(victim, signal.SIGCONT)
    serves_again(gateway)
