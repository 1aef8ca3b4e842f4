"""A whole gateway on loopback for end-to-end tests (`kvswitch up`'s launcher), and calls through
it."""

from __future__ import annotations

import contextlib
import os
import signal
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvswitch.launcher import GatewaySpec, LaunchedGateway, launch_gateway
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc as rpc
from kvswitch.supervisor import Supervisor
from tests.support.processes import free_port

# The simulator's KV block size: prompts here are whole blocks so prefix matches are exact.
BLOCK = 16
CALL_TIMEOUT = 20.0


@dataclass
class Gateway:
    launched: LaunchedGateway
    supervisor: Supervisor
    channel: grpc.Channel

    @property
    def stub(self) -> rpc.VllmEngineStub:
        return rpc.VllmEngineStub(self.channel)

    @property
    def engines(self) -> tuple[str, ...]:
        return self.launched.endpoints[: self.launched.spec.replicas]

    def engine_pid(self, address: str) -> int:
        return self.supervisor.get(self.launched.engine_name(address)).pid

    def logs(self) -> str:
        return "\n".join(f"--- {c.name} (pid {c.pid})\n{c.tail(1500)}"
                         for c in self.supervisor.children)


def start_gateway(tmp: Path, **spec: object) -> tuple[Gateway, Supervisor]:
    supervisor = Supervisor(tmp)
    try:
        launched = launch_gateway(
            supervisor, GatewaySpec(port=free_port(), **spec), tmp)  # type: ignore[arg-type]
    except BaseException:
        supervisor.stop_all()
        raise
    channel = grpc.insecure_channel(launched.address)
    return Gateway(launched, supervisor, channel), supervisor


@contextlib.contextmanager
def running_gateway(tmp: Path, **spec: object) -> Iterator[Gateway]:
    """`start_gateway`, then every process it started stopped (by PID) however the block ends."""
    gw, supervisor = start_gateway(tmp, **spec)
    try:
        yield gw
    finally:
        gw.channel.close()
        supervisor.stop_all()


def epp_metrics(gateway: Gateway, epp: int = 0) -> list[Sample]:
    """Every Prometheus sample EPP number `epp` serves, from one scrape."""
    url = f"http://127.0.0.1:{gateway.launched.ports.epp_metrics[epp]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text)
            for sample in family.samples]


def epp_samples(gateway: Gateway, name: str, *, epp: int = 0, **labels: str) -> list[float]:
    """The values of EPP number `epp`'s Prometheus samples `name` whose labels include
    `labels`."""
    return [sample.value for sample in epp_metrics(gateway, epp)
            if sample.name == name and labels.items() <= sample.labels.items()]


def prompt(seed: int, blocks: int = 4) -> list[int]:
    """A prompt of whole blocks whose every block is unique to `seed`."""
    return [1000 + (seed * 7919 + i * 31) % 50000 for i in range(blocks * BLOCK)]


def generate_request(ids: Sequence[int], *, max_tokens: int = 8, stream: bool = False,
                     request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id or f"e2e-{os.getpid()}-{ids[0]}-{len(ids)}-{max_tokens}",
        tokenized=pb.TokenizedInput(input_ids=list(ids)),
        sampling_params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        stream=stream,
    )


def generate(stub: rpc.VllmEngineStub, ids: Sequence[int], *, max_tokens: int = 8,
             metadata: Sequence[tuple[str, str]] = ()) -> pb.GenerateComplete:
    responses = list(stub.Generate(generate_request(ids, max_tokens=max_tokens),
                                   metadata=metadata, timeout=CALL_TIMEOUT))
    completes = [r.complete for r in responses if r.HasField("complete")]
    assert len(completes) == 1, responses
    return completes[0]


def cached_on(engines: Sequence[str], ids: Sequence[int]) -> list[str]:
    """The engines whose prefix cache holds `ids`' first block: they served a request with it.

    Asks each engine directly with the first block plus one token (so the probe itself only adds
    a block nobody else asks for)."""
    holders = []
    probe = [*ids[:BLOCK], 7]
    for address in engines:
        with grpc.insecure_channel(address) as channel:
            complete = generate(rpc.VllmEngineStub(channel), probe, max_tokens=1)
        if complete.cached_tokens >= BLOCK:
            holders.append(address)
    return holders


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
