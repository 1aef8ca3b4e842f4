"""Benchmark workloads: inference-perf's `shared_prefix` shape, Poisson arrivals, a QPS ladder.

Shape (inference-perf `shared_prefix`): `num_groups` system prompts of `system_prompt_len`
tokens; each group has `num_prompts_per_group` users, each asking questions of `question_len`
tokens; every request asks for exactly `output_len` tokens (ignore_eos). A request picks a
(group, user) uniformly at random. Single-turn: the prompt is system + that user's question.
Multi-turn (inference-perf's user sessions): each user keeps a conversation; turn t's prompt is
system + (question, answer) of turns < t + a new question. Turn t waits for turn t - 1 to end
(`BenchRequest.previous`: sent at its arrival time or when the previous turn ends, whichever is
later), and its answer is `output_len` tokens of words the request asks the engine to say
(`BenchRequest.answer_ids`, a structured-output choice), so the next turn's history holds the
engine's own output and every target sees the same prompts. A conversation starts over when its
prompt would pass `max_context` tokens.

Prompts are real text made with the real tokenizer: a sequence of single-token words (" word")
and full stops drawn from the tokenizer's own vocabulary, so the text tokenizes back to exactly
the token ids (lengths are exact in both tokenized and text mode).

Arrivals: a QPS ladder of stages, each `stage_duration` simulated seconds at its rate, in one of
`ARRIVALS`:
- "poisson": one request at a time, exponential gaps of mean 1 / rate;
- "bursts": bursts of B requests at the same instant, B uniform in [burst_min, burst_max]
  (default 10-50), the bursts themselves Poisson at rate / mean(B), so the stage's mean rate is
  the same (agent fan-out, batch jobs, retries).
All times here are simulated seconds; the runner divides them by the time scale.
The seed makes prompts, picks and arrival times repeatable.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvswitch.tokenization import TokenizerBundle

ARRIVALS = ("poisson", "bursts")


@dataclass(frozen=True, slots=True)
class Arrivals:
    kind: str = "poisson"
    """One of ARRIVALS."""
    burst_min: int = 10
    burst_max: int = 50

    def __post_init__(self) -> None:
        if self.kind not in ARRIVALS:
            raise ValueError(f"unknown arrivals {self.kind!r}; use one of {ARRIVALS}")
        if not 1 <= self.burst_min <= self.burst_max <= 10_000:
            raise ValueError("bursts need 1 <= burst_min <= burst_max <= 10000")


@dataclass(frozen=True, slots=True)
class SharedPrefixShape:
    num_groups: int
    num_prompts_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int
    multi_turn: bool = False
    max_context: int = 32_768
    """Multi-turn only: start a conversation over before its prompt passes this many tokens."""


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    shape: SharedPrefixShape
    qps: tuple[float, ...]
    """The default QPS ladder (simulated requests per simulated second)."""
    stage_duration: float
    """Default simulated seconds per ladder stage."""
    description: str = ""
    stream: bool = False
    """Default for `--stream`: shared-prefix runs send non-streamed requests (one message per
    request through the gateway and client; TTFT from the engines' request logs)."""
    time_scale: float = 1.0
    """Default for `--time-scale`: what 8 replicas of this shape sustain on 2 cores."""


PRESETS: dict[str, Preset] = {p.name: p for p in (
    # llm-d's run used 3,10,15,20,22,25,30,40,50,60 QPS x 50 s (inference-perf drains each
    # stage); on 2 cores that is hours. This ladder keeps what matters: 60-s steps (3-4 request
    # durations, so queues reach steady growth) and QPS from well under to well past round
    # robin's capacity (~13 QPS on 8 qwen3-32b-2xh100 replicas, KV-bound) up to about where
    # precise routing still holds (~30).
    Preset("shared-prefix-150x5-6000-1200-1000",
           SharedPrefixShape(150, 5, 6000, 1200, 1000), (6, 12, 18, 24, 30), 60.0,
           "llm-d's precise-prefix benchmark shape"),
    Preset("shared-prefix-150x5-1000-6200-1000",
           SharedPrefixShape(150, 5, 1000, 6200, 1000), (3, 10, 20, 30, 40, 60), 50.0,
           "long unique questions behind a short shared prefix"),
    Preset("multi-turn-6x1000-1000-30-1000",
           SharedPrefixShape(6, 1000, 1000, 30, 1000, multi_turn=True), (3, 10, 20, 30), 50.0,
           "6 groups x 1000 users, short questions, conversations"),
    Preset("multi-turn-6x1000-1000-3000-1000",
           SharedPrefixShape(6, 1000, 1000, 3000, 1000, multi_turn=True), (3, 10, 20, 30), 50.0,
           "6 groups x 1000 users, long questions, conversations"),
    Preset("tiny", SharedPrefixShape(4, 4, 256, 32, 16), (4.0, 8.0), 5.0,
           "CI smoke test: 4 groups of 256-token system prompts", stream=True, time_scale=4.0),
)}


@dataclass(frozen=True, slots=True)
class BenchRequest:
    index: int
    stage: int
    """Index into the QPS ladder."""
    qps: float
    send_at: float
    """Simulated seconds from the start of the run."""
    group: int
    user: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    prefix_len: int
    """Tokens shared with the group (the system prompt)."""
    previous: int = -1
    """Multi-turn: the index of the conversation's previous turn, which ends before this one is
    sent (-1: none)."""
    answer_ids: tuple[int, ...] = ()
    """Multi-turn: the answer the engine is asked to give (all `max_tokens` of it), which the
    conversation's next turn carries in its history; empty: any output."""


@dataclass(frozen=True)
class Workload:
    shape: SharedPrefixShape
    qps: tuple[float, ...]
    stage_duration: float
    seed: int
    requests: tuple[BenchRequest, ...]
    tokenizer: TokenizerBundle

    def text(self, request: BenchRequest) -> str:
        """The prompt as text; it tokenizes back to exactly `request.prompt_ids`."""
        return self.tokenizer.decode(list(request.prompt_ids))

    def stage_requests(self, stage: int) -> list[BenchRequest]:
        return [r for r in self.requests if r.stage == stage]


def answer_text(request: BenchRequest, tokenizer: TokenizerBundle) -> str | None:
    """The answer `request` asks for, as text (it tokenizes back to exactly
    `request.answer_ids`); None when it asks for none."""
    return tokenizer.decode(list(request.answer_ids)) if request.answer_ids else None


_WORDS: dict[int, tuple[tuple[int, ...], int]] = {}


def word_token_ids(tokenizer: TokenizerBundle) -> tuple[tuple[int, ...], int]:
    """Ids of common single-token lowercase words with a leading space, and the id of '.'."""
    key = id(tokenizer.tokenizer)
    if key not in _WORDS:
        vocab = tokenizer.tokenizer.get_vocab()
        # Lower ids are earlier BPE merges: the commoner words.
        words = sorted(i for t, i in vocab.items() if re.fullmatch(r"Ġ[a-z]{3,9}", t))[:8000]
        _WORDS[key] = (tuple(words), vocab["."])
    return _WORDS[key]


def random_text_ids(tokenizer: TokenizerBundle, length: int, rng: random.Random) -> list[int]:
    """`length` token ids of words and full stops (about one sentence per 12 words)."""
    words, period = word_token_ids(tokenizer)
    out: list[int] = []
    for _ in range(length):
        previous_is_word = bool(out) and out[-1] != period
        out.append(period if previous_is_word and rng.random() < 0.08 else rng.choice(words))
    return out


class _Conversations:
    """Multi-turn state per (group, user): the history after the system prompt and the index of
    the conversation's last turn."""

    def __init__(self, shape: SharedPrefixShape, tokenizer: TokenizerBundle, rng: random.Random):
        self.shape, self.tokenizer, self.rng = shape, tokenizer, rng
        self.history: dict[tuple[int, int], list[int]] = {}
        self.last: dict[tuple[int, int], int] = {}

    def next_turn(self, system: list[int], group: int, user: int, index: int
                  ) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
        """Request `index` as the conversation's next turn: its prompt, the index of the turn
        before it (-1: none) and the answer it asks for."""
        shape = self.shape
        history = self.history.setdefault((group, user), [])
        turn = shape.question_len + shape.output_len
        if len(system) + len(history) + turn > shape.max_context:
            history.clear()
        question = random_text_ids(self.tokenizer, shape.question_len, self.rng)
        prompt = (*system, *history, *question)
        answer = tuple(random_text_ids(self.tokenizer, shape.output_len, self.rng))
        history.extend(question)
        history.extend(answer)
        previous = self.last.get((group, user), -1)
        self.last[(group, user)] = index
        return prompt, previous, answer


def build_workload(shape: SharedPrefixShape, qps: Sequence[float], stage_duration: float,
                   tokenizer: TokenizerBundle, seed: int = 0,
                   max_requests: int | None = None,
                   arrivals_shape: Arrivals = Arrivals()) -> Workload:
    """Every request of the run, in send order (repeatable for a seed)."""
    rng = random.Random(seed)
    systems = [random_text_ids(tokenizer, shape.system_prompt_len, rng)
               for _ in range(shape.num_groups)]
    questions = {(g, u): random_text_ids(tokenizer, shape.question_len, rng)
                 for g in range(shape.num_groups) for u in range(shape.num_prompts_per_group)}
    conversations = _Conversations(shape, tokenizer, rng)
    arrivals = random.Random(seed + 1)
    requests: list[BenchRequest] = []
    start = 0.0
    bursts = arrivals_shape.kind == "bursts"
    mean_burst = (arrivals_shape.burst_min + arrivals_shape.burst_max) / 2 if bursts else 1.0
    for stage, rate in enumerate(qps):
        t = start
        full = False
        while not full:
            t += arrivals.expovariate(rate / mean_burst)
            if t >= start + stage_duration:
                break
            size = (arrivals.randint(arrivals_shape.burst_min, arrivals_shape.burst_max)
                    if bursts else 1)
            for _ in range(size):
                if max_requests and len(requests) >= max_requests:
                    full = True
                    break
                group = arrivals.randrange(shape.num_groups)
                user = arrivals.randrange(shape.num_prompts_per_group)
                previous, answer = -1, tuple[int, ...]()
                if shape.multi_turn:
                    prompt, previous, answer = conversations.next_turn(
                        systems[group], group, user, len(requests))
                else:
                    prompt = (*systems[group], *questions[(group, user)])
                requests.append(BenchRequest(len(requests), stage, float(rate), t, group, user,
                                             prompt, shape.output_len, shape.system_prompt_len,
                                             previous, answer))
        start += stage_duration
    return Workload(shape, tuple(float(q) for q in qps), stage_duration, seed, tuple(requests),
                    tokenizer)
