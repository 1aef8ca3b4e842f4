"""Loading a tokenizer bundle (see the package docstring) from package data or a directory."""

from __future__ import annotations

import functools
import gzip
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kvswitch.errors import InvalidRequest

BUNDLED_TOKENIZER_NAME = "Qwen/Qwen3-0.6B"


def bundled_tokenizer_dir() -> Path:
    """The package-data directory of the bundled Qwen3 tokenizer (tokenizer.json is gzipped)."""
    return Path(str(resources.files("kvswitch").joinpath("assets/tokenizers/qwen3")))


@dataclass(frozen=True)
class TokenizerBundle:
    """A loaded tokenizer and the metadata around it."""

    tokenizer: Tokenizer
    """The fast tokenizer (`tokenizers` library)."""
    config: dict[str, Any]
    """`tokenizer_config.json` as a dict (chat template, special tokens)."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """`config.json` if the bundle has one, else empty."""
    source: str = ""
    """Where it was loaded from, for logs and GetModelInfo.tokenizer_path."""

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def chat_template(self) -> str | None:
        template = self.config.get("chat_template")
        return template if isinstance(template, str) else None

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @functools.cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids: `config.json`'s `eos_token_id` (int or list), else the eos token."""
        configured = self.model_config.get("eos_token_id")
        if isinstance(configured, int):
            return (configured,)
        if isinstance(configured, list) and configured:
            return tuple(int(i) for i in configured)
        eos = special_token_text(self.config.get("eos_token"))
        eos_id = self.token_id(eos)
        return () if eos_id is None else (eos_id,)

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        decoder = self.config.get("added_tokens_decoder", {})
        return frozenset(int(i) for i, t in decoder.items() if t.get("special"))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def encode_nogil(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The same ids as `encode`, through the `tokenizers` batch path, which releases the GIL
        (`encode` holds it throughout): call it from a worker thread so that a long prompt
        does not stall the event loop."""
        encodings = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encodings[0].ids
        return ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        text: str = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text


def special_token_text(token: Any) -> str | None:
    """A special token's text as tokenizer_config.json stores it: a string or
    {"content": ...}; None for anything else."""
    if isinstance(token, dict):
        content = token.get("content")
        return content if isinstance(content, str) else None
    return token if isinstance(token, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest(f"{path} does not hold a JSON object")
    return data


@functools.lru_cache(maxsize=8)
def load_tokenizer(directory: str | None = None) -> TokenizerBundle:
    """Load the bundle in `directory`, or the bundled default when it is None.

    The directory must hold `tokenizer.json` (or `tokenizer.json.gz`) and
    `tokenizer_config.json`; `config.json` is optional.
    """
    root = bundled_tokenizer_dir() if directory is None else Path(directory)
    plain, packed = root / "tokenizer.json", root / "tokenizer.json.gz"
    try:
        if plain.is_file():
            tokenizer = Tokenizer.from_file(str(plain))
        elif packed.is_file():
            tokenizer = Tokenizer.from_str(gzip.decompress(packed.read_bytes()).decode("utf-8"))
        else:
            raise InvalidRequest(f"no tokenizer.json in {root}")
    except (OSError, ValueError, Exception) as exc:  # tokenizers raises plain Exception
        if isinstance(exc, InvalidRequest):
            raise
        raise InvalidRequest(f"cannot load the tokenizer in {root}: {exc}") from exc
    config_path = root / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    model_config_path = root / "config.json"
    model_config = _read_json(model_config_path) if model_config_path.is_file() else {}
    source = BUNDLED_TOKENIZER_NAME if directory is None else str(root)
    return TokenizerBundle(tokenizer, config, model_config, source)
