"""The real OpenAI SDK against `kvswitch frontend` in front of a real echo engine.

In echo mode the engine returns the prompt's own tokens, so a chat completion comes back as the
rendered chat prompt and a text completion as its prompt: exact, non-ASCII included.
"""

from __future__ import annotations

import asyncio
import base64
import struct

import httpx
import openai
import pytest

from kvswitch.tokenization import load_tokenizer
from kvswitch.tokenization.chat_template import ChatTemplate
from tests.support.frontend_stack import Stack

BUNDLE = load_tokenizer(None)
TEMPLATE = ChatTemplate.from_bundle(BUNDLE)
MODEL = "Qwen/Qwen3-0.6B"
MESSAGES = [{"role": "system", "content": "Réponds en français."},
            {"role": "user", "content": "héllo 你好 😀 — what's up?"}]
TEXT = "Grüße aus Köln 你好世界 😀👍 and some plain ASCII to finish."


def _chat_prompt_ids(messages: list[dict[str, str]]) -> list[int]:
    return BUNDLE.encode(TEMPLATE.render(messages))


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0)


def test_models_lists_the_served_model(stack: Stack) -> None:
    models = _client(stack).models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "kvswitch"
    assert models[0].model_extra["max_model_len"] == 4096


def _echoed(ids: list[int]) -> str:
    # The echo engine repeats the prompt without its special tokens, then sends eos.
    return BUNDLE.decode(ids, skip_special_tokens=True)


def test_chat_echoes_the_rendered_prompt(stack: Stack) -> None:
    ids = _chat_prompt_ids(MESSAGES)
    client = _client(stack)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == _echoed(ids)
    assert "Réponds en français." in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    echoed = [i for i in ids if i not in BUNDLE.special_token_ids]
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(echoed) + 1  # the eos token counts
    assert reply.usage.total_tokens == len(ids) + len(echoed) + 1
    short = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    assert short.choices[0].finish_reason == "length"
    assert short.choices[0].message.content == BUNDLE.decode(echoed[:5])


def test_chat_stream_sync(stack: Stack) -> None:
    ids = _chat_prompt_ids(MESSAGES)
    stream = _client(stack).chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == _echoed(ids)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)


async def test_chat_stream_async_and_concurrent(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0)
    ids = _chat_prompt_ids(MESSAGES)

    async def one() -> str:
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                      stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    texts = await asyncio.gather(*(one() for _ in range(8)))
    assert set(texts) == {_echoed(ids)}
    reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert reply.choices[0].message.content == texts[0]
    await client.close()


@pytest.mark.parametrize("stream", [False, True])
def test_completions_echo_the_prompt(stack: Stack, stream: bool) -> None:
    ids = BUNDLE.encode(TEXT)
    client = _client(stack)
    if stream:
        chunks = list(client.completions.create(model=MODEL, prompt=TEXT, max_tokens=None,
                                                stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert all(c.object == "text_completion" for c in chunks)
    else:
        reply = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=None)
        assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
        text = reply.choices[0].text
        assert reply.usage.prompt_tokens == len(ids)
    assert text == TEXT


def test_long_prompts_tokenized_off_the_loop_come_back_exactly(stack: Stack) -> None:
    from kvswitch.tokenization.offload import needs_offload

    long_text = " ".join([TEXT] * 60)  # ~3.6k characters: tokenized in a worker thread
    assert needs_offload(long_text)
    client = _client(stack)
    reply = client.completions.create(model=MODEL, prompt=long_text, max_tokens=None)
    assert reply.choices[0].text == long_text
    assert reply.usage.prompt_tokens == len(BUNDLE.encode(long_text))
    messages = [{"role": "user", "content": long_text}]
    chat = client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    assert chat.usage.prompt_tokens == len(_chat_prompt_ids(messages))
    assert chat.choices[0].message.content == _echoed(_chat_prompt_ids(messages))
    embedded = client.embeddings.create(model=MODEL, input=[long_text, "short"])
    assert embedded.usage.prompt_tokens == (len(BUNDLE.encode(long_text))
                                            + len(BUNDLE.encode("short")))


def test_completions_token_prompts_and_several_prompts(stack: Stack) -> None:
    ids = BUNDLE.encode(TEXT)
    client = _client(stack)
    reply = client.completions.create(model=MODEL, prompt=[ids, BUNDLE.encode("short one")],
                                      max_tokens=2, n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.choices[0].text == reply.choices[1].text == BUNDLE.decode(ids[:2])
    assert reply.choices[2].text == reply.choices[3].text == "short one"  # two tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_where_they_should(stack: Stack, stream: bool) -> None:
    prompt = "one two three four five six seven"
    ids = BUNDLE.encode(prompt)
    client = _client(stack)

    def text_of(**kwargs: object) -> tuple[str, str | None]:
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                                    max_tokens=None, **kwargs))
            return ("".join(c.choices[0].text for c in chunks),
                    chunks[-1].choices[0].finish_reason)
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=None,
                                          **kwargs)
        return reply.choices[0].text, reply.choices[0].finish_reason

    assert text_of(stop=[" four", "xyz"]) == ("one two three", "stop")
    assert text_of(stop="ee f", extra_body={"include_stop_str_in_output": True}) == \
        ("one two three f", "stop")
    assert text_of(stop=["absent"]) == (prompt, "stop")
    assert len(ids) > 5


