"""The contract between the gRPC servicer and an engine backend.

The servicer (`kvswitch.engine.servicer`) converts protobuf to these plain types and back; a
backend (`kvswitch.engine.sim.SimEngine`, later a Hugging Face one) never sees protobuf or gRPC.
Output follows vLLM's DELTA semantics: each `GenerationUpdate` carries only the tokens produced
since the previous update. When the consumer falls behind, a backend merges pending deltas into
one update (as vLLM's output collector does), so a slow stream never stalls the batch.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

FinishReason = str  # "stop" | "length" | "abort"


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """vLLM's SamplingParams, already validated by the servicer."""

    max_tokens: int | None = None
    """None: generate until an eos token or the context limit."""
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    """Top logprobs per output token (0: only the sampled token's); None: no logprobs."""
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    constraint: tuple[str, str] | None = None
    """Structured-output constraint as (kind, value), e.g. ("json_schema", "{...}")."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingOptions
    arrival_time: float = 0.0
    """Wall-clock arrival (time.time()), as vLLM's arrival_time."""
    incremental: bool = True
    """False when the consumer only needs the whole output (a non-streamed request): the
    backend may then hold every update back and deliver one merged update at the end, which
    saves a wake-up per token; `GenerationUpdate.first_token_time` keeps TTFT exact."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """The top alternatives as (token_id, logprob), best first."""


@dataclass(slots=True)
class SequenceDelta:
    """New output of one of the request's n sequences."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    """Set on the delta that finishes the sequence."""
    matched_stop: int | str | None = None
    """The stop token id or stop string that ended it, if any."""


@dataclass(slots=True)
class GenerationUpdate:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    sequences: list[SequenceDelta]
    finished: bool
    """True on the last update of the request (every sequence has finished)."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Only on the first update when asked; the first prompt token has none."""
    queue_seconds: float | None = None
    """On the first update: seconds on the engine's clock (see `Engine.now`) from arrival until
    the scheduler first ran the request (vllm:request_queue_time_seconds); None when the
    backend does not tell."""
    time: float | None = None
    """The engine's clock when the newest token here was produced; None: the consumer uses its
    own read time. Merged deltas keep the newest token's time."""
    first_token_time: float | None = None
    """On the update that carries the request's first output token: the engine's clock when
    that token was produced (None: not told, or not in this update)."""
    num_preemptions: int | None = None
    """On the last update: how many times the request's sequences were preempted (None: the
    backend does not tell)."""


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What GetModelInfo / GetServerInfo report about the served model."""

    served_model_name: str
    model_path: str
    tokenizer_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int = -1
    pad_token_id: int = -1
    is_generation: bool = True
    embedding_dim: int = 1024
    model_type: str = "qwen3"
    architectures: tuple[str, ...] = ("Qwen3ForCausalLM",)
    block_size: int = 16
    num_gpu_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


@dataclass(frozen=True, slots=True)
class EngineLoadSnapshot:
    """The scheduler's state at one instant (GetLoads, KV event batches, /metrics)."""

    running: int
    waiting: int
    waiting_uncached_tokens: int
    used_blocks: int
    total_blocks: int
    block_size: int
    max_running: int
    gen_throughput: float
    """Output tokens per (simulated) second over the recent past."""
    cache_hit_rate: float
    """Prefix-cache hits / queries, in tokens, since start."""

    @property
    def used_tokens(self) -> int:
        return self.used_blocks * self.block_size

    @property
    def total_tokens(self) -> int:
        return self.total_blocks * self.block_size

    @property
    def token_usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def routing_core(self) -> tuple[int, int, int, float]:
        """What an EPP routes on (running, waiting, uncached waiting tokens, KV usage): a
        load push that would repeat the last record's is not sent."""
        return self.running, self.waiting, self.waiting_uncached_tokens, self.token_usage


@dataclass(frozen=True, slots=True)
class KvBlockStored:
    block_hash: int
    parent_block_hash: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class QueuedPrompt:
    """A request the engine has queued, as a load push announces it: the full KV blocks of its
    prompt will be stored here once it is scheduled (several EPPs follow; docs/multi-epp.md)."""

    request_id: str
    token_ids: tuple[int, ...]
    """The prompt's tokens up to its last full block."""


@dataclass(frozen=True, slots=True)
class KvEventBatchData:
    """One scheduler step's KV events: stored blocks, removed block hashes, or a full clear."""

    sequence_number: int
    timestamp: float
    stored: tuple[KvBlockStored, ...] = ()
    removed: tuple[int, ...] = ()
    cleared: bool = False
    load: EngineLoadSnapshot | None = None
    load_only: bool = False
    """No events, not in the history: a push of the engine's load as it is now (the stream
    sends it as a load-only record repeating the last sequence number)."""
    queued: tuple[QueuedPrompt, ...] = ()
    """On a load push: the requests that arrived since the previous push, still in prefill."""
    withdrawn: tuple[str, ...] = ()
    """On a load push: ids of requests an earlier push announced that left the engine before
    their prefill ended (cancelled or failed while queued): their blocks will not be stored."""


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """Monotonic counters since start, for Prometheus (vLLM metric names in the servicer)."""

    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    requests_finished: dict[str, int]
    """Finished requests by finish reason."""
    load_pushes: int = 0
    """Load pushes fired (each goes to every subscriber whose last record it does not repeat)."""


@runtime_checkable
class Engine(Protocol):
    """A model-server backend. All methods run on the server's event loop.

    Optional: `now() -> float`, the engine's clock in seconds (a simulator's simulated time).
    When present the servicer times requests with it, so latency histograms are in the engine's
    seconds; without it they are in wall seconds (`engine_clock`)."""

    @property
    def model(self) -> ModelCard: ...

    async def start(self) -> None:
        """Start background work (the scheduler loop)."""

    async def stop(self) -> None:
        """Abort what is left and stop background work."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        """Run a request. Closing the iterator (or cancelling its consumer) aborts the request
        and frees its batch slot and KV blocks at once. Raises `InvalidRequest` for bad input."""
        ...

    async def abort(self, request_ids: Sequence[str]) -> None:
        """End these requests with finish_reason "abort"; unknown ids are ignored."""

    def has_request(self, request_id: str) -> bool: ...

    async def embed(self, request_id: str, token_ids: Sequence[int]) -> list[float]: ...

    def is_healthy(self) -> bool: ...

    def load(self) -> EngineLoadSnapshot: ...

    def counters(self) -> EngineCounters: ...

    def kv_events(self, start_sequence_number: int = 0) -> AsyncIterator[KvEventBatchData]:
        """Batches from `start_sequence_number` on (as far back as the engine still holds), then
        live ones as scheduler steps produce them."""
        ...

    async def flush_cache(self) -> bool:
        """Drop every cached block not in use (AllBlocksCleared); False if requests are running."""
        ...


def engine_clock(engine: Engine) -> Callable[[], float]:
    """The engine's optional `now()` clock, else the wall clock (time.monotonic)."""
    now = getattr(engine, "now", None)
    return now if callable(now) else time.monotonic
