"""Request traces as bench workloads: Mooncake's JSONL, replayed with deterministic prompts.

Format (Mooncake FAST'25 traces, one JSON object per line): `timestamp` (ms from the trace's
start), `input_length` and `output_length` (tokens), `hash_ids` (ids of the prompt's 512-token
blocks; equal ids at the same position are the same tokens, so rows sharing leading ids share a
prefix).

Prompts: block id b always becomes the same 512 token ids, single-token words drawn from the
tokenizer's vocabulary (`workloads.word_token_ids`) by a generator seeded with b, so equal ids
share a prefix token for token; the prompt is its blocks' ids cut to `input_length` (a row
longer than its blocks is padded with tokens seeded by the row). Each request asks for exactly
`output_length` tokens (ignore_eos).

Replay: the rows with start <= timestamp/1000 < start + duration are sent at
(timestamp/1000 - start) / speedup. Rows whose input_length + output_length exceed the
profile's `max_model_len` are left out and listed (`TraceWorkload.skipped`, by row number), never
dropped silently.

Ideal prefix-hit ratio (`ideal_hit_ratio`): what an infinite cache shared by every request would
serve, over the replayed rows in order: sum over rows of min(512 x leading block ids seen in an
earlier row, input_length - 1) / sum of input_length (the engine recomputes at least one token).
`ideal_prefix_hit_ratio(requests, block_size)` is the same in the engine's own blocks over token
ids, for any workload (a multi-turn request's answer cached with its prompt).

Limits on hostile input: at most `MAX_ROWS` rows read, lines of at most `MAX_LINE` bytes, lengths
in [1, MAX_TOKENS], at most MAX_TOKENS / 512 + 1 block ids per row; anything else is a
`TraceError` naming the line.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvswitch.bench.workloads import BenchRequest, word_token_ids
from kvswitch.epp.kvindex.hashing import chained_block_hashes
from kvswitch.tokenization import TokenizerBundle

__all__ = [
    "MAX_LINE", "MAX_ROWS", "MAX_TOKENS", "TRACE_BLOCK", "TraceError", "TraceRow",
    "TraceWorkload", "ideal_hit_ratio", "ideal_prefix_hit_ratio", "load_trace", "read_mooncake",
]

TRACE_BLOCK = 512
MAX_ROWS = 1_000_000
MAX_LINE = 1 << 20
MAX_TOKENS = 1 << 20


class TraceError(ValueError):
    """A trace file that cannot be read as Mooncake JSONL (the message names the line)."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    row: int
    """0-based line number among the file's rows."""
    timestamp: float
    """Seconds from the trace's start."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int(value: object, what: str, line: int, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise TraceError(f"line {line}: {what} must be an integer in [{low}, {high}], "
                         f"got {value!r}")
    return value


def read_mooncake(path: Path, max_rows: int = MAX_ROWS) -> list[TraceRow]:
    rows: list[TraceRow] = []
    max_ids = MAX_TOKENS // TRACE_BLOCK + 1
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc}") from exc
    with f:
        for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), 1):
            if len(raw) > MAX_LINE:
                raise TraceError(f"line {number}: longer than {MAX_LINE} bytes")
            if not raw.strip():
                continue
            if len(rows) >= max_rows:
                raise TraceError(f"more than {max_rows} rows")
            try:
                obj = json.loads(raw)
            except ValueError as exc:
                raise TraceError(f"line {number}: not JSON: {exc}") from exc
            if not isinstance(obj, dict):
                raise TraceError(f"line {number}: expected an object")
            ids = obj.get("hash_ids")
            if not isinstance(ids, list) or len(ids) > max_ids:
                raise TraceError(f"line {number}: hash_ids must be a list of at most "
                                 f"{max_ids} ids")
            stamp = obj.get("timestamp")
            if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or stamp < 0:
                raise TraceError(f"line {number}: timestamp must be a number >= 0 (ms)")
            rows.append(TraceRow(
                len(rows), float(stamp) / 1000.0,
                _int(obj.get("input_length"), "input_length", number, 1, MAX_TOKENS),
                _int(obj.get("output_length"), "output_length", number, 1, MAX_TOKENS),
                tuple(_int(i, "hash_ids[]", number, 0, 2**63 - 1) for i in ids)))
    return rows


class _Blocks:
    """Block id -> its 512 token ids, generated on demand (a bounded LRU keeps hot ones)."""

    def __init__(self, tokenizer: TokenizerBundle, seed: int, capacity: int = 4096) -> None:
        self.words = word_token_ids(tokenizer)[0]
        self.seed = seed
        self.capacity = capacity
        self._cache: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def ids(self, block: int) -> tuple[int, ...]:
        cached = self._cache.get(block)
        if cached is not None:
            self._cache.move_to_end(block)
            return cached
        out = tuple(random.Random(block * 1_000_003 + self.seed).choices(self.words,
                                                                          k=TRACE_BLOCK))
        self._cache[block] = out
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return out

    def prompt(self, row: TraceRow) -> tuple[int, ...]:
        out: list[int] = []
        for block in row.hash_ids:
            if len(out) >= row.input_length:
                break
            out.extend(self.ids(block))
        if len(out) < row.input_length:
            pad = random.Random(f"row-{row.row}-{self.seed}")
            out.extend(pad.choices(self.words, k=row.input_length - len(out)))
        return tuple(out[:row.input_length])


def ideal_hit_ratio(rows: Iterable[TraceRow]) -> float | None:
    """Infinite shared cache, in the trace's 512-token blocks (module docstring)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for row in rows:
        lead = 0
        for k in range(1, len(row.hash_ids) + 1):
            if row.hash_ids[:k] not in seen:
                break
            lead = k
        hits += max(0, min(lead * TRACE_BLOCK, row.input_length - 1))
        total += row.input_length
        seen.update(row.hash_ids[:k] for k in range(1, len(row.hash_ids) + 1))
    return hits / total if total else None


