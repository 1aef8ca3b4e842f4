"""CPU cost of the EPP request path per request: a streaming Generate with a 1k-token prompt.

Three figures, each CPU seconds per request (not wall time):
- `core`: ExtProcStream alone (headers, body, routed, response headers, trailers, close) on
  prebuilt messages -- parsing, routing bookkeeping, reply building;
- `core_wire`: the same plus protobuf (de)serialization of every ext_proc message, as grpc does;
- `server`: the whole EPP process (`EppServer` with a constant router, uvloop) in a child
  process, once per `--transports` entry (h2: kvswitch.epp.h2server; grpcio: grpc.aio), driven
  over loopback by `--concurrency` concurrent ext_proc streams; measured as the child's
  user+sys CPU time (from /proc) over the run;
- `grpc_floor`: the same child and load with a servicer that only answers constants -- what
  grpc.aio itself costs for one ext_proc stream (4 messages in, 5 out), the floor under `server`.
With `--skip-response-headers` the driver sends what Envoy sends for a gRPC pool with
response_header_mode SKIP (kvswitch's bootstrap): no response headers, 3 messages in, 4 out.

Server figures are taken over `--rounds` interleaved rounds (h2, grpcio, floor, h2, ...) and
reported as medians, since the machine is shared.

    .venv/bin/python benchmarks/epp_request_path.py [--requests 20000] [--rounds 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvswitch.epp.extproc import ExtProcStream, NeedRouting
from kvswitch.epp.parsers import default_parsers
from kvswitch.epp.request import EndpointPicker, RoutingDecision
from kvswitch.protocol import vllm_engine_pb2
from kvswitch.protocol.frames import encode
from tests.epp.test_extproc import (
    body,
    grpc_headers,
    response_headers,
    response_trailers,
)

DECISION = RoutingDecision(endpoints=("10.0.0.1:8000",))
PROMPT_TOKENS = 1024


class ConstantRouter:
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def route(self, request: object, subset: object) -> RoutingDecision:
        return DECISION
    def request_finished(self, request: object, outcome: object) -> None: ...


def messages() -> list[ep.ProcessingRequest]:
    generate = vllm_engine_pb2.GenerateRequest(
        request_id="bench", stream=True,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=range(1000, 1000 + PROMPT_TOKENS)),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=64),
    )
    headers = grpc_headers(("x-request-id", "bench"), ("user-agent", "grpc-python/1.85"),
                           ("x-forwarded-proto", "http"), ("grpc-accept-encoding", "gzip"))
    return [
        headers,
        body(encode(generate.SerializeToString()), eos=True),
        response_headers((":status", "200"), ("content-type", "application/grpc")),
        response_trailers(("grpc-status", "0"),
                          ("x-kvswitch-usage", "prompt_tokens=1024;completion_tokens=64;cached_tokens=0")),
    ]


def run_core(picker: EndpointPicker, n: int, wire: bool) -> float:
    msgs = messages()
    raw = [m.SerializeToString() for m in msgs]
    start = time.process_time()
    for _ in range(n):
        stream = ExtProcStream(picker)
        replies = []
        for i in range(4):
            message = ep.ProcessingRequest.FromString(raw[i]) if wire else msgs[i]
            for action in stream.receive(message):
                if type(action) is NeedRouting:
                    replies.extend(stream.routed(DECISION))
                else:
                    replies.append(action)
        replies.extend(stream.close())
        if wire:
            for reply in replies:
                if type(reply) is ep.ProcessingResponse:
                    reply.SerializeToString()
    return (time.process_time() - start) / n


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SERVER_CHILD = """
import asyncio, sys, uvloop
sys.path.insert(0, {repo!r})
from benchmarks.epp_request_path import ConstantRouter
from kvswitch.epp.parsers import default_parsers
from kvswitch.epp.request import EndpointPicker
from kvswitch.epp.server import EppServer
async def main():
    server = EppServer(EndpointPicker(parsers=default_parsers(), router=ConstantRouter()), port=0,
                       transport={transport!r})
    print(await server.start(), flush=True)
    await server.wait()
