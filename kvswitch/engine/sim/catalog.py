"""The model and GPU configs the simulator ships, and the one set of roofline efficiencies.

Model values are their Hugging Face config.json fields (num_hidden_layers, hidden_size,
num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size,
tie_word_embeddings; bf16) and the published parameter count. GPU values are the datasheet's
(dense bf16 FLOP/s, HBM bandwidth, NVLink bandwidth each way) with the total memory and the
non-torch reserve vLLM's memory profiler reports. The efficiencies are set once for every profile
and workload: weight streaming, KV reads and the per-sequence cost are fitted to published
single-server vLLM measurements (benchmarks/sim_calibration.py --fit), the others are published
figures; docs/simulator.md gives each one's grounds.
"""

from __future__ import annotations

from kvswitch.engine.sim.roofline import GIB, Efficiency, GpuSpec, ModelSpec

__all__ = ["EFFICIENCY", "GPUS", "MODELS"]

MODELS: dict[str, ModelSpec] = {
    "qwen3-32b": ModelSpec(
        name="Qwen/Qwen3-32B",
        num_layers=64,
        hidden_size=5120,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=25600,
        vocab_size=151_936,
        params=32.8e9,
    ),
    "llama-3.1-8b": ModelSpec(
        name="meta-llama/Llama-3.1-8B-Instruct",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128_256,
        params=8.03e9,
    ),
}

GPUS: dict[str, GpuSpec] = {
    "h100-sxm": GpuSpec(
        name="H100 SXM 80GB",
        peak_flops=989e12,
        hbm_bandwidth=3.35e12,
        memory_bytes=79.22 * GIB,
        link_bandwidth=450e9,
        runtime_reserve_bytes=1.79 * GIB,
    ),
}

EFFICIENCY = Efficiency(
    gemm=0.65,
    weights=0.75,
    attention=0.60,
    kv=0.90,
    link=0.80,
    allreduce_latency_us=8.0,
    step_overhead_us=1000.0,
    decode_seq_layer_us=1.25,
)
