"""One sequence as the scheduler sees it (vLLM's `Request`, one per output index when n > 1)."""

from __future__ import annotations

import enum
from typing import Any

from kvswitch.engine.base import SamplingOptions, TokenLogprob

__all__ = ["SeqStatus", "SimSequence"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class SimSequence:
    """Mutable per-sequence state. Slots and plain ints: the scheduler touches every running
    sequence on every step, so this object is the hot path."""

    __slots__ = (
        "block_hashes",
        "blocks",
        "echo",
        "eos_id",
        "finish_reason",
        "index",
        "last_logprob",
        "matched_stop",
        "max_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_scheduled",
        "owner",
        "planned_len",
        "rng",
        "sampling",
        "seq_id",
        "status",
        "stop_ids",
        "token_ids",
        "waiting_estimate",
    )

    def __init__(
        self,
        seq_id: str,
        index: int,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        max_tokens: int,
        owner: Any = None,
    ) -> None:
        self.seq_id = seq_id
        self.index = index
        self.owner = owner
        """The engine's handle for the request this sequence belongs to."""
        self.token_ids = list(prompt_token_ids)
        """Prompt then output tokens."""
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        """Tokens whose KV is in the cache (computed or prefix hits)."""
        self.num_cached_tokens = -1
        """Prefix-cache hit at first admission; -1 until admitted."""
        self.num_scheduled = 0
        self.block_hashes: list[int] = []
        self.blocks: list[int] = []
        self.num_cached_blocks = 0
        """Leading blocks of `blocks` already registered in the prefix cache."""
        self.status = SeqStatus.WAITING
        self.sampling = sampling
        self.max_tokens = max_tokens
        """Resolved output budget (max_tokens, or what the context leaves)."""
        self.stop_ids: frozenset[int] = frozenset()
        """Ids that stop with matched_stop = the id (stop_token_ids + secondary eos ids)."""
        self.eos_id = -1
        """The primary eos id (stops with matched_stop None); -1 when ignored."""
        self.rng = 0
        self.planned_len = 0
        """Output length after which the sampler emits eos; 0 = never."""
        self.echo: list[int] | None = None
        self.last_logprob: TokenLogprob | None = None
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None
        self.num_preemptions = 0
        self.waiting_estimate = 0
        """Uncached tokens this sequence added to the waiting-queue estimate."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"SimSequence({self.seq_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.blocks)})"
        )