uvloop.run(main())
"""


FLOOR_CHILD = """
import sys, uvloop, grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
REPLY = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
class Constant(ep_grpc.ExternalProcessorServicer):
    async def Process(self, requests, context):
        n = 0
        async for _ in requests:
            n += 1
            yield REPLY
            if n == 2:
                yield REPLY
async def main():
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(Constant(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()
uvloop.run(main())
"""


SKIP_RESPONSE_HEADERS = False


async def drive(port: int, n: int, concurrency: int) -> None:
    msgs = messages()
    if SKIP_RESPONSE_HEADERS:
        del msgs[2]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)

        async def one() -> None:
            call = stub.Process()
            await call.write(msgs[0])
            await call.write(msgs[1])
            await call.read()
            await call.read()
            for m in msgs[2:]:
                await call.write(m)
                await call.read()
            await call.done_writing()
            await call.read()

        async def worker(count: int) -> None:
            for _ in range(count):
                await one()

        await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))


def run_server(n: int, concurrency: int, code: str) -> tuple[float, float]:
    child = subprocess.Popen([sys.executable, "-c", code],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        asyncio.run(drive(port, 200, concurrency))  # warm up
        cpu0, wall0 = proc_cpu_seconds(child.pid), time.perf_counter()
        asyncio.run(drive(port, n, concurrency))
        cpu1, wall1 = proc_cpu_seconds(child.pid), time.perf_counter()
        return (cpu1 - cpu0) / n, n / (wall1 - wall0)
    finally:
        child.terminate()
        child.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--server-requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved server rounds")
    parser.add_argument("--transports", default="h2,grpcio", help="EppServer transports to run")
    parser.add_argument("--skip-response-headers", action="store_true",
                        help="drive the server as Envoy does with response_header_mode SKIP")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "epp_request_path.json"))
    args = parser.parse_args()
    global SKIP_RESPONSE_HEADERS
    SKIP_RESPONSE_HEADERS = args.skip_response_headers
    picker = EndpointPicker(parsers=default_parsers(), router=ConstantRouter())
    run_core(picker, 2000, wire=True)  # warm up
    core = run_core(picker, args.requests, wire=False)
    core_wire = run_core(picker, args.requests, wire=True)
    transports = args.transports.split(",")
    rounds: dict[str, list[tuple[float, float]]] = {t: [] for t in [*transports, "grpc_floor"]}
    for index in range(args.rounds):
        for name, values in rounds.items():
            code = FLOOR_CHILD if name == "grpc_floor" else SERVER_CHILD.format(
                repo=str(REPO), transport=name)
            cpu, rate = run_server(args.server_requests, args.concurrency, code)
            values.append((cpu, rate))
            print(f"round {index + 1} {name:10s} {cpu * 1e3:.4f} ms CPU/request, "
                  f"{rate:.0f} requests/s", flush=True)
    result: dict[str, object] = {
        "prompt_tokens": PROMPT_TOKENS,
        "requests": args.requests,
        "core_cpu_ms_per_request": round(core * 1e3, 4),
        "core_wire_cpu_ms_per_request": round(core_wire * 1e3, 4),
        "server_requests": args.server_requests,
        "server_concurrency": args.concurrency,
        "rounds": args.rounds,
    }
    for name, values in rounds.items():
        prefix = name if name == "grpc_floor" else f"server_{name}"
        result[f"{prefix}_cpu_ms_per_request"] = round(
            statistics.median(v[0] for v in values) * 1e3, 4)
        result[f"{prefix}_cpu_ms_per_request_rounds"] = [round(v[0] * 1e3, 4) for v in values]
        if name != "grpc_floor":
            result[f"{prefix}_requests_per_second"] = round(
                statistics.median(v[1] for v in values), 1)
    result.update({
        "skip_response_headers": args.skip_response_headers,
        "load_average_1m": os.getloadavg()[0],
        "python": sys.version.split()[0],
    })
    for key, value in result.items():
        print(f"{key:40s} {value}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
