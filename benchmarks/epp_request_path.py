"""CPU cost of the EPP request path per request: a streaming Generate (`--prompt-tokens`, 1024).

Five figures, each CPU seconds per request (not wall time):
- `core`: ExtProcStream alone (headers, body, routed, response headers, trailers, close) on
  prebuilt messages -- parsing, routing bookkeeping, reply building;
- `core_wire`: the same plus protobuf (de)serialization of every ext_proc message, as grpc does;
- `h2_inproc`: the h2 transport in process: what Envoy sends for a gRPC pool (HEADERS,
  request_headers, request_body, response_trailers, end of stream) fed as bytes to the
  server's protocol object, replies written to a null transport -- frames, HPACK, gRPC framing
  and the core, with no socket or event loop;
- `server`: the whole EPP process (`EppServer` with a constant router, uvloop) in a child
  process, once per `--transports` entry (h2: kvswitch.epp.h2server; grpcio: grpc.aio), driven
  over loopback by `--concurrency` concurrent ext_proc streams; measured as the child's
  user+sys CPU time (from /proc) over the run;
- `grpc_floor`: the same child and load with a servicer that only answers constants -- what
  grpc.aio itself costs for one ext_proc stream (4 messages in, 5 out), the floor under `server`.
With `--skip-response-headers` the driver sends what Envoy sends for a gRPC pool with
response_header_mode SKIP: no response headers, 3 messages in, 4 out.

By default these are the streams other gateways run. `--kvswitch-bootstrap` runs, in every
figure, the stream kvswitch's own Envoy bootstrap runs for a gRPC pool instead: request_headers
with only the headers its forward_rules pass for a grpcio call (`:path`, `content-type`,
`x-request-id`; `EPP_HEADERS` in kvswitch/envoy/bootstrap.py) and, like request_body, the
`kvswitch` metadata saying the request is access-logged; no response headers or trailers (both
SKIP), so after routing Envoy ends the stream with RST_STREAM CANCEL instead of END_STREAM
(`h2_inproc`: that frame; `server`: the client cancels the call; `core`: `close()`). 2 messages
in (`grpc_floor`: 2 in, 3 out); the request's end comes later from Envoy's access log, which
these figures do not count.

Server figures are taken over `--rounds` interleaved rounds (h2, grpcio, floor, h2, ...) and
reported as medians, the in-process ones as the best of `--repeat` runs, since the machine is
shared (`--rounds 0`: in-process figures only).

    .venv/bin/python benchmarks/epp_request_path.py [--prompt-tokens 1024] [--requests 20000]
        [--rounds 3] [--transports h2,grpcio] [--kvswitch-bootstrap] [--out FILE.json]
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
from envoy.config.core.v3.base_pb2 import Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf.struct_pb2 import Struct, Value
from hpack import Encoder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvswitch.epp.contracts import EndpointPicker, RoutingDecision
from kvswitch.epp.extproc import ExtProcStream, NeedRouting
from kvswitch.epp.h2server import _Protocol
from kvswitch.epp.parsers import default_parsers
from kvswitch.epp.server import PROCESS_PATH, EppServer
from kvswitch.protocol import GENERATE_PATH, vllm_engine_pb2
from kvswitch.protocol.grpc_framing import encode
from kvswitch.protocol.headers import ACCESS_LOGGED, GATEWAY_METADATA_NAMESPACE
from kvswitch.protocol.http2 import (
    CANCEL,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    MAX_WINDOW,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    U32,
    WINDOW_UPDATE,
    frame,
)
from tests.support.extproc import (
    body,
    grpc_headers,
    header_map,
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


def messages(prompt_tokens: int = PROMPT_TOKENS,
             kvswitch_bootstrap: bool = False) -> list[ep.ProcessingRequest]:
    """The ext_proc messages of one streamed Generate, in order: other gateways' (request
    headers, body, response headers, trailers), or kvswitch's bootstrap's (see the module)."""
    generate = vllm_engine_pb2.GenerateRequest(
        request_id="bench", stream=True,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=range(1000, 1000 + prompt_tokens)),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=64),
    )
    if kvswitch_bootstrap:
        return kvswitch_messages(encode(generate.SerializeToString()))
    headers = grpc_headers(("x-request-id", "bench"), ("user-agent", "grpc-python/1.85"),
                           ("x-forwarded-proto", "http"), ("grpc-accept-encoding", "gzip"))
    return [
        headers,
        body(encode(generate.SerializeToString()), eos=True),
        response_headers((":status", "200"), ("content-type", "application/grpc")),
        response_trailers(("grpc-status", "0"),
                          ("x-kvswitch-usage",
                           f"prompt_tokens={prompt_tokens};completion_tokens=64;cached_tokens=0")),
    ]


def kvswitch_messages(framed_request: bytes) -> list[ep.ProcessingRequest]:
    """What kvswitch's Envoy bootstrap sends for a grpcio Generate to a gRPC pool: the headers
    its forward_rules pass and the body, each with the metadata of `set_metadata` (forwarded
    namespace `kvswitch`: logged to the EPP); nothing after routing."""
    logged = Metadata(filter_metadata={GATEWAY_METADATA_NAMESPACE: Struct(
        fields={ACCESS_LOGGED: Value(bool_value=True)})})
    pairs = [(":path", GENERATE_PATH), ("content-type", "application/grpc"),
             ("x-request-id", "bench")]
    headers = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map(pairs)),
                                   metadata_context=logged)
    request_body = body(framed_request, eos=True)
    request_body.metadata_context.CopyFrom(logged)
    return [headers, request_body]


def run_core(picker: EndpointPicker, n: int, wire: bool, prompt_tokens: int,
             kvswitch_bootstrap: bool = False) -> float:
    msgs = messages(prompt_tokens, kvswitch_bootstrap)
    raw = [m.SerializeToString() for m in msgs]
    start = time.process_time()
    for _ in range(n):
        stream = ExtProcStream(picker)
        replies = []
        for i in range(len(msgs)):
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


class _NullTransport:
    """What `_Protocol` needs of an asyncio transport; counts what it is given."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None: ...


