"""Output tokens, logprobs and stop conditions of simulated sequences (sans-IO).

Token choice (`TokenSource`):
- "echo": the prompt's tokens cycled, special tokens left out (a chat prompt is full of
  `<|im_end|>`, which is also eos). Without max_tokens the prompt is echoed once, then eos.
- "random": ids drawn uniformly from the ordinary vocabulary (below the first special id) by a
  per-sequence 64-bit LCG. Its seed is `SamplingOptions.seed` when given (same seed -> same
  output), the prompt alone when temperature == 0 (greedy is deterministic), else the engine
  seed, the prompt and the arrival count. Without max_tokens the output length L is geometric
  with mean `mean_output_len`, P(L = k) = p (1 - p)^(k-1), p = 1 / mean, and its last token is
  eos; with max_tokens the sequence runs to max_tokens.

Stop conditions (`StopChecker`, vLLM's `check_stop` then its detokenizer's stop strings):
length first (max_tokens or the context limit), then nothing before min_tokens, then eos (unless
ignore_eos), stop_token_ids, and stop strings. Output token ids keep the token that completed a
stop string, as vLLM's do (`include_stop_str_in_output` only shapes text, which a token-level
engine does not return; `matched_stop` tells the detokenizing client where to cut).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvswitch.engine.base import SamplingOptions, TokenLogprob
from kvswitch.engine.sim.request import SimSequence
from kvswitch.tokenization import TokenizerBundle

__all__ = ["StopChecker", "TokenSource", "prompt_logprobs", "simulated_logprob"]

_MASK = (1 << 64) - 1
_LCG_A = 6364136223846793005
_LCG_C = 1442695040888963407


def _mix(*parts: int) -> int:
    """A 64-bit seed from ints (tuple hashing of ints is stable across runs)."""
    return hash(parts) & _MASK


class TokenSource:
    """Chooses each sequence's next token."""

    def __init__(
        self,
        mode: str,
        seed: int,
        ordinary_vocab: int,
        eos_token_ids: Sequence[int],
        special_ids: frozenset[int],
        mean_output_len: int,
    ) -> None:
        if mode not in ("echo", "random"):
            raise ValueError(f"unknown simulator mode {mode!r}; use 'echo' or 'random'")
        self.mode = mode
        self.seed = seed
        self.ordinary_vocab = max(1, ordinary_vocab)
        self.eos_token_ids = tuple(eos_token_ids)
        self.special_ids = special_ids
        self.mean_output_len = max(1, mean_output_len)
        self._arrivals = 0

    def init_sequence(self, seq: SimSequence, prompt_key: int, has_max_tokens: bool) -> None:
        """Seed the sequence and plan where it emits eos (`planned_len`, 0 = never)."""
        s = seq.sampling
        self._arrivals += 1
        if s.seed is not None:
            rng = _mix(s.seed, seq.index)
        elif s.temperature == 0.0:
            rng = _mix(prompt_key)
        else:
            rng = _mix(self.seed, prompt_key, self._arrivals, seq.index)
        seq.rng = rng
        eos_allowed = bool(self.eos_token_ids) and not s.ignore_eos and not has_max_tokens
        if self.mode == "echo":
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            echo = [t for t in prompt if t not in self.special_ids] or prompt
            seq.echo = echo
            planned = len(echo) + 1 if eos_allowed else 0
        elif eos_allowed:
            seq.rng, u = _next_unit(seq.rng)
            p = 1.0 / self.mean_output_len
            # Inverse CDF of the geometric distribution on {1, 2, ...}.
            planned = 1 if p >= 1.0 else 1 + int(math.log(1.0 - u) / math.log(1.0 - p))
        else:
            planned = 0
        # eos is masked until min_tokens have been produced (vLLM's min_tokens processor).
        seq.planned_len = max(planned, s.min_tokens + 1) if planned else 0

    def next_token(self, seq: SimSequence) -> int:
        """The token at output position `seq.num_output_tokens` (0-based)."""
        k = len(seq.token_ids) - seq.num_prompt_tokens
        if seq.planned_len and k + 1 >= seq.planned_len:
            return self.eos_token_ids[0]
        echo = seq.echo
        if echo is not None:
            return echo[k % len(echo)]
        seq.rng = state = (seq.rng * _LCG_A + _LCG_C) & _MASK
        return (state >> 33) % self.ordinary_vocab


def _next_unit(state: int) -> tuple[int, float]:
    state = (state * _LCG_A + _LCG_C) & _MASK
    return state, (state >> 11) / float(1 << 53)


def simulated_logprob(token_id: int, position: int, top_k: int, vocab: int) -> TokenLogprob:
    """A plausible, deterministic logprob for `token_id` at `position` and `top_k` alternatives
    (best first, the sampled token leading), shaped like vLLM's sample logprobs."""
    x = ((token_id * 2654435761 + position * 40503) & 0xFFFF) / 65536.0
    lp = -0.05 - 1.5 * x * x
    top: list[tuple[int, float]] = []
    if top_k:
        top.append((token_id, lp))
        for j in range(1, top_k):
            alt = (token_id + j * 7919) % vocab
            top.append((alt, lp - 0.6 * j - x))
    return TokenLogprob(token_id, lp, tuple(top))


def prompt_logprobs(token_ids: Sequence[int], top_k: int, vocab: int) -> list[TokenLogprob | None]:
    """Prompt logprobs as vLLM returns them: none for the first token."""
    out: list[TokenLogprob | None] = [None]
    out.extend(simulated_logprob(t, i, top_k, vocab) for i, t in enumerate(token_ids) if i)
    return out


class StopChecker:
    """vLLM's stop rules; stop strings detokenize a trailing window of the output."""

    def __init__(self, tokenizer: TokenizerBundle | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def check(self, seq: SimSequence, token: int) -> bool:
        """After `token` was appended: set finish_reason / matched_stop and return True if the
        sequence is done."""
        n_out = len(seq.token_ids) - seq.num_prompt_tokens
        if n_out >= seq.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        s = seq.sampling
        if n_out < s.min_tokens:
            return False
        if token == seq.eos_id:
            seq.finish_reason = "stop"
            return True
        if token in seq.stop_ids:
            seq.finish_reason, seq.matched_stop = "stop", token
            return True
        if s.stop and n_out > s.min_tokens:
            matched = self._match_stop_string(seq, s)
            if matched is not None:
                seq.finish_reason, seq.matched_stop = "stop", matched
                return True
        return False

    def _match_stop_string(self, seq: SimSequence, s: SamplingOptions) -> str | None:
        """The stop string completed by the newest token, if any.

        Decodes the last W tokens with and without the newest one (W = longest stop string in
        characters + 2, since a token is at least one character apart from byte pieces) and
        searches only the text the newest token can have completed."""
        if self.tokenizer is None:
            return None
        window = max(len(x) for x in s.stop) + 2
        out = seq.token_ids[seq.num_prompt_tokens :]
        start = max(0, len(out) - window)
        skip = s.skip_special_tokens
        before = self.tokenizer.decode(out[start:-1], skip_special_tokens=skip)
        after = self.tokenizer.decode(out[start:], skip_special_tokens=skip)
        best: tuple[int, str] | None = None
        for stop in s.stop:
            # One character of slack: a byte piece decodes as U+FFFD until completed.
            lo = max(0, len(before) - len(stop))
            pos = after.find(stop, lo)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return None if best is None else best[1]
