"""The zip archive that `GetTokenizer` streams: what a client needs to rebuild the tokenizer.

It holds, at the archive root, `tokenizer.json`, `tokenizer_config.json`, any other tokenizer
files of the source directory, and a generated `config.json` describing the served (simulated)
model — eos ids, context length, vocabulary size, model type and architectures — because a
simulated model has no real `config.json` and clients read eos ids and limits from it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvswitch.engine.base import ModelCard
from kvswitch.tokenization import TokenizerBundle, bundled_tokenizer_dir

# Tokenizer files besides tokenizer.json that Hugging Face loaders look for.
_EXTRA_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")

CHUNK_SIZE = 512 * 1024


@dataclass(frozen=True, slots=True)
class TokenizerArchive:
    data: bytes
    sha256: str

    def chunks(self, size: int = CHUNK_SIZE) -> list[bytes]:
        return [self.data[i:i + size] for i in range(0, len(self.data), size)] or [b""]


def model_config(card: ModelCard, bundle: TokenizerBundle) -> dict[str, Any]:
    """A Hugging Face `config.json` for the served model, from its model card."""
    config: dict[str, Any] = dict(bundle.model_config)
    config.update({
        "architectures": list(card.architectures),
        "model_type": card.model_type,
        "eos_token_id": list(card.eos_token_ids),
        "max_position_embeddings": card.max_model_len,
        "vocab_size": card.vocab_size,
        "_name_or_path": card.served_model_name,
    })
    if card.bos_token_id >= 0:
        config["bos_token_id"] = card.bos_token_id
    if card.pad_token_id >= 0:
        config["pad_token_id"] = card.pad_token_id
    return config


def build_tokenizer_archive(directory: str | None, card: ModelCard,
                            bundle: TokenizerBundle) -> TokenizerArchive:
    """Zip the tokenizer in `directory` (None: the bundled one). CPU-bound: run in a thread."""
    root = bundled_tokenizer_dir() if directory is None else Path(directory)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        zf.writestr("tokenizer.json", _tokenizer_json(root, bundle))
        for name in _EXTRA_FILES:
            path = root / name
            if path.is_file():
                zf.writestr(name, path.read_bytes())
        if not (root / "tokenizer_config.json").is_file():
            zf.writestr("tokenizer_config.json", json.dumps(bundle.config))
        zf.writestr("config.json", json.dumps(model_config(card, bundle), indent=2))
    data = buffer.getvalue()
    return TokenizerArchive(data, hashlib.sha256(data).hexdigest())


def _tokenizer_json(root: Path, bundle: TokenizerBundle) -> bytes:
    plain, packed = root / "tokenizer.json", root / "tokenizer.json.gz"
    if plain.is_file():
        return plain.read_bytes()
    if packed.is_file():
        return gzip.decompress(packed.read_bytes())
    return bundle.tokenizer.to_str().encode("utf-8")
