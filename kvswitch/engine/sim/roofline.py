"""The roofline step-time model: one engine step's duration from model and GPU configs.

Every term costs the larger of its compute time and its memory time, per GPU (work divided by
the tensor-parallel size `tp`), at the term's efficiency `e`:

    gemm    = max(T·F_lin/tp / (e_gemm·peak),            W/tp / (e_w·bw))
    decode  = max(C_d·F_att/tp / (e_att·peak),           C_d·K/tp / (e_kv·bw))
    prefill = max(P·F_att/tp / (e_att·peak),             C_p·K/tp / (e_kv·bw))
    comm    = 2·layers·(latency + 2(tp-1)/tp · T·hidden·bytes / (e_link·link_bw))   (tp > 1)
    per_seq = D·layers·seq_layer_us
    step_s  = gemm + decode + prefill + comm + per_seq + overhead

T: tokens in the step (prefill + decode); F_lin: 2 FLOPs per weight of the transformer layers per
token (plus the LM head for each sampled token); W: weight bytes read once per step (all but the
input embedding, a gather); C_d: the decoding sequences' contexts summed (each reads its whole KV
cache); P: the query-key pairs of the prefill chunks (a chunk of n tokens after c cached ones
attends n·c + n(n+1)/2 pairs); C_p: the prefill chunks' KV tokens (c + n each, read once);
F_att = 4·layers·heads·head_dim FLOPs per pair (QKᵀ and PV); K: KV bytes per token; D: the
decoding sequences (one decode token each), whose per-layer attention work beyond the bytes read
(block-table lookups, split-KV reductions, launch) grows with the batch.

KV capacity per engine is what vLLM's memory profiler leaves:
(gpu_memory_utilization·memory - weights/tp - runtime reserve - activation peak) / (K/tp) tokens,
the activation peak being one forward pass of `max_num_batched_tokens` tokens (MLP activations
and a few hidden-size buffers) plus the sampler's fp32 logits for `max_num_seqs` sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Efficiency", "GpuSpec", "ModelSpec", "Roofline"]

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer, as its Hugging Face config.json describes it."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    params: float
    """Total parameters as published (embedding and LM head included)."""
    dtype_bytes: int = 2
    tied_embeddings: bool = False

    @property
    def layer_params(self) -> int:
        """Weights of one layer's linear maps: q, k, v, o and the gated MLP's three."""
        h = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def derived_params(self) -> int:
        """Parameters counted from the shapes (norms aside): checks `params`."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def streamed_weight_bytes(self) -> float:
        """Weights a forward pass reads: all but an untied input embedding (a row gather)."""
        gathered = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return (self.params - gathered) * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        return 4 * self.num_layers * self.num_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator's datasheet figures and what its runtime keeps for itself."""

    name: str
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s."""
    hbm_bandwidth: float
    """Bytes/s."""
    memory_bytes: float
    """Memory the CUDA runtime reports as total (what gpu_memory_utilization multiplies)."""
    link_bandwidth: float
    """Bytes/s each way between two GPUs of a tensor-parallel group (NVLink)."""
    runtime_reserve_bytes: float
    """Memory per GPU outside torch's allocator (CUDA context, cuBLAS and NCCL workspaces)."""


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Achieved fraction of each peak, and the costs no roofline covers."""

    gemm: float
    """Dense GEMM FLOP/s / peak."""
    weights: float
    """Weight streaming bytes/s / HBM peak."""
    attention: float
    """Attention kernel FLOP/s / peak."""
    kv: float
    """KV-cache read bytes/s / HBM peak (paged, one block table per sequence)."""
    link: float
    """All-reduce bus bandwidth / link peak."""
    allreduce_latency_us: float
    """Fixed cost of one all-reduce (launch and synchronisation)."""
    step_overhead_us: float
    """Per step: scheduling, input preparation, sampling, launching the graph."""
    decode_seq_layer_us: float
    """Per decoding sequence and layer: decode-attention work no byte or FLOP count covers."""


@dataclass(frozen=True, slots=True)
class Roofline:
    """A model served on `tp` GPUs: step durations and KV capacity."""

    model: ModelSpec
    gpu: GpuSpec
    tp: int
    eff: Efficiency

    def __post_init__(self) -> None:
        m = self.model
        if self.tp < 1 or m.num_heads % self.tp or m.num_kv_heads % self.tp:
            raise ValueError(f"tp {self.tp} must divide {m.name}'s attention and KV heads")

    def step_seconds(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        *,
        decode_context: int = 0,
        prefill_context: int = 0,
        prefill_pairs: int = 0,
    ) -> float:
        """Duration of one step (the formula in the module docstring)."""
        m, g, e, tp = self.model, self.gpu, self.eff, self.tp
        flops, bw = g.peak_flops * tp, g.hbm_bandwidth * tp
        tokens = prefill_tokens + decode_tokens
        lin = tokens * m.num_layers * m.layer_params + decode_tokens * m.vocab_size * m.hidden_size
        gemm = max(2.0 * lin / (e.gemm * flops), m.streamed_weight_bytes / (e.weights * bw))
        f_att, kv = m.attention_flops_per_pair, m.kv_bytes_per_token
        decode = max(decode_context * f_att / (e.attention * flops),
                     decode_context * kv / (e.kv * bw))
        prefill = max(prefill_pairs * f_att / (e.attention * flops),
                      prefill_context * kv / (e.kv * bw))
        per_seq = decode_tokens * m.num_layers * e.decode_seq_layer_us
        return (gemm + decode + prefill + self.comm_seconds(tokens)
                + (per_seq + e.step_overhead_us) * 1e-6)

    def comm_seconds(self, tokens: int) -> float:
        """Two all-reduces per layer (after attention and after the MLP), ring algorithm."""
        if self.tp == 1:
            return 0.0
        m, e, tp = self.model, self.eff, self.tp
        payload = tokens * m.hidden_size * m.dtype_bytes * 2 * (tp - 1) / tp
        one = e.allreduce_latency_us * 1e-6 + payload / (e.link * self.gpu.link_bandwidth)
        return 2 * m.num_layers * one

    def activation_peak_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        m, tp = self.model, self.tp
        per_token = (3 * m.intermediate_size // tp + 4 * m.hidden_size) * m.dtype_bytes
        return max_num_batched_tokens * per_token + max_num_seqs * m.vocab_size * 4

    def kv_capacity_tokens(
        self,
        *,
        gpu_memory_utilization: float,
        max_num_batched_tokens: int,
        max_num_seqs: int,
    ) -> int:
        """KV tokens one engine holds (the memory formula in the module docstring)."""
        g = self.gpu
        free = (
            gpu_memory_utilization * g.memory_bytes
            - self.model.weight_bytes / self.tp
            - g.runtime_reserve_bytes
            - self.activation_peak_bytes(max_num_batched_tokens, max_num_seqs)
        )
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit {self.tp} x {g.name}")
        return int(free // (self.model.kv_bytes_per_token / self.tp))
