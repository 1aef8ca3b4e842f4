"""The real OpenAI SDK against the whole gateway (`kvswitch up`'s launch) on its one public port.

HTTP goes Envoy → frontend → (gRPC) Envoy → EPP → an echo engine and back. In echo mode an
engine returns the prompt's own tokens, so a chat completion comes back as the rendered chat
prompt and a text completion as its prompt: exact, non-ASCII included.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol import vllm_engine_pb2_grpc as rpc
from kvswitch.tokenization import load_tokenizer
from kvswitch.tokenization.chat_template import ChatTemplate
from tests.support.gateway import Gateway, epp_samples, running_gateway
from tests.support.processes import free_port, kvswitch_argv, running

BUNDLE = load_tokenizer(None)
TEMPLATE = ChatTemplate.from_bundle(BUNDLE)
MESSAGES = [{"role": "system", "content": "Réponds en français."},
            {"role": "user", "content": "héllo 你好 😀 — what's up?"}]
TEXT = "Grüße aus Köln 你好世界 😀👍 and some plain ASCII to finish."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Two tiny echo engines (≈ 0.5 ms a token, so long streams last), EPP, Envoy, a frontend."""
    with running_gateway(tmp_path_factory.mktemp("openai-gateway"), replicas=2, profile="tiny",
                         time_scale=2.0, mode="echo", grace_period=1.0,
                         frontend_workers=1) as gw:
        yield gw


@pytest.fixture(scope="module")
def model(gateway: Gateway) -> str:
    reply = httpx.get(f"http://{gateway.launched.address}/v1/models", timeout=20)
    return str(reply.json()["data"][0]["id"])


def _client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{gateway.launched.address}/v1", api_key="none",
                         max_retries=0, timeout=30)


def _echoed(ids: list[int]) -> str:
    # The echo engine repeats the prompt without its special tokens, then sends eos.
    return BUNDLE.decode(ids, skip_special_tokens=True)


def _chat_echo(messages: list[dict[str, str]]) -> str:
    return _echoed(BUNDLE.encode(TEMPLATE.render(messages)))


def _active_requests(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        info = rpc.VllmEngineStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    return int(info.active_requests)


def test_models_are_listed_on_the_public_port(gateway: Gateway, model: str) -> None:
    models = _client(gateway).models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].model_extra["max_model_len"] == 1024


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echoes_the_rendered_prompt(gateway: Gateway, model: str, stream: bool) -> None:
    client = _client(gateway)
    if not stream:
        reply = client.chat.completions.create(model=model, messages=MESSAGES)
        assert reply.choices[0].message.content == _chat_echo(MESSAGES)
        assert reply.choices[0].finish_reason == "stop"
        return
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == _chat_echo(MESSAGES)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(BUNDLE.encode(TEMPLATE.render(MESSAGES)))


