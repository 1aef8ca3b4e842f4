"""CPU cost of the gRPC client's receive path per streamed message, in process.

What the frontend pays per token on its Generate streams: reads of `--per-read` streamed
messages of `--message-bytes` each (one DATA frame per message, as an engine sends them) fed
to `kvswitch.protocol.h2client`'s connection (`data_received`, a null transport, no socket),
each read followed by the `read_batch()` that takes its messages; and (`core_cpu_us_per_message`)
the same reads fed to the sans-IO core alone (`H2ClientConnection.receive`: frames, windows,
message cutting, events). Reported as CPU µs per message, the best of `--repeat` runs (the
machine is shared); printed and saved as JSON.

    .venv/bin/python benchmarks/h2client_receive_path.py [--messages 80000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import time

from kvswitch.protocol import h2client
from kvswitch.protocol.h2client_core import H2ClientConnection
from kvswitch.protocol.http2 import DATA, END_HEADERS, HEADERS, SETTINGS, frame, hpack_literal


class _NullTransport:
    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


async def run(messages: int, per_read: int, message_bytes: int) -> float:
    conn = h2client._Connection("bench:1")
    conn.connection_made(_NullTransport())  # type: ignore[arg-type]
    call = conn.start("/x.Y/Z", (), b"", bytes)
    conn.data_received(frame(SETTINGS, 0, 0)
                       + frame(HEADERS, END_HEADERS, 1, hpack_literal(":status", "200")))
    message = b"\x00" + struct.pack(">I", message_bytes) + b"t" * message_bytes
    read = frame(DATA, 0, 1, message) * per_read
    reads = messages // per_read
    start = time.process_time()
    for _ in range(reads):
        conn.data_received(read)
        await call.read_batch()
    return (time.process_time() - start) / (reads * per_read)


def run_core(messages: int, per_read: int, message_bytes: int) -> float:
    conn = H2ClientConnection("bench:1")
    conn.initiate()
    conn.start_call("/x.Y/Z", (), b"")
    conn.receive(frame(SETTINGS, 0, 0)
                 + frame(HEADERS, END_HEADERS, 1, hpack_literal(":status", "200")))
    message = b"\x00" + struct.pack(">I", message_bytes) + b"t" * message_bytes
    read = frame(DATA, 0, 1, message) * per_read
    reads = messages // per_read
    receive = conn.receive
    start = time.process_time()
    for _ in range(reads):
        receive(read)
    return (time.process_time() - start) / (reads * per_read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=80_000)
    parser.add_argument("--per-read", type=int, default=4)
    parser.add_argument("--message-bytes", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    best = min(asyncio.run(run(args.messages, args.per_read, args.message_bytes))
               for _ in range(args.repeat))
    core = min(run_core(args.messages, args.per_read, args.message_bytes)
               for _ in range(args.repeat))
    result = {"messages": args.messages, "per_read": args.per_read,
              "message_bytes": args.message_bytes, "repeat": args.repeat,
              "cpu_us_per_message": round(best * 1e6, 4),
              "core_cpu_us_per_message": round(core * 1e6, 4),
              "load_average_1m": os.getloadavg()[0], "python": sys.version.split()[0]}
    for key, value in result.items():
        print(f"{key:<24} {value}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=2)
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