def test_n_choices_interleave_by_index(stack: Stack) -> None:
    ids = _chat_prompt_ids(MESSAGES)
    client = _client(stack)
    expected = _echoed(ids)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert {c.message.content for c in reply.choices} == {expected}
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert reply.usage.completion_tokens == 3 * single.usage.completion_tokens
    texts = {0: "", 1: "", 2: ""}
    roles = set()
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3,
                                                stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert roles == {0, 1, 2} and set(texts.values()) == {expected}


def test_second_identical_request_reports_cached_tokens(stack: Stack) -> None:
    messages = [{"role": "user", "content": "cache me " * 40}]
    client = _client(stack)
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_embeddings(stack: Stack) -> None:
    reply = _client(stack).embeddings.create(model=MODEL, input=["héllo", "wörld 你好"])
    assert [d.index for d in reply.data] == [0, 1]
    assert len(reply.data[0].embedding) > 0
    assert reply.usage.prompt_tokens == (len(BUNDLE.encode("héllo"))
                                         + len(BUNDLE.encode("wörld 你好")))
    b64 = _client(stack).embeddings.create(model=MODEL, input="héllo", encoding_format="base64")
    floats = struct.unpack(f"<{len(reply.data[0].embedding)}f",
                           base64.b64decode(b64.data[0].embedding))
    assert floats == pytest.approx(reply.data[0].embedding, abs=1e-6)


def test_logprobs_shapes(stack: Stack) -> None:
    client = _client(stack)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) <= 2 for c in content)
    text = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, logprobs=1)
    assert len(text.choices[0].logprobs.tokens) == 4


# --- errors -------------------------------------------------------------------------------

def test_unknown_fields_are_ignored_and_unsupported_ones_named(stack: Stack) -> None:
    client = _client(stack)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                           extra_body={"frobnicate": 1, "store": True})
    assert reply.choices[0].finish_reason == "length"  # accepted and ignored, as in vLLM
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", suffix="y")
    assert info.value.status_code == 400 and info.value.body["param"] == "suffix"
    assert info.value.body["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "x", "frobnicate": 1}])  # type: ignore[misc]
    assert info.value.body["param"] == "messages.0.frobnicate"


def test_bad_values_are_rejected(stack: Stack) -> None:
    client = _client(stack)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=7)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])


def test_unknown_model_is_404(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _client(stack).chat.completions.create(model="nope", messages=MESSAGES)
    assert info.value.body["type"] == "NotFoundError"


def test_malformed_json_and_oversized_bodies(stack: Stack) -> None:
    url = stack.base_url + "/v1/chat/completions"
    bad = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300_000}]}
    too_big = httpx.post(url, json=huge)
    assert too_big.status_code == 413
    assert set(too_big.json()["error"]) == {"message", "type", "param", "code"}


def test_tokenize_and_detokenize_as_vllm_serves_them(stack: Stack) -> None:
    url = stack.base_url
    text = httpx.post(url + "/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    assert text["tokens"] == BUNDLE.encode(TEXT) and text["count"] == len(text["tokens"])
    assert text["max_model_len"] == 4096 and "".join(text["token_strs"]).startswith("Gr")
    chat = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert chat["tokens"] == _chat_prompt_ids(MESSAGES) and chat["token_strs"] is None
    back = httpx.post(url + "/detokenize", json={"tokens": text["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}
    for path, body, param in [("/detokenize", {"tokens": [10**7]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
                              ("/tokenize", {"prompt": "x", "model": "nope"}, "model")]:
        reply = httpx.post(url + path, json=body)
        assert reply.status_code in (400, 404) and reply.json()["error"]["param"] == param