def test_async_client_streams_completions_exactly(gateway: Gateway, model: str) -> None:
    async def run() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=f"http://{gateway.launched.address}/v1",
                                      api_key="none", max_retries=0, timeout=30) as client:
            whole = await client.completions.create(model=model, prompt=TEXT, max_tokens=None)
            parts = [c.choices[0].text async for c in await client.completions.create(
                model=model, prompt=TEXT, max_tokens=None, stream=True)]
            return whole.choices[0].text, "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole == streamed == _echoed(BUNDLE.encode(TEXT))


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut(gateway: Gateway, model: str, stream: bool) -> None:
    client = _client(gateway)
    prompt = "one two three four five six seven"
    kwargs = {"model": model, "prompt": prompt, "max_tokens": None, "stop": [" five"]}
    if stream:
        chunks = list(
            client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
        text, reason = ("".join(c.choices[0].text for c in chunks),
                        chunks[-1].choices[0].finish_reason)
    else:
        reply = client.completions.create(**kwargs)  # type: ignore[call-overload]
        text, reason = reply.choices[0].text, reply.choices[0].finish_reason
    assert (text, reason) == ("one two three four", "stop")


def test_n_choices(gateway: Gateway, model: str) -> None:
    client = _client(gateway)
    reply = client.chat.completions.create(model=model, messages=MESSAGES, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert {c.message.content for c in reply.choices} == {_chat_echo(MESSAGES)}
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, n=2,
                                                stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: _chat_echo(MESSAGES), 1: _chat_echo(MESSAGES)}


def test_usage_reports_cached_tokens_on_a_repeat(gateway: Gateway, model: str) -> None:
    client = _client(gateway)
    messages = [{"role": "user", "content": "cache me through the gateway " * 12}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.completion_tokens == 2
    # Prefix routing follows the engines' KV events, which may trail the first reply a little.
    cached = [client.chat.completions.create(model=model, messages=messages, max_tokens=2)
              .usage.prompt_tokens_details.cached_tokens for _ in range(5)]
    assert max(cached) > 0 and max(cached) % 16 == 0


def test_the_epp_labels_requests_by_the_served_model(gateway: Gateway, model: str) -> None:
    _client(gateway).completions.create(model=model, prompt="label me", max_tokens=2)
    # gRPC Generate has no model field: the frontend names it in x-gateway-model-name. The
    # request is recorded when its access-log entry reaches the EPP (within ~50 ms).
    deadline = time.monotonic() + 10
    while not epp_samples(gateway, "kvswitch_epp_requests_finished_total", model=model):
        assert time.monotonic() < deadline, "no finished request labelled with the model"
        time.sleep(0.05)
    assert epp_samples(gateway, "kvswitch_epp_requests_total", model=model, status="200")


def test_embeddings(gateway: Gateway, model: str) -> None:
    reply = _client(gateway).embeddings.create(model=model, input=["héllo", "wörld 你好"])
    assert [d.index for d in reply.data] == [0, 1]
    assert len(reply.data[0].embedding) > 0
    assert reply.usage.prompt_tokens == (len(BUNDLE.encode("héllo"))
                                         + len(BUNDLE.encode("wörld 你好")))


def test_error_paths(gateway: Gateway, model: str) -> None:
    client = _client(gateway)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert missing.value.body["type"] == "NotFoundError"
    with pytest.raises(openai.BadRequestError) as unknown:  # unknown top-level: ignored
        client.chat.completions.create(model=model, messages=[
            {"role": "user", "content": "hi", "frobnicate": 1}])  # type: ignore[misc]
    assert unknown.value.body["param"] == "messages.0.frobnicate"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="hi", temperature=7, stream=True)


def test_a_disconnected_stream_frees_the_engine(gateway: Gateway, model: str) -> None:
    body = {"model": model, "prompt": "count slowly", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    url = f"http://{gateway.launched.address}/v1/completions"
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert sum(_active_requests(a) for a in gateway.engines) == 1
    # Leaving the block closed the connection mid-stream; the engine must drop the request
    # long before its 1000 tokens (≈ 0.5 s) would have run out.
    stopped = threading.Event()
    for _ in range(100):  # bounded: 100 x 20 ms
        if sum(_active_requests(a) for a in gateway.engines) == 0:
            break
        stopped.wait(0.02)
    assert [_active_requests(a) for a in gateway.engines] == [0] * len(gateway.engines)


# --- headers become gRPC metadata ---------------------------------------------------------

class _RecordingEngine(rpc.VllmEngineServicer):
    """Answers Generate with two tokens and records each call's metadata."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext
                     ) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(served_model_name="recorder", max_context_length=512)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[pb.GenerateResponse]:
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata()})
        ids = [9707, 0]
        yield pb.GenerateResponse(complete=pb.GenerateComplete(
            output_ids=ids, finish_reason="length", prompt_tokens=len(request.tokenized.input_ids),
            completion_tokens=len(ids)))


def test_objective_and_fairness_headers_arrive_as_grpc_metadata(tmp_path: Path) -> None:
    engine = _RecordingEngine()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rpc.add_VllmEngineServicer_to_server(engine, server)
    engine_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port = free_port()
    argv = kvswitch_argv("frontend", "--target", f"127.0.0.1:{engine_port}", "--port", str(port))
    try:
        with running(argv, port, tmp_path / "frontend.log", timeout=60):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                   max_retries=0)
            headers = {"x-llm-d-inference-objective": "premium",
                       "x-llm-d-inference-fairness-id": "tenant-a", "x-request-id": "abc-1"}
            for stream in (False, True):
                reply = client.with_options(default_headers=headers).completions.create(
                    model="recorder", prompt="hi", max_tokens=2, stream=stream)
                if stream:
                    list(reply)  # type: ignore[arg-type]
    finally:
        server.stop(0)
    assert len(engine.metadata) == 2
    for seen in engine.metadata:
        assert seen["x-llm-d-inference-objective"] == "premium"
        assert seen["x-llm-d-inference-fairness-id"] == "tenant-a"
        assert seen["x-request-id"] == "abc-1"
        assert seen["x-gateway-model-name"] == "recorder"  # the EPP's `model` label


def test_tokenize_routes_to_the_frontend(gateway: Gateway, model: str) -> None:
    url = f"http://{gateway.launched.address}"
    tokens = httpx.post(url + "/tokenize", json={"model": model, "prompt": "héllo"}, timeout=30)
    assert tokens.status_code == 200 and tokens.json()["tokens"] == BUNDLE.encode("héllo")
    text = httpx.post(url + "/detokenize", json={"tokens": tokens.json()["tokens"]}, timeout=30)
    assert text.json() == {"prompt": "héllo"}
