"""Per-request log of an engine: one JSON line per finished Generate, like vLLM's request metrics.

`kvswitch engine --request-log PATH` appends a `RequestRecord` per request that ended (finished,
aborted or failed). Latencies are on the engine's clock (`Engine.now`: simulated seconds for the
simulator), so a benchmark can measure routing quality from the engines themselves, whatever
stands between its client and the engines (Envoy + EPP, SMG, nothing) and however loaded the
machine is. Wall times (`time.time()`) sit beside them, so records can be bucketed into a
benchmark's wall-clock windows, and so the simulator's clock slip can be measured: between two
arrivals on one engine, `(wall_2 - wall_1) x time_scale - (arrival_2 - arrival_1)` is the
simulated time the clock dropped because Python fell behind (it moves its anchor instead of
bursting steps).

Cheap by design: `append` only buffers a line; a timer writes the buffer every `flush_interval`
wall seconds (one write per interval), and `close()` writes the rest at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

__all__ = ["RequestLog", "RequestRecord", "read_records"]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    """The GenerateRequest's request_id (as the client or gateway sent it)."""
    arrival_wall: float
    """Wall-clock time (time.time()) when the Generate call arrived."""
    finish_wall: float
    """Wall-clock time when the servicer saw the request end."""
    arrival: float
    """Engine clock at arrival (simulated seconds since the engine started)."""
    e2e_s: float
    """Arrival to the last output (engine seconds)."""
    ttft_s: float | None
    """Arrival to the first output token; None when no token was produced."""
    queue_s: float | None
    """Arrival to the first scheduled step (vllm:request_queue_time_seconds); None if unknown."""
    itl_s: float | None
    """Mean seconds between output tokens after the first: (last - first) / (tokens - 1)."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    completion_tokens: int
    finish_reason: str
    """stop | length | abort (client gone, Abort, deadline) | error."""
    stream: bool
    """Whether the client asked for streamed output."""
    preemptions: int | None = None
    """Times the request was preempted; None when the backend does not tell."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def read_records(path: Path, offset: int = 0) -> tuple[list[RequestRecord], int]:
    """Records from byte `offset` on, and the offset after the last complete line (a line still
    being written is left for the next read)."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    records = [RequestRecord(**json.loads(line)) for line in data[:end].splitlines() if line]
    return records, offset + end


class RequestLog:
    """Buffered JSON-lines writer; `start()` on the event loop, `close()` at shutdown."""

    def __init__(self, path: Path, flush_interval: float = 1.0) -> None:
        self.path = path
        self.flush_interval = flush_interval
        self._buffer: list[str] = []
        self._file: IO[str] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._task = asyncio.get_running_loop().create_task(self._flush_periodically())

    def append(self, record: RequestRecord) -> None:
        self._buffer.append(record.to_json())

    def flush(self) -> None:
        if self._buffer and self._file is not None:
            lines, self._buffer = self._buffer, []
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            self.flush()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __repr__(self) -> str:
        return f"RequestLog({str(self.path)!r}, buffered={len(self._buffer)})"