def without_response_headers(msgs: list[ep.ProcessingRequest]) -> list[ep.ProcessingRequest]:
    return [m for m in msgs if not m.HasField("response_headers")]


def h2_input(n: int, prompt_tokens: int, kvswitch_bootstrap: bool = False) -> list[list[bytes]]:
    """What Envoy sends for `n` ext_proc streams on one connection, one list of reads each:
    HEADERS + request_headers + request_body, response_trailers (response headers skipped, as
    for a gRPC pool), end of stream; with `kvswitch_bootstrap`, HEADERS + request_headers +
    request_body, then RST_STREAM CANCEL."""
    msgs = without_response_headers(messages(prompt_tokens, kvswitch_bootstrap))
    framed = [b"\0" + U32.pack(len(raw)) + raw for raw in (m.SerializeToString() for m in msgs)]
    encoder = Encoder()
    fields = [(":method", "POST"), (":scheme", "http"), (":path", PROCESS_PATH),
              (":authority", "epp"), ("content-type", "application/grpc"), ("te", "trailers"),
              ("x-envoy-internal", "true"), ("x-forwarded-for", "10.0.0.9")]
    first = bytes(encoder.encode(fields))
    again = bytes(encoder.encode(fields))  # all indexed now: the same block from here on
    streams = []
    for i in range(n):
        sid = 2 * i + 1
        block = again if i else first
        reads = [frame(HEADERS, END_HEADERS, sid, block) + frame(DATA, 0, sid, framed[0])
                 + frame(DATA, 0, sid, framed[1])]
        if kvswitch_bootstrap:  # routed: Envoy has nothing more to send, and resets the stream
            reads.append(frame(RST_STREAM, 0, sid, U32.pack(CANCEL)))
        else:
            reads += [frame(DATA, 0, sid, framed[2]), frame(DATA, END_STREAM, sid, b"")]
        streams.append(reads)
    return streams


