"""The served model: what GetModelInfo says about it, its tokenizer, and /v1/models.

Loaded on first use (per worker process) and retried until the target answers, so a frontend
started before its engines reports 503 instead of failing to start. The tokenizer comes from
`--tokenizer DIR`, else the target's GetTokenizer archive, else the bundled default.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvswitch.errors import NotFound
from kvswitch.frontend.engine_client import EngineClient
from kvswitch.frontend.sampling import parse_default_sampling
from kvswitch.tokenization import TokenizerBundle, load_tokenizer
from kvswitch.tokenization.chat_template import ChatTemplate
from kvswitch.tokenization.detokenizer import DecodeTable

__all__ = ["ModelRegistry", "ServedModel"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    names: tuple[str, ...]
    """The names clients may ask for; the first is the one responses report."""
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    created: int
    tokenizer: TokenizerBundle
    decode_table: DecodeTable | None
    """Set for byte-level tokenizers: the fast exact detokenizer."""
    chat_template: ChatTemplate | None
    sampling_defaults: dict[str, Any]

    @property
    def name(self) -> str:
        return self.names[0]

    def card(self) -> dict[str, Any]:
        """One entry of /v1/models, as vLLM renders it."""
        return {"id": self.name, "object": "model", "created": self.created,
                "owned_by": "kvswitch", "root": self.name, "parent": None,
                "max_model_len": self.max_model_len, "permission": []}


class ModelRegistry:
    """The model behind the target, loaded once per process."""

    def __init__(self, client: EngineClient, *, served_model_names: Sequence[str] = (),
                 tokenizer_dir: str | None = None) -> None:
        self._client = client
        self._names = tuple(served_model_names)
        self._tokenizer_dir = tokenizer_dir
        self._model: ServedModel | None = None
        self._lock = asyncio.Lock()

    @property
    def loaded(self) -> ServedModel | None:
        return self._model

    async def get(self) -> ServedModel:
        """The model, asking the target first if need be; raises Unavailable if it is down."""
        if self._model is not None:
            return self._model
        async with self._lock:
            if self._model is None:
                self._model = await self._load()
        return self._model

    async def resolve(self, requested: str | None) -> ServedModel:
        """The model a request names; an unknown name is a 404, as in vLLM."""
        model = await self.get()
        if requested is None or requested in model.names:
            return model
        raise NotFound(f"The model `{requested}` does not exist.", param="model")

    async def _load(self) -> ServedModel:
        info = await self._client.model_info()
        bundle = await self._tokenizer()
        names = self._names or (info.served_model_name or info.model_path or "default",)
        eos = tuple(info.eos_token_ids) or bundle.eos_token_ids
        table = DecodeTable(bundle.tokenizer) if DecodeTable.supports(bundle.tokenizer) else None
        template = ChatTemplate.from_bundle(bundle) if bundle.chat_template else None
        model = ServedModel(
            names=names, max_model_len=info.max_context_length or
            int(bundle.model_config.get("max_position_embeddings", 32768)),
            vocab_size=info.vocab_size or bundle.vocab_size, eos_token_ids=eos,
            created=int(time.time()), tokenizer=bundle, decode_table=table,
            chat_template=template,
            sampling_defaults=parse_default_sampling(info.default_sampling_params_json))
        logger.info("serving %s (max_model_len %d, tokenizer %s)", model.name,
                    model.max_model_len, bundle.source)
        return model

    async def _tokenizer(self) -> TokenizerBundle:
        if self._tokenizer_dir is not None:
            return await asyncio.to_thread(load_tokenizer, self._tokenizer_dir)
        directory = await self._client.fetch_tokenizer()
        if directory is None:
            logger.warning("the target does not serve GetTokenizer; using the bundled tokenizer")
            return await asyncio.to_thread(load_tokenizer, None)
        try:
            return await asyncio.to_thread(load_tokenizer, str(directory))
        finally:
            # The tokenizer is in memory now; the archive's files are not needed.
            shutil.rmtree(directory, ignore_errors=True)