def ideal_prefix_hit_ratio(requests: Iterable[BenchRequest], block_size: int = 16
                           ) -> float | None:
    """Infinite shared cache, in the engine's blocks over token ids (chained block hashes), of
    each request's prompt and the answer it asks for (`answer_ids`) but its last token, which
    the engine samples and never computes KV for."""
    seen: set[int] = set()
    hits = total = 0
    for request in requests:
        prompt = request.prompt_ids
        hashes = chained_block_hashes(prompt, block_size)
        lead = 0
        for h in hashes:
            if h not in seen:
                break
            lead += 1
        hits += max(0, min(lead * block_size, len(prompt) - 1))
        total += len(prompt)
        answer = request.answer_ids
        seen.update(chained_block_hashes((*prompt, *answer[:-1]), block_size)
                    if answer else hashes)
    return hits / total if total else None


@dataclass(frozen=True)
class TraceWorkload:
    """A trace slice as a workload (`requests`, `text`, `qps`, `stage_duration` as `Workload`)."""

    source: str
    start: float
    duration: float
    speedup: float
    requests: tuple[BenchRequest, ...]
    tokenizer: TokenizerBundle
    skipped: tuple[int, ...] = ()
    """Rows (0-based) left out: input_length + output_length > max_model_len."""
    ideal_hit_ratio: float | None = None
    qps: tuple[float, ...] = ()
    stage_duration: float = 0.0
    seed: int = 0
    meta: dict[str, object] = field(default_factory=dict)

    def text(self, request: BenchRequest) -> str:
        return self.tokenizer.decode(list(request.prompt_ids))


def load_trace(path: Path, tokenizer: TokenizerBundle, *, start: float = 0.0,
               duration: float | None = None, speedup: float = 1.0, max_model_len: int,
               seed: int = 0, max_requests: int | None = None) -> TraceWorkload:
    """The slice [start, start + duration) trace seconds, replayed `speedup` times faster."""
    if speedup <= 0:
        raise TraceError("speedup must be > 0")
    if start < 0 or (duration is not None and duration <= 0):
        raise TraceError("start must be >= 0 and duration > 0")
    rows = [r for r in read_mooncake(path)
            if r.timestamp >= start and (duration is None or r.timestamp < start + duration)]
    if max_requests is not None:
        rows = rows[:max_requests]
    fits = [r for r in rows if r.input_length + r.output_length <= max_model_len]
    skipped = tuple(r.row for r in rows if r.input_length + r.output_length > max_model_len)
    span = duration if duration is not None else (
        max((r.timestamp for r in rows), default=start) - start)
    wall = max(span / speedup, 1e-9)
    rate = len(fits) / wall if fits else 0.0
    blocks = _Blocks(tokenizer, seed)
    requests = tuple(
        BenchRequest(i, 0, rate, (r.timestamp - start) / speedup, 0, r.row, blocks.prompt(r),
                     r.output_length, 0)
        for i, r in enumerate(fits))
    return TraceWorkload(str(path), start, span, speedup, requests, tokenizer, skipped,
                         ideal_hit_ratio(fits), (rate,), wall, seed,
                         {"rows": len(rows), "replayed": len(fits), "skipped": len(skipped)})
