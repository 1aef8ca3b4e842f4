"""`kvswitch engine --api sglang` with an independent client: SMG (`smg launch --backend sglang`)
routes OpenAI requests to it over SGLang's gRPC API, reached here with the openai SDK."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from tests.support.processes import free_port, kvswitch_argv, running
from tests.support.smg import answers, smg_binary

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def smg_base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    smg = smg_binary()
    if smg is None:
        pytest.skip("smg is not installed")
    tmp = tmp_path_factory.mktemp("sglang-smg")
    engine_port, smg_port = free_port(), free_port()
    engine = kvswitch_argv("engine", "--api", "sglang", "--port", str(engine_port),
                           "--profile", "tiny", "--time-scale", "100", "--mode", "echo",
                           "--page-size", "4", "--grace-period", "1")
    gateway = [smg, "launch", "--host", "127.0.0.1", "--port", str(smg_port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--log-level", "warn", "--backend", "sglang",
               "--worker-urls", f"grpc://127.0.0.1:{engine_port}"]
    with running(engine, engine_port, tmp / "engine.log"), \
            running(gateway, smg_port, tmp / "smg.log", timeout=60.0):
        deadline = time.monotonic() + 60
        # SMG lists the worker's model before its tokenizer is registered (it answers
        # "Tokenizer not yet registered" meanwhile): ready once a one-token completion succeeds.
        while not answers(smg_port):
            assert time.monotonic() < deadline, "SMG never served the engine's model"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{smg_port}/v1"


@pytest.fixture
def client(smg_base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=smg_base_url, api_key="-", timeout=30)


def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_unary_completion_echoes_the_prompt(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=model(client), prompt=PROMPT, max_tokens=11,
                                       temperature=0)
    choice = answer.choices[0]
    # Echo mode answers with the prompt's tokens, cycled up to max_tokens.
    assert choice.text == PROMPT + "The quick" and choice.finish_reason == "length"
    assert answer.usage is not None and answer.usage.prompt_tokens == 9
    assert answer.usage.completion_tokens == 11


def test_streamed_completion_reassembles_and_counts(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=model(client), prompt=PROMPT, max_tokens=5,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    text, reasons, usage = "", [], None
    for event in stream:
        for choice in event.choices:
            text += choice.text
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
        usage = event.usage or usage
    assert text == "The quick brown fox jumps" and reasons == ["length"]
    assert usage is not None and usage.completion_tokens == 5


def test_n2_and_a_stop_string(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=model(client), prompt=PROMPT, max_tokens=5,
                                       temperature=0, n=2)
    assert sorted(c.index for c in answer.choices) == [0, 1]
    assert {c.text for c in answer.choices} == {"The quick brown fox jumps"}
    stopped = client.completions.create(model=model(client), prompt=PROMPT, max_tokens=20,
                                        temperature=0, stop=[" fox"])
    assert stopped.choices[0].text == "The quick brown"
    assert stopped.choices[0].finish_reason == "stop"


def test_streamed_chat_and_a_bad_request(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=model(client), messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        stream=True, stream_options={"include_usage": True})
    usage = None
    for event in stream:
        usage = event.usage or usage
    assert usage is not None and usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model(client), prompt=PROMPT, max_tokens=5000)
