"""Tokenizers as kvswitch uses them: the bundled Qwen3 default, or a Hugging Face directory.

A tokenizer *bundle* is what a Hugging Face model directory holds for tokenization:
`tokenizer.json`, `tokenizer_config.json` (with the chat template) and, optionally, a
`config.json` describing the model (eos ids, context length). The bundled default ships
compressed as package data; `load_tokenizer(None)` loads it without touching the network.
"""

from __future__ import annotations

from kvswitch.tokenization.bundle import (
    BUNDLED_TOKENIZER_NAME,
    TokenizerBundle,
    bundled_tokenizer_dir,
    load_tokenizer,
)

__all__ = ["BUNDLED_TOKENIZER_NAME", "TokenizerBundle", "bundled_tokenizer_dir", "load_tokenizer"]
