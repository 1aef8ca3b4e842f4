"""Named deployments: a model on GPUs, vLLM's limits, the KV-cache geometry and the step model.

A profile's step-time model is one of `STEP_MODELS`:

- "roofline" (the default where a profile names a model and GPU): `roofline.Roofline`, built from
  the configs in `catalog`; a step's time grows with the decoding sequences' contexts and with
  the context each prefill chunk attends to. Its KV capacity (`num_gpu_blocks`) is derived from
  memory the same way vLLM's profiler does (see `roofline`): from the block size, `max_num_seqs`
  (the sampler's logits) and `max_num_batched_tokens` (the forward pass) it is served with, so
  `derived_blocks` recomputes it when a config overrides any of them.
- "linear": `step_s = (base_us + prefill_us·p + decode_us·d) / 1e6` for `p` uncached prefill
  tokens and `d` decode tokens, whatever their contexts. The coefficients are inference-sim's
  (llm-d's simulator) fit for Llama-3.1-8B on one H100 with vLLM 0.8.4 (5,753 µs, 17.25 µs,
  6.0 µs), scaled per GPU for Qwen3-32B TP=2 (12,500 µs, 38 µs, 9 µs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvswitch.engine.sim.catalog import EFFICIENCY, GPUS, MODELS
from kvswitch.engine.sim.roofline import Roofline

__all__ = ["PROFILES", "STEP_MODELS", "SimProfile", "derived_blocks", "get_profile"]

STEP_MODELS = ("roofline", "linear")

GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default share of GPU memory for weights, activations and KV cache."""


@dataclass(frozen=True, slots=True)
class SimProfile:
    """One simulated deployment: model + GPUs + vLLM limits + step model."""

    name: str
    description: str
    base_us: float
    """Linear model: fixed cost of a step, µs."""
    prefill_us: float
    """Linear model: cost per uncached prefill token scheduled in the step, µs."""
    decode_us: float
    """Linear model: cost per decode token scheduled in the step, µs."""
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    roofline: Roofline | None = None
    step_model: str = "linear"
    """One of STEP_MODELS ("roofline" needs `roofline`)."""
    kv_from_memory: bool = False
    """`num_gpu_blocks` follows from `roofline`'s memory (see `derived_blocks`)."""

    def __post_init__(self) -> None:
        if self.step_model not in STEP_MODELS:
            raise ValueError(f"unknown step model {self.step_model!r}; use one of {STEP_MODELS}")
        if self.step_model == "roofline" and self.roofline is None:
            raise ValueError(f"profile {self.name!r} has no model/GPU config for the roofline")

    def step_seconds(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        *,
        decode_context: int = 0,
        prefill_context: int = 0,
        prefill_pairs: int = 0,
    ) -> float:
        """Simulated duration of one step.

        decode_context: the decoding sequences' context lengths summed (tokens in KV, the new
        one included); prefill_context: the prefill chunks' KV tokens summed (cached + chunk);
        prefill_pairs: the chunks' attended query-key pairs summed (n·c + n(n+1)/2 for a chunk
        of n tokens after c). The linear model ignores all three."""
        if self.roofline is not None and self.step_model == "roofline":
            return self.roofline.step_seconds(
                prefill_tokens,
                decode_tokens,
                decode_context=decode_context,
                prefill_context=prefill_context,
                prefill_pairs=prefill_pairs,
            )
        return (
            self.base_us + self.prefill_us * prefill_tokens + self.decode_us * decode_tokens
        ) * 1e-6

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_size * self.num_gpu_blocks


def derived_blocks(profile: SimProfile) -> int:
    """KV blocks vLLM's profiler leaves for `profile`'s model, GPUs and limits: the memory
    formula in `roofline`, divided into blocks of `block_size` tokens."""
    if profile.roofline is None:
        raise ValueError(f"profile {profile.name!r} has no model/GPU config to derive KV from")
    tokens = profile.roofline.kv_capacity_tokens(
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        max_num_batched_tokens=profile.max_num_batched_tokens,
        max_num_seqs=profile.max_num_seqs,
    )
    return tokens // profile.block_size


def _deployment(
    name: str,
    description: str,
    roofline: Roofline,
    linear_us: tuple[float, float, float],
    *,
    max_model_len: int,
    block_size: int = 16,
    max_num_seqs: int = 1024,
    max_num_batched_tokens: int = 8192,
) -> SimProfile:
    """A roofline profile whose KV blocks follow from memory (vLLM V1's server defaults for
    the limits on an 80 GB GPU)."""
    base_us, prefill_us, decode_us = linear_us
    profile = SimProfile(
        name=name,
        description=description,
        base_us=base_us,
        prefill_us=prefill_us,
        decode_us=decode_us,
        block_size=block_size,
        num_gpu_blocks=0,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        roofline=roofline,
        step_model="roofline",
        kv_from_memory=True,
    )
    return dataclasses.replace(profile, num_gpu_blocks=derived_blocks(profile))


_H100 = GPUS["h100-sxm"]
_LLAMA_8B_H100 = Roofline(MODELS["llama-3.1-8b"], _H100, 1, EFFICIENCY)
_QWEN3_32B_2XH100 = Roofline(MODELS["qwen3-32b"], _H100, 2, EFFICIENCY)
# The linear fit scaled to Qwen3-32B TP=2: weights per GPU twice the 8B's plus two all-reduces
# per layer (base), twice the FLOPs per token per GPU plus communication (prefill), more
# per-token work at the same KV bytes per token per GPU (decode).
_QWEN3_32B_LINEAR = (12_500.0, 38.0, 9.0)

PROFILES: dict[str, SimProfile] = {
    p.name: p
    for p in (
        _deployment(
            "llama3-8b-h100",
            "Llama-3.1-8B, 1x H100 SXM",
            _LLAMA_8B_H100,
            (5753.0, 17.25, 6.0),
            max_model_len=131_072,
        ),
        _deployment(
            "qwen3-32b-2xh100",
            "Qwen3-32B, TP=2 on 2x H100 SXM",
            _QWEN3_32B_2XH100,
            _QWEN3_32B_LINEAR,
            max_model_len=40_960,
        ),
        # YaRN (rope factor 4) stretches Qwen3's 32k native context to 128k; the step costs
        # and KV bytes per token are the same model's.
        _deployment(
            "qwen3-32b-2xh100-128k",
            "Qwen3-32B with YaRN to 131,072 tokens, TP=2 on 2x H100 SXM",
            _QWEN3_32B_2XH100,
            _QWEN3_32B_LINEAR,
            max_model_len=131_072,
        ),
        # Small enough that tests hit queueing, chunked prefill and preemption with a few
        # requests.
        SimProfile(
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
    )
}


def get_profile(name: str, step_model: str | None = None) -> SimProfile:
    """The named profile, with its step model switched when `step_model` is given."""
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown simulator profile {name!r}; known: {sorted(PROFILES)}") from None
    if step_model is not None and step_model != profile.step_model:
        profile = dataclasses.replace(profile, step_model=step_model)
    return profile
