"""Rendering chat templates with Hugging Face `apply_chat_template` semantics.

Same environment as transformers: a sandboxed, immutable jinja2 environment with
`trim_blocks`/`lstrip_blocks` and the loop-controls extension; the `tojson` filter that keeps
non-ASCII characters; the `raise_exception` and `strftime_now` globals; the tokenizer's special
tokens (`bos_token`, `eos_token`, ...) as variables; and `messages`, `tools`, `documents`,
`add_generation_prompt` plus any extra keyword arguments (`enable_thinking`, ...).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvswitch.errors import InvalidRequest
from kvswitch.tokenization.bundle import TokenizerBundle, special_token_text

__all__ = ["ChatTemplate", "TemplateError"]

# The tokenizer_config.json keys transformers exposes to the template as variables.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class TemplateError(InvalidRequest):
    """The template raised (`raise_exception`) or failed on the given messages."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers overrides jinja2's tojson: no HTML escaping, non-ASCII kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template and the special-token variables of its tokenizer."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any]) -> None:
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequest(f"invalid chat template: {exc}") from exc
        self._variables = dict(special_tokens)

    @classmethod
    def from_bundle(cls, bundle: TokenizerBundle, override: str | None = None) -> ChatTemplate:
        source = override if override is not None else bundle.chat_template
        if source is None:
            raise InvalidRequest("the tokenizer has no chat template; pass one as chat_template")
        config = bundle.config
        variables: dict[str, Any] = {k: special_token_text(config.get(k))
                                     for k in _SPECIAL_TOKEN_KEYS}
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            variables["additional_special_tokens"] = [special_token_text(t) for t in extra]
        return cls(source, variables)

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None,
               continue_final_message: bool = False,
               extra: Mapping[str, Any] | None = None) -> str:
        """Render `messages`; `extra` holds chat_template_kwargs (e.g. enable_thinking)."""
        variables = {**self._variables, **(extra or {})}
        try:
            text: str = self._template.render(
                messages=list(messages), tools=list(tools) if tools else None,
                documents=list(documents) if documents else None,
                add_generation_prompt=add_generation_prompt, **variables)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, AttributeError, KeyError, ValueError) as exc:
            raise TemplateError(f"chat template failed on these messages: {exc}") from exc
        if continue_final_message:
            text = _strip_after_final_message(text, messages)
        return text


def _strip_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    # transformers cuts everything after the final message's content so the model continues it.
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise InvalidRequest("continue_final_message needs a final message with text content")
    position = text.rfind(final.strip())
    if position < 0:
        raise InvalidRequest("continue_final_message: the final message is not in the prompt")
    end = position + len(final.strip())
    # Keep the content's own trailing whitespace when the template kept it.
    if text[end:end + len(final) - len(final.rstrip())] == final[len(final.rstrip()):]:
        end += len(final) - len(final.rstrip())
    return text[:end]
