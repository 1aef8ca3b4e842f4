"""Incremental detokenization: kvswitch's detokenizers against `tokenizers`' DecodeStream.

`kvswitch_table` (`ByteLevelDetokenizer`, used for byte-level BPE tokenizers), `kvswitch_stream`
(`StreamDetokenizer`, used for any other decoder: DecodeStream plus an end of stream) and
`decode_stream` (`tokenizers.decoders.DecodeStream` alone) turn streamed token ids into text deltas
with the bundled Qwen3 tokenizer. Two measures:

- exactness: for each sequence, whether the concatenated deltas (plus the end of the stream)
  equal `tokenizer.decode(ids)`, and whether any delta shows a "\\ufffd" that the full decode
  does not hold (a split UTF-8 character sent too early). Sequences: real text of several
  scripts and emoji encoded and decoded back, and random ids (byte tokens that split
  characters, special tokens), with skip_special_tokens on and off.
- speed: CPU per token (`time.process_time`) over the same sequences, pushing 1 token at a
  time (a stream read per token) and 8 at a time (a batch of deltas), best of `--rounds`.

The engine sends token ids; the frontend detokenizes every streamed token, so this is its hot
path. Prints and saves JSON.

    .venv/bin/python benchmarks/detokenizer_stream.py \\
        --out benchmarks/results/detokenizer_stream.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvswitch.tokenization.bundle import load_tokenizer
from kvswitch.tokenization.detokenizer import DecodeTable, new_detokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 8,
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n" * 4,
    "東京は日本の首都です。人口は約千四百万人です。" * 6,
    "Привет, мир! Как дела? Всё хорошо. " * 6,
    "مرحبا بالعالم، كيف حالك اليوم؟ " * 6,
    "emoji 😀🎉👩‍👩‍👧‍👦🏳️‍🌈 and flags 🇯🇵🇫🇷 mixed with text. " * 6,
    "नमस्ते दुनिया, आप कैसे हैं? " * 6,
]

Run = Callable[[Sequence[int], int, bool], list[str]]


def run_kvswitch(tokenizer: Tokenizer, table: DecodeTable | None) -> Run:
    def run(ids: Sequence[int], step: int, skip: bool) -> list[str]:
        detok = new_detokenizer(tokenizer, table, skip_special_tokens=skip)
        out = [detok.push(ids[i:i + step]) for i in range(0, len(ids), step)]
        out.append(detok.flush())
        return out
    return run


def run_decode_stream(tokenizer: Tokenizer) -> Run:
    def run(ids: Sequence[int], step: int, skip: bool) -> list[str]:
        stream = DecodeStream(skip_special_tokens=skip)
        out = []
        for i in range(0, len(ids), step):
            chunk = stream.step(tokenizer, list(ids[i:i + step]) if step > 1 else ids[i])
            out.append(chunk or "")
        return out  # DecodeStream has no end-of-stream call: what it holds back is lost
    return run


def sequences(tokenizer: Tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    out = [tokenizer.encode(text, add_special_tokens=False).ids for text in TEXTS]
    for _ in range(count):
        out.append([rng.randrange(size) for _ in range(length)])
    return out


def exactness(tokenizer: Tokenizer, run: Run, seqs: list[list[int]]) -> dict[str, Any]:
    exact = early_replacement = total = 0
    for ids in seqs:
        for skip in (True, False):
            for step in (1, 8):
                total += 1
                deltas = run(ids, step, skip)
                full = tokenizer.decode(ids, skip_special_tokens=skip)
                exact += "".join(deltas) == full
                early_replacement += any("\ufffd" in d for d in deltas) and "\ufffd" not in full
    return {"cases": total, "exact": exact, "early_replacement": early_replacement}


def cpu_per_token_us(run: Run, seqs: list[list[int]], step: int, rounds: int) -> float:
    tokens = sum(len(s) for s in seqs)
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for ids in seqs:
            run(ids, step, True)
        best = min(best, time.process_time() - start)
    return round(best / tokens * 1e6, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-sequences", type=int, default=200)
    parser.add_argument("--length", type=int, default=256, help="tokens per random sequence")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/detokenizer_stream.json")
    args = parser.parse_args()

    bundle = load_tokenizer(None)
    tokenizer = bundle.tokenizer
    table = DecodeTable(tokenizer) if DecodeTable.supports(tokenizer) else None
    seqs = sequences(tokenizer, args.random_sequences, args.length, args.seed)
    runs = {"kvswitch_table": run_kvswitch(tokenizer, table),
            "kvswitch_stream": run_kvswitch(tokenizer, None),
            "decode_stream": run_decode_stream(tokenizer)}
    summary: dict[str, Any] = {"args": vars(args), "tokens": sum(len(s) for s in seqs)}
    for name, run in runs.items():
        summary[name] = {
            "exactness": exactness(tokenizer, run, seqs),
            "cpu_us_per_token_step1": cpu_per_token_us(run, seqs, 1, args.rounds),
            "cpu_us_per_token_step8": cpu_per_token_us(run, seqs, 8, args.rounds),
        }
    print(json.dumps(summary, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
