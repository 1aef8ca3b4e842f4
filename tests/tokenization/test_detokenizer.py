"""The incremental detokenizers reproduce `tokenizer.decode` exactly, however ids are chunked."""

from __future__ import annotations

import random

import pytest

from kvswitch.tokenization import load_tokenizer
from kvswitch.tokenization.detokenizer import (
    DecodeTable,
    StopStringMatcher,
    new_detokenizer,
)

BUNDLE = load_tokenizer(None)
TOKENIZER = BUNDLE.tokenizer
TABLE = DecodeTable(TOKENIZER)
SAMPLES = [
    "héllo wörld",
    "你好，世界！这是一个测试。",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>",
    "mixed Ελληνικά русский العربية हिन्दी 日本語",
]


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        step = rng.choice([1, 1, 1, 2, 3, 7])
        out.append(ids[i:i + step])
        i += step
    return out


def _stream(ids: list[int], skip: bool, use_table: bool, rng: random.Random
            ) -> tuple[str, list[str]]:
    detok = new_detokenizer(TOKENIZER, TABLE if use_table else None, skip_special_tokens=skip)
    deltas = [detok.push(chunk) for chunk in _chunks(ids, rng)]
    deltas.append(detok.flush())
    return "".join(deltas), deltas


def test_the_bundled_tokenizer_uses_the_table() -> None:
    assert DecodeTable.supports(TOKENIZER)


@pytest.mark.parametrize("use_table", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_text_round_trips(use_table: bool, skip: bool) -> None:
    rng = random.Random(1)
    for text in SAMPLES:
        ids = BUNDLE.encode(text)
        joined, deltas = _stream(ids, skip, use_table, rng)
        assert joined == TOKENIZER.decode(ids, skip_special_tokens=skip)
        # An incomplete character is held back, never sent as a replacement character.
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("use_table", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_random_id_sequences_match_decode(use_table: bool, skip: bool) -> None:
    rng = random.Random(7 + skip)
    special = sorted(BUNDLE.special_token_ids)
    # Ids of multi-byte pieces (CJK, emoji fragments) make split characters likely.
    multibyte = [i for i in range(0, 151643, 97) if len(TABLE.with_special[i]) and
                 TABLE.with_special[i][0] >= 0x80]
    for _ in range(150 if use_table else 40):
        length = rng.randint(1, 40)
        ids = [rng.choice([rng.randrange(151669), rng.choice(multibyte), rng.choice(multibyte),
                           rng.choice(special)]) for _ in range(length)]
        joined, _ = _stream(ids, skip, use_table, rng)
        assert joined == TOKENIZER.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("use_table", [True, False])
def test_a_sequence_ending_inside_a_character_ends_as_decode_does(use_table: bool) -> None:
    ids = BUNDLE.encode("ab \U0001d11e")[:-1]  # the last token would complete the character
    detok = new_detokenizer(TOKENIZER, TABLE if use_table else None, skip_special_tokens=True)
    sent = "".join(detok.push([i]) for i in ids)
    full = TOKENIZER.decode(ids, skip_special_tokens=True)
    assert full.endswith("\ufffd") and "\ufffd" not in sent  # held back while it could complete
    assert sent + detok.flush() == full  # and sent at the end, as decode has it


def test_out_of_vocabulary_ids_decode_to_nothing() -> None:
    ids = BUNDLE.encode("ab") + [151900] + BUNDLE.encode("c")
    joined, _ = _stream(ids, True, True, random.Random(0))
    assert joined == TOKENIZER.decode(ids, skip_special_tokens=True) == "abc"


def _feed_all(matcher: StopStringMatcher, parts: list[str]) -> str:
    return "".join(matcher.feed(p) for p in parts) + matcher.finish()


@pytest.mark.parametrize("parts", [["hello wor", "ld STOP here"], ["hello world S", "TO", "P here"],
                                   ["hello world STOP here"], ["h", "e", "llo world ST", "OP"]])
def test_stop_string_cuts_across_deltas(parts: list[str]) -> None:
    cut = StopStringMatcher(["STOP"], include_stop_str_in_output=False)
    assert _feed_all(cut, parts) == "hello world "
    assert cut.matched == "STOP"
    kept = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert _feed_all(kept, parts) == "hello world STOP"


def test_earliest_stop_string_wins_and_absent_stops_release_everything() -> None:
    m = StopStringMatcher(["xyz", "wor"], include_stop_str_in_output=False)
    assert _feed_all(m, ["hello world xyz"]) == "hello "
    assert m.matched == "wor"
    none = StopStringMatcher(["zzz"], include_stop_str_in_output=False)
    assert _feed_all(none, ["hello", " world", " z"]) == "hello world z"
    assert none.matched is None
