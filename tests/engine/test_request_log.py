"""`kvswitch engine --request-log`: one JSON line per ended request, in the engine's clock."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from kvswitch.engine.request_log import RequestLog, RequestRecord, read_records
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc
from tests.support.processes import free_port, kvswitch_argv, running


def _record(request_id: str) -> RequestRecord:
    return RequestRecord(request_id, 1.0, 2.0, 0.5, 3.0, 0.25, 0.125, 0.01, 100, 64, 10,
                         "length", False)


async def test_lines_are_buffered_until_the_timer_or_close(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path, flush_interval=0.05)
    log.start()
    log.append(_record("a"))
    assert path.read_text() == ""  # buffered, not written per request
    await asyncio.sleep(0.15)
    assert [r.request_id for r in read_records(path)[0]] == ["a"]
    log.append(_record("b"))
    await log.close()
    records, offset = read_records(path)
    assert records == [_record("a"), _record("b")] and offset == path.stat().st_size


def test_a_partial_last_line_is_left_for_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    whole = _record("a").to_json() + "\n"
    path.write_text(whole + _record("b").to_json()[:20])
    records, offset = read_records(path)
    assert [r.request_id for r in records] == ["a"] and offset == len(whole)
    path.write_text(whole + _record("b").to_json() + "\n")
    assert [r.request_id for r in read_records(path, offset)[0]] == ["b"]


def _request(rid: str, ids: list[int], max_tokens: int, stream: bool) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=rid, stream=stream, sampling_params=pb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    request.tokenized.input_ids.extend(ids)
    return request


async def _finish(stub: vllm_engine_pb2_grpc.VllmEngineStub, request: pb.GenerateRequest
                  ) -> list[pb.GenerateResponse]:
    return [m async for m in stub.Generate(request)]


async def _records(path: Path, want: int, timeout: float = 10.0) -> dict[str, RequestRecord]:
    deadline = time.monotonic() + timeout
    while True:
        records = read_records(path)[0] if path.exists() else []
        if len(records) >= want or time.monotonic() > deadline:
            return {r.request_id: r for r in records}
        await asyncio.sleep(0.1)


@pytest.mark.timeout(60)
async def test_engine_logs_each_request_in_its_own_clock(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "requests.jsonl"
    scale = 1.0
    # tiny: 4 sequences at a time, so the 5th and 6th concurrent requests queue.
    argv = kvswitch_argv("engine", "--port", str(port), "--profile", "tiny", "--time-scale",
                         f"{scale:g}", "--grace-period", "5", "--request-log", str(log))
    started = time.time()
    with running(argv, port, tmp_path / "engine.log") as process:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            prompt = list(range(100, 164))  # 4 full blocks of 16
            await _finish(stub, _request("warm", prompt, 8, stream=False))
            # 100 tokens ~ 0.12 s each: the six overlap even if their arrivals spread out.
            await asyncio.gather(*(_finish(stub, _request(f"q{i}", prompt, 100, stream=i % 2 == 0))
                                   for i in range(6)))
            cancelled = stub.Generate(_request("gone", list(range(500, 540)), 200, stream=True))
            await cancelled.read()
            cancelled.cancel()
            by_id = await _records(log, 8)
        # Written at shutdown too: nothing is lost between the last timer tick and SIGTERM.
        assert process.stop() == 0
    by_id = {r.request_id: r for r in read_records(log)[0]}
    assert set(by_id) == {"warm", "gone", *(f"q{i}" for i in range(6))}
    for rid in (f"q{i}" for i in range(6)):
        r = by_id[rid]
        assert (r.prompt_tokens, r.completion_tokens, r.finish_reason) == (64, 100, "length")
        assert r.stream == (rid in ("q0", "q2", "q4"))
        assert r.preemptions is not None  # the simulator tells (0 unless KV ran out)
        assert r.cached_tokens == 48  # the warm-up's first 3 blocks (the last token is recomputed)
        assert started <= r.arrival_wall <= r.finish_wall <= time.time()
        assert r.queue_s is not None and r.ttft_s is not None and r.itl_s is not None
        assert 0 <= r.queue_s < r.ttft_s < r.e2e_s
        assert r.itl_s == pytest.approx((r.e2e_s - r.ttft_s) / 99)
        # Engine seconds run `scale` times faster than the wall clock (the clock did not slip
        # by more than a few steps on an idle 2-second run).
        assert r.e2e_s <= (r.finish_wall - r.arrival_wall) * scale + 0.05
    queued = sorted(by_id[f"q{i}"].queue_s or 0.0 for i in range(6))
    assert queued[-1] > 0.01 > queued[0]  # two of six waited for a free sequence slot
    gone = by_id["gone"]
    assert gone.finish_reason == "abort" and 1 <= gone.completion_tokens < 200
    # Arrivals on the engine clock advance like the wall clock x scale, less any slip (time the
    # clock dropped when Python fell behind, e.g. on a loaded machine); it never runs ahead.
    warm, last = by_id["warm"], by_id["gone"]
    span = (last.arrival_wall - warm.arrival_wall) * scale
    slip = span - (last.arrival - warm.arrival)
    assert -0.01 < slip < span
