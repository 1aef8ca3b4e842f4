"""Interop with an independent gRPC stack: Node's @grpc/grpc-js (its own HTTP/2, HPACK, framing,
deadlines and status handling; no code shared with grpcio's C-core, Envoy or kvswitch).

`node/client.js` makes one fixed set of VllmEngine calls against an address, loading the API from
the `smg_grpc_proto` package's own .proto files, and prints what it saw as JSON. Each target, one
`kvswitch engine` process and the full gateway (Envoy → EPP → two engines), is run once per module
and the tests assert on its report. The engines echo the prompt, so exact output ids are known.

`make test` installs the pinned npm packages (`npm ci --prefix tests/interop/node`); the module
skips only when node or npm is not installed at all.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import smg_grpc_proto
from google.protobuf import descriptor_pb2
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2

from kvswitch.protocol import SERVICE_NAME, vllm_engine_pb2_grpc
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.headers import FAIRNESS_ID, OBJECTIVE
from tests.support.gateway import prompt, start_gateway
from tests.support.processes import free_port, kvswitch_argv, running

NODE_DIR = Path(__file__).parent / "node"
CLIENT = NODE_DIR / "client.js"
PROTO_DIR = Path(smg_grpc_proto.__file__).parent / "proto"
NODE, NPM = shutil.which("node"), shutil.which("npm")

pytestmark = pytest.mark.skipif(
    NODE is None or NPM is None,
    reason="node and npm are not installed: the @grpc/grpc-js interop tests need Node >= 18")

PROMPT = prompt(77)  # 64 tokens, whole KV blocks
MAX_TOKENS, STREAM_TOKENS = 8, 16  # what client.js asks for
# ~17 s of simulated decode at time scale 10: the client's deadline ends it long before.
LONG_MAX_TOKENS, DEADLINE_MS = 30_000, 300
TIME_SCALE = "10"
OBJECTIVE_VALUE, TENANT = "interop-objective", "interop-tenant"
HEALTH_SERVICES = ("", SERVICE_NAME, "no.such.Service")


@dataclass(frozen=True)
class Target:
    name: str
    address: str
    engines: tuple[str, ...]
    report: dict[str, Any]
    epp_metrics_port: int | None = None


def write_health_descriptor_set(path: Path) -> Path:
    """grpc.health.v1 as a FileDescriptorSet (grpcio-health-checking ships no .proto file)."""
    files = descriptor_pb2.FileDescriptorSet()
    health_pb2.DESCRIPTOR.CopyToProto(files.file.add())
    path.write_bytes(files.SerializeToString())
    return path


def run_client(address: str, health_descriptor_set: Path | None) -> dict[str, Any]:
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("the npm packages are missing: run `make test` or "
                    "`npm ci --prefix tests/interop/node`")
    config = {
        "address": address, "protoDir": str(PROTO_DIR), "promptIds": PROMPT,
        "metadata": [[OBJECTIVE, OBJECTIVE_VALUE], [FAIRNESS_ID, TENANT]],
        "longMaxTokens": LONG_MAX_TOKENS, "deadlineMs": DEADLINE_MS,
        "healthDescriptorSet": str(health_descriptor_set) if health_descriptor_set else None,
        "healthServices": list(HEALTH_SERVICES),
    }
    done = subprocess.run([str(NODE), str(CLIENT), json.dumps(config)], capture_output=True,
                          text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


@pytest.fixture(scope="module")
def engine_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    tmp = tmp_path_factory.mktemp("interop-engine")
    port = free_port()
    argv = kvswitch_argv("engine", "--port", str(port), "--time-scale", TIME_SCALE,
                         "--mode", "echo", "--grace-period", "1")
    with running(argv, port, tmp / "engine.log"):
        address = f"127.0.0.1:{port}"
        report = run_client(address, write_health_descriptor_set(tmp / "health.pb"))
        yield Target("engine", address, (address,), report)


@pytest.fixture(scope="module")
def gateway_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    gw, supervisor = start_gateway(tmp_path_factory.mktemp("interop-gateway"), replicas=2,
                                   time_scale=float(TIME_SCALE), mode="echo", grace_period=1.0)
    try:
        report = run_client(gw.launched.address, None)
        yield Target("gateway", gw.launched.address, gw.engines, report,
                     gw.launched.ports.epp_metrics[0])
    except BaseException:
        print(gw.logs())
        raise
    finally:
        gw.channel.close()
        supervisor.stop_all()


@pytest.fixture(params=["engine", "gateway"])
def target(request: pytest.FixtureRequest) -> Target:
    return request.getfixturevalue(f"{request.param}_target")  # type: ignore[no-any-return]


def test_generate_not_streamed(target: Target) -> None:
    seen = target.report["generate"]
    assert seen["error"] is None and seen["messages"] == 1 and seen["chunks"] == 0
    [complete] = seen["completes"]
    assert complete["output_ids"] == PROMPT[:MAX_TOKENS]  # echo: the prompt's first tokens
    assert complete["finish_reason"] == "length"
    assert complete["prompt_tokens"] == len(PROMPT)
    assert complete["completion_tokens"] == MAX_TOKENS


def test_generate_streamed(target: Target) -> None:
    seen = target.report["generate_stream"]
    assert seen["error"] is None and seen["last_is_complete"]
    assert seen["chunks"] == seen["messages"] - 1 >= 1
    assert seen["chunk_token_ids"] == PROMPT[:STREAM_TOKENS]
    assert seen["chunk_prompt_tokens"] == [len(PROMPT)]
    [complete] = seen["completes"]
    # vLLM's streamed complete carries the last delta, not the whole output.
    assert complete["output_ids"] == seen["last_chunk_token_ids"]
    assert complete["finish_reason"] == "length"
    assert complete["prompt_tokens"] == len(PROMPT)


def test_embed(target: Target) -> None:
    seen = target.report["embed"]
    assert seen["length"] == seen["dim"] > 0
    assert seen["prompt_tokens"] == len(PROMPT)
    assert seen["finite"]


def test_model_info_matches_grpcio(target: Target) -> None:
    with grpc.insecure_channel(target.engines[0]) as channel:
        info = vllm_engine_pb2_grpc.VllmEngineStub(channel).GetModelInfo(
            pb.GetModelInfoRequest(), timeout=10)
    expected = MessageToDict(info, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)
    assert target.report["model_info"] == expected
    assert expected["served_model_name"] and expected["max_context_length"] > 0


def test_health_check(target: Target) -> None:
    assert target.report["health_check"]["healthy"] is True


def test_bad_sampling_params_are_invalid_argument(target: Target) -> None:
    seen = target.report["bad_sampling"]
    assert seen["messages"] == 0
    assert seen["error"]["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature" in seen["error"]["details"]


def test_deadline_ends_a_long_stream_and_frees_the_engine(target: Target) -> None:
    seen = target.report["deadline"]
    assert seen["error"]["code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert seen["completes"] == [] and seen["tokens_before_deadline"] > 0
    assert seen["elapsed_ms"] < DEADLINE_MS + 2000
    # The stream would run ~17 s; a cancel that reached the engine frees it well before.
    wait_idle(target.engines, timeout=5.0)


def test_standard_health_service(engine_target: Target) -> None:
    statuses = engine_target.report["grpc_health"]
    assert statuses[""] == statuses[SERVICE_NAME] == "SERVING"
    assert statuses["no.such.Service"]["error"]["code"] == grpc.StatusCode.NOT_FOUND.value[0]


def test_objective_and_fairness_metadata_reach_the_epp(gateway_target: Target) -> None:
    assert gateway_target.epp_metrics_port is not None
    url = f"http://127.0.0.1:{gateway_target.epp_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    labels = f'objective="{OBJECTIVE_VALUE}"', f'fairness_id="{TENANT}"'
    routed = [line for line in text.splitlines()
              if line.startswith("kvswitch_epp_requests_total{") and all(l in line for l in labels)]
    # Two Generates, the Embed and the long stream (the bad one is refused by the engine).
    assert sum(float(line.rsplit(" ", 1)[1]) for line in routed) >= 4, text


def wait_idle(engines: Sequence[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for address in engines:
        with grpc.insecure_channel(address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            while (load := stub.GetLoads(pb.GetLoadsRequest(), timeout=5).loads[0]).num_total_reqs:
                assert time.monotonic() < deadline, f"{address} still busy: {load}"
                time.sleep(0.05)
