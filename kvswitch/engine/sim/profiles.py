"""Named hardware/model profiles: the KV-cache geometry, batch limits and step-time model.

A scheduler step that runs `p` uncached prefill tokens and `d` decode tokens takes

    step_s = (base_us + prefill_us * p + decode_us * d) / 1e6

simulated seconds. That linear form is the published fit for Llama-3.1-8B on one H100 with vLLM
0.8.4 (docs/simulator.md): base 5,753 µs (weight reads + launch overhead, paid once per step), 17.25 µs
per prefill token (compute-bound GEMMs) and 6.0 µs per decode token (KV reads + sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PROFILES", "SimProfile", "get_profile"]


@dataclass(frozen=True, slots=True)
class SimProfile:
    """One simulated deployment: model + GPUs + vLLM limits."""

    name: str
    description: str
    base_us: float
    """Fixed cost of a step, µs."""
    prefill_us: float
    """Cost per uncached prefill token scheduled in the step, µs."""
    decode_us: float
    """Cost per decode token scheduled in the step, µs."""
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def step_seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        """Simulated duration of one step (the formula in the module docstring)."""
        return (
            self.base_us + self.prefill_us * prefill_tokens + self.decode_us * decode_tokens
        ) * 1e-6

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_size * self.num_gpu_blocks


PROFILES: dict[str, SimProfile] = {
    "llama3-8b-h100": SimProfile(
        name="llama3-8b-h100",
        description="Llama-3.1-8B, 1x H100, vLLM 0.8.4 (published fit)",
        base_us=5753.0,
        prefill_us=17.25,
        decode_us=6.0,
        block_size=16,
        num_gpu_blocks=29_205,
        # vLLM V1's defaults for the OpenAI server on an 80 GB GPU.
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        max_model_len=131_072,
    ),
    # Qwen3-32B with TP=2 on two H100s. Derived from the 8B fit, scaled per GPU:
    # - base: each GPU streams half of 32B bf16 weights = 32 GB per step, 2x the 8B case
    #   (16 GB), so 2 x 5,753 µs, plus ~1,000 µs for 2 all-reduces x 64 layers -> 12,500 µs;
    # - prefill: FLOPs per token per GPU are 2 x 32e9 / 2 = 2x the 8B's, plus ~10% TP
    #   communication -> 17.25 x 2 x 1.1 = 38 µs;
    # - decode: KV bytes per token per GPU are the same as 8B (64 layers x 8 KV heads x 128,
    #   split over 2 GPUs vs 32 layers on one), but per-token MLP/attention work doubles in
    #   part -> 1.5 x 6.0 = 9 µs;
    # - KV: ~307k tokens per instance (docs/simulator.md) = 19,200 blocks of 16.
    "qwen3-32b-2xh100": SimProfile(
        name="qwen3-32b-2xh100",
        description="Qwen3-32B, TP=2 on 2x H100 (scaled from the 8B fit)",
        base_us=12_500.0,
        prefill_us=38.0,
        decode_us=9.0,
        block_size=16,
        num_gpu_blocks=19_200,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        max_model_len=40_960,
    ),
    # Small enough that tests hit queueing, chunked prefill and preemption with a few requests.
    "tiny": SimProfile(
        name="tiny",
        description="test profile: 64 blocks of 16, 4 sequences, 64-token budget",
        base_us=1000.0,
        prefill_us=10.0,
        decode_us=50.0,
        block_size=16,
        num_gpu_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=1024,
    ),
}


def get_profile(name: str) -> SimProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown simulator profile {name!r}; known: {sorted(PROFILES)}") from None