def run_h2(picker: EndpointPicker, n: int, prompt_tokens: int,
           kvswitch_bootstrap: bool = False) -> float:
    """The h2 transport in process: Envoy's bytes fed to `_Protocol.data_received`, no socket
    or event loop (the router answers at once)."""
    server = EppServer(picker, port=0)._h2
    assert server is not None
    protocol = _Protocol(server)
    transport = _NullTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    protocol.data_received(PREFACE + frame(SETTINGS, 0, 0, b"")
                           + frame(WINDOW_UPDATE, 0, 0, U32.pack(MAX_WINDOW - DEFAULT_WINDOW)))
    streams = h2_input(n, prompt_tokens, kvswitch_bootstrap)
    start = time.process_time()
    for reads in streams:
        for data in reads:
            protocol.data_received(data)
    elapsed = time.process_time() - start
    assert not protocol.conn.streams and not protocol.conn.closed and transport.written
    return elapsed / n


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SERVER_CHILD = """
import asyncio, sys, uvloop
sys.path.insert(0, {repo!r})
from benchmarks.epp_request_path import ConstantRouter
from kvswitch.epp.parsers import default_parsers
from kvswitch.epp.contracts import EndpointPicker
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
KVSWITCH_BOOTSTRAP = False


async def drive(port: int, n: int, concurrency: int, prompt_tokens: int) -> None:
    msgs = messages(prompt_tokens, KVSWITCH_BOOTSTRAP)
    if SKIP_RESPONSE_HEADERS:
        msgs = without_response_headers(msgs)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)

        async def one() -> None:
            call = stub.Process()
            await call.write(msgs[0])
            await call.write(msgs[1])
            await call.read()
            await call.read()
            if KVSWITCH_BOOTSTRAP:  # routed: Envoy resets the stream (RST_STREAM CANCEL)
                call.cancel()
                return
            for m in msgs[2:]:
                await call.write(m)
                await call.read()
            await call.done_writing()
            await call.read()

        async def worker(count: int) -> None:
            for _ in range(count):
                await one()

        await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))


def run_server(n: int, concurrency: int, code: str, prompt_tokens: int) -> tuple[float, float]:
    child = subprocess.Popen([sys.executable, "-c", code],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        asyncio.run(drive(port, 200, concurrency, prompt_tokens))  # warm up
        cpu0, wall0 = proc_cpu_seconds(child.pid), time.perf_counter()
        asyncio.run(drive(port, n, concurrency, prompt_tokens))
        cpu1, wall1 = proc_cpu_seconds(child.pid), time.perf_counter()
        return (cpu1 - cpu0) / n, n / (wall1 - wall0)
    finally:
        child.terminate()
        child.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5,
                        help="in-process runs of requests/repeat each; the best is reported")
    parser.add_argument("--server-requests", type=int, default=4000)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved server rounds (0: in-process figures only)")
    parser.add_argument("--transports", default="h2,grpcio", help="EppServer transports to run")
    parser.add_argument("--skip-response-headers", action="store_true",
                        help="drive the server as Envoy does with response_header_mode SKIP")
    parser.add_argument("--kvswitch-bootstrap", action="store_true",
                        help="every figure runs the stream kvswitch's Envoy bootstrap runs for "
                             "a gRPC pool: fewer request headers, no response messages, reset")
    parser.add_argument("--out",
                        default=str(REPO / "benchmarks" / "results" / "epp_request_path.json"))
    args = parser.parse_args()
    global SKIP_RESPONSE_HEADERS, KVSWITCH_BOOTSTRAP
    SKIP_RESPONSE_HEADERS = args.skip_response_headers
    KVSWITCH_BOOTSTRAP = kvswitch = args.kvswitch_bootstrap
    picker = EndpointPicker(parsers=default_parsers(), router=ConstantRouter())
    tokens = args.prompt_tokens
    run_core(picker, 2000, wire=True, prompt_tokens=tokens, kvswitch_bootstrap=kvswitch)  # warm up
    run_h2(picker, 2000, tokens, kvswitch)
    # The in-process figures: the best of `--repeat` runs, as the machine may be shared.
    share = max(1, args.requests // args.repeat)
    core = min(run_core(picker, share, wire=False, prompt_tokens=tokens,
                        kvswitch_bootstrap=kvswitch) for _ in range(args.repeat))
    core_wire = min(run_core(picker, share, wire=True, prompt_tokens=tokens,
                             kvswitch_bootstrap=kvswitch) for _ in range(args.repeat))
    h2_inproc = min(run_h2(picker, share, tokens, kvswitch) for _ in range(args.repeat))
    transports = args.transports.split(",")
    rounds: dict[str, list[tuple[float, float]]] = {t: [] for t in [*transports, "grpc_floor"]}
    for index in range(args.rounds):
        for name, values in rounds.items():
            code = FLOOR_CHILD if name == "grpc_floor" else SERVER_CHILD.format(
                repo=str(REPO), transport=name)
            cpu, rate = run_server(args.server_requests, args.concurrency, code, tokens)
            values.append((cpu, rate))
            print(f"round {index + 1} {name:10s} {cpu * 1e3:.4f} ms CPU/request, "
                  f"{rate:.0f} requests/s", flush=True)
    result: dict[str, object] = {
        "prompt_tokens": tokens,
        "requests": args.requests,
        "core_cpu_ms_per_request": round(core * 1e3, 4),
        "core_wire_cpu_ms_per_request": round(core_wire * 1e3, 4),
        "h2_inproc_cpu_ms_per_request": round(h2_inproc * 1e3, 4),
        "server_requests": args.server_requests,
        "server_concurrency": args.concurrency,
        "rounds": args.rounds,
    }
    for name, values in rounds.items():
        if not values:  # --rounds 0: in-process figures only
            continue
        prefix = name if name == "grpc_floor" else f"server_{name}"
        result[f"{prefix}_cpu_ms_per_request"] = round(
            statistics.median(v[0] for v in values) * 1e3, 4)
        result[f"{prefix}_cpu_ms_per_request_rounds"] = [round(v[0] * 1e3, 4) for v in values]
        if name != "grpc_floor":
            result[f"{prefix}_requests_per_second"] = round(
                statistics.median(v[1] for v in values), 1)
    result.update({
        "skip_response_headers": args.skip_response_headers,
        "kvswitch_bootstrap": kvswitch,
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
