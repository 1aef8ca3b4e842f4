"""SimConfig: how to build one simulated engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvswitch.engine.sim.events import COALESCE_SECONDS, LOAD_PUSH_SECONDS, MAX_EVENTS
from kvswitch.engine.sim.profiles import SimProfile, derived_blocks, get_profile

__all__ = ["FAILURE_KINDS", "MODES", "SimConfig"]

MODES = ("echo", "random")

FAILURE_KINDS = ("internal", "unavailable", "abort")
"""Injected failures, each hitting a request with probability `failure_rate`:
- "internal": iterating generate() raises `InternalError` before any output (gRPC INTERNAL);
- "unavailable": it raises `Unavailable` (gRPC UNAVAILABLE), as an overloaded server would;
- "abort": the request runs, then ends with finish_reason "abort" right after its first token.
"""


@dataclass(frozen=True)
class SimConfig:
    served_model_name: str = "Qwen/Qwen3-0.6B"
    tokenizer_dir: str | None = None
    """None: the bundled Qwen3 tokenizer."""
    profile: str = "llama3-8b-h100"
    step_model: str | None = None
    """"roofline" or "linear" (see `profiles`); None: the profile's own."""
    time_scale: float = 1.0
    """Simulated seconds per real second (100: a 10 ms step takes 0.1 ms)."""
    mode: str = "random"
    """"echo" (the prompt's tokens, cycled) or "random" (seeded); see `sampler`."""
    seed: int = 0
    max_model_len: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    """None, for each of the five above: the profile's value."""
    mean_output_len: int = 256
    """Random mode without max_tokens: mean of the geometric output length (ends with eos)."""
    embedding_dim: int = 1024
    failure_rate: float = 0.0
    failure_kind: str = "internal"
    """One of FAILURE_KINDS."""
    kv_event_history: int = 4096
    """KV event batches kept for replay by `kv_events(start_sequence_number)`."""
    kv_event_history_events: int = MAX_EVENTS
    """...holding at most this many block events between them (the newest batch always)."""
    kv_events_coalesce_seconds: float = COALESCE_SECONDS
    """Wall seconds over which scheduler steps merge into one KV event batch (0: none)."""
    kv_load_push_seconds: float = LOAD_PUSH_SECONDS
    """Wall seconds after an arrival to push the load to two or more subscribers (0: never)."""
    max_logprobs: int = 20
    """vLLM's max_logprobs: larger logprobs / prompt_logprobs requests are rejected."""

    def resolved_profile(self) -> SimProfile:
        """The named profile with this config's overrides applied, checked for consistency."""
        base = get_profile(self.profile, self.step_model)
        overrides: dict[str, Any] = {
            k: v
            for k, v in (
                ("block_size", self.block_size),
                ("num_gpu_blocks", self.num_gpu_blocks),
                ("max_num_seqs", self.max_num_seqs),
                ("max_num_batched_tokens", self.max_num_batched_tokens),
                ("max_model_len", self.max_model_len),
            )
            if v is not None
        }
        p = dataclasses.replace(base, **overrides)
        if p.kv_from_memory and self.num_gpu_blocks is None and overrides:
            # vLLM sizes its blocks and its profiling pass from these limits: re-derive.
            p = dataclasses.replace(p, num_gpu_blocks=derived_blocks(p))
        if min(p.block_size, p.num_gpu_blocks, p.max_num_seqs, p.max_num_batched_tokens) < 1:
            raise ValueError(
                "block_size, num_gpu_blocks, max_num_seqs, max_num_batched_tokens must be >= 1"
            )
        if self.max_model_len is None:
            # Like vLLM's auto-fit: a context that cannot fit the KV cache is shrunk to it.
            p = dataclasses.replace(p, max_model_len=min(p.max_model_len, p.kv_capacity_tokens))
        elif p.max_model_len > p.kv_capacity_tokens:
            raise ValueError(
                f"max_model_len {p.max_model_len} exceeds the KV cache "
                f"({p.num_gpu_blocks} blocks x {p.block_size} = {p.kv_capacity_tokens} tokens)"
            )
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; use one of {MODES}")
        if self.failure_kind not in FAILURE_KINDS:
            raise ValueError(
                f"unknown failure_kind {self.failure_kind!r}; use one of {FAILURE_KINDS}"
            )
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError("failure_rate must be in [0, 1]")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.kv_events_coalesce_seconds < 0:
            raise ValueError("kv_events_coalesce_seconds must be >= 0")
        if self.kv_load_push_seconds < 0:
            raise ValueError("kv_load_push_seconds must be >= 0")
        return p
